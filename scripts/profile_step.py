"""Where a host step's GPU time goes: the top CUDA kernels of eager steps of one backend
through the host (Ouro-1.4B shapes, random weights), as a torch.profiler table and, with
``--json``, a record of each kernel's share of the profiled GPU time.

    python3 scripts/profile_step.py --backend triton --context 8192 --concurrency 1 \
        --layers 4 --phase decode --json profile_decode_8k.json

``--phase decode`` profiles ``--steps`` decode steps once every request decodes (one step
per loop depth, so --steps 8 covers each depth twice); ``--phase prefill`` profiles every
prompt step (each chunk at each loop) and the completed prompts' hand-over to the backend
(KV quantization packs them there). A warm-up pass on short prompts compiles the
kernels first. Decode records also time --steps eager steps without the profiler (wall ms
per step, beside the profiled GPU kernel ms per step)."""

import argparse
import json
import sys
import time

import torch

from flashloop_backend import FlashLoopConfig
from flashloop_backend.host.capacity import footprint, planning_capacity
from flashloop_backend.host.engine import Engine, SamplingParams
from flashloop_backend.registry import Registry
from flashloop_backend.tools.bench.bench_models import random_ouro


def new_tokens(args) -> int:
    """Tokens each request decodes: enough for the per-step, timed and profiled decode
    steps (--steps each; one loop depth a step, four a token) after the first token."""
    return 4 + -(-3 * args.steps // 4)


def _engine(args, model, request):
    config = FlashLoopConfig()
    if args.config:
        config = FlashLoopConfig.from_dict(json.load(open(args.config)))
    backend = Registry.discover().create(args.backend, request, config)
    # pools sized as bench e2e sizes them: a dense-sized BF16 pool beside the packed one
    # does not fit 32K x 16 on an 80 GB GPU
    shape = planning_capacity(
        model.config, args.context + new_tokens(args), 16, torch.device("cuda")
    )
    itemsize = next(model.parameters()).dtype.itemsize
    cost = footprint(backend, shape, args.context, new_tokens(args), itemsize)
    return Engine(
        model,
        backend,
        num_blocks=args.concurrency * cost.prefill_blocks + 8,
        packed_pages=args.concurrency * cost.packed_pages or None,
        block_size=16,
        prefill_chunk=args.prefill_chunk,
        max_batch_tokens=args.prefill_chunk * args.concurrency,
        max_context=args.context + new_tokens(args),
        max_slots=args.concurrency,
    )


def _device_us(event) -> float:
    for name in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(event, name):
            return float(getattr(event, name))
    return 0.0


def _profile_one_step(engine, step: int, layers: int) -> dict:
    """Print one decode step's kernels (launches and GPU µs per layer, by name) and return
    them as a record: the step's GPU µs and launches per layer, and each kernel's."""
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        engine.step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=_device_us, reverse=True)
    total = sum(_device_us(e) for e in kernels)
    launches = sum(e.count for e in kernels)
    print(
        f"step {step}: {total / layers:.1f} GPU us and {launches / layers:.1f} launches a layer",
        file=sys.stderr,
    )
    for e in kernels:
        print(
            f"  {_device_us(e) / layers:8.2f} us {e.count / layers:5.2f}x  {e.key[:90]}",
            file=sys.stderr,
        )
    return {
        "step": step,
        "gpu_us_per_layer": total / layers,
        "launches_per_layer": launches / layers,
        "kernels": [
            {
                "name": e.key[:120],
                "us_per_layer": _device_us(e) / layers,
                "launches_per_layer": e.count / layers,
            }
            for e in kernels
        ],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", default="flashloop")
    parser.add_argument("--config")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--phase", choices=("decode", "prefill"), default="decode")
    parser.add_argument("--layer-ops", choices=("fused", "reference"), default="fused")
    parser.add_argument("--prefill-chunk", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=30, help="kernels listed")
    parser.add_argument("--json", help="write the record here")
    parser.add_argument(
        "--per-step",
        action="store_true",
        help="also list each profiled decode step's kernels (one loop depth a step at "
        "concurrency 1), and record them under per_step in --json",
    )
    args = parser.parse_args()
    model, request = random_ouro(args.layers, 16, fused=args.layer_ops == "fused")
    engine = _engine(args, model, request)
    # decode: --steps timed without the profiler, then --steps profiled
    params = SamplingParams(max_new_tokens=new_tokens(args), ignore_eos=True)
    prompts = [
        torch.randint(0, model.config.vocab_size, (args.context,)).tolist()
        for _ in range(args.concurrency)
    ]
    warm = min(args.context, args.prefill_chunk)
    engine.generate([p[:warm] for p in prompts], params)  # compiles every kernel
    for p in prompts:
        engine.add_request(p, params)
    if args.phase == "decode":
        while engine.counters()["prompts_running"]:  # until every request decodes
            engine.step()
        engine.hand_over_prompts()  # the packing stays out of the timed decode steps
    torch.cuda.synchronize()
    wall_ms = None
    per_step = []
    if args.phase == "decode" and args.per_step:
        per_step = [_profile_one_step(engine, step, args.layers) for step in range(args.steps)]
    if args.phase == "decode":
        started = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
        wall_ms = 1e3 * (time.perf_counter() - started) / args.steps
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    steps = 0
    with torch.profiler.profile(activities=activities) as prof:
        if args.phase == "decode":
            for _ in range(args.steps):
                engine.step()
            steps = args.steps
        else:
            while engine.counters()["prompts_running"]:
                engine.step()
                steps += 1
            engine.hand_over_prompts()  # the packing the next step would start with
        torch.cuda.synchronize()
    title = (
        f"{args.backend} {args.config or 'dense'} {args.layer_ops} layer ops "
        f"ctx={args.context} conc={args.concurrency} layers={args.layers}: {steps} "
        f"{args.phase} steps"
    )
    print(title, file=sys.stderr)
    events = prof.key_averages()
    print(events.table(sort_by="self_cuda_time_total", row_limit=args.rows))
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_us = sum(_device_us(e) for e in kernels)
    top = sorted(kernels, key=_device_us, reverse=True)[: args.rows]
    record = {
        "title": title,
        "phase": args.phase,
        "backend": args.backend,
        "layer_ops": args.layer_ops,
        "context": args.context,
        "concurrency": args.concurrency,
        "layers": args.layers,
        "steps": steps,
        "eager_wall_ms_per_step_unprofiled": wall_ms,
        "gpu_kernel_ms_per_step": gpu_us / 1e3 / steps,
        "gpu_us_per_layer_step": gpu_us / steps / args.layers,
        "kernel_launches_per_layer_step": sum(e.count for e in kernels) / steps / args.layers,
        "top_kernels": [
            {
                "name": e.key[:120],
                "share": _device_us(e) / gpu_us,
                "us_per_step": _device_us(e) / steps,
                "launches_per_step": e.count / steps,
            }
            for e in top
        ],
        "method": "torch.profiler over eager host steps (profiler overhead inflates wall time)",
    }
    if per_step:  # one loop depth a step at concurrency 1, in the order the engine ran them
        record["per_step"] = per_step
    print(json.dumps({k: v for k, v in record.items() if k != "top_kernels"}), file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
