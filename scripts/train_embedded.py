"""Train the embedded default model: a tiny Ouro-layout looped LM (head_dim 128, 4 loops,
byte-level vocabulary) with Ouro's stage-I objective, on the Python standard library's
source (held out by file) plus synthetic passkey sequences.

Run on a GPU (``--seconds`` bounds the training loop; the embedded model's own run is
results/embedded_train_h200.log, and flashloop_backend/models/ouro-tiny-bytes/MODEL_CARD.md
describes it):
    python3 scripts/train_embedded.py --out $OUT --seconds 390
``--init DIR`` continues from a checkpoint instead (a short run that fits on a CPU, e.g.
the embedded model with ``--consistency``); ``--max-steps`` bounds a run by steps.
Writes config.json, model.safetensors, tokenizer.json and metrics.json (a model card is
written from metrics.json by hand).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flashloop_backend.host.config import OuroConfig  # noqa: E402
from flashloop_backend.host.layer_ops import rope_reference  # noqa: E402
from flashloop_backend.host.loader import load_model, save_checkpoint  # noqa: E402
from flashloop_backend.host.model import (  # noqa: E402
    OuroModel,
    exit_distribution,
    rope_cos_sin,
)
from flashloop_backend.host.tokenizer import build_byte_tokenizer  # noqa: E402
from flashloop_backend.tools.paths import record_path  # noqa: E402

BOS, EOS = 256, 257
NEEDLE = " The pass key is {k}. Remember it. {k} is the pass key. "
QUESTION = " What is the pass key? The pass key is {k}"


def corpus_root(name: str) -> Path:
    """The source tree of a corpus: the standard library, or the installed packages."""
    key = {"stdlib": "stdlib", "packages": "purelib"}[name]
    return Path(sysconfig.get_paths()[key])


def corpus(
    held_out_percent: int, name: str = "stdlib", limit_mb: float = 0
) -> tuple[np.ndarray, np.ndarray, int, int]:
    """The corpus's .py files as bytes separated by EOS; held-out split by a hash of the
    path (``stdlib`` leaves site-packages out; ``packages`` is site-packages alone).
    ``limit_mb`` > 0 stops once that many megabytes are read, files taken in the order of
    their path hashes so that a capped corpus still mixes every package."""
    root = corpus_root(name)
    train, held, total = [], [], 0
    keyed = []
    for path in root.rglob("*.py"):
        if name == "stdlib" and "site-packages" in path.parts:
            continue
        rel = str(path.relative_to(root))
        keyed.append((hashlib.sha256(rel.encode()).hexdigest(), path))
    keyed.sort()
    for digest, path in keyed:
        if limit_mb > 0 and total >= limit_mb * 1e6:
            break
        try:
            data = path.read_bytes()
        except OSError:
            continue
        total += len(data)
        bucket = int(digest, 16) % 100
        (held if bucket < held_out_percent else train).append(
            np.frombuffer(data, np.uint8).astype(np.int16)
        )
        (held if bucket < held_out_percent else train).append(np.array([EOS], np.int16))
    return (
        np.concatenate(train),
        np.concatenate(held),
        (len(train) + len(held)) // 2,
        len(held) // 2,
    )


def passkey_sample(filler: np.ndarray, length: int, depth: float, rng: np.random.Generator):
    """(tokens [length], answer start index, key string) with the needle at ``depth``."""
    key = "".join(str(d) for d in rng.integers(0, 10, 5))
    needle = np.frombuffer(NEEDLE.format(k=key).encode(), np.uint8).astype(np.int16)
    question = np.frombuffer(QUESTION.format(k=key).encode(), np.uint8).astype(np.int16)
    body = length - 1 - len(question)
    start = rng.integers(0, len(filler) - body)
    seq = filler[start : start + body].copy()
    at = int(depth * (body - len(needle)))
    seq[at : at + len(needle)] = needle
    tokens = np.concatenate([[BOS], seq, question])
    return tokens, len(tokens) - 5, key


def windows(data: torch.Tensor, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, data.numel() - length, (batch,), generator=gen, device=data.device)
    idx = starts[:, None] + torch.arange(length, device=data.device)
    return data[idx].long()


def ouro_loss(
    model: OuroModel, tokens: torch.Tensor, beta: float, consistency: float = 0.0, after: int = 2
):
    """Ouro's stage-I loss; ``consistency`` > 0 adds that weight times the mean relative
    squared change of the end-of-loop hidden state over the transitions after loop
    ``after`` (the loops sparse decode and the residual quantization predict from)."""
    hiddens, gates = model.full_forward(tokens[:, :-1])
    targets = tokens[:, 1:]
    per_loop = torch.stack(
        [
            F.cross_entropy(model.lm_head(h).float().transpose(1, 2), targets, reduction="none")
            for h in hiddens
        ],
        dim=-1,
    )  # [B, T, loops]
    pdf = exit_distribution(gates)
    entropy = -(pdf * torch.log(pdf.clamp_min(1e-9))).sum(-1)
    loss = (pdf * per_loop).sum(-1).mean() - beta * entropy.mean()
    if consistency > 0:
        changes = [
            (
                (hiddens[r].float() - hiddens[r - 1].float()).pow(2).sum(-1)
                / hiddens[r].float().pow(2).sum(-1).clamp_min(1e-6)
            ).mean()
            for r in range(after, len(hiddens))
        ]
        loss = loss + consistency * torch.stack(changes).mean()
    return loss, per_loop.mean(dim=(0, 1)), entropy.mean()


@torch.no_grad()
def analyse(model: OuroModel, tokens: torch.Tensor) -> dict:
    """Per-loop loss (nats and bits/byte) and cross-loop relative change of hidden, K, V."""
    cfg = model.config
    hiddens, _ = model.full_forward(tokens[:, :-1])
    targets = tokens[:, 1:]
    losses = [
        F.cross_entropy(model.lm_head(h).float().transpose(1, 2), targets).item() for h in hiddens
    ]
    positions = torch.arange(tokens.shape[1] - 1, device=tokens.device)
    cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta)
    ks, vs = [], []
    h = model.model.embed_tokens(tokens[:, :-1])
    for _ in range(cfg.total_ut_steps):
        k_loop, v_loop = [], []
        for layer in model.model.layers:
            x = layer.input_layernorm(h)
            k = layer.self_attn.k_proj(x).view(*x.shape[:2], cfg.num_key_value_heads, cfg.head_dim)
            k_loop.append(rope_reference(k, cos, sin).float())
            v_loop.append(layer.self_attn.v_proj(x).float())
            # advance h through the layer exactly as full_forward does
            q, kk, vv = layer.self_attn.qkv(x, cos, sin)
            group = cfg.num_attention_heads // cfg.num_key_value_heads
            q, kk, vv = (t.transpose(1, 2) for t in (q, kk, vv))
            attn = F.scaled_dot_product_attention(
                q, kk.repeat_interleave(group, 1), vv.repeat_interleave(group, 1), is_causal=True
            )
            attn = layer.self_attn.o_proj(attn.transpose(1, 2).reshape(*x.shape[:2], -1))
            h = layer.mlp_block(h + layer.input_layernorm_2(attn))
        h = model.model.norm(h)
        ks.append(torch.stack(k_loop))
        vs.append(torch.stack(v_loop))

    def rel(seq):
        return [((seq[i] - seq[i - 1]).norm() / seq[i].norm()).item() for i in range(1, len(seq))]

    return {
        "loss_nats_per_loop": losses,
        "bits_per_byte_per_loop": [x / math.log(2) for x in losses],
        "relative_change_hidden": rel([x.float() for x in hiddens]),
        "relative_change_k": rel(ks),
        "relative_change_v": rel(vs),
    }


@torch.no_grad()
def passkey_accuracy(
    model: OuroModel, filler: np.ndarray, device, seed: int, lengths=(256, 512, 1024)
) -> dict:
    rng = np.random.default_rng(seed)
    result = {}
    for length in lengths:
        for depth in (0.1, 0.5, 0.9):
            samples = [passkey_sample(filler, length, depth, rng) for _ in range(32)]
            tokens = torch.tensor(np.stack([s[0] for s in samples]), device=device).long()
            answer = samples[0][1]
            hiddens, _ = model.full_forward(tokens[:, :-1])
            pred = model.lm_head(hiddens[-1][:, answer - 1 : answer - 1 + 5]).argmax(-1)
            correct = (pred == tokens[:, answer : answer + 5]).all(-1).float().mean().item()
            result[f"len{length}_depth{depth}"] = correct
    return result


def model_shape(model: OuroModel) -> dict[str, int]:
    """The shape flags as the trained model has them (with ``--init``, the checkpoint's:
    the flags given are not used)."""
    c = model.config
    return {
        "hidden": c.hidden_size,
        "layers": c.num_hidden_layers,
        "heads": c.num_attention_heads,
        "intermediate": c.intermediate_size,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seconds", type=float, default=390)
    parser.add_argument(
        "--max-steps",
        type=int,
        default=0,
        help="also stop after this many steps (0: only --seconds bounds the run); the "
        "learning-rate schedule follows whichever bound is nearer",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--beta", type=float, default=0.05, help="entropy bonus weight")
    parser.add_argument("--passkey-fraction", type=float, default=0.25)
    parser.add_argument(
        "--consistency",
        type=float,
        default=0.0,
        help="weight of the late loops' hidden-state change in the loss (0: Ouro's stage I)",
    )
    parser.add_argument(
        "--consistency-after",
        type=int,
        default=2,
        help="the change is taken over the transitions after this loop (1-based)",
    )
    # the model's shape (defaults: the embedded model's) and its corpus
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=2, help="attention and KV heads (128 dims)")
    parser.add_argument("--intermediate", type=int, default=704)
    parser.add_argument("--corpus", choices=("stdlib", "packages"), default="stdlib")
    parser.add_argument(
        "--corpus-mb", type=float, default=0, help="read at most this many MB (0: all)"
    )
    parser.add_argument(
        "--init",
        default=None,
        help="start from this checkpoint directory (its architecture; --layers, --hidden, "
        "--heads and --intermediate are then not used) instead of random weights",
    )
    parser.add_argument(
        "--warmup-steps", type=int, default=200, help="steps of linear learning-rate warm-up"
    )
    parser.add_argument("--passkey-lengths", default="256,512,1024")
    parser.add_argument("--eval-windows", type=int, default=64)
    args = parser.parse_args()
    if args.hidden != 128 * args.heads:
        parser.error(f"--hidden {args.hidden} must be 128 x --heads {args.heads} (head_dim 128)")
    if args.max_steps < 0:
        parser.error(f"--max-steps {args.max_steps} must be >= 0 (0: no step bound)")
    if args.warmup_steps < 1:
        parser.error(f"--warmup-steps {args.warmup_steps} must be >= 1")
    if args.init is not None and not (Path(args.init) / "config.json").is_file():
        parser.error(f"--init {args.init} is not a checkpoint directory (no config.json in it)")
    if args.consistency < 0 or not 1 <= args.consistency_after <= 3:
        parser.error(
            f"--consistency {args.consistency} must be >= 0 and --consistency-after "
            f"{args.consistency_after} one of 1, 2, 3 (the model has 4 loops)"
        )
    lengths = tuple(int(v) for v in args.passkey_lengths.split(","))
    if min(args.seq_len, *lengths) < 128:  # a needle and its question take about 100 bytes
        parser.error(f"--seq-len {args.seq_len} and --passkey-lengths {lengths} must be >= 128")
    torch.manual_seed(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = OuroConfig(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        head_dim=128,
        intermediate_size=args.intermediate,
        vocab_size=258,
        rope_theta=10000.0,
        total_ut_steps=4,
        max_position_embeddings=4096,
        early_exit_threshold=1.0,
        bos_token_id=BOS,
        eos_token_id=EOS,
    )
    train_np, held_np, n_files, n_held = corpus(5, args.corpus, args.corpus_mb)
    print(
        f"corpus: {n_files} files read, train {len(train_np) / 1e6:.1f} MB, "
        f"held-out {len(held_np) / 1e6:.2f} MB ({n_held} files)"
    )
    train = torch.tensor(train_np, device=device)
    held = torch.tensor(held_np, device=device)
    rng = np.random.default_rng(args.seed)
    pool = [passkey_sample(train_np, args.seq_len + 1, rng.random(), rng)[0] for _ in range(8192)]
    passkeys = torch.tensor(np.stack(pool), device=device).long()

    if args.init is not None:
        model = load_model(Path(args.init), device, torch.float32)
        model.train()
    else:
        model = OuroModel(cfg).to(device)
        for name, p in model.named_parameters():
            if p.dim() == 2:
                torch.nn.init.normal_(
                    p,
                    std=0.02
                    if "o_proj" not in name and "down_proj" not in name
                    else 0.02 / math.sqrt(2 * cfg.num_hidden_layers),
                )
        torch.nn.init.zeros_(model.model.early_exit_gate.bias)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    n_pass = int(args.batch * args.passkey_fraction)
    start, step, log = time.time(), 0, []
    while (elapsed := time.time() - start) < args.seconds and (
        args.max_steps == 0 or step < args.max_steps
    ):
        frac = max(elapsed / args.seconds, step / args.max_steps if args.max_steps else 0.0)
        lr = (
            args.lr
            * min(1.0, (step + 1) / args.warmup_steps)
            * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        )
        for group in opt.param_groups:
            group["lr"] = lr
        text = windows(train, args.batch - n_pass, args.seq_len + 1, gen)
        pick = torch.randint(0, passkeys.shape[0], (n_pass,), generator=gen, device=device)
        tokens = torch.cat([text, passkeys[pick]])
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=device == "cuda"):
            loss, per_loop, entropy = ouro_loss(
                model, tokens, args.beta, args.consistency, args.consistency_after
            )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 200 == 0:
            row = {
                "step": step,
                "seconds": round(elapsed, 1),
                "lr": lr,
                "loss": loss.item(),
                "per_loop": [round(x, 4) for x in per_loop.tolist()],
                "exit_entropy": entropy.item(),
            }
            log.append(row)
            print(json.dumps(row), flush=True)
        step += 1

    model.eval()
    eval_gen = torch.Generator(device=device).manual_seed(args.seed + 1)
    held_tokens = windows(held, args.eval_windows, args.seq_len + 1, eval_gen)
    with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=device == "cuda"):
        metrics = analyse(model, held_tokens)
        metrics["passkey_accuracy"] = passkey_accuracy(
            model, held_np, device, args.seed + 2, lengths
        )
    metrics.update(
        steps=step,
        seconds=round(time.time() - start, 1),
        seed=args.seed,
        args={**vars(args), **model_shape(model), "out": record_path(args.out)},
        device=torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        corpus={
            "files": n_files,
            "held_out_files": n_held,
            "train_bytes": len(train_np),
            "held_out_bytes": len(held_np),
            "source": f"Python {sys.version.split()[0]} "
            + ("standard library" if args.corpus == "stdlib" else "installed packages")
            + f" (*.py under {corpus_root(args.corpus)}), held out by sha256(path) % 100 < 5",
        },
        params=sum(p.numel() for p in model.parameters()),
        log=log,
    )
    out = Path(args.out)
    save_checkpoint(model, out, dtype=torch.bfloat16)
    build_byte_tokenizer().save(str(out / "tokenizer.json"))
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    print(json.dumps({k: v for k, v in metrics.items() if k != "log"}, indent=2))


if __name__ == "__main__":
    main()
