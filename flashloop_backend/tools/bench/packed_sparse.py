"""The packed sparse-decode ops per layer call (``bench packed``'s ``sparse_ops`` part):
the loop-2 source over two packed levels beside the plain two-level read, and the loop
3-4 corrections over the selected keys, each with its bytes and rate beside FlashInfer's
BF16 decode of the same rows; the CUDA launches timed beside the registered ones."""

from __future__ import annotations

from dataclasses import replace

import torch

from flashloop_backend.tools.bench.packed_rows import (
    GROUP,
    HEADS,
    bf16_rows,
    byte_rate,
    cuda_unavailable,
    encoded_store,
    flashinfer_decode,
    level_bytes,
    log_entry,
    rotation_layers,
    selected_bytes,
)
from flashloop_backend.tools.bench.timing import (
    graph_ms,
)


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
        dense = flashinfer_decode(context, batch, gen)
    q, caches, tables, lengths = bf16_rows(context, batch, 1, gen)  # BF16 pages: never read
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
        entry = {"ms": ms, **byte_rate(nbytes, ms, dense["tb_s"] if dense else None)}
        if dense:
            entry["vs_dense_decode"] = ms / dense["ms"]
        results["ops"][key] = entry
        if dense:
            log_entry(log, f"packed sparse ctx={context} conc={batch}", key, entry, dense)

    for sparse in (False, True):
        name = "token_sparse" if sparse else "dense_levels"
        store, _ = encoded_store(batch, context, layers, sparse, gen)
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
