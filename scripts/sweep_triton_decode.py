"""Sweep launch shapes of the Triton paged decode kernel against FlashInfer on the H200.

    python3 scripts/sweep_triton_decode.py --shapes 8192x1,32768x1 > $OUT/sweep.json
Prints the best variants per shape to stderr and a JSON summary to stdout. Each time is
the median replay of a CUDA graph of ``calls`` launches over KV copies larger than the L2
cache together (no host launch cost, no cache reuse), divided by ``calls``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys

import torch

from flashloop_backend.kernels.flashinfer import paged_attention_flashinfer, planned_wrapper
from flashloop_backend.kernels.triton.paged_decode import DecodeTuning, paged_attention_triton
from flashloop_backend.tools.bench.timing import graph_ms

SHAPES = [(32768, 16), (32768, 1), (8192, 16), (8192, 1), (1024, 16)]
HEADS, DIM, BS = 16, 128, 16


def timed(fn, caches, reps=20, calls=10) -> float:
    return graph_ms(lambda pair: fn(*pair), reps=reps, calls=calls, rotate=caches)


def sweep_shape(ctx: int, conc: int, variants: list[DecodeTuning], gen: torch.Generator) -> dict:
    pages = math.ceil(ctx / BS)
    nbytes = 2 * conc * pages * BS * HEADS * DIM * 2
    copies = max(2, math.ceil(512 * 2**20 / nbytes))
    shape = (conc * pages, BS, HEADS, DIM)
    caches = [
        [torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2)]
        for _ in range(copies)
    ]
    tables = torch.randperm(conc * pages, device="cuda", generator=gen).int().reshape(conc, pages)
    lengths = torch.full((conc,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(conc, HEADS, DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    ref = paged_attention_flashinfer(q, *caches[0], tables, lengths)
    wrapper = planned_wrapper(q.device)
    base = timed(lambda k, v: wrapper.run(q, (k, v)), caches)
    rows = []
    for tune, splits in variants:

        def fn(k, v, t=tune, n=splits):
            return paged_attention_triton(q, k, v, tables, lengths, num_splits=n, tuning=t)

        err = ((fn(*caches[0]).float() - ref.float()).norm() / ref.float().norm()).item()
        ms = timed(fn, caches)
        rows.append(
            {
                "tuning": tune.__dict__,
                "num_splits": splits,
                "ms": ms,
                "vs_flashinfer": ms / base,
                "tb_s": nbytes / ms / 1e9,
                "rel_err": err,
            }
        )
    rows.sort(key=lambda r: r["ms"])
    for r in rows[:5]:
        print(f"ctx={ctx} conc={conc} flashinfer {base * 1e3:.1f}us | {r['tuning']} splits={r['num_splits']} {r['ms'] * 1e3:.1f}us "
              f"x{r['vs_flashinfer']:.2f} {r['tb_s']:.2f}TB/s err {r['rel_err']:.1e}", file=sys.stderr)  # fmt: skip
    return {"context": ctx, "concurrency": conc, "flashinfer_ms": base, "variants": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", default=",".join(f"{c}x{n}" for c, n in SHAPES))
    parser.add_argument("--splits", default="0", help="split counts; 0: the wrapper's choice")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    variants = [
        (DecodeTuning(keys_per_iter=k, num_warps=w, num_stages=s, use_dot=dot), n or None)
        for k, w, s, dot, n in itertools.product(
            (64, 128), (4, 8), (2, 3), (False, True), [int(n) for n in args.splits.split(",")]
        )
    ]
    summary = []
    shapes = [tuple(int(x) for x in shape.split("x")) for shape in args.shapes.split(",")]
    for ctx, conc in shapes:
        summary.append(sweep_shape(ctx, conc, variants, gen))
        torch.cuda.empty_cache()
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
