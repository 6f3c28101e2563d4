"""Wrapper for the Triton per-row paged attention: validates, picks a split count from
shapes only (never from tensor values: no host sync), launches split and merge kernels."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from flashloop_backend.kernels.validate import check_serves, check_triton_paged

SM_COUNT_FALLBACK = 132  # H100/H200
KEYS_PER_SPLIT_MIN = 256


@functools.cache
def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return SM_COUNT_FALLBACK
    return torch.cuda.get_device_properties(device).multi_processor_count


@dataclass(frozen=True)
class DecodeTuning:
    """Launch shape of the split kernel (chosen with ``scripts/sweep_triton_decode.py``)."""

    keys_per_iter: int = 64
    num_warps: int = 4
    num_stages: int = 2
    programs_per_sm: int = 4
    use_dot: bool = False


# Tensor-core dots, 64 keys per iteration, 4 warps, 2 stages (results/sweep_triton_decode.json)
# and ~4 programs per SM of at least 256 keys: 32 splits at 8K and 32K for one row, timed
# from CUDA graphs (results/sweep_triton_decode_graphs.json).
DEFAULT_TUNING = DecodeTuning(use_dot=True)


def _num_splits(
    rows: int, kv_heads: int, capacity_keys: int, device: torch.device, per_sm: int
) -> int:
    """Splits so that at most ``per_sm`` programs run per SM (one wave: a partial second
    wave costs a whole one), never below ``KEYS_PER_SPLIT_MIN`` keys a split."""
    want = max(1, per_sm * sm_count(device) // max(1, rows * kv_heads))
    most = max(1, math.ceil(capacity_keys / KEYS_PER_SPLIT_MIN))
    return min(want, most)


# splits the merge reads at a time: one merge variant for every split count, so a context
# longer than the warm-up's needs no new variant (tile dims >= 16 for the interpreter)
MERGE_SPLIT_BLOCK = 16


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): Triton tile extents."""
    return 1 << max(0, n - 1).bit_length()


def split_buffers(rows: int, heads: int, splits: int, head_dim: int, device: torch.device):
    """FP32 partial states of split-K kernels: acc [R, H, S, D], max and sum [R, H, S]."""
    part_out = torch.empty((rows, heads, splits, head_dim), device=device, dtype=torch.float32)
    part_max = torch.empty((rows, heads, splits), device=device, dtype=torch.float32)
    return part_out, part_max, torch.empty_like(part_max)


def merge_splits(
    part_out,
    part_max,
    part_sum,
    out: torch.Tensor,
    lse: torch.Tensor | None = None,
    correction: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    serves: torch.Tensor | None = None,
) -> torch.Tensor:
    """Combine split partial states into ``out`` [R, H, D] (rows with no key give 0) and,
    if given, the natural-log LSE [R, H] of the scaled logits. ``correction`` = (output
    [R, H, D], contribution [R, H, D], mass [R, H]), all FP32, turns the merged sparse
    softmax into the sparse correction output - contribution + mass * merged. ``serves``
    [R] bool: only those rows of ``out`` are written (the others keep what they hold)."""
    from flashloop_backend.kernels.triton.paged_decode_jit import merge_splits_kernel

    rows, heads, splits, head_dim = part_out.shape
    ref, contrib, mass = correction if correction is not None else (out, out, part_max)
    # the kernel steps along D in out, ref and contrib and along heads in mass one element
    # at a time (it takes no stride for them)
    inner = {"out": out.stride(-1)}
    if correction is not None:
        inner |= {"output": ref.stride(-1), "contribution": contrib.stride(-1)}
        inner["mass"] = mass.stride(-1)
    strided = {name: stride for name, stride in inner.items() if stride != 1}
    if strided:
        raise ValueError(
            f"merge_splits needs unit stride in the last dimension; got strides {strided}"
        )
    if serves is not None:
        check_serves(serves, rows)
    merge_splits_kernel[(rows, heads)](
        part_out,
        part_max,
        part_sum,
        out,
        lse if lse is not None else out,
        ref,
        contrib,
        mass,
        serves.contiguous().view(torch.int8) if serves is not None else part_max,
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_max.stride(0),
        part_max.stride(1),
        out.stride(0),
        out.stride(1),
        lse.stride(0) if lse is not None else 0,
        ref.stride(0),
        ref.stride(1),
        contrib.stride(0),
        contrib.stride(1),
        mass.stride(0),
        splits,
        SPLIT_BLOCK=MERGE_SPLIT_BLOCK,
        HEAD_DIM=head_dim,
        STORE_LSE=lse is not None,
        CORRECT=correction is not None,
        SERVES=serves is not None,
    )
    return out


def merge_lse(part_max: torch.Tensor, part_sum: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``lse`` [R, H] (natural log) from the split states ``part_max`` / ``part_sum`` [R, H,
    S] of a pass that sums no values (the keys pass of a two-pass read): ``merge_splits``
    without an output."""
    from flashloop_backend.kernels.triton.paged_decode_jit import merge_splits_kernel

    rows, heads, splits = part_max.shape
    if part_sum.stride() != part_max.stride():
        raise ValueError("part_max and part_sum must share strides")
    if rows:
        unused = part_max  # the output's and correction's pointers: never read or written
        merge_splits_kernel[(rows, heads)](
            unused,
            part_max,
            part_sum,
            unused,
            lse,
            unused,
            unused,
            unused,
            unused,
            *(0, 0, 0),
            part_max.stride(0),
            part_max.stride(1),
            *(0, 0),
            lse.stride(0),
            *(0, 0, 0, 0, 0),
            splits,
            SPLIT_BLOCK=MERGE_SPLIT_BLOCK,
            HEAD_DIM=16,
            STORE_LSE=True,
            CORRECT=False,
            STORE_OUT=False,
        )
    return lse


def _checked_spans(
    row_spans: torch.Tensor | None,
    max_span: int,
    rows: int,
    device: torch.device,
    logits: torch.Tensor | None,
) -> int:
    """Rows one program computes: 1 without ``row_spans``, else ``max_span``."""
    if row_spans is None:
        if max_span != 1:
            raise ValueError(f"max_span={max_span} needs row_spans (without them it is 1)")
        return 1
    if max_span < 1:
        raise ValueError(f"max_span={max_span} must be >= 1")
    if row_spans.shape != (rows,) or row_spans.dtype != torch.int32:
        raise ValueError(
            f"row_spans must be [rows={rows}] int32; got {tuple(row_spans.shape)} {row_spans.dtype}"
        )
    if row_spans.device != device:
        raise ValueError(f"row_spans is on {row_spans.device}, q on {device}")
    if logits is not None and max_span > 1:
        raise ValueError("logits are stored one row per program: give max_span=1 with logits")
    return max_span


def paged_attention_triton(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lengths: torch.Tensor,
    scale: float | None = None,
    num_splits: int | None = None,
    tuning: DecodeTuning = DEFAULT_TUNING,
    logits: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    read_values: bool = True,
    row_spans: torch.Tensor | None = None,
    max_span: int = 1,
) -> torch.Tensor:
    """Per-row causal paged attention, the ``PagedAttention`` contract (see ``ops.py``).

    q [R, Hq, D]; key_cache/value_cache [NB, BS, Hkv, D] with unit stride on D (per-layer
    strided views allowed); block_tables [R, MB] int32; context_lengths [R] int32.
    Returns [R, Hq, D] in q's dtype (or ``out_dtype``). D and BS must be powers of two.
    Selection statistics (``dense_source``): ``logits`` [R, Hq, T >= MB * BS] FP32 receives
    every visible key's scaled logit (other entries untouched) and ``lse`` [R, Hq] FP32 the
    natural-log log-sum-exp. ``read_values`` False reads the keys only: ``logits`` and
    ``lse`` as above, the returned output zeros.

    ``row_spans`` [R] int32 with ``max_span`` > 1 (verification rows): one program computes
    ``row_spans[r]`` consecutive rows from row r (at most ``max_span``), reading the keys
    they share once; the caller guarantees that those rows use row r's block table up to
    their lengths, that every row lies in exactly one span, and that a row inside an
    earlier span has span 0. The output is the per-row attention as without spans.
    """
    from flashloop_backend.kernels.triton.paged_decode_jit import paged_attention_split_kernel

    rows, num_q_heads, head_dim, block_tables = check_triton_paged(
        q, key_cache, value_cache, block_tables, context_lengths
    )
    _, block_size, num_kv_heads, _ = key_cache.shape
    if block_size & (block_size - 1):
        raise ValueError(f"block_size={block_size} must be a power of two for the triton kernel")
    rows_per_program = _checked_spans(row_spans, max_span, rows, q.device, logits)
    out = torch.empty_like(q, dtype=out_dtype or q.dtype)
    if rows == 0:
        return out
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    max_blocks = block_tables.shape[1]
    # a grouped launch sizes its splits for the groups that work, not for every row: at
    # most one program in rows_per_program leads a group of that many rows
    working = math.ceil(rows / rows_per_program)
    splits = num_splits or _num_splits(
        working, num_kv_heads, max_blocks * block_size, q.device, tuning.programs_per_sm
    )
    blocks_per_split = math.ceil(max_blocks / splits)
    group = num_q_heads // num_kv_heads
    group_pad = next_pow2(group * rows_per_program)
    if tuning.use_dot:
        group_pad = max(16, group_pad)  # tensor-core tiles need M >= 16
    pages = max(1, tuning.keys_per_iter // block_size)
    if not tuning.use_dot:  # the broadcast-reduce keeps GROUP_PAD x N x D values in registers
        pages = max(1, pages // group_pad)
    part_out, part_max, part_sum = split_buffers(rows, num_q_heads, splits, head_dim, q.device)
    paged_attention_split_kernel[(rows, num_kv_heads, splits)](
        q,
        key_cache,
        value_cache,
        block_tables,
        context_lengths,
        row_spans if row_spans is not None else context_lengths,
        part_out,
        part_max,
        part_sum,
        logits if logits is not None else part_max,
        scale,
        q.stride(0),
        q.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_tables.stride(0),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_max.stride(0),
        part_max.stride(1),
        logits.stride(0) if logits is not None else 0,
        logits.stride(1) if logits is not None else 0,
        blocks_per_split,
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        PAGES=pages,
        USE_DOT=tuning.use_dot,
        # FP32 inputs keep IEEE products (a TF32 dot would lose ~3 digits); 16-bit inputs
        # multiply exactly on tensor cores either way.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        STORE_LOGITS=logits is not None,
        READ_VALUES=read_values,
        ROWS=rows_per_program,
        num_warps=tuning.num_warps,
        num_stages=tuning.num_stages,
    )
    merge_splits(part_out, part_max, part_sum, out, lse)
    return out
