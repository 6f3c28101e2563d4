"""One loop-4 prompt chunk's attention per layer call on the GPU, the ways it could run:
the Triton tile kernel over the chunk's retained rows (``--rows`` of a 0.75 windowed
subset, default 2,048 and 1,536) with its keys split as the wrapper's rule chooses
(``key_splits``, recorded) and in two splits, FlashInfer's causal
prefill over the chunk's whole span of positions (retained and dropped rows: each
retained row sees exactly its own keys, the dropped rows' outputs are thrown away), and
FlashInfer over as many consecutive rows ending at the same place (a dense chunk of that
many rows) for scale, and the ``flashinfer_span`` op itself (the same prefill with its
scatter, gather and host span plan, planned once as every layer after a traversal's first).
Chunks at the start, middle and end of a 32K prompt; CUDA-event medians, eager, with the
largest difference of each retained row's output from the Triton kernel's.

    python3 scripts/probe_loop4_chunk.py [context] [--rows 2048,1536] [--json out.json]
"""

import argparse
import json
import math
from dataclasses import replace

import torch

from flashloop_backend.kernels.flashinfer import paged_attention_flashinfer
from flashloop_backend.kernels.flashinfer_span import sparse_prefill_flashinfer
from flashloop_backend.kernels.span_plan import plan_host_spans
from flashloop_backend.kernels.triton.paged_decode import sm_count
from flashloop_backend.kernels.triton.sparse_prefill import (
    DEFAULT_PREFILL,
    key_splits,
    sparse_prefill_triton,
)
from flashloop_backend.tools.bench.prefill import BLOCK_SIZE, HEAD_DIM, HEADS, windowed_subset
from flashloop_backend.tools.bench.timing import eager_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("context", type=int, nargs="?", default=32768)
    parser.add_argument(
        "--rows", default="2048,1536", help="retained rows a chunk, comma-separated"
    )
    parser.add_argument("--json")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    pages = math.ceil(args.context / BLOCK_SIZE)
    shape = (pages, BLOCK_SIZE, HEADS, HEAD_DIM)
    kc = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    vc = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    table = torch.randperm(pages, device="cuda", generator=gen).int()
    q_all = torch.randn(args.context, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    subset = windowed_subset(args.context, 0.75, gen)
    records = []
    for chunk_rows in (int(r) for r in args.rows.split(",")):
        # exactly two splits: the least wave budget under which the rule takes two
        tiles = math.ceil(chunk_rows / DEFAULT_PREFILL.block_m)
        per_sm = math.ceil(2 * tiles * HEADS / sm_count(kc.device))
        two_splits = replace(DEFAULT_PREFILL, programs_per_sm=per_sm)
        splits = [
            key_splits(tiles, HEADS, pages * BLOCK_SIZE, sm_count(kc.device), tuning)
            for tuning in (DEFAULT_PREFILL, two_splits)
        ]
        if splits[1] != 2:  # a chunk under one wave's programs: no budget gives two
            raise SystemExit(f"--rows {chunk_rows}: no wave budget gives two key splits")
        chunks = len(subset) // chunk_rows
        for index in (0, chunks // 2, chunks - 1):
            rows = subset[index * chunk_rows : (index + 1) * chunk_rows]
            span = torch.arange(int(rows[0]), int(rows[-1]) + 1, device="cuda")
            dense = torch.arange(int(rows[-1]) + 1 - chunk_rows, int(rows[-1]) + 1, device="cuda")

            def call(positions, kernel, tuning=DEFAULT_PREFILL):
                q, n = q_all[positions], (positions + 1).int()
                t = table[None, :].expand(len(positions), -1)
                if kernel == "triton":
                    return lambda: sparse_prefill_triton(q, kc, vc, t, n, tuning=tuning)
                return lambda: paged_attention_flashinfer(q, kc, vc, t, n)

            base = call(rows, "triton")().float()
            lengths = (rows + 1).int()
            host_plan = plan_host_spans(
                torch.zeros(len(rows), dtype=torch.int64),
                lengths.cpu(),
                table[None, :].cpu(),
                BLOCK_SIZE,
                pin=True,
            )
            span_inputs = (q_all[rows], kc, vc, table[None, :].expand(len(rows), -1), lengths)

            def span_op(inputs=span_inputs, plan=host_plan):
                return sparse_prefill_flashinfer(*inputs, span_plan=plan)

            op_out = span_op().float()
            padded = call(span, "flashinfer")()[rows - span[0]].float()
            split = call(rows, "triton", two_splits)().float()
            record = {
                "chunk_rows": chunk_rows,
                "chunk": index,
                "first_position": int(rows[0]),
                "last_position": int(rows[-1]),
                "span_rows": len(span),
                "rule_splits": splits[0],
                "triton_rule_ms": eager_ms(call(rows, "triton"), 10, 3),
                "two_splits": splits[1],
                "triton_two_splits_ms": eager_ms(call(rows, "triton", two_splits), 10, 3),
                "flashinfer_span_ms": eager_ms(call(span, "flashinfer"), 10, 3),
                "flashinfer_loop1_chunk_ms": eager_ms(call(dense, "flashinfer"), 10, 3),
                "flashinfer_span_max_abs_diff": (padded - base).abs().max().item(),
                "span_op_ms": eager_ms(span_op, 10, 3),
                "span_op_spans": host_plan.spans.num_sequences,
                "span_op_max_abs_diff": (op_out - base).abs().max().item(),
                "two_splits_max_abs_diff": (split - base).abs().max().item(),
            }
            records.append(record)
            print(json.dumps(record), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"context": args.context, "records": records}, f)


if __name__ == "__main__":
    main()
