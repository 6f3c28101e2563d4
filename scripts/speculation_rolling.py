"""Speculation under KV quantization ``rolling`` on a trained model (CPU, FP32): plain greedy
decoding against speculation with serial-aligned blocks (ending before each flush) and
with blocks that run across flushes (``block_boundary``, packing between blocks). Per
mode: the first token that differs from plain decoding in each sequence (None: none),
the acceptance rate and the host steps.

    python3 scripts/speculation_rolling.py --model models/ouro-eval-bytes-20m --out FILE
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flashloop_backend import FlashLoopConfig  # noqa: E402
from flashloop_backend.host import Engine, SamplingParams, load_model, load_tokenizer  # noqa: E402
from flashloop_backend.host.speculation import SpeculationSettings  # noqa: E402
from flashloop_backend.registry import Registry  # noqa: E402
from flashloop_backend.tools.evaluation import heldout_text  # noqa: E402
from flashloop_backend.tools.paths import record_path  # noqa: E402

ROLLING = {"enabled": True, "policy": "rolling", "group_size": 64, "tail_size": 64}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=192)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--block-size", type=int, default=4)
    parser.add_argument("--draft-depth", type=int, default=1)
    parser.add_argument("--out")
    args = parser.parse_args()
    model = load_model(args.model, "cpu", torch.float32)
    tokenizer = load_tokenizer(args.model)
    text = tokenizer.encode(heldout_text()[0]).ids
    stride = len(text) // args.prompts
    prompts = [text[i * stride : i * stride + args.prompt_tokens] for i in range(args.prompts)]
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    config = FlashLoopConfig(kv_residual_quantization=ROLLING)
    request = model.support_request(16)

    def engine(speculation=None) -> Engine:
        backend = Registry.discover().create("flashloop", request, config)
        return Engine(model, backend, num_blocks=1024, prefill_chunk=256, speculation=speculation)

    serial = engine()
    plain = [r.output_token_ids for r in serial.generate(prompts, params)]
    runs = []
    for mode in ("serial_aligned", "block_boundary"):
        settings = SpeculationSettings(
            block_size=args.block_size, draft_depth=args.draft_depth, rolling=mode
        )
        spec = engine(settings)
        tokens = [r.output_token_ids for r in spec.generate(prompts, params)]
        first_difference = [
            next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), None)
            for x, y in zip(plain, tokens, strict=True)
        ]
        counts = spec.counters()
        runs.append(
            {
                "rolling": mode,
                "first_difference": first_difference,
                "acceptance_rate": counts["acceptance_rate"],
                "blocks": counts["speculation_blocks"],
                "steps": spec.steps,
            }
        )
        print(json.dumps(runs[-1]), flush=True)
    record = {
        "kind": "speculation_rolling",
        "model": record_path(args.model),
        "config": config.model_dump(mode="json"),
        "prompts": args.prompts,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "block_size": args.block_size,
        "draft_depth": args.draft_depth,
        "plain_steps": serial.steps,
        "runs": runs,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
