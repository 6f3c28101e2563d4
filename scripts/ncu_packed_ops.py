"""The packed decode ops of one layer call, each launched a few times on encoded rows, for
a kernel profiler to read (Nsight Compute): the streaming reader at depth 1, the loop-2
source (keys pass, selection, values pass) at depth 2 and the loop 3-4 correction at
depths 3 and 4, CUDA kernels only.

    ncu --clock-control none --section SpeedOfLight -k regex:packed_ \
        python3 scripts/ncu_packed_ops.py --context 8192 --concurrency 1
"""

import argparse

import torch

from flashloop_backend.backends.sparse_state import key_bucket
from flashloop_backend.kernels.cuda.packed_selected import packed_sparse_correction_cuda
from flashloop_backend.kernels.cuda.packed_source import packed_dense_source_cuda
from flashloop_backend.kernels.cuda.packed_stream import packed_decode_cuda
from flashloop_backend.kv.levels import level_metadata
from flashloop_backend.tools.bench.packed_rows import bf16_rows, encoded_store


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--calls", type=int, default=3, help="launches of each op")
    parser.add_argument("--key-retention", type=float, default=0.10)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, context = args.concurrency, args.context
    q, caches, tables, lengths = bf16_rows(context, rows, 1, gen)
    kc, vc = caches[0]
    store, _ = encoded_store(rows, context, 1, False, gen)
    meta = [level_metadata(store, list(range(rows)), [d] * rows, q.device) for d in range(4)]
    bucket = key_bucket(args.key_retention, context)
    for _ in range(args.calls):
        packed_decode_cuda(q, store, 0, meta[0], kc, vc, tables, lengths)
    for _ in range(args.calls):
        source = packed_dense_source_cuda(
            q, store, 0, meta[1], kc, vc, tables, lengths, args.key_retention, bucket, None
        )
    _, indices, mass, output, contribution = source
    for depth in (2, 3):
        for _ in range(args.calls):
            packed_sparse_correction_cuda(
                q, store, 0, meta[depth], kc, vc, tables, indices, mass, output, contribution
            )
    torch.cuda.synchronize()
    print("done")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
