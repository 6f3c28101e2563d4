"""Quality of a FlashLoop configuration against dense on the same model and text.

Teacher-forced through the real decode path: each window's context is prefilled, then its
continuation is fed one token at a time through decode, and the log-probabilities before
every token are compared. Reports Δ bits per byte with a bootstrap confidence interval,
KL(dense ‖ config) mean and p99, top-1 agreement, and passkey retrieval accuracy by
context length and needle depth.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import platform
import random
import sysconfig
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from flashloop_backend.config import ConfigError, FlashLoopConfig
from flashloop_backend.host.engine import Engine, SamplingParams
from flashloop_backend.host.model import OuroModel
from flashloop_backend.registry import Registry, resolve

NEEDLE = " The pass key is {k}. Remember it. {k} is the pass key. "
QUESTION = " What is the pass key? The pass key is "
PASSKEY_TOKENS = 5  # the answer's digits
PASSKEY_MIN_CONTEXT = 128


def heldout_text(limit_bytes: int = 400_000) -> tuple[str, str]:
    """The embedded model's held-out split, rebuilt from this machine's Python standard
    library: files whose sha256(relative path) % 100 < 5. Returns (text, description)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts, total = [], 0
    for path in sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts):
        rel = str(path.relative_to(stdlib))
        if int(hashlib.sha256(rel.encode()).hexdigest(), 16) % 100 >= 5:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        parts.append(text)
        total += len(text)
        if total >= limit_bytes:
            break
    # named by version: the directory is where this machine installed it, which the text is not
    source = f"the Python {platform.python_version()} standard library"
    return "\n".join(parts), f"held-out split of {source} (sha256(path) % 100 < 5)"


@dataclass(frozen=True)
class EvalSettings:
    windows: int = 8
    context: int = 256
    continuation: int = 64
    passkey_contexts: tuple[int, ...] = (256, 512)
    passkey_depths: tuple[float, ...] = (0.1, 0.5, 0.9)
    passkey_samples: int = 8
    bootstrap: int = 1000
    seed: int = 0
    # Ouro's exit rule for both sides (a token leaves once its cumulative exit probability
    # reaches it); None: the model's own setting
    exit_threshold: float | None = None

    def check(self, model: OuroModel, text_tokens: int) -> None:
        if self.windows < 1 or self.context < 1 or self.continuation < 1:
            raise ConfigError(
                f"windows={self.windows}, context={self.context}, continuation={self.continuation} "
                "must all be >= 1"
            )
        if self.exit_threshold is not None and not 0 < self.exit_threshold <= 1:
            raise ConfigError(f"exit_threshold={self.exit_threshold} must be in (0, 1]")
        if self.passkey_samples < 0 or self.bootstrap < 1:
            raise ConfigError(
                f"passkey_samples={self.passkey_samples} must be >= 0 (0 skips passkey retrieval) "
                f"and bootstrap={self.bootstrap} >= 1"
            )
        short = [c for c in self.passkey_contexts if c < PASSKEY_MIN_CONTEXT]
        if short:
            raise ConfigError(
                f"passkey contexts {short} are too short: a needle and its question take "
                f"about 100 tokens; each context must be >= {PASSKEY_MIN_CONTEXT}"
            )
        limit = model.config.max_position_embeddings
        longest = max(
            self.context + self.continuation, *(c + PASSKEY_TOKENS for c in self.passkey_contexts)
        )
        if longest > limit:
            raise ConfigError(f"evaluation needs {longest} positions; the model allows {limit}")
        window = self.context + self.continuation + 1
        if text_tokens < window:
            raise ConfigError(f"text has {text_tokens} tokens; one window needs {window}")


@dataclass(frozen=True)
class _Prompts:
    """What both sides run: scored windows (contexts, forced targets) and passkey prompts
    with their keys."""

    contexts: list[list[int]]
    targets: list[list[int]]
    passkey: list[list[int]]
    keys: list[str]


def _pool_blocks(prompts: _Prompts, block_size: int, depths: int) -> int:
    """KV blocks for every window and passkey prompt at once on each of ``depths`` planes,
    so that no prompt waits for another to finish."""
    lengths = [len(c) + len(t) for c, t in zip(prompts.contexts, prompts.targets, strict=True)]
    lengths += [len(p) + PASSKEY_TOKENS for p in prompts.passkey]
    return depths * sum(-(-n // block_size) for n in lengths)


def _engine(
    model: OuroModel,
    tokenizer_decode,
    backend: str,
    config: FlashLoopConfig,
    block_size: int,
    prompts: _Prompts,
) -> tuple[Engine, str]:
    request = model.support_request(block_size)
    registry = Registry.discover()
    effective = resolve(config, backend, request, registry)
    attention = registry.create(backend, request, config)
    chunk = 256
    if config.token_sparse_prefill.enabled:  # chunks must hold whole selection windows
        window = config.token_sparse_prefill.window_size
        chunk = window * -(-chunk // window)
    # a GPU step takes many prompts' chunks at once; the CPU keeps steps small
    on_gpu = next(model.parameters()).is_cuda
    engine = Engine(
        model,
        attention,
        num_blocks=_pool_blocks(prompts, block_size, model.config.total_ut_steps),
        block_size=block_size,
        prefill_chunk=chunk,
        max_batch_tokens=max(8192 if on_gpu else 512, chunk),
        detokenize=tokenizer_decode,
    )
    return engine, effective.digest()


def _passkey_prompts(filler: list[int], encode, settings: EvalSettings, rng: random.Random):
    prompts, keys, cells = [], [], []
    for length in settings.passkey_contexts:
        for depth in settings.passkey_depths:
            for _ in range(settings.passkey_samples):
                key = "".join(rng.choice("0123456789") for _ in range(5))
                needle, question = encode(NEEDLE.format(k=key)), encode(QUESTION)
                body = length - len(needle) - len(question)
                start = rng.randrange(0, len(filler) - body)
                seq = filler[start : start + body]
                at = int(depth * (body - len(needle)))
                prompts.append(seq[:at] + needle + seq[at:] + question)
                keys.append(key)
                cells.append(f"len{length}_depth{depth}")
    return prompts, keys, cells


def _stage(progress, name: str, engine: Engine, tokens: int):
    """An engine progress callback reporting the ``tokens`` a stage generates or scores
    under ``name`` (None without ``progress``)."""
    if progress is None:
        return None
    start = engine.counters()["tokens_generated"]
    return lambda *_: progress(name, engine.counters()["tokens_generated"] - start, tokens)


def exit_histogram(results, loops: int) -> list[int]:
    """Tokens that left after each loop (zero-based depth), over ``results``."""
    counts = [0] * loops
    for result in results:
        for depth in result.exit_depths:
            counts[depth] += 1
    return counts


@contextmanager
def exit_rule(model: OuroModel, threshold: float | None):
    """The model with Ouro's exit rule at ``threshold`` inside the block (None: as is)."""
    saved = model.config
    if threshold is not None:
        model.config = dataclasses.replace(saved, early_exit_threshold=threshold)
    try:
        yield
    finally:
        model.config = saved


def _run_sides(model, tokenizer, config, backend, block_size, progress, dense_cache, prompts):
    """Dense and ``config`` over the same windows and passkey prompts: per side its
    digest, log-probs, exit-depth histogram and passkey answers."""
    runs = {}
    for label, cfg in (("dense", FlashLoopConfig()), ("config", config)):
        if label == "dense" and dense_cache is not None and "dense" in dense_cache:
            runs["dense"] = dense_cache["dense"]
            continue
        side_backend = backend if label == "config" else "auto"
        engine, digest = _engine(model, tokenizer.decode, side_backend, cfg, block_size, prompts)
        targets = prompts.targets
        scoring = _stage(progress, f"{label}: windows", engine, sum(map(len, targets)))
        started = time.perf_counter()
        scored = engine.generate(
            prompts.contexts, forced=targets, keep_logprobs=True, progress=scoring
        )
        scoring_s = time.perf_counter() - started  # the tokens are on the host: work is done
        asking = _stage(
            progress, f"{label}: passkey", engine, PASSKEY_TOKENS * len(prompts.passkey)
        )
        answer_params = SamplingParams(max_new_tokens=PASSKEY_TOKENS, ignore_eos=True)
        started = time.perf_counter()
        answers = engine.generate(prompts.passkey, progress=asking, params=answer_params)
        runs[label] = {
            "digest": digest,
            "seconds": {"windows": scoring_s, "passkey": time.perf_counter() - started},
            "logprobs": [r.logprobs for r in scored],
            "exit_depths": exit_histogram(scored, model.config.total_ut_steps),
            "passkey": [
                tokenizer.decode(a.output_token_ids) == k
                for a, k in zip(answers, prompts.keys, strict=True)
            ],
        }
    if dense_cache is not None:
        dense_cache["dense"] = runs["dense"]
    return runs


def evaluate(
    model: OuroModel,
    tokenizer,
    text: str,
    config: FlashLoopConfig,
    backend: str = "auto",
    settings: EvalSettings | None = None,
    block_size: int = 16,
    progress: Callable[[str, int, int], None] | None = None,
    dense_cache: dict | None = None,
) -> dict:
    """``progress(stage, done, total)``: tokens scored or generated in each stage
    (``dense: windows``, ``config: passkey``, ...). ``dense_cache``: pass the same dict to
    calls with the same model, text and settings to run the dense side once
    (``eval --combinations``)."""
    settings = settings or EvalSettings()
    encode = lambda s: tokenizer.encode(s).ids  # noqa: E731
    tokens = encode(text)
    settings.check(model, len(tokens))
    rng = random.Random(settings.seed)
    span = settings.context + settings.continuation
    starts = [rng.randrange(0, len(tokens) - span) for _ in range(settings.windows)]
    contexts = [tokens[s : s + settings.context] for s in starts]
    targets = [tokens[s + settings.context : s + span] for s in starts]
    pass_prompts, keys, cells = _passkey_prompts(tokens, encode, settings, rng)

    resolve(config, backend, model.support_request(block_size))  # unservable: before dense work
    with exit_rule(model, settings.exit_threshold):
        prompts = _Prompts(contexts, targets, pass_prompts, keys)
        runs = _run_sides(
            model, tokenizer, config, backend, block_size, progress, dense_cache, prompts
        )
    dense, cand = runs["dense"], runs["config"]
    nll = {k: [] for k in runs}
    kl_all, agree = [], []
    for i, target in enumerate(targets):
        y = torch.tensor(target)
        d, c = dense["logprobs"][i], cand["logprobs"][i]
        nll["dense"].append(float(-d[torch.arange(len(y)), y].sum()))
        nll["config"].append(float(-c[torch.arange(len(y)), y].sum()))
        kl_all.append((d.exp() * (d - c)).sum(-1))
        agree.append((d.argmax(-1) == c.argmax(-1)).float())
    nbytes = [len(tokenizer.decode(t).encode("utf-8")) for t in targets]

    def rel_delta(idx: list[int]) -> float:
        bd = sum(nll["dense"][i] for i in idx)
        bc = sum(nll["config"][i] for i in idx)
        return 0.0 if bd == bc else 100.0 * (bc - bd) / bd

    boot = sorted(
        rel_delta([rng.randrange(len(targets)) for _ in targets]) for _ in range(settings.bootstrap)
    )
    kl = torch.cat(kl_all).clamp_min(0)
    total_bytes = sum(nbytes)

    def accuracy(flags: list[bool]) -> dict[str, float]:
        by_cell: dict[str, list[bool]] = {}
        for cell, ok in zip(cells, flags, strict=True):
            by_cell.setdefault(cell, []).append(ok)
        return {cell: sum(v) / len(v) for cell, v in by_cell.items()}

    return {
        "dense_digest": dense["digest"],
        "config_digest": cand["digest"],
        "config": config.model_dump(mode="json"),
        "kv_quantization": (
            f"packed INT4 store ({config.kv_residual_quantization.policy}), read by packed_decode"
            if config.kv_residual_quantization.enabled
            else "off"
        ),
        "settings": {k: v for k, v in settings.__dict__.items()},
        "bits_per_byte": {k: sum(v) / math.log(2) / total_bytes for k, v in nll.items()},
        "delta_bits_per_byte_percent": rel_delta(list(range(len(targets)))),
        "delta_ci95_percent": [boot[int(0.025 * len(boot))], boot[int(0.975 * len(boot)) - 1]],
        "kl_mean": float(kl.mean()),
        "kl_p99": float(torch.quantile(kl, 0.99)),
        "top1_agreement": float(torch.cat(agree).mean()),
        # tokens that left after each loop while scoring (all at the last without an exit rule)
        "exit_depths": {"dense": dense["exit_depths"], "config": cand["exit_depths"]},
        # wall time of each side's teacher-forced windows and passkey answers, first runs
        # included (kernels compile on first use): a latency figure for exit-rule runs
        "seconds": {"dense": dense["seconds"], "config": cand["seconds"]},
        "passkey_accuracy": {
            "dense": accuracy(dense["passkey"]),
            "config": accuracy(cand["passkey"]),
        },
        "tokens_scored": sum(len(t) for t in targets),
        "bytes_scored": total_bytes,
        "per_window": [
            {
                "start": start,
                "bits_per_byte": {k: v[i] / math.log(2) / nbytes[i] for k, v in nll.items()},
                "delta_bits_per_byte_percent": rel_delta([i]),
                "top1_agreement": float(agree[i].mean()),
            }
            for i, start in enumerate(starts)
        ],
    }
