"""The loop-2 top-K selection alone on the GPU, from CUDA graphs of 10 calls: the Triton
launches (bracket, candidates, threshold, compaction) per radix digit width of their
searches and per candidate-list size, and the one-launch CUDA selection
(``kernels/cuda/select_top_k.py``):

    python3 scripts/bench_selection.py --json selection.json

Logits are N(0, 3^2) per (row, head) at 16 heads, key retention 0.10, the bucket the
backend sizes; every variant's indices and threshold plan are checked against the
first's, and its mass to 1e-5 relative."""

import argparse
import dataclasses
import json

import torch

from flashloop_backend.backends.sparse_state import key_bucket
from flashloop_backend.kernels.cuda.select_top_k import select_positions_cuda
from flashloop_backend.kernels.triton.threshold_select import DEFAULT_SELECT, select_positions
from flashloop_backend.tools.bench.timing import graph_ms

HEADS = 16
RETENTION = 0.10


def _case(context: int, rows: int, tunings: dict, gen: torch.Generator) -> dict:
    logits = torch.randn(rows, HEADS, context, generator=gen, device="cuda") * 3.0
    lse = logits.logsumexp(-1)
    lengths = torch.full((rows,), context, dtype=torch.int32, device="cuda")
    bucket = key_bucket(RETENTION, context)
    record, first = {"context": context, "rows": rows, "bucket": bucket, "us": {}}, None
    for name, tuning in tunings.items():
        indices = torch.empty(rows, HEADS, bucket, dtype=torch.int32, device="cuda")
        selections = []

        def select(tuning=tuning, indices=indices, selections=selections):
            if isinstance(tuning, int):  # the CUDA kernel's tiles in flight per warp
                selections.append(
                    select_positions_cuda(logits, lse, lengths, indices, RETENTION, tuning)
                )
            else:
                selections.append(
                    select_positions(logits, lse, lengths, indices, RETENTION, tuning)
                )

        us = 1e3 * graph_ms(select)
        plan, mass = selections[-1].plan, selections[-1].part_mass.sum(-1)
        if first is None:
            first = (indices.clone(), plan.clone(), mass.clone())
        elif not (torch.equal(indices, first[0]) and torch.equal(plan[..., :2], first[1][..., :2])):
            raise AssertionError(f"{name} selects other keys than {next(iter(tunings))}")
        elif not torch.allclose(mass, first[2], rtol=1e-5, atol=1e-7):
            raise AssertionError(f"{name}'s mass differs from {next(iter(tunings))}'s")
        record["us"][name] = us
        print(f"selection ctx={context} rows={rows} {name}: {us:.1f} us")
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--widths", default="1,2,4,8", help="radix_bits values")
    parser.add_argument("--candidates", default="", help="candidate-list sizes (default digits)")
    parser.add_argument("--shapes", default="8192x1,32768x1,32768x16")
    parser.add_argument("--json")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    tunings = {
        f"radix_bits={w}": dataclasses.replace(DEFAULT_SELECT, radix_bits=int(w))
        for w in args.widths.split(",")
        if w
    }
    for size in (int(c) for c in args.candidates.split(",") if c):
        tunings[f"candidates={size}"] = dataclasses.replace(DEFAULT_SELECT, candidates=size)
    for batch in (4, 8):
        tunings[f"cuda one launch, batch {batch}"] = batch
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    records = [_case(context, rows, tunings, gen) for context, rows in shapes]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "cases": records}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
