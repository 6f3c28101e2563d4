"""Sweep launch shapes of the tiled sparse-prefill kernel on the GPU (context from the
command line, 32K by default): dense rows, windowed subsets at 0.75 and 0.25, and the last
2048-row chunk of the 0.75 subset (the heaviest call the host makes with its default
prefill chunk); prints one JSON line per shape. Each subset's tables tensor is the same at
every call, so its tile starts are planned once, as at a traversal's later layers
(sweeps before that memo include their planning launches in every call)."""

import json
import math
import sys

import torch

from flashloop_backend.kernels.triton.sparse_prefill import PrefillTuning, sparse_prefill_triton
from flashloop_backend.tools.bench.prefill import windowed_subset
from flashloop_backend.tools.bench.timing import eager_ms

context = int(sys.argv[1]) if len(sys.argv) > 1 else 32768
gen = torch.Generator(device="cuda").manual_seed(0)
pages = math.ceil(context / 16)
kc = torch.randn(pages, 16, 16, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
vc = torch.randn_like(kc)
table = torch.randperm(pages, device="cuda", generator=gen).int()
q_all = torch.randn(context, 16, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
subsets = {
    "dense": torch.arange(context, device="cuda"),
    "0.75": windowed_subset(context, 0.75, gen),
    "0.25": windowed_subset(context, 0.25, gen),
}
subsets["0.75_last_chunk"] = subsets["0.75"][-2048:]
SHAPES = [  # (block_m, block_n, warps, stages, register cap or None[, programs per SM])
    (64, 64, 4, 2, None),
    (64, 64, 4, 3, None),
    (128, 64, 8, 2, None),
    (128, 64, 8, 3, None),
    (128, 32, 4, 3, None),
    (64, 32, 4, 3, None),
    (128, 128, 8, 2, None),
    # two CTAs of 8 warps per SM need <= 128 registers a thread (ptxas spills a little at
    # 128 x 64 tiles, kilobytes at 128 x 128: results/README.md)
    (128, 64, 8, 2, 128),
    (128, 64, 8, 3, 128),
    # four warps under a cap: up to four CTAs per SM at 128 registers, three at 168
    (64, 64, 4, 2, 128),
    (64, 64, 4, 3, 128),
    (64, 128, 4, 2, 168),
    (128, 64, 4, 2, 168),
    # few tiles (a low-retention chunk at 8K): more key splits for more, shorter programs
    (128, 64, 8, 2, 128, 4),
    (128, 64, 8, 2, 128, 8),
    (64, 64, 4, 2, 128, 8),
]
for bm, bn, warps, stages, registers, *per_sm in SHAPES:
    per_sm = per_sm[0] if per_sm else PrefillTuning.programs_per_sm
    tuning = PrefillTuning(bm, bn, warps, stages, max_registers=registers, programs_per_sm=per_sm)
    row = {"block_m": bm, "block_n": bn, "warps": warps, "stages": stages, "maxnreg": registers}
    row["programs_per_sm"] = per_sm
    for name, subset in subsets.items():
        q, t, n = q_all[subset], table[None].expand(len(subset), -1), (subset + 1).int()
        try:
            row[name + "_ms"] = eager_ms(
                lambda q=q, t=t, n=n, k=tuning: sparse_prefill_triton(q, kc, vc, t, n, tuning=k),
                5,
                2,
            )
        except Exception as exc:  # a shape that does not fit shared memory
            row[name + "_ms"] = f"{type(exc).__name__}"
    print(json.dumps(row), flush=True)
