"""Where a sparse-decode op's GPU time goes: each kernel's mean device time per call of the
loop-2 source (BF16 pages and packed depth 2) and the loop 3-4 correction, Triton and (on
a GPU that builds them) CUDA, under torch.profiler, at one shape (Ouro-1.4B attention: 16
heads of 128, random BF16 rows); ``--only`` keeps the ops whose name holds it.

    python3 scripts/profile_sparse_ops.py --context 32768 --concurrency 16 \
        --key-retention 0.25 --only cuda --json profile_sparse_ops_32k.json
"""

import argparse
import json
from collections import defaultdict

import torch

from flashloop_backend.backends.sparse_state import key_bucket
from flashloop_backend.kernels.triton.dense_source import dense_source_triton
from flashloop_backend.kernels.triton.packed_sparse import (
    packed_dense_source_triton,
    packed_sparse_correction_triton,
)
from flashloop_backend.kernels.triton.sparse_decode import sparse_correction_triton
from flashloop_backend.kv.levels import level_metadata
from flashloop_backend.tools.bench.packed_rows import bf16_rows, encoded_store


def _kernel_means(fn, calls: int) -> dict[str, float]:
    """Kernel name -> mean device µs per call of ``fn`` over ``calls`` calls."""
    fn()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        us = float(getattr(event, "self_device_time_total", 0.0))
        if us > 0:
            totals[event.key[:80]] += us / calls
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--key-retention", type=float, default=0.25)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--only", default="", help="keep the ops whose name holds this")
    parser.add_argument("--json")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, caches, tables, lengths = bf16_rows(args.context, args.concurrency, 1, gen)
    kc, vc = caches[0]
    bucket = key_bucket(args.key_retention, args.context)
    ops = {}
    ops["bf16_source"] = lambda: dense_source_triton(
        q, kc, vc, tables, lengths, args.key_retention, bucket
    )
    _, idx, mass, output, contribution = ops["bf16_source"]()
    ops["bf16_correction"] = lambda: sparse_correction_triton(
        q, kc, vc, tables, idx, mass, output, contribution
    )
    store, _ = encoded_store(args.concurrency, args.context, 1, False, gen)
    rows = list(range(args.concurrency))
    meta = [level_metadata(store, rows, [d] * len(rows), q.device) for d in range(4)]
    reads = (q, store, 0, meta[1], kc, vc, tables, lengths)
    ops["packed_source_depth2"] = lambda: packed_dense_source_triton(
        *reads, args.key_retention, bucket
    )
    _, idx, mass, output, contribution = ops["packed_source_depth2"]()
    state = (idx, mass, output, contribution)
    ops["packed_correction_depth3"] = lambda: packed_sparse_correction_triton(
        q, store, 0, meta[2], kc, vc, tables, *state
    )
    from flashloop_backend.kernels.cuda.loader import unavailable

    if unavailable() is None:
        from flashloop_backend.kernels.cuda.packed_selected import packed_sparse_correction_cuda
        from flashloop_backend.kernels.cuda.packed_source import packed_dense_source_cuda

        ops["packed_source_depth2_cuda"] = lambda: packed_dense_source_cuda(
            *reads, args.key_retention, bucket
        )
        for depth in (2, 3):
            ops[f"packed_correction_depth{depth + 1}_cuda"] = lambda m=meta[depth]: (
                packed_sparse_correction_cuda(q, store, 0, m, kc, vc, tables, *state)
            )
    record = {"context": args.context, "concurrency": args.concurrency, "ops": {}}
    for name, fn in ops.items():
        if args.only not in name:
            continue
        means = _kernel_means(fn, args.calls)
        record["ops"][name] = means
        print(f"{name}: {sum(means.values()):.1f} us per call")
        for kernel, us in list(means.items())[:10]:
            print(f"  {us:9.1f} us  {kernel}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
