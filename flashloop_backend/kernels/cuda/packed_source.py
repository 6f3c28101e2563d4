"""Wrapper of the two-pass CUDA loop-2 source (``packed_source.cu``): the
``packed_dense_source`` contract as a keys pass (exact logits and split states), the LSE
merge and the exact top-K selection, then a values pass that sums the dense output and
the selected keys' contribution in one read of the values. BF16 queries and caches,
head_dim 128, dense levels; metadata that may hold compact levels takes the Triton
source."""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import torch

from flashloop_backend.kernels.cuda import loader
from flashloop_backend.kernels.cuda.arrivals import arrival_counters
from flashloop_backend.kernels.cuda.packed_stream import unsupported
from flashloop_backend.kernels.cuda.select_top_k import select_positions_cuda
from flashloop_backend.kernels.cuda.trace import POINTS, traced
from flashloop_backend.kernels.triton.packed_decode import (
    check_packed_inputs,
    packed_span,
    stream_splits,
)
from flashloop_backend.kernels.triton.packed_sparse import check_bucket
from flashloop_backend.kernels.triton.paged_decode import merge_lse
from flashloop_backend.kernels.triton.threshold_select import (
    DEFAULT_SELECT,
    Selection,
    SelectTuning,
    finish_selection,
    select_positions,
    source_outputs,
)
from flashloop_backend.kernels.validate import check_paged_inputs, check_unit_last_stride
from flashloop_backend.kv.levels import LevelMetadata
from flashloop_backend.kv.store import PackedKVStore

KEYS, VALUES = 1, 2


@dataclass(frozen=True)
class SourceTuning:
    """Launches of the two passes: about ``*_ctas_per_sm`` CTAs per SM over the rows'
    heads and splits, ``warps`` per CTA, ``*_stages`` ring buffers per warp (each one
    group's half blocks at every level; the values pass's also its logits). The defaults
    were the fastest at 32K x 16 on the H200 (results/README.md). The selection between
    the passes is the one-launch CUDA kernel (``select_top_k.py``), or with
    ``one_launch_selection`` off the Triton launches; both select the same keys. With
    ``finish_in_kernel`` the values pass's last CTA of each (row, head) sums its splits
    (off: the Triton finish launch after it). With ``whole_waves`` a pass fits its split
    count to the CTAs an SM holds (``wave_splits``: fewer splits where a last wave of a few
    CTAs would cost a tenth more). ``rank_list``: the longest candidate list the one-launch
    selection ranks directly (results/README.md, "Fourteenth session", chose 256). Both
    passes look their pages up a window of 32 / levels groups ahead in one load a lane
    (``page_window.cuh``), so no copy waits for a table entry behind the loads in flight.
    ``statistics_rows``: up to this many rows, given a statistics stream, the selection and
    the contribution (``packed_contribution.cu``) run on it beside a values pass that sums
    the dense output alone (0: never; it stays off until its GPU tests and an end-to-end
    comparison have run, results/README.md, "Twenty-seventh session"); with more rows the
    passes fill the GPU and the one values pass serves both."""

    keys_ctas_per_sm: float = 4
    keys_stages: int = 2
    values_ctas_per_sm: float = 2
    values_stages: int = 2
    warps: int = 4
    one_launch_selection: bool = True
    finish_in_kernel: bool = True
    whole_waves: bool = True
    rank_list: int = 256
    statistics_rows: int = 0


DEFAULT_SOURCE = SourceTuning()


def _layout(pointers: str, ints: str, scale: bool) -> list:
    """ctypes fields of a Params struct: the pointers (``page_bytes`` an int64 after
    ``blocks``), then the scale if any, then the ints."""
    fields: list = []
    for name in pointers.split():
        fields.append((name, ctypes.c_void_p))
        if name == "blocks":
            fields.append(("page_bytes", ctypes.c_int64))
    if scale:
        fields.append(("scale", ctypes.c_float))
    return fields + [(name, ctypes.c_int) for name in ints.split()]


class _KeyParams(ctypes.Structure):
    # the C layout of KeyParams in packed_source.cu
    _fields_ = _layout(
        "q blocks tables kinds packed k_cache block_tables lengths logits part_max part_sum",
        "q_row q_head t_row t_level kind_row k_block k_slot k_head bt_row "
        "g_row g_head s_row s_head groups_per_split group_q block_size",
        scale=True,
    )


class _SourceFinish(ctypes.Structure):
    # the C layout of SourceFinish in packed_source.cu (counters nullptr: no finish)
    _fields_ = [
        *(
            (name, ctypes.c_void_p)
            for name in ("counters", "part_mass", "output", "out", "mass", "contribution")
        ),
        *(
            (name, ctypes.c_int)
            for name in (
                "output_row",
                "output_head",
                "out_row",
                "out_head",
                "mass_row",
                "contrib_row",
                "contrib_head",
                "mass_splits",
                "value_splits",
            )
        ),
    ]


class _LseStates(ctypes.Structure):
    # the C layout of LseStates in packed_source.cu (part_max nullptr: lse is read)
    _fields_ = [
        ("part_max", ctypes.c_void_p),
        ("part_sum", ctypes.c_void_p),
        *((name, ctypes.c_int) for name in ("s_row", "s_head", "splits")),
    ]


class _ValueParams(ctypes.Structure):
    # the C layout of ValueParams in packed_source.cu
    _fields_ = [
        *_layout(
            "blocks tables kinds packed v_cache block_tables lengths logits lse plan "
            "part_out part_contrib",
            "t_row t_level kind_row v_block v_slot v_head bt_row g_row g_head e_row "
            "o_row o_head o_split groups_per_split group_q block_size",
            scale=False,
        ),
        ("finish", _SourceFinish),
        ("states", _LseStates),
    ]


def _lse_states(states: tuple[torch.Tensor, torch.Tensor] | None) -> _LseStates:
    """The values pass's split states to merge each row's LSE from (None: it reads lse)."""
    if states is None:
        return _LseStates()
    part_max, part_sum = states
    return _LseStates(
        part_max.data_ptr(),
        part_sum.data_ptr(),
        part_max.stride(0),
        part_max.stride(1),
        part_max.shape[-1],
    )


def select_from_states(
    logits: torch.Tensor,
    lse: torch.Tensor,
    context_lengths: torch.Tensor,
    indices: torch.Tensor,
    key_retention: float,
    states: tuple[torch.Tensor, torch.Tensor],
    tuning: SourceTuning,
) -> Selection:
    """The one-launch selection, merging each row's LSE from the keys pass's split
    ``states`` into ``lse``, with ``tuning``'s candidate ranking."""
    return select_positions_cuda(
        logits,
        lse,
        context_lengths,
        indices,
        key_retention,
        split_states=states,
        rank_list=tuning.rank_list,
    )


def _finish(selection, outputs, value_splits: int) -> _SourceFinish:
    """The values pass's finish record writing ``outputs`` = (out, mass, output,
    contribution) as ``finish_selection`` would."""
    out, mass, output, contribution = outputs
    part_mass = selection.part_mass
    if not part_mass.is_contiguous() or mass.stride(-1) != 1:
        raise ValueError("the source's finish needs a contiguous part_mass and mass rows")
    check_unit_last_stride("the source's finish", out=out, output=output, contribution=contribution)
    rows, heads, _ = out.shape
    return _SourceFinish(
        arrival_counters(out.device, rows * heads).data_ptr(),
        *(t.data_ptr() for t in (part_mass, output, out, mass, contribution)),
        *(output.stride(0), output.stride(1), out.stride(0), out.stride(1), mass.stride(0)),
        *(contribution.stride(0), contribution.stride(1), selection.splits, value_splits),
    )


def _dense_finish(out: torch.Tensor, output: torch.Tensor, value_splits: int) -> _SourceFinish:
    """The finish record of a values pass that sums the dense output alone: ``output``
    and ``out`` written, no mass or contribution."""
    check_unit_last_stride("the source's finish", out=out, output=output)
    rows, heads, _ = out.shape
    return _SourceFinish(
        arrival_counters(out.device, rows * heads).data_ptr(),
        *(None, output.data_ptr(), out.data_ptr(), None, None),
        *(output.stride(0), output.stride(1), out.stride(0), out.stride(1), 0, 0, 0, 0),
        value_splits,
    )


def _values_finish(finish: tuple | None, selected: bool, value_splits: int) -> _SourceFinish:
    if finish is None:
        return _SourceFinish()
    return _finish(*finish, value_splits) if selected else _dense_finish(*finish, value_splits)


def shared_bytes(which: int, levels: int, group: int, head_dim: int, tuning: SourceTuning) -> int:
    """Dynamic shared memory of a pass: the warps' rings and the CTA's merge area."""
    stages = tuning.keys_stages if which == KEYS else tuning.values_stages
    stage = levels * (group * head_dim // 2 + 4 * head_dim) + (4 * group if which == VALUES else 0)
    merge = 2 if which == KEYS else 2 * head_dim + 1
    return tuning.warps * (stages * stage + 4 * merge)


def _kernel(
    which: int,
    levels: int,
    group: int,
    head_dim: int,
    tuning: SourceTuning,
    traced: bool,
    selected: bool = True,
):
    defines = {
        "HEAD_DIM": head_dim,
        "GROUP": group,
        "LEVELS": levels,
        "WARPS": tuning.warps,
        "STAGES": tuning.keys_stages if which == KEYS else tuning.values_stages,
        "PASS": which,
    }
    if not selected:  # a values pass that sums the dense output alone
        defines["SELECTED"] = 0
    if traced:
        defines["TRACE"] = len(POINTS["keys" if which == KEYS else "values"])
    name = "packed_source_keys" if which == KEYS else "packed_source_values"
    shared = shared_bytes(which, levels, group, head_dim, tuning)
    return loader.build_file("packed_source", defines, shared, kernel=name), shared


def _resident(kernel, shared: int, tuning: SourceTuning) -> int | None:
    """CTAs of a pass one SM holds at once, when ``whole_waves`` fits its grid to them."""
    return kernel.resident_ctas(tuning.warps * 32, shared) if tuning.whole_waves else None


def source_keys(
    q: torch.Tensor,
    store: PackedKVStore,
    layer: int,
    meta: LevelMetadata,
    key_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lengths: torch.Tensor,
    logits: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    tuning: SourceTuning = DEFAULT_SOURCE,
    merge: bool = True,
    trace: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys pass: the scaled natural logits into ``logits`` [R, Hq, >= span] FP32 (each
    row's positions below its length) and, with ``merge``, their LSE into ``lse`` [R, Hq]
    FP32 (without, the one-launch selection merges it), from q [R, Hq, D] BF16 over dense
    packed levels and the BF16 keys [NB, BS, Hkv, D] above each row's packed length; its
    split states (part_max, part_sum) [R, Hq, S]. Inputs are checked by the caller.
    ``trace``: phase timestamps [S * Hq * R, points, 2] int64 (``trace.py``)."""
    rows, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    levels = meta.tables.shape[1]
    kernel, shared = _kernel(KEYS, levels, store.group_size, head_dim, tuning, trace is not None)
    splits, per_split = stream_splits(
        q,
        store,
        meta,
        block_tables,
        block_size,
        logits,
        tuning.keys_ctas_per_sm,
        _resident(kernel, shared, tuning),
        tuning.warps,
    )
    part_max = torch.empty((rows, num_q_heads, splits), dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    codes = store.blocks[:, layer]
    t = lambda x: x.data_ptr()  # noqa: E731
    keys = _KeyParams(
        *(t(q), t(codes), codes.stride(0), t(meta.tables), t(meta.kinds)),
        *(t(meta.packed_lengths), t(key_cache), t(block_tables), t(context_lengths)),
        *(t(logits), t(part_max), t(part_sum), scale),
        *(q.stride(0), q.stride(1), meta.tables.stride(0), meta.tables.stride(1)),
        *(meta.kinds.stride(0), *key_cache.stride()[:3], block_tables.stride(0)),
        *(logits.stride(0), logits.stride(1), part_max.stride(0), part_max.stride(1)),
        *(per_split, num_q_heads // num_kv_heads, block_size),
    )
    if trace is not None:
        keys = traced(keys, trace, splits * num_q_heads * rows, "keys")
    kernel((splits, num_q_heads, rows), (tuning.warps * 32, 1, 1), [keys], shared)
    if merge:
        merge_lse(part_max, part_sum, lse)
    return part_max, part_sum


def source_values(
    store: PackedKVStore,
    layer: int,
    meta: LevelMetadata,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lengths: torch.Tensor,
    logits: torch.Tensor,
    lse: torch.Tensor,
    plan: torch.Tensor | None,
    tuning: SourceTuning = DEFAULT_SOURCE,
    finish: tuple | None = None,
    trace: torch.Tensor | None = None,
    lse_states: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The values pass: split partials (dense output, contribution) [R, Hq, S, D] FP32 of
    sum p v over every key and over the keys ``plan`` [R, Hq, 3] takes (``Selection``), p
    = exp(logit - lse) from the keys pass's ``logits`` and ``lse``. With ``finish`` =
    (selection, (out, mass, output, contribution)) the pass's last CTA of each (row, head)
    also does ``finish_selection``'s work. ``plan`` None: the dense output alone (the
    contribution partial is left unwritten), each row's LSE merged in the kernel from
    ``lse_states`` (the keys pass's split states), and ``finish`` = (out, output) writes
    those two. ``trace``: as the keys pass's."""
    rows, num_q_heads, _ = logits.shape
    _, block_size, num_kv_heads, head_dim = value_cache.shape
    levels = meta.tables.shape[1]
    selected = plan is not None
    if not selected and lse_states is None:
        raise ValueError("a values pass without a selection plan merges its LSE: pass lse_states")
    kernel, shared = _kernel(
        VALUES, levels, store.group_size, head_dim, tuning, trace is not None, selected
    )
    splits, per_split = stream_splits(  # logits [R, Hq, T] give the rows' shape and device
        logits,
        store,
        meta,
        block_tables,
        block_size,
        None,
        tuning.values_ctas_per_sm,
        _resident(kernel, shared, tuning),
        tuning.warps,
    )
    f32 = {"dtype": torch.float32, "device": logits.device}
    part_out = torch.empty((rows, num_q_heads, splits, head_dim), **f32)
    part_contrib = torch.empty_like(part_out) if selected else part_out.new_empty(0)
    codes = store.blocks[:, layer]
    t = lambda x: x.data_ptr()  # noqa: E731
    values = _ValueParams(
        *(t(codes), codes.stride(0), t(meta.tables), t(meta.kinds), t(meta.packed_lengths)),
        *(t(value_cache), t(block_tables), t(context_lengths)),
        *(t(logits), t(lse), None if plan is None else t(plan), t(part_out), t(part_contrib)),
        *(meta.tables.stride(0), meta.tables.stride(1), meta.kinds.stride(0)),
        *(*value_cache.stride()[:3], block_tables.stride(0)),
        *(logits.stride(0), logits.stride(1), lse.stride(0)),
        *(part_out.stride(0), part_out.stride(1), part_out.stride(2)),
        *(per_split, num_q_heads // num_kv_heads, block_size),
        _values_finish(finish, selected, splits),
        _lse_states(lse_states),
    )
    if trace is not None:
        values = traced(values, trace, splits * num_q_heads * rows, "values")
    kernel((splits, num_q_heads, rows), (tuning.warps * 32, 1, 1), [values], shared)
    return part_out, part_contrib


def packed_dense_source_cuda(
    q: torch.Tensor,
    store: PackedKVStore,
    layer: int,
    meta: LevelMetadata,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lengths: torch.Tensor,
    key_retention: float,
    k_bucket: int,
    scale: float | None = None,
    tuning: SourceTuning | None = None,
    select: SelectTuning = DEFAULT_SELECT,
    statistics_stream: torch.cuda.Stream | None = None,
) -> tuple:
    """The ``PackedDenseSource`` contract: (out [R, Hq, D] q.dtype, indices [R, Hq, Kb]
    int32 in position order (-1 past K), mass [R, Hq], output [R, Hq, D], contribution [R,
    Hq, D]; the last three FP32) from q [R, Hq, D], K = max(1, ceil(key_retention * T)),
    Kb = ``k_bucket``. With ``statistics_stream`` and at most ``tuning.statistics_rows``
    rows, a sixth item, :class:`StatisticsStream`: indices, mass and contribution are
    then written on that stream (``StatisticsStream`` says what the caller owes it)."""
    tuning = DEFAULT_SOURCE if tuning is None else tuning
    rows, num_q_heads, head_dim = check_paged_inputs(
        q, key_cache, value_cache, block_tables, context_lengths
    )
    check_packed_inputs(q, store, meta, key_cache)
    reason = unsupported(q, store, key_cache)
    if reason is not None:
        raise ValueError(f"packed_dense_source_cuda: {reason}")
    if meta.compact_from < meta.tables.shape[1]:  # the Triton source reads compact levels
        from flashloop_backend.kernels.triton.packed_sparse import packed_dense_source_triton

        paged = (key_cache, value_cache, block_tables, context_lengths)
        return packed_dense_source_triton(
            q, store, layer, meta, *paged, key_retention, k_bucket, scale
        )
    span = packed_span(store, meta, block_tables, key_cache.shape[1])
    check_bucket(span, rows, key_retention, k_bucket)
    device = q.device
    f32 = {"dtype": torch.float32, "device": device}
    output = torch.empty((rows, num_q_heads, head_dim), **f32)
    out, indices, mass, output, contribution = source_outputs(q, k_bucket, output)
    if rows == 0:
        return out, indices, mass, output, contribution
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    logits = torch.empty((rows, num_q_heads, span), **f32)
    lse = torch.empty((rows, num_q_heads), **f32)
    block_tables = block_tables.contiguous()
    q = q if q.stride(-1) == 1 else q.contiguous()
    tables = (block_tables, context_lengths)
    if statistics_stream is not None and rows <= tuning.statistics_rows:
        from flashloop_backend.kernels.cuda.source_statistics import source_beside_statistics

        return source_beside_statistics(
            q,
            store,
            layer,
            meta,
            (key_cache, value_cache, *tables),
            key_retention,
            scale,
            tuning,
            statistics_stream,
            (out, indices, output, contribution),
            logits,
            lse,
        )
    one_launch = tuning.one_launch_selection
    states = source_keys(
        q, store, layer, meta, key_cache, *tables, logits, lse, scale, tuning, merge=not one_launch
    )
    if one_launch:  # the selection merges the rows' lse from the split states
        selection = select_from_states(
            logits, lse, context_lengths, indices, key_retention, states, tuning
        )
    else:
        selection = select_positions(logits, lse, context_lengths, indices, key_retention, select)
    finish = (selection, (out, mass, output, contribution)) if tuning.finish_in_kernel else None
    parts = source_values(
        store, layer, meta, value_cache, *tables, logits, lse, selection.plan, tuning, finish
    )
    if finish is None:
        finish_selection(selection, output, out, mass, contribution, parts)
    return out, indices, mass, output, contribution
