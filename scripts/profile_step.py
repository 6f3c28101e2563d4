"""Where a decode step's GPU time goes: the top CUDA kernels of eager decode steps of one
backend through the host (Ouro-1.4B shapes, random weights), as a torch.profiler table.

    python3 scripts/profile_decode.py --backend flashloop --config configs/all_on.json \
        --context 32768 --concurrency 16 --layers 2 --steps 8

A warm-up pass on short prompts compiles the kernels first; profiled steps start once every
request decodes (one decode step per loop depth, so --steps 8 covers each depth twice)."""

import argparse
import json
import sys

import torch

from flashloop_backend import FlashLoopConfig
from flashloop_backend.host.engine import Engine, SamplingParams
from flashloop_backend.registry import Registry
from flashloop_backend.tools.bench.e2e import random_ouro


def _engine(args, model, request):
    config = FlashLoopConfig()
    if args.config:
        config = FlashLoopConfig.from_dict(json.load(open(args.config)))
    backend = Registry.discover().create(args.backend, request, config)
    blocks = args.concurrency * (-(-(args.context + 64) // 16)) * model.config.total_ut_steps + 8
    return Engine(
        model,
        backend,
        num_blocks=blocks,
        block_size=16,
        prefill_chunk=2048,
        max_batch_tokens=2048 * args.concurrency,
        max_context=args.context + 64,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", default="flashloop")
    parser.add_argument("--config")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rows", type=int, default=30, help="kernels listed")
    args = parser.parse_args()
    model, request = random_ouro(args.layers, 16)
    engine = _engine(args, model, request)
    params = SamplingParams(max_new_tokens=4 + args.steps // 4, ignore_eos=True)
    prompts = [
        torch.randint(0, model.config.vocab_size, (args.context,)).tolist()
        for _ in range(args.concurrency)
    ]
    engine.generate([p[:2048] for p in prompts], params)  # compiles every kernel
    for p in prompts:
        engine.add_request(p, params)
    while engine.counters()["prompts_running"]:  # until every request decodes
        engine.step()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
    print(
        f"{args.backend} {args.config or 'dense'} ctx={args.context} conc={args.concurrency} "
        f"layers={args.layers}: {args.steps} decode steps",
        file=sys.stderr,
    )
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
