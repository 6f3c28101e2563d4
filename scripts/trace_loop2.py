"""Where the packed decode launches' time goes at small batches. For each shape: FlashInfer's
BF16 decode of the same rows; the loop-1 streaming reader (depth 1) and the CUDA loop-2
source (depth 2: keys pass, selection, values pass), whole and launch by launch, from CUDA
graphs over rotating layers, under each launch variant; then one traced launch of each
loop-2 kernel (``kernels/cuda/trace.py``): per phase the median over CTAs of its time
after the CTA's entry, and the CTAs' entries after the first one's (a second wave shows
as late entries); last, the keys pass, the loop-1 reader and the source over stores of 1
and 24 layers from a cold L2 (``--strides``: do pages far apart cost bandwidth?). Ouro-1.4B attention (16 heads of 128), random rows, key retention 0.10.

    python3 scripts/trace_loop2.py --shapes 8192x1,32768x1 --json trace_loop2.json
"""

import argparse
import json
import math
import statistics
from dataclasses import replace

import torch

from flashloop_backend.backends.sparse_state import key_bucket
from flashloop_backend.kernels.cuda.packed_source import (
    DEFAULT_SOURCE,
    packed_dense_source_cuda,
    source_keys,
    source_values,
)
from flashloop_backend.kernels.cuda.packed_stream import DEFAULT_STREAM, packed_decode_cuda
from flashloop_backend.kernels.cuda.select_top_k import select_positions_cuda
from flashloop_backend.kernels.cuda.trace import POINTS
from flashloop_backend.kernels.triton.packed_decode import packed_span
from flashloop_backend.kernels.triton.threshold_select import source_outputs
from flashloop_backend.kv.levels import level_metadata
from flashloop_backend.tools.bench.packed_rows import (
    GROUP,
    HEADS,
    bf16_rows,
    encoded_store,
    flashinfer_decode,
    level_bytes,
    rotation_layers,
)
from flashloop_backend.tools.bench.timing import graph_ms

RETENTION = 0.10
SOURCE_VARIANTS = {
    "committed": DEFAULT_SOURCE,
    "keys 1 stage": replace(DEFAULT_SOURCE, keys_stages=1),
    "values 1 stage": replace(DEFAULT_SOURCE, values_stages=1),
}
STREAM_VARIANTS = {
    "committed": DEFAULT_STREAM,
}


def phases(trace: torch.Tensor, ctas: int, kernel: str) -> dict:
    """Per point: median and 90th percentile over CTAs of ns after the CTA's entry (CTAs
    that never reached it left out), and the CTAs' entries after the first one's."""
    data = trace[:ctas].cpu()
    ns, cycles = data[..., 0].double(), data[..., 1].double()
    entry = ns[:, 0]
    out: dict = {"ctas": ctas, "points": {}}
    for p, name in enumerate(POINTS[kernel]):
        reached = ns[:, p] > 0
        if p == 0 or not bool(reached.any()):
            continue
        after = (ns[reached, p] - entry[reached]).tolist()
        cyc = (cycles[reached, p] - cycles[reached, 0]).tolist()
        out["points"][name] = {
            "median_ns": statistics.median(after),
            "p90_ns": sorted(after)[int(0.9 * (len(after) - 1))],
            "median_cycles": statistics.median(cyc),
            "ctas": len(after),
        }
    late = (entry - entry.min()).tolist()
    end = ns[:, len(POINTS[kernel]) - 1]
    span = float(ns[ns > 0].max() - entry.min())
    out["entry_after_first_ns"] = {
        "median": statistics.median(late),
        "p90": sorted(late)[int(0.9 * (len(late) - 1))],
        "max": max(late),
    }
    out["span_ns"] = span
    out["ctas_ended_before_last_entry"] = int((end[end > 0] < entry.max()).sum())
    return out


def print_phases(label: str, summary: dict) -> None:
    points = ", ".join(
        f"{name} {v['median_ns'] / 1e3:.2f} (p90 {v['p90_ns'] / 1e3:.2f})"
        for name, v in summary["points"].items()
    )
    late = summary["entry_after_first_ns"]
    print(
        f"    trace {label}: {summary['ctas']} CTAs, span {summary['span_ns'] / 1e3:.2f} us; "
        f"entries after the first: median {late['median'] / 1e3:.2f}, p90 {late['p90'] / 1e3:.2f}, "
        f"max {late['max'] / 1e3:.2f} us; {summary['ctas_ended_before_last_entry']} CTAs ended "
        f"before the last entered; us after entry: {points}",
        flush=True,
    )


def shape_case(context: int, batch: int, gen: torch.Generator) -> dict:
    device = gen.device
    dense = flashinfer_decode(context, batch, gen)
    print(f"{context} x {batch}: FlashInfer BF16 {dense['ms'] * 1e3:.1f} us", flush=True)
    q, caches, tables, lengths = bf16_rows(context, batch, 1, gen)
    kc, vc = caches[0]
    layers = rotation_layers(batch * context * HEADS * GROUP * 2)
    store, _ = encoded_store(batch, context, layers, False, gen)
    meta = [level_metadata(store, list(range(batch)), [d] * batch, device) for d in range(2)]
    bucket = key_bucket(RETENTION, context)
    rotate = list(range(layers))
    two, one = level_bytes(store, meta[1], batch, 2), level_bytes(store, meta[0], batch, 1)
    scale = 1.0 / math.sqrt(q.shape[-1])
    span = packed_span(store, meta[1], tables, kc.shape[1])
    f32 = {"dtype": torch.float32, "device": device}
    result: dict = {"context": context, "concurrency": batch, "flashinfer_bf16": dense}
    result["bytes"] = {"depth1": one, "depth2": two}

    def timed(fn, nbytes: int | None) -> dict:
        ms = graph_ms(fn, rotate=rotate) if nbytes is not None else graph_ms(lambda: fn(0))
        entry = {"us": ms * 1e3, "vs_flashinfer": dense["ms"] / ms}
        if nbytes:
            entry["tb_s"] = nbytes / (ms / 1e3) / 1e12
        return entry

    result["stream"] = {}
    for name, tuning in STREAM_VARIANTS.items():
        entry = timed(
            lambda layer, t=tuning: packed_decode_cuda(
                q, store, layer, meta[0], kc, vc, tables, lengths, tuning=t
            ),
            one,
        )
        result["stream"][name] = entry
        print(
            f"  loop 1 stream, {name}: {entry['us']:.1f} us, {entry['tb_s']:.2f} TB/s", flush=True
        )

    result["source"] = {}
    for name, tuning in SOURCE_VARIANTS.items():
        logits = torch.empty((batch, HEADS, span), **f32)
        lse = torch.empty((batch, HEADS), **f32)
        output = torch.empty((batch, HEADS, q.shape[-1]), **f32)
        out, indices, mass, output, contribution = source_outputs(q, bucket, output)
        paged = (kc, tables, lengths, logits, lse, scale, tuning)

        def keys(layer, paged=paged, trace=None):
            return source_keys(q, store, layer, meta[1], *paged, merge=False, trace=trace)

        states = keys(0)

        def select(
            _layer, logits=logits, lse=lse, indices=indices, states=states, t=tuning, trace=None
        ):
            return select_positions_cuda(
                *(logits, lse, lengths, indices, RETENTION),
                split_states=states,
                trace=trace,
                rank_list=t.rank_list,
            )

        selection = select(0)
        finish = (selection, (out, mass, output, contribution))

        def values(
            layer, logits=logits, lse=lse, plan=selection.plan, t=tuning, f=finish, trace=None
        ):
            return source_values(
                store, layer, meta[1], vc, tables, lengths, logits, lse, plan, t, f, trace=trace
            )

        entry = {
            "whole": timed(
                lambda layer, t=tuning: packed_dense_source_cuda(
                    q,
                    store,
                    layer,
                    meta[1],
                    kc,
                    vc,
                    tables,
                    lengths,
                    RETENTION,
                    bucket,
                    tuning=t,
                ),
                two,
            ),
            "keys": timed(keys, two // 2),
            "selection": timed(select, None),
            "values": timed(values, two // 2),
            "splits": {"keys": states[0].shape[-1], "values": values(0)[0].shape[2]},
        }
        parts = sum(entry[k]["us"] for k in ("keys", "selection", "values"))
        print(
            f"  loop 2 source, {name}: {entry['whole']['us']:.1f} us whole "
            f"({entry['whole']['tb_s']:.2f} TB/s); keys {entry['keys']['us']:.1f} "
            f"({entry['keys']['tb_s']:.2f} TB/s), selection {entry['selection']['us']:.1f}, "
            f"values {entry['values']['us']:.1f} ({entry['values']['tb_s']:.2f} TB/s), "
            f"sum {parts:.1f}; splits {entry['splits']}",
            flush=True,
        )
        traces = {}
        for label, fn, ctas, kernel in (
            ("keys", keys, entry["splits"]["keys"] * HEADS * batch, "keys"),
            ("selection", select, HEADS * batch, "select"),
            ("values", values, entry["splits"]["values"] * HEADS * batch, "values"),
        ):
            trace = torch.zeros((ctas, len(POINTS[kernel]), 2), dtype=torch.int64, device=device)
            for layer in rotate[1:]:  # the traced layer's bytes out of L2 as in the timing
                fn(layer)
            fn(0, trace=trace)
            torch.cuda.synchronize()
            traces[label] = phases(trace, ctas, kernel)
            print_phases(label, traces[label])
        entry["trace"] = traces
        result["source"][name] = entry
    return result


def cold_ops(store, q, kc, vc, tables, lengths, bucket, flush, flush_ms) -> dict:
    """µs of the keys pass, the loop-1 reader and the source over ``store``'s layer 0,
    each after ``flush``'s read, less that read's ``flush_ms``."""
    batch, device = q.shape[0], q.device
    meta = [level_metadata(store, list(range(batch)), [d] * batch, device) for d in range(2)]
    span = packed_span(store, meta[1], tables, kc.shape[1])
    logits = torch.empty((batch, HEADS, span), dtype=torch.float32, device=device)
    lse = torch.empty((batch, HEADS), dtype=torch.float32, device=device)
    ops = {
        "keys": lambda: source_keys(
            q, store, 0, meta[1], kc, tables, lengths, logits, lse, 0.088, merge=False
        ),
        "stream": lambda: packed_decode_cuda(q, store, 0, meta[0], kc, vc, tables, lengths),
        "source": lambda: packed_dense_source_cuda(
            q, store, 0, meta[1], kc, vc, tables, lengths, RETENTION, bucket
        ),
    }
    row = {"page_stride_bytes": store.blocks.stride(0)}
    for name, fn in ops.items():
        row[name + "_us"] = (graph_ms(lambda fn=fn: (flush.amax(), fn())) - flush_ms) * 1e3
    return row


def layer_strides(context: int, batch: int, gen: torch.Generator) -> dict:
    """The keys pass and the loop-1 reader over stores of 1 and 24 layers (a head's pages
    16 x 9,216 B or 24 times that apart), each call after a read of 256 MB that leaves
    the L2 without the store's bytes, the read's own time subtracted."""
    device = gen.device
    flush = torch.ones(64 * 2**20, dtype=torch.float32, device=device)
    flush_ms = graph_ms(lambda: flush.amax())
    q, caches, tables, lengths = bf16_rows(context, batch, 1, gen)
    kc, vc = caches[0]
    bucket = key_bucket(RETENTION, context)
    out = {"flush_us": flush_ms * 1e3}
    for layers in (1, 24):
        store, _ = encoded_store(batch, context, layers, False, gen)
        row = cold_ops(store, q, kc, vc, tables, lengths, bucket, flush, flush_ms)
        out[f"{layers}_layers"] = row
        print(
            f"  {context} x {batch}, store of {layers} layers ({row['page_stride_bytes'] / 1e6:.2f}"
            f" MB between pages), cold L2: keys {row['keys_us']:.1f} us, loop-1 stream "
            f"{row['stream_us']:.1f} us, loop-2 source {row['source_us']:.1f} us",
            flush=True,
        )
        del store
        torch.cuda.empty_cache()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", default="8192x1,32768x1")
    parser.add_argument("--json")
    parser.add_argument(
        "--strides", default="8192x1,32768x1", help="shapes of the layer-stride probe"
    )
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    records = []
    print(f"device: {torch.cuda.get_device_name()}", flush=True)
    for shape in args.shapes.split(","):
        context, batch = (int(x) for x in shape.split("x"))
        records.append(shape_case(context, batch, gen))
        torch.cuda.empty_cache()
    strides = {}
    for shape in filter(None, args.strides.split(",")):
        context, batch = (int(x) for x in shape.split("x"))
        strides[shape] = layer_strides(context, batch, gen)
    if args.json:
        with open(args.json, "w") as f:
            record = {"device": torch.cuda.get_device_name(), "shapes": records, "strides": strides}
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
