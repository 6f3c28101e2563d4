"""Packed INT4 KV (encoding v3): each packed op per layer call beside FlashInfer's BF16
paged decode of the same rows (CUDA-graph medians, side by side), with the bytes each op
must move (from the layout and the selection) and the rate it reached; and the steady
bytes per prompt token the store really holds (from its tensors) against BF16
copy-on-exit planes. Calls rotate over layers whose bytes together exceed the L2 cache
several times, so every rate is a memory rate."""

from __future__ import annotations

import math
from dataclasses import asdict, replace

import torch

from flashloop_backend.config import ConfigError
from flashloop_backend.tools.bench.timing import (
    HBM_BYTES_PER_S,
    environment_record,
    graph_ms,
    require_cuda,
)

HEADS, HEAD_DIM, BLOCK_SIZE, GROUP = 16, 128, 16, 64
SPARSITY = [1.0, 1.0, 0.25, 0.10]
L2_ROTATION = 4 * 60 * 2**20  # bytes a rotation covers: four times the H200's L2
MAX_LAYERS = 24


def _versions(rows: int, layers: int, gen: torch.Generator, depths: int = 4) -> list[torch.Tensor]:
    """Per-depth K or V [rows, layers, H, D] on ``gen``'s device whose loop-to-loop change
    shrinks like Ouro's."""
    shape = (rows, layers, HEADS, HEAD_DIM)
    out = [torch.randn(shape, device=gen.device, generator=gen)]
    for step in range(1, depths):
        out.append(out[-1] + (0.5 / step) * torch.randn(shape, device=gen.device, generator=gen))
    return out


def _active(rows: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Nested active sets with SPARSITY's retention (windows of 64, like the host)."""
    masks = [torch.ones(rows, dtype=torch.bool, device=gen.device)]
    for ratio in SPARSITY[1:]:
        keep = masks[-1].clone()
        if ratio < 1.0:
            scores = torch.rand(rows, device=gen.device, generator=gen).masked_fill(
                ~masks[-1], -1.0
            )
            windows = scores.reshape(-1, GROUP)
            budget = max(1, math.ceil(ratio * GROUP))
            top = windows.topk(budget, dim=1).indices
            keep = torch.zeros_like(windows, dtype=torch.bool).scatter_(1, top, True).flatten()
        masks.append(keep)
    return masks


def _store(sequences: int, rows: int, layers: int, sparse: bool, gen: torch.Generator):
    """A store holding ``sequences`` encoded prompts of ``rows`` rows and ``layers``
    layers, written as the backend writes them (the Triton level writer on a GPU, the
    torch chain elsewhere), and the largest allocation one encoding added on top of its
    inputs and the pools."""
    from flashloop_backend.kv.store import PackedKVStore

    pages = sequences * 4 * math.ceil(rows / GROUP) + 8
    store = PackedKVStore(pages, layers, HEADS, HEAD_DIM, GROUP, device=gen.device)
    cuda = gen.device.type == "cuda"
    write = None
    if cuda:
        from flashloop_backend.kernels.triton.encode import encode_levels_triton as write
    transient = 0
    for s in range(sequences):
        keys, values = _versions(rows, layers, gen), _versions(rows, layers, gen)
        active = _active(rows, gen) if sparse else None
        if cuda:
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()  # inputs and pools exist: conversion only
            torch.cuda.reset_peak_memory_stats()
        store.encode(s, keys, values, active, write)
        if cuda:
            torch.cuda.synchronize()
            transient = max(transient, torch.cuda.max_memory_allocated() - before)
        del keys, values
    return store, transient


def _accounting(rows: int, layers: int, gen: torch.Generator) -> dict:
    """Steady bytes per prompt token over 4 depths, dense and with token sparsity."""
    bf16_per_token = 4 * layers * HEADS * HEAD_DIM * 2 * 2  # 4 copy-on-exit planes, K and V
    record = {"bf16_bytes_per_token_4_depths": bf16_per_token, "layers": layers, "rows": rows}
    for name, sparse in (("dense_levels", False), ("token_sparse_1_1_0.25_0.10", True)):
        store, transient = _store(1, rows, layers, sparse, gen)
        report = store.accounting()
        report["ratio_vs_bf16"] = bf16_per_token / report["steady_bytes_per_token"]
        report["conversion_peak_bytes_per_token"] = transient / rows
        record[name] = report
        del store
        torch.cuda.empty_cache()
    return record


def rotation_layers(bytes_per_layer: int) -> int:
    """Layers whose bytes together cover ``L2_ROTATION`` (at most ``MAX_LAYERS``)."""
    return max(2, min(MAX_LAYERS, math.ceil(L2_ROTATION / max(1, bytes_per_layer))))


def level_bytes(store, meta, rows: int, levels: int) -> int:
    """Bytes a streaming read of ``levels`` levels moves for ``rows`` rows of one layer:
    every block of the rows' pages at those levels (K and V codes, parameters), plus the
    compact levels' map entries."""
    _, heads, _ = store.shape
    total = 0
    for r in range(rows):
        entry = store.sequences[r]
        total += sum(len(p) for p in entry.pages[:levels]) * heads * store.layout.block_bytes
        total += sum(m.numel() * 4 for m in entry.maps[:levels] if m is not None)
    return total


def selected_bytes(store, meta, indices: torch.Tensor, levels: int) -> int:
    """Bytes a read of the selected keys ``indices`` [R, H, Kb] at ``levels`` levels
    moves: per present (key, level) its K row, V row and V record; per touched (row, head,
    page, level) the page's K parameters; 4 bytes per index (host count, untimed)."""
    layout = store.layout
    key_bytes = 2 * layout.row_bytes + layout.record_bytes
    total = int((indices >= 0).sum()) * 4
    for r in range(indices.shape[0]):
        entry = store.sequences[r]
        for h in range(indices.shape[1]):
            pos = indices[r, h][indices[r, h] >= 0].long().cpu()
            for level in range(min(levels, len(entry.pages))):
                mapping = entry.host_maps[level]
                rows = pos if mapping is None else mapping[pos]
                rows = rows[rows >= 0]
                total += rows.numel() * key_bytes
                total += torch.unique(rows // store.group_size).numel() * 4 * layout.head_dim
    return total


def _rate(nbytes: int, ms: float, dense_tb_s: float | None) -> dict:
    tb_s = nbytes / (ms / 1e3) / 1e12
    out = {"bytes": nbytes, "tb_s": tb_s, "hbm_fraction": tb_s * 1e12 / HBM_BYTES_PER_S}
    if dense_tb_s:
        out["fraction_of_flashinfer_tb_s"] = tb_s / dense_tb_s
    return out


def _bf16_rows(context: int, batch: int, layers: int, gen: torch.Generator):
    """(q [B, H, D], per-layer key/value caches [pages, 16, H, D], block tables [B, pages],
    lengths [B]) of ``batch`` rows at ``context`` in BF16 on ``gen``'s device."""
    device = gen.device
    pages = math.ceil(context / BLOCK_SIZE)
    shape = (batch * pages, BLOCK_SIZE, HEADS, HEAD_DIM)
    caches = [
        (
            torch.randn(shape, device=device, generator=gen).bfloat16(),
            torch.randn(shape, device=device, generator=gen).bfloat16(),
        )
        for _ in range(layers)
    ]
    tables = torch.randperm(batch * pages, device=device, generator=gen).int().reshape(batch, pages)
    lengths = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, HEADS, HEAD_DIM, device=device, generator=gen).bfloat16()
    return q, caches, tables, lengths


def _flashinfer(context: int, batch: int, gen: torch.Generator) -> dict:
    """FlashInfer's BF16 paged decode of these rows: CUDA-graph median ms over rotating
    layers, its bytes and rate."""
    from flashloop_backend.kernels.flashinfer import paged_attention_flashinfer, planned_wrapper

    nbytes = batch * context * HEADS * HEAD_DIM * 2 * 2
    q, caches, tables, lengths = _bf16_rows(context, batch, rotation_layers(nbytes), gen)
    paged_attention_flashinfer(q, *caches[0], tables, lengths)
    wrapper = planned_wrapper(q.device)
    ms = graph_ms(lambda kv: wrapper.run(q, kv), rotate=caches)
    del caches
    torch.cuda.empty_cache()
    return {"ms": ms, **_rate(nbytes, ms, None)}


def _tunings(sweep: bool) -> list:
    """The registered launch, without half products, and (``sweep``) other programs per SM
    and warps."""
    from flashloop_backend.kernels.triton.packed_decode import DEFAULT_TUNING

    out = [DEFAULT_TUNING, replace(DEFAULT_TUNING, half_products=False)]
    if sweep:
        out += [replace(DEFAULT_TUNING, programs_per_sm=p) for p in (4, 16, 32)]
        out += [replace(DEFAULT_TUNING, num_warps=w) for w in (2, 8)]
    return out


def tuning_label(tuning) -> str:
    """``_w{warps}_p{programs per SM}``, ``_fp32`` without half products."""
    label = f"_w{tuning.num_warps}_p{tuning.programs_per_sm}"
    return label + ("" if tuning.half_products else "_fp32")


def _cuda_variants(levels: int, sweep: bool) -> list:
    """StreamTunings of the CUDA reader at ``levels`` levels: the registered launch and
    (``sweep``) other CTAs per SM, warps and stages (the reader writes no logits: the
    loop-2 source's keys pass does, ``packed_source.cu``)."""
    from flashloop_backend.kernels.cuda.packed_stream import (
        DEFAULT_STREAM,
        StreamTuning,
        copies_in_halves,
    )

    out = [DEFAULT_STREAM]
    if sweep:
        deep = [(4, 1), (3, 1), (2, 1)]
        shapes = {1: [(4, 2), (8, 1), (4, 1)], 2: [(4, 1), (8, 1), (2, 2)]}.get(levels, deep)
        for ctas in (1, 4, 8):
            out.append(StreamTuning(ctas_per_sm=ctas))
        for warps, stages in shapes:
            for ctas in (2, 4):
                out.append(StreamTuning(ctas_per_sm=ctas, warps=warps, stages=stages))
    if levels > 1:  # the copies other than the default's: whole blocks, K and V halves,
        # or units of a few levels' K or V half
        copies = [StreamTuning(split_copy=split, level_chunk=0) for split in (False, True)]
        for chunk, units in ((1, 3), (1, 4), (2, 3), (2, 2)):
            if levels >= 3 and levels % chunk == 0:
                copies.append(StreamTuning(level_chunk=chunk, ring_units=units))
        out += [c for c in copies if _copy(levels, c) != _copy(levels, DEFAULT_STREAM)]
        if sweep and levels > 2:
            split = copies_in_halves(levels, StreamTuning(level_chunk=0))
            out += [
                StreamTuning(warps=w, stages=1, split_copy=not split, level_chunk=0) for w in (3, 2)
            ]
    return out


def _copy(levels: int, stream) -> tuple:
    """What a tuning's copy is at ``levels`` levels: (halves, levels per unit, ring)."""
    from flashloop_backend.kernels.cuda.packed_stream import chunk_levels, copies_in_halves

    chunk = chunk_levels(levels, stream)
    return copies_in_halves(levels, stream), chunk, stream.ring_units if chunk else 0


def _stream_label(stream) -> str:
    from flashloop_backend.kernels.cuda.packed_stream import DEFAULT_STREAM

    if stream == DEFAULT_STREAM:
        return ""
    halves = {None: "", True: "_split_copy", False: "_whole_copy"}[stream.split_copy]
    units = "" if not stream.level_chunk else f"_units{stream.level_chunk}x{stream.ring_units}"
    return f"_c{stream.ctas_per_sm}_w{stream.warps or 0}_s{stream.stages or 0}{halves}{units}"


def cuda_unavailable() -> str | None:
    from flashloop_backend.kernels.cuda.loader import unavailable

    return unavailable()


def _reader(tuning, with_logits: bool, shape, tables, provider: str):
    """A packed read with ``tuning`` by the Triton or CUDA reader, with the loop-2 logits
    and LSE into preallocated buffers when ``with_logits`` (output FP32, as the source)."""
    from flashloop_backend.kernels.triton.packed_decode import packed_decode_triton

    if provider == "cuda":
        from flashloop_backend.kernels.cuda.packed_stream import packed_decode_cuda

        def read(*args, **kwargs):
            return packed_decode_cuda(*args, tuning=tuning, **kwargs)

    else:

        def read(*args, **kwargs):
            return packed_decode_triton(*args, tuning=tuning, **kwargs)

    if not with_logits:
        return read
    rows, heads, _ = shape
    logits = torch.empty((rows, heads, tables.shape[1] * BLOCK_SIZE), device=tables.device)
    lse = torch.empty((rows, heads), device=tables.device)
    return lambda *args: read(*args, logits=logits, lse=lse, out_dtype=torch.float32)


def _log_entry(log, where: str, key: str, entry: dict, dense: dict) -> None:
    log(
        f"  {where} {key}: {entry['ms'] * 1e3:.1f} us vs FlashInfer {dense['ms'] * 1e3:.1f} us "
        f"(x{dense['ms'] / entry['ms']:.2f}), {entry['bytes'] / 1e6:.1f} MB at "
        f"{entry['tb_s']:.2f} TB/s = {entry.get('fraction_of_flashinfer_tb_s', 0):.2f} of "
        f"FlashInfer's {dense['tb_s']:.2f} TB/s"
    )


def _decode_case(
    context: int, batch: int, gen: torch.Generator, log, sweep: bool, cuda_only: bool = False
) -> dict:
    from flashloop_backend.kernels.triton.packed_decode import DEFAULT_TUNING, packed_decode_triton
    from flashloop_backend.kv.levels import level_metadata

    dense = _flashinfer(context, batch, gen)
    results = {"context": context, "concurrency": batch, "flashinfer_bf16": dense, "depths": {}}
    q, caches, tables, lengths = _bf16_rows(context, batch, 1, gen)  # BF16 pages: never read
    kc, vc = caches[0]
    per_layer = batch * context * HEADS * GROUP * 2  # one level's codes, about
    layers = rotation_layers(per_layer)
    for sparse in (False,) if cuda_only else (False, True):
        store, _ = _store(batch, context, layers, sparse, gen)
        for depth in range(4):
            meta = level_metadata(store, list(range(batch)), [depth] * batch, "cuda")
            nbytes = level_bytes(store, meta, batch, depth + 1)
            args = (q, store, 0, meta, kc, vc, tables, lengths)
            exact = packed_decode_triton(*args, tuning=replace(DEFAULT_TUNING, half_products=False))
            name = f"{'token_sparse' if sparse else 'dense_levels'}_depth{depth + 1}"
            variants = [
                (name + ("" if t == DEFAULT_TUNING else tuning_label(t)), t, False)
                for t in _tunings(sweep and not sparse)
            ]
            if not sparse and depth == 1:  # the loop-2 read: with logits, FP32
                variants.append((name + "_logits", DEFAULT_TUNING, True))
            if cuda_unavailable() is None:  # the registered Triton launch alone
                variants = variants[:1] + variants[-1:] if depth == 1 else variants[:1]
            if cuda_only:
                variants = []
            for key, tuning, with_logits in variants:
                reader = _reader(tuning, with_logits, q.shape, tables, "triton")
                gap = reader(q, store, 0, meta, kc, vc, tables, lengths).float() - exact.float()
                ms = graph_ms(
                    lambda layer, m=meta, s=store, r=reader: r(
                        q, s, layer, m, kc, vc, tables, lengths
                    ),
                    rotate=list(range(layers)),
                )
                entry = {"ms": ms, "speedup_vs_flashinfer_bf16": dense["ms"] / ms}
                entry |= _rate(nbytes, ms, dense["tb_s"])
                entry |= {"tuning": asdict(tuning), "max_abs_vs_fp32": gap.abs().max().item()}
                results["depths"][key] = entry
                _log_entry(log, f"packed ctx={context} conc={batch}", key, entry, dense)
            if sparse or cuda_unavailable() is not None:
                continue
            for stream in _cuda_variants(depth + 1, sweep):
                reader = _reader(stream, False, q.shape, tables, "cuda")
                gap = reader(q, store, 0, meta, kc, vc, tables, lengths).float() - exact.float()
                ms = graph_ms(
                    lambda layer, m=meta, s=store, r=reader: r(
                        q, s, layer, m, kc, vc, tables, lengths
                    ),
                    rotate=list(range(layers)),
                )
                key = name + "_cuda" + _stream_label(stream)
                entry = {"ms": ms, "speedup_vs_flashinfer_bf16": dense["ms"] / ms}
                entry |= _rate(nbytes, ms, dense["tb_s"]) | {
                    "max_abs_vs_fp32": gap.abs().max().item()
                }
                results["depths"][key] = entry
                _log_entry(log, f"packed ctx={context} conc={batch}", key, entry, dense)
        del store
        torch.cuda.empty_cache()
    return results


def sparse_ops_case(
    context: int,
    batch: int,
    gen: torch.Generator,
    log,
    dense: dict | None,
    key_retention: float = 0.10,
    timer=graph_ms,
    select=None,
    sweep: bool = False,
) -> dict:
    """The packed sparse-decode ops per layer call on ``gen``'s device: the loop-2 source
    (two-level read with logits, selection, contribution) beside the plain two-level read,
    and the loop 3-4 correction over the selected keys at three and four levels, dense and
    compact levels, each with its bytes and rate; ``dense``: FlashInfer BF16 decode of the
    same rows (same run; None: timed here on a GPU); ``select``: the selection's
    ``SelectTuning`` (None: the registered one); ``sweep``: the CUDA correction under other
    launches too."""
    from flashloop_backend.backends.sparse_state import key_bucket
    from flashloop_backend.kernels.triton.dense_source import DEFAULT_SELECT
    from flashloop_backend.kernels.triton.packed_decode import packed_decode_triton
    from flashloop_backend.kernels.triton.packed_sparse import (
        packed_dense_source_triton,
        packed_sparse_correction_triton,
    )
    from flashloop_backend.kv.levels import level_metadata

    device = gen.device
    cuda = device.type == "cuda"
    if dense is None and cuda:
        dense = _flashinfer(context, batch, gen)
    q, caches, tables, lengths = _bf16_rows(context, batch, 1, gen)  # BF16 pages: never read
    kc, vc = caches[0]
    bucket = key_bucket(key_retention, context)
    layers = rotation_layers(batch * context * HEADS * GROUP * 2) if cuda else 1
    results: dict = {
        "context": context,
        "concurrency": batch,
        "key_retention": key_retention,
        "key_bucket": bucket,
        "flashinfer_bf16": dense,
        "ops": {},
    }

    def record(key: str, fn, nbytes: int) -> None:
        ms = timer(fn, rotate=list(range(layers))) if cuda else timer(lambda: fn(0))
        entry = {"ms": ms, **_rate(nbytes, ms, dense["tb_s"] if dense else None)}
        if dense:
            entry["vs_dense_decode"] = ms / dense["ms"]
        results["ops"][key] = entry
        if dense:
            _log_entry(log, f"packed sparse ctx={context} conc={batch}", key, entry, dense)

    for sparse in (False, True):
        name = "token_sparse" if sparse else "dense_levels"
        store, _ = _store(batch, context, layers, sparse, gen)
        meta = [level_metadata(store, list(range(batch)), [d] * batch, device) for d in range(4)]
        source = (q, store, 0, meta[1], kc, vc, tables, lengths, key_retention, bucket, None)
        _, indices, mass, output, contribution = packed_dense_source_triton(
            *source, select or DEFAULT_SELECT
        )
        two_levels = level_bytes(store, meta[1], batch, 2)
        record(
            f"{name}_plain_read_depth2",
            lambda layer, s=store, src=source: packed_decode_triton(q, s, layer, *src[3:8]),
            two_levels,
        )
        record(
            f"{name}_source_depth2",
            lambda layer, s=store, src=source: packed_dense_source_triton(
                q, s, layer, *src[3:], select or DEFAULT_SELECT
            ),
            two_levels + selected_bytes(store, meta[1], indices, 2),
        )
        state = (indices, mass, output, contribution)
        corrections = [("", packed_sparse_correction_triton)]
        if cuda and cuda_unavailable() is None:
            from flashloop_backend.kernels.cuda.packed_selected import (
                packed_sparse_correction_cuda,
            )
            from flashloop_backend.kernels.cuda.packed_source import packed_dense_source_cuda

            corrections.append(("_cuda", packed_sparse_correction_cuda))
            sources = [("_cuda", packed_dense_source_cuda), *_source_launch_variants()]
            if sweep:
                sources += _source_variants(packed_dense_source_cuda)
            for suffix, source_fn in sources:
                record(
                    f"{name}_source_depth2{suffix}",
                    lambda layer, s=store, src=source, f=source_fn: f(q, s, layer, *src[3:]),
                    two_levels + selected_bytes(store, meta[1], indices, 2),
                )
            if sweep:
                corrections += _selected_variants(packed_sparse_correction_cuda)
        for suffix, correct in corrections:
            for depth in (2, 3):
                record(
                    f"{name}_correction_depth{depth + 1}{suffix}",
                    lambda layer, s=store, m=meta[depth], st=state, f=correct: f(
                        q, s, layer, m, kc, vc, tables, *st
                    ),
                    selected_bytes(store, meta[depth], indices, depth + 1),
                )
    return results


def _source_launch_variants() -> list[tuple]:
    """(suffix, source) of the two-pass CUDA source with the Triton selection launches in
    place of the one-launch kernel, and with the Triton finish launch in place of the
    values pass's own, each timed beside it in every run."""
    import functools

    from flashloop_backend.kernels.cuda.packed_source import (
        DEFAULT_SOURCE,
        packed_dense_source_cuda,
    )

    return [
        (
            suffix,
            functools.partial(packed_dense_source_cuda, tuning=replace(DEFAULT_SOURCE, **change)),
        )
        for suffix, change in (
            ("_cuda_triton_selection", {"one_launch_selection": False}),
            ("_cuda_finish_launch", {"finish_in_kernel": False}),
        )
    ]


def _source_variants(source) -> list:
    """(suffix, source) of the two-pass CUDA source under other launches: CTAs per SM and
    ring stages of each pass."""
    import functools

    from flashloop_backend.kernels.cuda.packed_source import SourceTuning

    shapes = [(3, 2, 2, 2), (6, 2, 2, 2), (8, 2, 2, 2), (4, 2, 3, 1), (4, 2, 4, 2), (6, 1, 2, 2)]
    return [
        (
            f"_cuda_keys{kc}x{ks}_values{vc}x{vs}",
            functools.partial(source, tuning=SourceTuning(kc, ks, vc, vs)),
        )
        for kc, ks, vc, vs in shapes
    ]


def _selected_variants(correct) -> list:
    """(suffix, correction) of the CUDA selected-key kernel under other launches: CTAs per
    SM in the grid, resident at once (the register cap) and the fewest keys a split takes."""
    import functools

    from flashloop_backend.kernels.cuda.packed_selected import DEFAULT_SELECTED, SelectedTuning

    out = []
    shapes = ((4, 4, 128), (4, 0, 64), (8, 4, 64), (4, 4, 32), (16, 4, 32))
    for ctas, resident, keys in shapes:
        tuning = SelectedTuning(ctas_per_sm=ctas, resident_ctas=resident, keys_per_split=keys)
        if tuning != DEFAULT_SELECTED:
            suffix = f"_cuda_c{ctas}_r{resident}_k{keys}"
            out.append((suffix, functools.partial(correct, tuning=tuning)))
    return out


PACKED_PARTS = ("decode", "sparse_ops")


def bench_packed_kv(
    contexts: list[int],
    concurrency: list[int],
    log=print,
    parts: tuple[str, ...] = PACKED_PARTS,
    sweep: bool = True,
    cuda_only: bool = False,
) -> dict:
    """``parts``: the reader per depth with its launch sweep (``decode``) and the packed
    sparse-decode ops (``sparse_ops``); each names FlashInfer's BF16 decode of its rows.
    ``cuda_only``: the reader per depth times the CUDA launches alone, over dense levels."""
    unknown = sorted(set(parts) - set(PACKED_PARTS))
    if unknown or not parts:
        named = unknown or list(parts)
        raise ConfigError(f"bench packed parts {named} are not among {list(PACKED_PARTS)}")
    require_cuda()
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(c, b) for c in contexts for b in concurrency]
    cases = []
    if "decode" in parts:
        cases = [_decode_case(c, b, gen, log, sweep, cuda_only) for c, b in shapes]
    dense = {(c["context"], c["concurrency"]): c["flashinfer_bf16"] for c in cases}
    sparse_ops = []
    if "sparse_ops" in parts:
        sparse_ops = [
            sparse_ops_case(c, b, gen, log, dense.get((c, b)), sweep=sweep) for c, b in shapes
        ]
    accounting = _accounting(2048, 24, gen)
    dense_levels = accounting["dense_levels"]["ratio_vs_bf16"]
    token_sparse = accounting["token_sparse_1_1_0.25_0.10"]["ratio_vs_bf16"]
    log(
        f"  steady bytes/token over 4 depths: dense levels x{dense_levels:.2f}, "
        f"token sparse x{token_sparse:.2f} smaller than BF16"
    )
    return {
        "kind": "packed_kv",
        "environment": environment_record(),
        "shapes": {
            "heads": HEADS,
            "head_dim": HEAD_DIM,
            "group_size": GROUP,
            "block_size": BLOCK_SIZE,
            "dtype": "bfloat16",
            "encoding": 3,
            "policy": "fixed_prompt (whole prompt packed, no tail)",
        },
        "method": "CUDA-graph replay medians, calls rotating over layers that together hold "
        "four times the L2 cache; FlashInfer BF16 decode of the same rows in the same run; "
        "bytes from the layout and the selection",
        "decode": cases,
        "sparse_ops": sparse_ops,
        "accounting": accounting,
    }
