"""Sweep launch shapes of the Triton paged decode kernel against FlashInfer on the H200.

    python3 scripts/sweep_triton_decode.py > $OUT/sweep.json
Prints one line per (shape, variant) to stderr and a JSON summary to stdout.
"""

from __future__ import annotations

import itertools
import json
import math
import sys

import torch

from flashloop_backend.kernels.flashinfer import paged_attention_flashinfer, planned_wrapper
from flashloop_backend.kernels.triton.paged_decode import DecodeTuning, paged_attention_triton

SHAPES = [(32768, 16), (32768, 1), (8192, 16), (8192, 1), (1024, 16)]
HEADS, DIM, BS = 16, 128, 16


def timed(fn, caches, reps=20, calls=10) -> float:
    fn(*caches[0])
    samples = []
    for rep in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(calls):
            fn(*caches[(rep * calls + i) % len(caches)])
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / calls)
    return sorted(samples)[len(samples) // 2]


def sweep_shape(ctx: int, conc: int, variants: list[DecodeTuning], gen: torch.Generator) -> dict:
    pages = math.ceil(ctx / BS)
    nbytes = 2 * conc * pages * BS * HEADS * DIM * 2
    copies = max(1, math.ceil(512 * 2**20 / nbytes))
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
    for tune in variants:

        def fn(k, v, t=tune):
            return paged_attention_triton(q, k, v, tables, lengths, tuning=t)

        err = ((fn(*caches[0]).float() - ref.float()).norm() / ref.float().norm()).item()
        ms = timed(fn, caches)
        rows.append(
            {
                "tuning": tune.__dict__,
                "ms": ms,
                "vs_flashinfer": ms / base,
                "tb_s": nbytes / ms / 1e9,
                "rel_err": err,
            }
        )
    rows.sort(key=lambda r: r["ms"])
    for r in rows[:5]:
        print(f"ctx={ctx} conc={conc} flashinfer {base * 1e3:.1f}us | {r['tuning']} {r['ms'] * 1e3:.1f}us "
              f"x{r['vs_flashinfer']:.2f} {r['tb_s']:.2f}TB/s err {r['rel_err']:.1e}", file=sys.stderr)  # fmt: skip
    return {"context": ctx, "concurrency": conc, "flashinfer_ms": base, "variants": rows}


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    variants = [
        DecodeTuning(keys_per_iter=k, num_warps=w, num_stages=s, programs_per_sm=p, use_dot=dot)
        for k, w, s, p, dot in itertools.product((64, 128), (4, 8), (2, 3), (2, 8), (False, True))
    ]
    summary = []
    for ctx, conc in SHAPES:
        summary.append(sweep_shape(ctx, conc, variants, gen))
        torch.cuda.empty_cache()
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
