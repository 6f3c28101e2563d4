"""CLI commands that drive the host: ``demo`` (the main job) and ``generate``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from ..capabilities import SupportRequest
from ..config import ConfigError, load_config
from ..registry import Registry, resolve
from .config import ModelError
from .engine import Engine, SamplingParams
from .kvcache import OutOfBlocksError
from .loader import load_model, load_tokenizer

DEMO_PROMPTS = (
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main():\n",
    "class Stack:\n    def __init__(self):\n",
    "The pass key is 71942. Remember it. 71942 is the pass key. "
    "What is the pass key? The pass key is ",
)


def embedded_model_path() -> Path:
    """Directory of the embedded default model (config.json, safetensors, tokenizer.json)."""
    return Path(__file__).resolve().parents[1] / "models" / "ouro-tiny-bytes"


def _pick_device(name: str) -> tuple[str, torch.dtype]:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "device 'cuda' was requested but no CUDA GPU is available (choices: auto, cpu)"
        )
    if name not in ("cpu", "cuda"):
        raise ConfigError(f"device {name!r} is unknown; choices: auto, cpu, cuda")
    return name, (torch.bfloat16 if name == "cuda" else torch.float32)


def _load(args: argparse.Namespace):
    """Device, dtype, FlashLoop config, model and tokenizer named by the common options."""
    device, dtype = _pick_device(args.device)
    config = load_config(args.config)
    try:
        model = load_model(args.model, device, dtype)
        tokenizer = load_tokenizer(args.model)
    except ModelError as exc:
        raise ConfigError(f"cannot load model {args.model!r}: {exc}") from None
    return device, dtype, config, model, tokenizer


def _setup(args: argparse.Namespace, log) -> tuple[Engine, object, object]:
    device, dtype, config, model, tokenizer = _load(args)
    cfg = model.config
    request = SupportRequest(
        device=device, dtype=dtype, head_dim=cfg.head_dim, block_size=args.block_size,
        num_q_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
    )  # fmt: skip
    registry = Registry.discover()
    try:
        selection = registry.select_backend(args.backend, request, config)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    backend = selection.spec.create(request, config, registry, selection.info)
    log(
        f"backend: {selection.info.selected_backend} (requested {args.backend!r}: {selection.info.selection_reason})"
    )
    for name, reasons in selection.rejected.items():
        log(f"  skipped {name}: {'; '.join(reasons)}")
    effective = resolve(config, selection.info.selected_backend, request, registry)
    log(f"effective config digest {effective.digest()}: features {list(config.enabled_features()) or 'none (dense)'}; "
        f"kernels {dict(effective.kernels)}")  # fmt: skip
    engine = Engine(
        model, backend, num_blocks=args.num_blocks, block_size=args.block_size,
        detokenize=tokenizer.decode,
    )  # fmt: skip
    return engine, tokenizer, selection


def _encode(tokenizer, engine: Engine, text: str) -> list[int]:
    ids = tokenizer.encode(text).ids
    bos = engine.cfg.bos_token_id
    return ([bos] if bos is not None else []) + ids


def _demo(args: argparse.Namespace) -> int:
    engine, tokenizer, _ = _setup(args, print)
    prompts = [_encode(tokenizer, engine, p) for p in DEMO_PROMPTS]
    try:
        params = SamplingParams(max_new_tokens=args.max_new_tokens)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    start = time.perf_counter()

    def progress(done: int, total: int) -> None:
        print(
            f"\r  generating: {done}/{total} requests done",
            end="" if done < total else "\n",
            file=sys.stderr,
            flush=True,
        )

    results = engine.generate(prompts, params, progress)
    seconds = time.perf_counter() - start
    generated = sum(len(r.output_token_ids) for r in results)
    for prompt, result in zip(DEMO_PROMPTS, results, strict=True):
        print(f"\n--- prompt {result.request_id} ({result.finish_reason}) ---")
        print(prompt + tokenizer.decode(result.output_token_ids))
    kv_tokens = sum(len(r.prompt_token_ids) + len(r.output_token_ids) for r in results)
    per_token = engine.kv.bytes_per_token()
    print(
        f"\n{generated} tokens in {seconds:.2f} s: {generated / seconds:.1f} tokens/s ({engine.steps} traversals)"
    )
    print(
        f"KV cache: {per_token} bytes/token over {engine.cfg.total_ut_steps} depth planes; "
        f"{kv_tokens} tokens held {kv_tokens * per_token / 1024:.1f} KiB; "
        f"pool {engine.kv.key_pool.numel() * engine.kv.key_pool.element_size() * 2 / 2**20:.1f} MiB"
    )
    if not args.no_compare:
        from .showcase import side_by_side

        side_by_side(engine.model, tokenizer, prompts, args.block_size, args.max_new_tokens)
    return 0


def _generate(args: argparse.Namespace) -> int:
    log = (lambda msg: print(msg, file=sys.stderr)) if args.json else print
    engine, tokenizer, selection = _setup(args, log)
    prompt = _encode(tokenizer, engine, args.prompt)
    start = time.perf_counter()
    try:  # bad sampling values, a prompt too long for the model, or for the KV pool
        params = SamplingParams(
            max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed
        )
        result = engine.generate([prompt], params)[0]
    except (ValueError, OutOfBlocksError) as exc:
        raise ConfigError(str(exc)) from None
    seconds = time.perf_counter() - start
    if args.json:
        print(json.dumps({
            "prompt_token_ids": result.prompt_token_ids,
            "output_token_ids": result.output_token_ids,
            "output_text": tokenizer.decode(result.output_token_ids),
            "finish_reason": result.finish_reason,
            "exit_depths": result.exit_depths,
            "backend": selection.info.selected_backend,
            "seconds": seconds,
        }))  # fmt: skip
    else:
        print(args.prompt + tokenizer.decode(result.output_token_ids))
        log(
            f"[{len(result.output_token_ids)} tokens, {seconds:.2f} s, finish: {result.finish_reason}]"
        )
    return 0


def _eval(args: argparse.Namespace) -> int:
    from ..evaluation import EvalSettings, evaluate, heldout_text

    device, dtype, config, model, tokenizer = _load(args)
    if args.text:
        path = Path(args.text)
        if not path.is_file():
            raise ConfigError(f"text file {args.text!r} does not exist")
        text, source = path.read_text(encoding="utf-8", errors="replace"), str(path)
    else:
        text, source = heldout_text()
    settings = EvalSettings(
        windows=args.windows, context=args.context, continuation=args.continuation,
        passkey_samples=args.passkey_samples, seed=args.seed,
    )  # fmt: skip
    log = (lambda m: print(m, file=sys.stderr)) if args.json else print
    if args.combinations:
        return _eval_combinations(args, model, tokenizer, text, source, config, settings, log)
    try:
        report = evaluate(model, tokenizer, text, config, args.backend, settings, args.block_size,
                          progress=lambda label: log(f"  scored {label}"))  # fmt: skip
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    report.update(model=str(args.model), text_source=source, device=device, dtype=str(dtype))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"bits/byte dense {report['bits_per_byte']['dense']:.4f} config {report['bits_per_byte']['config']:.4f} "
              f"(delta {report['delta_bits_per_byte_percent']:+.3f}%, 95% CI {report['delta_ci95_percent']})")  # fmt: skip
        print(
            f"KL mean {report['kl_mean']:.3g} p99 {report['kl_p99']:.3g}; top-1 agreement {report['top1_agreement']:.4f}"
        )
        print(f"passkey {report['passkey_accuracy']}")
    return 0


def _passkey_mean(cells: dict[str, float]) -> float:
    return sum(cells.values()) / max(1, len(cells))


def _eval_combinations(args, model, tokenizer, text, source, config, settings, log) -> int:
    """``eval --combinations``: every on/off combination of the config's features."""
    from ..evaluation import evaluate, feature_combinations

    try:
        combos = feature_combinations(config)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    records, dense_cache = [], {}
    for i, (features, combo) in enumerate(combos, 1):
        log(f"combination {i}/{len(combos)}: {' + '.join(features) or 'dense (all off)'}")
        try:
            report = evaluate(model, tokenizer, text, combo, args.backend, settings, args.block_size,
                              progress=lambda label: log(f"  scored {label}"), dense_cache=dense_cache)  # fmt: skip
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        records.append({"features": list(features), **report})
        if args.out:  # written after every combination: a long run loses nothing finished
            param = next(model.parameters())
            record = {"kind": "eval_combinations", "model": str(args.model), "text_source": source,
                      "device": str(param.device), "dtype": str(param.dtype),
                      "config": config.model_dump(mode="json"), "combinations": records}  # fmt: skip
            Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    if args.json:
        print(json.dumps(records, indent=2))
        return 0
    print(f"{'features':<76} {'d bits/byte':>12} {'95% CI':>18} {'top-1':>7} {'passkey':>15}")
    for r in records:
        ci = "[{:+.2f}, {:+.2f}]".format(*r["delta_ci95_percent"])
        keys = r["passkey_accuracy"]
        passkey = f"{_passkey_mean(keys['config']):.2f} / {_passkey_mean(keys['dense']):.2f}"
        print(f"{' + '.join(r['features']) or 'dense':<76} {r['delta_bits_per_byte_percent']:>+11.2f}% "
              f"{ci:>18} {r['top1_agreement']:>7.4f} {passkey:>15}")  # fmt: skip
    return 0


def _common(parser: argparse.ArgumentParser, model_default: str | None) -> None:
    parser.add_argument(
        "--model",
        default=model_default,
        required=model_default is None,
        help="Ouro checkpoint directory",
    )
    parser.add_argument("--backend", default="auto", help="backend name or 'auto' (default)")
    parser.add_argument("--config", help="FlashLoop config file (.json or .toml)")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--num-blocks", type=int, default=512, help="KV blocks in the pool")
    parser.add_argument("--block-size", type=int, default=16)


def add_commands(sub) -> None:
    demo = sub.add_parser("demo", help="main job: generate on the embedded model")
    _common(demo, str(embedded_model_path()))
    demo.add_argument("--max-new-tokens", type=int, default=48)
    demo.add_argument(
        "--no-compare", action="store_true",
        help="skip the closing dense vs FlashLoop (all on) table",
    )  # fmt: skip
    demo.set_defaults(handler=_demo)
    gen = sub.add_parser("generate", help="generate from any Ouro checkpoint")
    _common(gen, None)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-new-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--json", action="store_true")
    gen.set_defaults(handler=_generate)
    ev = sub.add_parser(
        "eval", help="quality of a FlashLoop config against dense (teacher-forced decode)"
    )
    _common(ev, str(embedded_model_path()))
    ev.add_argument("--text", help="text file (default: the embedded model's held-out split)")
    ev.add_argument("--windows", type=int, default=8)
    ev.add_argument("--context", type=int, default=256, help="prefilled tokens per window")
    ev.add_argument(
        "--continuation", type=int, default=64, help="teacher-forced decode tokens per window"
    )
    ev.add_argument("--passkey-samples", type=int, default=8, help="per (context, depth) cell")
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument(
        "--combinations", action="store_true",
        help="evaluate every on/off combination of the features the config enables",
    )  # fmt: skip
    ev.add_argument("--out", help="also write the JSON record here")
    ev.add_argument("--json", action="store_true")
    ev.set_defaults(handler=_eval)
