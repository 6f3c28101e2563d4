"""The main job's closing table: dense against FlashLoop with all three features on, on the
same model, prompts and held-out text, measured in this process (speed from generation,
KV bytes from the engine's pools and the packed store, quality from a small
teacher-forced evaluation through the decode path)."""

from __future__ import annotations

import time

from ..capabilities import SupportRequest
from ..config import FlashLoopConfig
from ..evaluation import EvalSettings, evaluate, heldout_text
from ..registry import Registry
from .engine import Engine, SamplingParams

ALL_ON = FlashLoopConfig(
    token_sparse_prefill={"enabled": True, "window_size": 64, "retention": [1, 1, 0.75, 0.5]},
    sparse_decode_attention={"enabled": True, "key_retention": 0.25},
    kv_residual_quantization={"enabled": True, "policy": "fixed_prompt", "group_size": 64},
)
QUICK_EVAL = EvalSettings(
    windows=8, context=256, continuation=64, passkey_contexts=(256,), passkey_samples=2,
    bootstrap=200,
)  # fmt: skip


def _run(model, tokenizer, prompts, config, block_size, max_new_tokens) -> dict:
    """Generate the prompts; tokens/s and the steady KV bytes per token at the fullest step."""
    cfg = model.config
    param = next(model.parameters())
    request = SupportRequest(param.device.type, param.dtype, cfg.head_dim, block_size,
                             cfg.num_attention_heads, cfg.num_key_value_heads)  # fmt: skip
    backend = Registry.discover().create("flashloop", request, config)
    engine = Engine(model, backend, num_blocks=4096, block_size=block_size, prefill_chunk=256,
                    detokenize=tokenizer.decode)  # fmt: skip
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True))
    start, generated, best = time.perf_counter(), 0, (0, 0.0)
    while engine.has_unfinished():
        generated += sum(len(r.output_token_ids) for r in engine.step())
        tokens, held = engine.kv_held()
        if tokens > best[0]:
            best = (tokens, held / tokens)
    seconds = time.perf_counter() - start
    return {"tokens_per_s": generated / seconds, "kv_bytes_per_token": best[1]}


def side_by_side(model, tokenizer, prompts: list[list[int]], block_size: int, max_new_tokens: int,
                 log=print) -> dict:  # fmt: skip
    """Measure dense and all-on FlashLoop, print the table, return the numbers."""
    log("\ncomparing dense with FlashLoop (all three features on) on the same model...")
    rows = {}
    for name, config in (("dense", FlashLoopConfig()), ("flashloop, all on", ALL_ON)):
        rows[name] = _run(model, tokenizer, prompts, config, block_size, max_new_tokens)
    text, _ = heldout_text()
    quality = evaluate(
        model, tokenizer, text, ALL_ON, "flashloop", QUICK_EVAL, block_size=block_size
    )
    dense, flash = rows["dense"], rows["flashloop, all on"]
    log("\n| | dense | FlashLoop, all on | ratio |")
    log("| --- | --- | --- | --- |")
    log(f"| tokens/s (this machine) | {dense['tokens_per_s']:.1f} | {flash['tokens_per_s']:.1f} | "
        f"{flash['tokens_per_s'] / dense['tokens_per_s']:.2f}x |")  # fmt: skip
    log(f"| KV bytes per held token | {dense['kv_bytes_per_token']:.0f} | {flash['kv_bytes_per_token']:.0f} | "
        f"{dense['kv_bytes_per_token'] / flash['kv_bytes_per_token']:.2f}x smaller |")  # fmt: skip
    log(f"| Δ bits/byte vs dense (95% CI) | 0 | {quality['delta_bits_per_byte_percent']:+.2f}% "
        f"[{quality['delta_ci95_percent'][0]:+.1f}, {quality['delta_ci95_percent'][1]:+.1f}] | |")  # fmt: skip
    log(f"| top-1 agreement with dense | 1 | {quality['top1_agreement']:.3f} | |")
    log(f"\n(speed on {next(model.parameters()).device.type} runs the reference kernels there: the "
        "FlashLoop speedups are GPU figures, see results/README.md; quality from "
        f"{QUICK_EVAL.windows} held-out windows of {QUICK_EVAL.context} + {QUICK_EVAL.continuation} tokens)")  # fmt: skip
    return {"rows": rows, "quality": quality}
