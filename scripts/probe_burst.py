"""How fast one wave of CTAs receives a burst of 4,608-byte chunks (a packed block's K or V
half) that it requests all at once, as a batch-1 loop-2 pass does: by the chunks each warp
takes, by how far apart a head's pages lie (page-major as the packed store keeps them, 24
layers to a page, or layer-major), at the chunk counts of 8K and 32K rows of 16 heads;
beside a plain device-to-device copy of the same bytes; then the loop-2 keys pass itself
over stores of 4 and 24 layers. CUDA graphs over 8 layers in turn (4 for the 4-layer
store), so the L2 holds little of a call's bytes.

    python3 scripts/probe_burst.py --json probe_burst.json
"""

import argparse
import ctypes
import json

import torch

from flashloop_backend.kernels.cuda import loader
from flashloop_backend.tools.bench.timing import graph_ms

SOURCE = r"""
#include "common.cuh"
extern "C" __global__ void burst(const unsigned char* base, long long page_stride,
                                 long long layer_stride, int layer, int chunk, int per_warp,
                                 int chunks, unsigned* sink) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    unsigned char* mine = smem + warp * per_warp * chunk;
    const int first = (blockIdx.x * warps + warp) * per_warp;
    const unsigned char* head = base + layer * layer_stride + blockIdx.y * 9216LL;
    for (int k = 0; k < per_warp && first + k < chunks; ++k)
        for (int off = 16 * lane; off < chunk; off += 512)
            cp_async16(mine + k * chunk + off, head + (first + k) * page_stride + off);
    cp_async_commit();
    cp_async_wait<0>();
    __syncwarp();
    const unsigned v = *(const unsigned*)(mine + 16 * lane);
    if (v == 0xdeadbeefu) sink[0] = v;
}
"""
HEADS, LAYERS, ROTATE, CHUNK, WARPS, HEAD_BLOCKS = 16, 24, 8, 4608, 4, 16 * 9216


def burst_case(kernel, sink: torch.Tensor, tokens: int) -> list[dict]:
    """The burst's rate at ``tokens`` per row, by layout and chunks a warp, and a copy's."""
    chunks = 2 * tokens // 64  # a keys pass: two levels' K halves per group of 64
    pages = chunks
    buffer = torch.zeros(pages * LAYERS * HEAD_BLOCKS, dtype=torch.uint8, device="cuda")
    nbytes = chunks * HEADS * CHUNK
    plain = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    copy_ms = graph_ms(
        lambda layer: plain.copy_(buffer[layer * nbytes : (layer + 1) * nbytes]),
        rotate=list(range(ROTATE)),
    )
    rows = [{"tokens": tokens, "layout": "copy_", "us": copy_ms * 1e3}]
    rows[0]["tb_s"] = 2 * nbytes / copy_ms / 1e9
    print(
        f"{tokens} tokens: {nbytes / 1e6:.1f} MB; copy_ {copy_ms * 1e3:.1f} us "
        f"({2 * nbytes / copy_ms / 1e9:.2f} TB/s read + write)",
        flush=True,
    )
    for layout, page_stride, layer_stride in (
        ("page-major", LAYERS * HEAD_BLOCKS, HEAD_BLOCKS),
        ("layer-major", HEAD_BLOCKS, pages * HEAD_BLOCKS),
    ):
        for per_warp in (1, 2, 4, 8):
            ctas = -(-chunks // (WARPS * per_warp))
            shared = WARPS * per_warp * CHUNK
            kernel.allow_shared(shared)
            fixed = (ctypes.c_int64(page_stride), ctypes.c_int64(layer_stride))

            def launch(layer, per_warp=per_warp, ctas=ctas, shared=shared, fixed=fixed):
                values = [
                    ctypes.c_void_p(buffer.data_ptr()),
                    *fixed,
                    *(ctypes.c_int(x) for x in (layer, CHUNK, per_warp, chunks)),
                    ctypes.c_void_p(sink.data_ptr()),
                ]
                kernel((ctas, HEADS, 1), (WARPS * 32, 1, 1), values, shared)

            ms = graph_ms(launch, rotate=list(range(ROTATE)))
            row = {
                "tokens": tokens,
                "layout": layout,
                "chunks_per_warp": per_warp,
                "ctas": ctas * HEADS,
                "resident_per_sm": kernel.resident_ctas(WARPS * 32, shared),
                "us": ms * 1e3,
                "tb_s": nbytes / ms / 1e9,
            }
            rows.append(row)
            print(
                f"  {layout}, {per_warp} chunks a warp: {row['ctas']} CTAs "
                f"({row['resident_per_sm']} per SM fit), {row['us']:.1f} us, "
                f"{row['tb_s']:.2f} TB/s",
                flush=True,
            )
    return rows


def keys_pass_case(tokens: int) -> list[dict]:
    """The keys pass at ``tokens`` x 1 over stores of 4 and 24 layers (a head's pages
    4 or 24 x 147,456 B apart), each timed over its first layers in turn."""
    from flashloop_backend.kernels.cuda.packed_source import source_keys
    from flashloop_backend.kernels.triton.packed_decode import packed_span
    from flashloop_backend.kv.levels import level_metadata
    from flashloop_backend.tools.bench.packed_rows import bf16_rows, encoded_store

    gen = torch.Generator(device="cuda").manual_seed(0)
    q, caches, tables, lengths = bf16_rows(tokens, 1, 1, gen)
    kc = caches[0][0]
    rows = []
    for layers in (4, 24):
        store, _ = encoded_store(1, tokens, layers, False, gen)
        meta = level_metadata(store, [0], [1], q.device)
        span = packed_span(store, meta, tables, kc.shape[1])
        logits = torch.empty((1, HEADS, span), dtype=torch.float32, device="cuda")
        lse = torch.empty((1, HEADS), dtype=torch.float32, device="cuda")
        ms = graph_ms(
            lambda layer, s=store, m=meta, lg=logits, ls=lse: source_keys(
                q, s, layer, m, kc, tables, lengths, lg, ls, 0.088, merge=False
            ),
            rotate=list(range(min(layers, ROTATE))),
        )
        rows.append({"tokens": tokens, "keys_pass_layers": layers, "us": ms * 1e3})
        print(f"  keys pass, {tokens} x 1, store of {layers} layers: {ms * 1e3:.1f} us", flush=True)
        del store
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json")
    args = parser.parse_args()
    body = loader.inline_includes("common.cuh", set())
    source = body + SOURCE.replace('#include "common.cuh"', "")
    kernel = loader.build(source, "burst", ("burst",))["burst"]
    sink = torch.zeros(1, dtype=torch.int32, device="cuda")
    print(f"device: {torch.cuda.get_device_name()}", flush=True)
    records = []
    for tokens in (8192, 32768):
        records += burst_case(kernel, sink, tokens)
        torch.cuda.empty_cache()
    for tokens in (8192, 32768):
        records += keys_pass_case(tokens)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": records}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
