"""The loop-2 top-K selection split over programs (kernels in ``threshold_select_jit.py``;
the value pass and the finish in ``source_values_jit.py``).

Each (row, head)'s exact top-K (K = max(1, ceil(key_retention * T)), ties to the earlier
position) over the scaled logits one attention pass wrote: a sampled bracket, a split
count that collects the bracket's candidates, an exact threshold from the candidates (the
radix select over the row when the bracket misses), a split compaction in position order
with mass partials, a split pass over every value (BF16 pages; packed KV sums its own
contribution) that sums the dense output and the contribution together after an attention
pass over the keys only, and the partials' sum. Split counts come from shapes only, so no launch waits on the host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flashloop_backend.algorithms import key_retention_fraction
from flashloop_backend.kernels.triton.paged_decode import DEFAULT_TUNING as DECODE_TUNING
from flashloop_backend.kernels.triton.paged_decode import next_pow2, sm_count


@dataclass(frozen=True)
class SelectTuning:
    """Selection launch shape: ``sample`` logits bracket the K-th key (each end found to
    its top ``bracket_bits`` bits, 1-32, rounded up to whole digits, and widened outwards);
    up to ``candidates`` keys inside the bracket are kept (more, or a miss, takes the exact
    radix select over the row); every search takes ``radix_bits`` per digit (1, 2, 4 or 8); split programs of at least
    ``chunk_min`` positions, about ``programs_per_sm`` per SM over all (row, head) pairs,
    scan ``block`` positions per step when counting and ``compact_block`` when compacting,
    with ``num_warps`` warps; the bracket and threshold searches run on ``search_warps``
    warps (fewer keys per thread per count); the value pass over the compaction's splits
    takes ``value_block`` positions per step."""

    sample: int = 2048
    bracket_bits: int = 20
    candidates: int = 4096
    block: int = 1024
    compact_block: int = 256
    radix_bits: int = 4
    chunk_min: int = 256
    programs_per_sm: int = 8
    num_warps: int = 4
    search_warps: int = 8
    value_block: int = 128


DEFAULT_SELECT = SelectTuning()


def selection_splits(rows: int, heads: int, span: int, device, tuning: SelectTuning):
    """(splits, positions per split) of the count and compaction launches."""
    want = math.ceil(tuning.programs_per_sm * sm_count(device) / max(1, rows * heads))
    splits = max(1, min(want, math.ceil(span / tuning.chunk_min)))
    return splits, max(1, math.ceil(span / splits))


@dataclass(frozen=True)
class Selection:
    """The selection's launches' results a value pass and the finish read: ``plan`` [R, H, 3]
    int32 (threshold order key, ties to take at it, the last tie position taken), per split
    ``offsets`` [R, H, S, 2] (output offset, earlier ties) and ``part_mass`` [R, H, S]
    FP32, over ``splits`` splits of ``chunk`` positions."""

    plan: torch.Tensor
    offsets: torch.Tensor
    part_mass: torch.Tensor
    splits: int
    chunk: int


def source_outputs(q: torch.Tensor, k_bucket: int, output: torch.Tensor) -> tuple:
    """What a loop-2 source returns, allocated around its dense ``output`` [R, H, D] FP32:
    (out [R, H, D] in q's dtype, indices [R, H, Kb] int32, mass [R, H] FP32, output,
    contribution [R, H, D] like output)."""
    rows, heads, _ = q.shape
    indices = torch.empty((rows, heads, k_bucket), dtype=torch.int32, device=q.device)
    mass = torch.empty((rows, heads), dtype=torch.float32, device=q.device)
    return torch.empty_like(q), indices, mass, output, torch.empty_like(output)


def select_positions(
    logits: torch.Tensor,
    lse: torch.Tensor,
    context_lengths: torch.Tensor,
    indices: torch.Tensor,
    key_retention: float,
    tuning: SelectTuning = DEFAULT_SELECT,
) -> Selection:
    """Top-K selection over ``logits`` [R, H, T] FP32 (each row valid below its
    ``context_lengths`` [R]) with ``lse`` [R, H]: writes ``indices`` [R, H, Kb] int32 in
    position order (-1 past K) and returns the plan a value pass takes the same keys by."""
    from flashloop_backend.kernels.triton import threshold_select_jit as jit

    rows, heads, bucket = indices.shape
    if logits.stride(-1) != 1 or lse.stride(-1) != 1:
        raise ValueError("logits and lse must have unit stride on their last axis")
    tiles = ("sample", "candidates", "block", "compact_block", "value_block")
    odd = {
        name: getattr(tuning, name)
        for name in tiles
        if getattr(tuning, name) & (getattr(tuning, name) - 1)
    }
    if odd:
        raise ValueError(f"SelectTuning {odd} must be powers of two (Triton tile extents)")
    if tuning.radix_bits not in (1, 2, 4, 8):
        raise ValueError(f"SelectTuning radix_bits={tuning.radix_bits} must be one of 1, 2, 4, 8")
    if not 1 <= tuning.bracket_bits <= 32:
        raise ValueError(f"SelectTuning bracket_bits={tuning.bracket_bits} must be in 1..32")
    device = logits.device
    span = logits.shape[-1]
    splits, chunk = selection_splits(rows, heads, span, device, tuning)
    pairs = (rows, heads)
    int32 = {"dtype": torch.int32, "device": device}
    plan = torch.empty((*pairs, 3), **int32)
    offsets = torch.empty((*pairs, splits, 2), **int32)
    part_mass = torch.empty((*pairs, splits), dtype=torch.float32, device=device)
    selection = Selection(plan, offsets, part_mass, splits, chunk)
    if rows == 0:
        return selection
    splits_pad = max(2, next_pow2(splits))
    ratio = key_retention_fraction(key_retention)
    bracket = torch.empty((*pairs, 2), **int32)
    counter = torch.empty(pairs, **int32)
    above = torch.empty((*pairs, splits), **int32)
    cand_key = torch.empty((*pairs, tuning.candidates), **int32)
    cand_pos = torch.empty((*pairs, tuning.candidates), **int32)
    logit_strides = (logits.stride(0), logits.stride(1))
    jit.select_bracket_kernel[pairs](
        logits,
        context_lengths,
        bracket,
        counter,
        *ratio,
        *logit_strides,
        SAMPLE=tuning.sample,
        BITS=tuning.bracket_bits,
        RADIX_BITS=tuning.radix_bits,
        num_warps=tuning.search_warps,
    )
    jit.select_candidates_kernel[(*pairs, splits)](
        logits,
        context_lengths,
        bracket,
        counter,
        above,
        cand_key,
        cand_pos,
        *logit_strides,
        chunk,
        splits,
        BLOCK=tuning.block,
        CANDIDATES=tuning.candidates,
        num_warps=tuning.num_warps,
    )
    jit.select_threshold_kernel[pairs](
        logits,
        context_lengths,
        bracket,
        counter,
        above,
        cand_key,
        cand_pos,
        plan,
        offsets,
        *ratio,
        *logit_strides,
        chunk,
        splits,
        BLOCK=tuning.block,
        RADIX_BITS=tuning.radix_bits,
        CANDIDATES=tuning.candidates,
        SPLITS_PAD=splits_pad,
        num_warps=tuning.search_warps,
    )
    jit.select_compact_kernel[(*pairs, splits)](
        logits,
        lse,
        context_lengths,
        plan,
        offsets,
        indices,
        part_mass,
        *ratio,
        *logit_strides,
        lse.stride(0),
        indices.stride(0),
        indices.stride(1),
        chunk,
        splits,
        bucket,
        BLOCK=tuning.compact_block,
        num_warps=tuning.num_warps,
    )
    return selection


def finish_selection(
    selection: Selection,
    output: torch.Tensor,
    out: torch.Tensor,
    mass: torch.Tensor,
    contribution: torch.Tensor,
    value_parts: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """``mass`` [R, H] from the compaction's partials; with ``value_parts`` (dense output,
    contribution) [R, H, S', D] FP32 contiguous, their sums into ``output`` and
    ``contribution`` [R, H, D] FP32; ``output`` then also in ``out``'s dtype [R, H, D]."""
    from flashloop_backend.kernels.triton import source_values_jit as values_jit

    rows, heads = mass.shape
    if rows == 0:
        return
    part_mass = selection.part_mass
    part_out, part_contrib = value_parts if value_parts is not None else (part_mass, part_mass)
    value_splits = part_out.shape[2] if value_parts is not None else 1
    values_jit.select_finish_kernel[(rows, heads)](
        part_mass,
        part_contrib,
        part_out,
        output,
        out,
        mass,
        contribution,
        output.stride(0),
        output.stride(1),
        out.stride(0),
        out.stride(1),
        mass.stride(0),
        contribution.stride(0),
        contribution.stride(1),
        selection.splits,
        value_splits,
        HEAD_DIM=output.shape[-1],
        SPLITS_PAD=max(2, next_pow2(selection.splits)),
        VALUE_SPLITS_PAD=max(2, next_pow2(value_splits)),
        VALUES=value_parts is not None,
    )


def select_top_keys(
    logits: torch.Tensor,
    lse: torch.Tensor,
    context_lengths: torch.Tensor,
    value_cache: torch.Tensor | None,
    block_tables: torch.Tensor,
    output: torch.Tensor,
    out: torch.Tensor,
    indices: torch.Tensor,
    mass: torch.Tensor,
    contribution: torch.Tensor,
    key_retention: float,
    tuning: SelectTuning = DEFAULT_SELECT,
) -> None:
    """Top-K selection over ``logits`` [R, Hq, T] FP32 (each row valid below its
    ``context_lengths`` [R]) with ``lse`` [R, Hq]: writes ``indices`` [R, Hq, Kb] int32 in
    position order (-1 past K), ``mass`` [R, Hq], ``out`` [R, Hq, D] (``output`` [R, Hq, D]
    FP32 in out's dtype) and, when ``value_cache`` [NB, BS, Hkv, D] is given,
    ``contribution`` [R, Hq, D] = sum over the selected keys of p * v from the pages of
    ``block_tables`` [R, MB] (packed KV sums it itself and passes None). With a value
    cache ``output`` is written (the dense output, summed in the same pass over the
    values), without one it is read."""
    from flashloop_backend.kernels.triton import source_values_jit as values_jit

    rows, heads, _ = indices.shape
    head_dim = output.shape[-1]
    selection = select_positions(logits, lse, context_lengths, indices, key_retention, tuning)
    if rows == 0:
        return
    if value_cache is None:
        finish_selection(selection, output, out, mass, contribution)
        return
    splits, chunk = selection.splits, selection.chunk
    _, block_size, num_kv_heads, _ = value_cache.shape
    pairs = (rows, heads)
    part_contrib = torch.empty(
        (*pairs, splits, head_dim), dtype=torch.float32, device=logits.device
    )
    part_out = torch.empty_like(part_contrib)
    group = heads // num_kv_heads
    use_dot = DECODE_TUNING.use_dot
    values_jit.source_values_kernel[(rows, num_kv_heads, splits)](
        logits,
        lse,
        context_lengths,
        selection.plan,
        selection.offsets,
        value_cache,
        block_tables,
        part_out,
        part_contrib,
        logits.stride(0),
        logits.stride(1),
        lse.stride(0),
        *value_cache.stride()[:3],
        block_tables.stride(0),
        chunk,
        splits,
        GROUP=group,
        # tensor-core tiles need M >= 16
        GROUP_PAD=max(16, next_pow2(group)) if use_dot else next_pow2(group),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_N=tuning.value_block,
        USE_DOT=use_dot,
        DOT_PRECISION="ieee" if value_cache.dtype == torch.float32 else "tf32",
        num_warps=DECODE_TUNING.num_warps,
        num_stages=DECODE_TUNING.num_stages,
    )
    finish_selection(selection, output, out, mass, contribution, (part_out, part_contrib))
