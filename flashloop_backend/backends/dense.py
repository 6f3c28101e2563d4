"""Dense baseline backends: ``torch`` (reference), ``triton`` and ``flashinfer``.

Each is one kernel provider's ``dense_attention`` (decode rows, and vllm-rlt's dense call
surface) plus a ``dense_prefill`` kernel for prefill rows, with no FlashLoop features. They
are the baselines every FlashLoop speed ratio is measured against, and the host's dense
paths.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from flashloop_backend._version import __version__
from flashloop_backend.backends.base import AttentionBackend
from flashloop_backend.backends.dense_plan import DensePlan
from flashloop_backend.capabilities import (
    Capability,
    Environment,
    SupportRequest,
    not_supported_reasons,
)
from flashloop_backend.config import FlashLoopConfig
from flashloop_backend.dispatch import BatchView
from flashloop_backend.kernels.op_inputs import PagedInputs
from flashloop_backend.kernels.op_protocols import OpName
from flashloop_backend.kernels.ops import KernelImpl
from flashloop_backend.registry.spec import BackendSpec, SelectionInfo

if TYPE_CHECKING:
    from flashloop_backend.registry import KernelChoice, Registry


class DenseBackendSpec(BackendSpec):
    """A dense backend built from the ``dense_attention`` op of one kernel provider.

    Prefill rows run on ``prefill_provider``'s ``dense_prefill``, or with None on the
    highest-priority usable one. Only decode steps are captured in CUDA graphs, so that
    choice ignores a required ``cuda_graphs``."""

    def __init__(
        self,
        name: str,
        provider: str,
        priority: int,
        description: str,
        prefill_provider: str | None,
    ) -> None:
        self.name, self.provider, self.priority = name, provider, priority
        self.version, self.description = __version__, description
        self.prefill_provider = prefill_provider

    def _prefill(self, registry: Registry, request: SupportRequest) -> KernelChoice:
        """The ``dense_prefill`` kernel; ValueError naming every reason if none can serve."""
        eager = replace(request, required=request.required - {Capability.CUDA_GRAPHS})
        return registry.select_kernel(OpName.DENSE_PREFILL, eager, self.prefill_provider)

    def _impl(self, registry: Registry) -> tuple[KernelImpl | None, list[str]]:
        reasons = registry.kernel_reasons(self.provider, OpName.DENSE_ATTENTION, SupportRequest())
        if self.provider not in registry.kernels:
            return None, reasons
        return registry.kernels[self.provider].impls.get(OpName.DENSE_ATTENTION), reasons

    def capabilities(
        self, registry: Registry, config: FlashLoopConfig, env: Environment, device: str
    ) -> frozenset[Capability]:
        impl, _ = self._impl(registry)
        if impl is None or impl.support.machine_reasons(device, env):
            return frozenset()
        return impl.support.capabilities_on(device)

    def not_supported_reasons(
        self, request: SupportRequest, config: FlashLoopConfig, registry: Registry, env: Environment
    ) -> list[str]:
        impl, reasons = self._impl(registry)
        if impl is None:
            return [f"kernel provider {self.provider!r} is unusable: {'; '.join(reasons)}"]
        reasons = not_supported_reasons(impl.support, request, env)
        if self.prefill_provider is not None:  # a fixed kernel: name it, not an override
            eager = replace(request, required=request.required - {Capability.CUDA_GRAPHS})
            found = registry.kernel_reasons(self.prefill_provider, OpName.DENSE_PREFILL, eager)
            reasons += [
                f"prefill rows ({self.prefill_provider!r} dense_prefill): {r}"
                for r in found
                if r not in reasons
            ]
        else:
            try:
                self._prefill(registry, request)
            except ValueError as exc:
                reasons.append(f"prefill rows: {exc}")
        if config.enabled_features():
            reasons.append(
                f"FlashLoop features {list(config.enabled_features())} are enabled; "
                f"the {self.name} backend is dense only (use backend 'flashloop')"
            )
        if config.kernel_overrides:
            reasons.append(
                f"kernel_overrides {dict(config.kernel_overrides)} choose the flashloop "
                f"backend's kernels; the {self.name} backend runs only its own "
                f"({self.provider!r} for decode rows)"
            )
        return reasons

    def create(
        self,
        request: SupportRequest,
        config: FlashLoopConfig,
        registry: Registry,
        info: SelectionInfo,
    ) -> DenseBackend:
        impl, _ = self._impl(registry)
        assert impl is not None  # not_supported_reasons ran first
        prefill_impl = self._prefill(registry, request).impl
        return DenseBackend(impl, prefill_impl, impl.support.capabilities_on(request.device), info)

    def kernel_choices(
        self, request: SupportRequest, config: FlashLoopConfig, registry: Registry
    ) -> dict[str, str]:
        prefill = self._prefill(registry, request).provider.name
        return {OpName.DENSE_ATTENTION.value: self.provider, OpName.DENSE_PREFILL.value: prefill}


class DenseBackend(AttentionBackend):
    """Decode rows on one provider's ``dense_attention``, prefill rows on a ``dense_prefill``
    kernel; no FlashLoop feature, so every host step but ``forward`` has nothing to do.
    ``impl`` is the ``dense_attention`` implementation, ``prefill_impl`` the
    ``dense_prefill`` one."""

    def __init__(
        self,
        impl: KernelImpl,
        prefill_impl: KernelImpl,
        capabilities: frozenset[Capability],
        info: SelectionInfo,
    ) -> None:
        self.impl, self.prefill_impl = impl, prefill_impl
        self.capabilities, self.info = capabilities, info
        self.config = FlashLoopConfig()
        self.dense_attention = impl.fn
        self._plan: DensePlan | None = None

    def graph_blockers(self) -> list[str]:
        """Why a CUDA graph cannot capture this backend's decode traversal (none: it can)."""
        if Capability.CUDA_GRAPHS in self.capabilities:
            return []
        return [
            f"dense_attention runs on {self.info.selected_backend!r}, which does not declare "
            f"{Capability.CUDA_GRAPHS.value!r} here "
            f"(declared: {sorted(c.value for c in self.capabilities)})"
        ]

    def forward(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        view: BatchView,
        layer: int = 0,
        scale: float | None = None,
    ) -> torch.Tensor:
        """Dense attention for every row of ``view``; inactive and padding rows get zeros.
        Decode rows run on ``dense_attention``, prefill rows on ``dense_prefill``; a kernel
        whose rows the host knows are absent (``decode_only``, ``decode_bound == 0``) is not
        launched. The rows' tables and lengths are planned once per view (every layer of a
        traversal passes the same tensors, so a planning kernel plans once too)."""
        one_kernel = self.prefill_impl.fn is self.impl.fn
        if self._plan is None or self._plan.view is not view:
            grouped = Capability.GROUPED_VERIFY_ROWS in self.impl.support.capabilities
            host_planned = (
                _host_planned(self.impl if one_kernel else self.prefill_impl),
                _host_planned(self.impl),
            )
            self._plan = DensePlan.of(
                view, one_kernel, grouped and not one_kernel, host_planned, key_cache.shape[1]
            )
        plan = self._plan
        out = None
        if plan.prefill_lengths is not None:
            impl = self.impl if one_kernel else self.prefill_impl
            out = impl(
                PagedInputs(
                    q,
                    key_cache,
                    value_cache,
                    plan.tables,
                    plan.prefill_lengths,
                    scale,
                    sequence_plan=plan.prefill_sequences,
                )
            )
        if plan.decode_lengths is not None:
            dense = self.impl(
                PagedInputs(
                    q,
                    key_cache,
                    value_cache,
                    plan.tables,
                    plan.decode_lengths,
                    scale,
                    plan.row_spans,
                    view.verify_rows,
                    sequence_plan=plan.decode_sequences,
                )
            )
            out = dense if out is None else torch.where(plan.decode_rows[:, None, None], dense, out)
        return torch.zeros_like(q) if out is None else out


def _host_planned(impl: KernelImpl) -> bool:
    """Whether ``impl`` plans from the host's sequence plan (``host_sequence_plan``)."""
    return Capability.HOST_SEQUENCE_PLAN in impl.support.capabilities


def torch_factory() -> DenseBackendSpec:
    return DenseBackendSpec(
        "torch",
        "torch_reference",
        10,
        "dense paged attention in plain torch (reference; CPU and GPU)",
        prefill_provider="torch_reference",
    )


def triton_factory() -> DenseBackendSpec:
    return DenseBackendSpec(
        "triton",
        "triton",
        80,
        "dense paged decode in Triton (GPU; split-K, FP32 online softmax); prefill rows on "
        "the highest-priority dense_prefill kernel (FlashInfer when installed, else Triton tiles)",
        prefill_provider=None,
    )


def flashinfer_factory() -> DenseBackendSpec:
    return DenseBackendSpec(
        "flashinfer",
        "flashinfer",
        90,
        "dense paged attention through FlashInfer (GPU; optional extra)",
        prefill_provider="flashinfer",
    )
