"""The ``flashinfer_span`` kernel provider: ``sparse_prefill`` as FlashInfer's causal
prefill over the span of positions a token-sparse chunk's rows cover
(``kernels/span_prefill.py``), planned on the planner of ``kernels/flashinfer.py``.

Opt in with ``kernel_overrides: {"sparse_prefill": "flashinfer_span"}``: its priority is
below every built-in provider's, so automatic selection never picks it (docs/flashloop.md,
"Token-sparse prefill over spans", says when to name it).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from flashloop_backend._version import __version__
from flashloop_backend.capabilities import Capability
from flashloop_backend.kernels.flashinfer import SUPPORT, flashinfer_version, instance_on
from flashloop_backend.kernels.op_protocols import OpName
from flashloop_backend.kernels.ops import KernelImpl, KernelProvider
from flashloop_backend.kernels.span_plan import SpanPlan
from flashloop_backend.kernels.span_prefill import span_prefill

# A span computes 1 / retention positions per served row, each at FlashInfer's rate; the
# tile kernel serves only the rows, at a lower rate per row. This is the least retention
# whose spans were measured faster (docs/flashloop.md, "Token-sparse prefill over spans").
SPAN_MIN_RETENTION = 0.75
SPAN_SUPPORT = replace(
    SUPPORT,
    capabilities=(SUPPORT.capabilities - {Capability.HOST_SEQUENCE_PLAN})
    | {Capability.SPAN_PREFILL},
    min_prefill_retention=SPAN_MIN_RETENTION,
)


def sparse_prefill_flashinfer(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lengths: torch.Tensor,
    scale: float | None = None,
    span_plan: SpanPlan | None = None,
) -> torch.Tensor:
    """The ``PagedAttention`` contract for nonconsecutive rows (q [R, Hq, D], caches
    [NB, BS, Hkv, D], block_tables [R, MB] int32, context_lengths [R] int32 -> [R, Hq, D])
    by FlashInfer's causal prefill over the rows' spans; ``span_plan``: the host's plan of
    the rows (None: planned from the device's rows, which waits for the device; a plan is
    reused while the same tensors come again, see ``DeviceSpanPlans``)."""
    planner = instance_on(q.device)
    if span_plan is None:
        block_size = key_cache.shape[1]
        span_plan = planner.device_spans.plan(block_tables, context_lengths, block_size)
    device_plan = planner.span_rows(span_plan, q.device)
    return span_prefill(
        q,
        key_cache,
        value_cache,
        block_tables,
        context_lengths,
        scale,
        span_plan,
        planner.run_host_planned,
        device_plan,
    )


def provider() -> KernelProvider:
    fi_version = flashinfer_version()
    impl = KernelImpl(OpName.SPARSE_PREFILL, sparse_prefill_flashinfer, SPAN_SUPPORT)
    return KernelProvider(
        name="flashinfer_span",
        version=f"{__version__} (flashinfer {fi_version})",
        priority=-10,
        description="FlashInfer causal prefill over a token-sparse chunk's span (opt in)",
        impls={OpName.SPARSE_PREFILL: impl},
    )
