"""The CUDA loop-2 source at few rows with its statistics on a side stream: the keys
pass, then on the statistics stream the selection and the selected keys' contribution
(``packed_contribution.cu``), and on the caller's stream a values pass that sums the dense
output alone (``docs/decode_kernels.md``, "At few rows, the statistics beside the dense
output")."""

from __future__ import annotations

import torch

from flashloop_backend.kernels.cuda.packed_contribution import (
    check_contribution_inputs,
    selected_contribution,
)
from flashloop_backend.kernels.cuda.packed_source import (
    SourceTuning,
    select_from_states,
    source_keys,
    source_values,
)
from flashloop_backend.kernels.op_protocols import StatisticsStream
from flashloop_backend.kv.levels import LevelMetadata
from flashloop_backend.kv.store import PackedKVStore


def source_beside_statistics(
    q: torch.Tensor,
    store: PackedKVStore,
    layer: int,
    meta: LevelMetadata,
    paged: tuple[torch.Tensor, ...],
    key_retention: float,
    scale: float,
    tuning: SourceTuning,
    stream: torch.cuda.Stream,
    outputs: tuple[torch.Tensor, ...],
    logits: torch.Tensor,
    lse: torch.Tensor,
) -> tuple:
    """The source with its statistics on ``stream``: the keys pass, then on ``stream`` the
    selection (which merges and writes ``lse`` [R, Hq]) and the selected keys'
    contribution, and on the caller's stream a values pass that merges its own LSE and
    sums the dense output alone. ``paged`` = (key_cache, value_cache, block_tables,
    context_lengths) and ``outputs`` = (out, indices, output, contribution) as
    ``packed_dense_source_cuda`` checked and allocated them, ``logits`` [R, Hq, span]
    FP32. Returns ``packed_dense_source_cuda``'s six items."""
    key_cache, value_cache, block_tables, context_lengths = paged
    out, indices, output, contribution = outputs
    tables = (block_tables, context_lengths)
    check_contribution_inputs(indices, logits, contribution)  # nothing forked may fail after
    states = source_keys(
        q, store, layer, meta, key_cache, *tables, logits, lse, scale, tuning, merge=False
    )
    caller = torch.cuda.current_stream()
    stream.wait_stream(caller)
    try:
        with torch.cuda.stream(stream):
            selection = select_from_states(
                logits, lse, context_lengths, indices, key_retention, states, tuning
            )
            selected_contribution(
                indices, logits, lse, store, layer, meta, value_cache, block_tables, contribution
            )
        source_values(
            store,
            layer,
            meta,
            value_cache,
            *tables,
            logits,
            lse,
            None,
            tuning,
            (out, output),
            lse_states=states,
        )
    except BaseException:  # what the stream reads lives until the caller has waited
        caller.wait_stream(stream)
        raise
    # the mass is the selection's buffer, made on ``stream``: the caller's stream reads it
    # too, so its memory waits for that stream's work before another allocation takes it
    selection.part_mass.record_stream(caller)
    mass = selection.part_mass[:, :, 0]
    read = (meta.tables, meta.kinds, meta.packed_lengths, store.blocks, value_cache)
    held = (logits, lse, *states, indices, contribution, context_lengths, block_tables, *read)
    return out, indices, mass, output, contribution, StatisticsStream(stream, held)
