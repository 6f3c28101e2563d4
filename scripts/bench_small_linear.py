"""The decode step's projections at a few rows: cuBLAS (``F.linear``) beside the
small-rows Triton kernel (``layer_ops.linear``) over launch shapes, timed from CUDA graphs
(each replay runs the op once on each of ``--copies`` weight copies, more bytes than the
L2 cache holds, as a traversal reads each layer's weights once; median of ``--replays``),
with the fraction of the H200's HBM bandwidth the weight bytes reach.

    python3 scripts/bench_small_linear.py --rows 1,4,16 --json small_linear.json
"""

import argparse
import itertools
import json
import sys

import torch
import torch.nn.functional as F

from flashloop_backend.host.layer_ops import LinearTuning, linear
from flashloop_backend.tools.bench.timing import graph_ms

HBM_TB_S = 4.3  # achievable H200 HBM bandwidth (the issues' roofline figure)
# Ouro-1.4B: fused QKV, o_proj, fused gate-up, down_proj as (outputs, inputs)
SHAPES = {
    "qkv": (6144, 2048),
    "o_proj": (2048, 2048),
    "gate_up": (11264, 2048),
    "down": (2048, 5632),
}


def _time_us(fn, weights: list[torch.Tensor], replays: int) -> float:
    """GPU us per call of ``fn(weight)``, one call per weight in a captured graph."""
    return 1e3 * graph_ms(fn, reps=replays, calls=len(weights), rotate=weights)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="1,4,16")
    parser.add_argument("--copies", type=int, default=16)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.manual_seed(0)
    lanes = itertools.product((4, 8, 16), (256, 512, 1024), (2, 4, 8), (2, 3, 4), (False,))
    dots = itertools.product((16, 32), (128, 256, 512), (4,), (3, 4), (True,))
    tunings = [
        LinearTuning(block_n=bn, block_k=bk, num_warps=w, num_stages=s, use_dot=dot, max_rows=16)
        for bn, bk, w, s, dot in [*lanes, *dots]
    ]
    records = []
    for (name, (n_out, k_in)), rows in itertools.product(
        SHAPES.items(), [int(r) for r in args.rows.split(",")]
    ):
        weights = [
            torch.randn(n_out, k_in, device="cuda", dtype=torch.bfloat16) / 64
            for _ in range(args.copies)
        ]
        weight = weights[0]
        x = torch.randn(rows, k_in, device="cuda", dtype=torch.bfloat16)
        ideal_us = n_out * k_in * 2 / (HBM_TB_S * 1e6)
        expected = F.linear(x.float(), weight.float())
        entry = {
            "shape": name,
            "rows": rows,
            "n_out": n_out,
            "k_in": k_in,
            "cublas_us": _time_us(lambda w, x=x: F.linear(x, w), weights, args.replays),
            "byte_roofline_us": ideal_us,
            "variants": [],
        }
        for tuning in tunings:
            if (rows > 1) != tuning.use_dot:  # one row: lanes; more: tensor-core tiles
                continue
            try:
                got = linear(x, weight, use_triton=True, tuning=tuning)
                err = ((got.float() - expected).abs().max() / expected.abs().max()).item()
                us = _time_us(lambda w, t=tuning, x=x: linear(x, w, True, t), weights, args.replays)
            except Exception as exc:  # a launch shape the compiler refuses
                entry["variants"].append({"tuning": tuning.__dict__, "error": str(exc)[:200]})
                continue
            entry["variants"].append({"tuning": tuning.__dict__, "us": us, "rel_err": err})
        ok = [v for v in entry["variants"] if "us" in v]
        best = min(ok, key=lambda v: v["us"]) if ok else None
        entry["best"] = best
        records.append(entry)
        print(
            f"{name:8s} rows={rows:2d}: cuBLAS {entry['cublas_us']:6.2f} us "
            f"({ideal_us / entry['cublas_us']:.0%} of HBM), best triton "
            f"{best['us'] if best else float('nan'):6.2f} us "
            f"({ideal_us / best['us'] if best else 0:.0%}) {best['tuning'] if best else ''}",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"hbm_tb_s": HBM_TB_S, "records": records}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
