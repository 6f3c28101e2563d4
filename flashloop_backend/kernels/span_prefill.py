"""``sparse_prefill`` through a kernel made for causal chunks, over the rows' spans.

The served rows' queries are scattered to their positions in a span buffer (zeros
elsewhere), the causal kernel runs over the buffer's sequences (:class:`SpanPlan`), and
the served rows' outputs are gathered back; rows the call does not serve get zeros, as
the op contract says. The causal kernel is FlashInfer's prefill on a GPU
(``kernels/flashinfer.py``) and :func:`causal_reference` (torch) as the CPU oracle.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from flashloop_backend.kernels.sequence_plan import SequencePlan
from flashloop_backend.kernels.span_plan import SpanPlan, check_span_sequences, plan_spans
from flashloop_backend.kernels.torch_ref.paged import paged_prefill
from flashloop_backend.kernels.validate import check_paged_inputs

# causal(q [S, Hq, D], key_cache, value_cache, spans, scale) -> [S, Hq, D]
CausalOverPlan = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, SequencePlan, float | None], torch.Tensor
]


def span_prefill(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lengths: torch.Tensor,
    scale: float | None,
    span_plan: SpanPlan | None,
    causal: CausalOverPlan,
    device_plan: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The ``PagedAttention`` contract for nonconsecutive rows: q [R, Hq, D], caches
    [NB, BS, Hkv, D], block_tables [R, MB] int32, context_lengths [R] int32 (0: a row not
    served, output zero) -> [R, Hq, D]. ``span_plan``: the host's plan of these rows (None:
    planned here from the device's rows, which waits for the device); ``device_plan``: its
    (rows [N], slots [N]) int64 already on q's device, or None to copy them."""
    rows, num_q_heads, head_dim = check_paged_inputs(
        q, key_cache, value_cache, block_tables, context_lengths
    )
    if span_plan is None:
        span_plan = plan_spans(block_tables, context_lengths, key_cache.shape[1])
    elif span_plan.num_rows != rows:
        raise ValueError(f"span_plan covers {span_plan.num_rows} rows; the call has {rows}")
    out = q.new_zeros((rows, num_q_heads, head_dim))
    if span_plan.rows.numel() == 0:
        return out
    if device_plan is None:
        device_plan = (
            span_plan.rows.to(q.device, non_blocking=True),
            span_plan.slots.to(q.device, non_blocking=True),
        )
    served, slots = device_plan
    check_span_sequences(span_plan.spans, span_plan.span_rows, key_cache.shape[1])
    span_q = q.new_zeros((span_plan.span_rows, num_q_heads, head_dim))
    span_q.index_copy_(0, slots, q.index_select(0, served))
    span_out = causal(span_q, key_cache, value_cache, span_plan.spans, scale)
    out.index_copy_(0, served, span_out.index_select(0, slots))
    return out


def causal_reference(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    spans: SequencePlan,
    scale: float | None,
) -> torch.Tensor:
    """The causal attention of q [S, Hq, D] over ``spans`` (host tensors) by the torch
    reference: each row of a sequence reads its pages up to its own length."""
    qo, kv = spans.qo_indptr.long(), spans.kv_indptr.long()
    sizes = qo[1:] - qo[:-1]
    pages = kv[1:] - kv[:-1]
    width = int(pages.max()) if pages.numel() else 1
    tables = torch.zeros((spans.num_sequences, width), dtype=torch.int32)
    columns = torch.arange(width)[None, :]
    keep = columns < pages[:, None]
    tables[keep] = spans.page_indices
    keys = (pages - 1) * spans.block_size + spans.last_page_lengths.long()  # [seq]
    # row i of a sequence of n rows over k keys sees k - (n - 1 - i) keys
    row_seq = torch.repeat_interleave(torch.arange(spans.num_sequences), sizes)
    from_end = qo[1:][row_seq] - 1 - torch.arange(int(qo[-1]))
    lengths = (keys[row_seq] - from_end).int()
    device = q.device
    return paged_prefill(
        q,
        key_cache,
        value_cache,
        tables[row_seq].to(device),
        lengths.to(device),
        scale,
    )


def span_prefill_reference(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lengths: torch.Tensor,
    scale: float | None = None,
    span_plan: SpanPlan | None = None,
) -> torch.Tensor:
    """:func:`span_prefill` with the torch causal reference (CPU and GPU)."""
    return span_prefill(
        q,
        key_cache,
        value_cache,
        block_tables,
        context_lengths,
        scale,
        span_plan,
        causal_reference,
    )
