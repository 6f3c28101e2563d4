"""Where a prompt's conversion to packed INT4 spends its time: ``PackedState.pack_prompt``
on one request's BF16 KV (every layer and depth, dense levels), timed per chunk size, then
one conversion under torch.profiler (top ops and the number of device launches).

    python3 scripts/profile_conversion.py --context 8192 --layers 6 --chunks 4096,0 \
        --layers-per-pass 1,6

Ouro-1.4B attention shapes by default (16 KV heads, head_dim 128, group 64). Chunk 0
converts the whole prompt at once; layers per pass: how many layers the chain encodes
together (fewer launches, more FP32 scratch; the pages are the same). Writers
(``--writers``): ``fused``, the registered Triton level writer (one kernel per level,
``kernels/triton/encode.py``), and ``chain``, the store's torch chain with the Triton
quantizer (the design before it); on CPU only the chain with the torch quantizer runs
(tiny shapes: a smoke run); ``cuda`` is the CUDA level writer
(``kernels/cuda/encode_level.py``, BF16 and head_dim 128). ``--encode-launches`` times
the fused writer at each launch ``WARPS:REGISTERS`` (0 registers: no cap), e.g.
``16:0,16:64,8:128``, and ``--cuda-launches`` the CUDA writer at each ``ROWS:MIN_CTAS``
(rows a thread owns, CTAs per SM the registers allow); the defaults are the registered
launches. Every timing prints the bytes a conversion must move (BF16 K and V of every
depth in, each level's earlier levels re-read, the packed pages out) and the rate, beside
a device copy of the same BF16 bytes in the same run."""

import argparse
import functools
import json
import sys
import time

import torch

from flashloop_backend.backends.packed_state import PackedState
from flashloop_backend.host.features import HostRequestKV
from flashloop_backend.host.kvcache import PagedKVCache
from flashloop_backend.host.requests import Request, SamplingParams
from flashloop_backend.kv.codec import encode_levels_chain
from flashloop_backend.kv.store import PackedKVStore

DEPTHS, BLOCK = 4, 16


def _writer(name: str, device, launch=None):
    """The level writer ``name`` on ``device`` (``kv.store.LevelWriter``); the fused one
    at ``launch`` (an ``EncodeTuning``; None: the registered launch)."""
    if name == "fused":
        from flashloop_backend.kernels.triton.encode import DEFAULT_ENCODE, encode_levels_triton

        return functools.partial(encode_levels_triton, tuning=launch or DEFAULT_ENCODE)
    if name == "cuda":
        from flashloop_backend.kernels.cuda.encode_level import (
            DEFAULT_LEVEL_WRITER,
            encode_levels_cuda,
        )

        return functools.partial(encode_levels_cuda, tuning=launch or DEFAULT_LEVEL_WRITER)
    if device.type == "cuda":
        from flashloop_backend.kernels.triton.quantize import quantize_int4_triton as quantize
    else:
        from flashloop_backend.algorithms import quantize_int4 as quantize
    return functools.partial(encode_levels_chain, quantize=quantize)


def _setup(args, device, layers_per_pass: int = 1, writer: str = "chain", launch=None):
    blocks = -(-args.context // BLOCK) * DEPTHS + 4
    kv = PagedKVCache(
        blocks,
        num_layers=args.layers,
        block_size=BLOCK,
        num_kv_heads=args.heads,
        head_dim=args.head_dim,
        num_depths=DEPTHS,
        dtype=torch.bfloat16,
        device=device,
    )
    kv.key_pool.normal_()
    kv.value_pool.normal_()
    pages = -(-args.context // args.group) * DEPTHS + 4
    store = PackedKVStore(
        pages,
        num_layers=args.layers,
        kv_heads=args.heads,
        head_dim=args.head_dim,
        group_size=args.group,
        device=device,
        layers_per_pass=layers_per_pass,
    )
    return kv, PackedState(store, _writer(writer, device, launch), "fixed_prompt", args.group)


def _convert(
    args, device, chunk: int, layers_per_pass: int = 1, writer: str = "chain", launch=None
) -> float:
    """Seconds of one conversion of a fresh request (the KV pool already holds its rows)."""
    kv, packed = _setup(args, device, layers_per_pass, writer, launch)
    request = Request(0, [0] * args.context, SamplingParams(max_new_tokens=1), None)
    kv.reserve(request.id, args.context)
    chunk = chunk or -(-args.context // args.group) * args.group
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    sync()
    start = time.perf_counter()
    packed.pack_prompt(request.id, HostRequestKV(kv, request, False, DEPTHS), chunk=chunk)
    sync()
    return time.perf_counter() - start


def _bytes_moved(args) -> dict[str, int]:
    """Bytes one conversion must move: BF16 K and V of every depth read, each level's
    earlier levels re-read (codes and parameters), every level's packed pages written."""
    token_heads = args.context * args.layers * args.heads
    level = token_heads * args.head_dim * (args.group + 8) // args.group
    moved = {
        "bf16_in": DEPTHS * token_heads * args.head_dim * 2 * 2,
        "levels_reread": sum(range(DEPTHS)) * level,
        "pages_out": DEPTHS * level,
    }
    moved["total"] = sum(moved.values())
    return moved


def _copy_seconds(moved: dict[str, int], device) -> float:
    """Median seconds of a device copy of the conversion's BF16 input (read and written)."""
    from flashloop_backend.tools.bench.timing import eager_ms

    source = torch.empty(moved["bf16_in"] // 2, dtype=torch.bfloat16, device=device)
    target = torch.empty_like(source)
    return eager_ms(lambda: target.copy_(source), reps=5, calls=1) / 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=16, help="KV heads")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--group", type=int, default=64)
    parser.add_argument("--chunks", default="4096,0", help="rows per chunk; 0: the whole prompt")
    parser.add_argument("--layers-per-pass", default="1", help="layers encoded together, swept")
    parser.add_argument("--writers", default="fused,chain", help="level writers, compared")
    parser.add_argument(
        "--encode-launches", default="", help="fused writer launches WARPS:REGISTERS"
    )
    parser.add_argument("--cuda-launches", default="", help="CUDA writer launches ROWS:MIN_CTAS")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", type=int, default=20, help="ops listed")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    chunks = [int(c) for c in args.chunks.split(",")]
    passes_list = [int(n) for n in args.layers_per_pass.split(",")]
    bad = [c for c in chunks if c < 0 or c % args.group]
    if bad or args.context % args.group:
        parser.error(
            f"--chunks {bad} and --context {args.context} must be multiples of --group {args.group}"
        )
    device = torch.device(args.device)
    writers = args.writers.split(",")
    unknown = sorted(set(writers) - {"fused", "chain", "cuda"})
    if unknown:
        parser.error(f"--writers {unknown} are not among ['chain', 'cuda', 'fused']")
    if device.type != "cuda":
        writers = ["chain"]
    launches = [None]
    if args.encode_launches:
        from flashloop_backend.kernels.triton.encode import EncodeTuning

        try:
            fields = [[int(x) for x in item.split(":")] for item in args.encode_launches.split(",")]
            launches = [EncodeTuning(w, r or None) for w, r in fields]
        except ValueError:
            parser.error(f"--encode-launches {args.encode_launches!r}: WARPS:REGISTERS,...")
    cuda_launches = [None]
    if args.cuda_launches:
        from flashloop_backend.kernels.cuda.encode_level import LevelWriterTuning

        try:
            fields = [[int(x) for x in item.split(":")] for item in args.cuda_launches.split(",")]
            cuda_launches = [LevelWriterTuning(r, c) for r, c in fields]
        except ValueError:
            parser.error(f"--cuda-launches {args.cuda_launches!r}: ROWS:MIN_CTAS,...")
    runs = [("fused", 1, launch) for launch in launches] if "fused" in writers else []
    runs += [("cuda", 1, launch) for launch in cuda_launches] if "cuda" in writers else []
    runs += [("chain", passes, None) for passes in passes_list if "chain" in writers]
    for writer, passes, launch in runs:  # compiles each writer's kernels
        _convert(args, device, chunks[0], passes, writer, launch)
    moved = _bytes_moved(args)
    copy_s = _copy_seconds(moved, device) if device.type == "cuda" else None
    record = {
        "bytes_moved": moved,
        "bf16_copy_seconds": copy_s,
        "context": args.context,
        "layers": args.layers,
        "kv_heads": args.heads,
        "head_dim": args.head_dim,
        "group": args.group,
        "device": str(device),
        "seconds": {},
    }
    for writer, passes, launch in runs:  # layers per pass only shape the chain
        for chunk in chunks:
            times = [
                _convert(args, device, chunk, passes, writer, launch) for _ in range(args.repeats)
            ]
            key = f"{writer}_chunk_{chunk or 'whole'}" + (f"_layers_{passes}" * (writer == "chain"))
            if launch is not None and writer == "fused":
                key += f"_launch_{launch.num_warps}:{launch.max_registers or 0}"
            if launch is not None and writer == "cuda":
                key += f"_launch_{launch.rows_per_thread}:{launch.min_ctas}"
            seconds = record["seconds"][key] = sorted(times)[len(times) // 2]
            copy = f", BF16 copy {moved['bf16_in'] * 2 / copy_s / 1e12:.2f} TB/s" if copy_s else ""
            print(
                f"  {key}: median {1e3 * seconds:.2f} ms ({args.context} rows x {args.layers} "
                f"layers x {DEPTHS} depths; {moved['total'] / 1e9:.3f} GB moved, "
                f"{moved['total'] / seconds / 1e12:.3f} TB/s{copy})",
                file=sys.stderr,
            )
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    record["aten_calls"], record["device_launches"] = {}, {}
    profiled = [r for r in runs if r[0] == "fused"][:1] + [r for r in runs if r[0] == "cuda"][:1]
    profiled += [r for r in runs if r[0] == "chain"]
    for writer, passes, launch in profiled:
        with torch.profiler.profile(activities=activities) as prof:  # calls and launches
            _convert(args, device, chunks[0], passes, writer, launch)
        events = prof.key_averages()
        label = f"{writer}_layers_{passes}"
        record["aten_calls"][label] = sum(e.count for e in events if e.key.startswith("aten::"))
        cuda = torch.autograd.DeviceType.CUDA
        on_device = [e for e in events if getattr(e, "device_type", None) == cuda]
        record["device_launches"][label] = sum(e.count for e in on_device)
        print(f"{writer}, layers per pass {passes}, chunk {chunks[0] or 'whole'}:")
        sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
        print(events.table(sort_by=sort, row_limit=args.rows))
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
