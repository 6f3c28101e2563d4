"""Host steps and draft acceptance of greedy block speculation against plain greedy decoding
on a trained model (CPU, FP32; dense, or the features of ``--config``). Speculation must give the same tokens; the record
holds, per draft depth and block size, the acceptance rate and the engine steps the whole
generation took (prefill steps included, the same for every run). Steps do not depend on
the hardware; their time does, and is the GPU benchmark's (bench e2e --speculate).

    python3 scripts/speculation_steps.py --model models/ouro-eval-bytes-20m --out FILE

Under KV quantization ``rolling`` (``--config configs/kv_quant_rolling.json``),
``--rolling serial_aligned,block_boundary`` compares blocks that end before each flush
with blocks that run across it (``first_difference`` says where tokens part).
``--confidences 0,0.5`` sweeps the draft confidence (a draft less probable ends its
block's drafting; ``stopped`` counts the blocks it ended).
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
from flashloop_backend.config import load_config  # noqa: E402
from flashloop_backend.host import Engine, SamplingParams, load_model, load_tokenizer  # noqa: E402
from flashloop_backend.host.speculation import SpeculationSettings  # noqa: E402
from flashloop_backend.registry import Registry  # noqa: E402
from flashloop_backend.tools.evaluation import heldout_text  # noqa: E402
from flashloop_backend.tools.paths import record_path  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=192)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--config", help="FlashLoop config file (default: every feature off)")
    parser.add_argument("--blocks", default="2,4,8", help="block sizes K, comma-separated")
    parser.add_argument("--depths", default="1,2", help="draft depths, comma-separated")
    parser.add_argument(
        "--rolling",
        default="serial_aligned",
        help="KV quantization rolling: serial_aligned and/or block_boundary, comma-separated",
    )
    parser.add_argument(
        "--confidences", default="0", help="draft confidences in [0, 1), comma-separated"
    )
    parser.add_argument("--out")
    args = parser.parse_args()
    config = load_config(args.config) if args.config else FlashLoopConfig()
    model = load_model(args.model, "cpu", torch.float32)
    tokenizer = load_tokenizer(args.model)
    source, described = heldout_text()
    text = tokenizer.encode(source).ids
    stride = len(text) // args.prompts
    prompts = [text[i * stride : i * stride + args.prompt_tokens] for i in range(args.prompts)]
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    request = model.support_request(16)

    def engine(speculation=None) -> Engine:
        backend = Registry.discover().create("flashloop", request, config)
        return Engine(model, backend, num_blocks=1024, prefill_chunk=256, speculation=speculation)

    plain_engine = engine()
    plain = [r.output_token_ids for r in plain_engine.generate(prompts, params)]
    rows = []
    sweep = [
        (int(depth), int(block), rolling, float(confidence))
        for depth in args.depths.split(",")
        for block in args.blocks.split(",")
        for rolling in args.rolling.split(",")
        for confidence in args.confidences.split(",")
    ]
    for depth, block, rolling, confidence in sweep:
        settings = SpeculationSettings(
            block_size=block, draft_depth=depth, rolling=rolling, draft_confidence=confidence
        )
        spec = engine(settings)
        tokens = [r.output_token_ids for r in spec.generate(prompts, params)]
        counts = spec.counters()
        rows.append(
            {
                "draft_depth": depth,
                "block_size": block,
                "rolling": rolling,
                "draft_confidence": confidence,
                "same_tokens": tokens == plain,
                # per sequence, the first output token that differs from plain decoding
                "first_difference": [
                    next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), None)
                    for x, y in zip(plain, tokens, strict=True)
                ],
                "acceptance_rate": counts["acceptance_rate"],
                "blocks": counts["speculation_blocks"],
                "stopped": counts["speculation_stopped"],
                "rows": counts["speculation_rows"],
                "steps": spec.steps,
                "steps_vs_plain": plain_engine.steps / spec.steps,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    record = {
        "kind": "speculation_steps",
        "model": record_path(args.model),
        "config": config.model_dump(mode="json"),
        "prompts": args.prompts,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "text": described,
        "plain_steps": plain_engine.steps,
        "runs": rows,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
