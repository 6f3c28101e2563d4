"""The ``flashloop`` backend's registry entry: the kernels its configuration needs, the
capabilities it can claim on a machine and the backend it creates.

What it can do on a machine is derived from the kernel implementations usable there: a
capability is reported only when every op it concerns has a usable implementation that
declares it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from flashloop_backend._version import __version__
from flashloop_backend.backends.flashloop import FlashLoopBackend
from flashloop_backend.capabilities import Capability, Environment, SupportRequest
from flashloop_backend.config import FlashLoopConfig, UnservableError
from flashloop_backend.dispatch import (
    config_capabilities,
    decode_route_ops,
    required_ops,
    sparse_prefill_retention,
)
from flashloop_backend.kernels.op_inputs import OP_INPUTS, PACKED_VERSION
from flashloop_backend.kernels.op_protocols import OpName
from flashloop_backend.kv.encoding import encoding_descriptor
from flashloop_backend.registry.spec import BackendSpec, SelectionInfo

if TYPE_CHECKING:
    from flashloop_backend.registry import KernelChoice, Registry

# Which ops must carry a capability for the backend to claim it. ``None``: every op the
# configuration routes to; ``"decode"``: every op it can route a decode row to.
CAPABILITY_OPS: dict[Capability, tuple[OpName, ...] | str | None] = {
    Capability.SOURCE_STATISTICS: (OpName.DENSE_SOURCE,),
    Capability.NONCONSECUTIVE_QUERIES: (OpName.SPARSE_PREFILL,),
    Capability.PACKED_KV_READ: (OpName.PACKED_DECODE,),
    # only decode steps are captured (DESIGN §4): sparse prefill runs eagerly, so graph
    # safety is asked of the sparse decode ops alone
    Capability.GRAPH_SAFE_SPARSE: (OpName.DENSE_SOURCE, OpName.SPARSE_CORRECTION),
    Capability.CORRECTION_INTO_BASE: (OpName.SPARSE_CORRECTION,),
    Capability.DEVICE_POSITIONS: None,
    # the backend hands prompt rows' host plans to the dense prefill kernel alone
    Capability.HOST_SEQUENCE_PLAN: (OpName.DENSE_PREFILL,),
    # and span plans to a sparse prefill kernel that computes its rows' spans
    Capability.SPAN_PREFILL: (OpName.SPARSE_PREFILL,),
    # the backend hands its statistics stream to the packed loop-2 source alone
    Capability.STATISTICS_STREAM: (OpName.PACKED_SOURCE,),
    Capability.PACKED_PREFILL: None,
    # CUDA graphs capture the decode traversal only (DESIGN §4); prefill steps run eagerly,
    # so their kernels may plan on the host
    Capability.CUDA_GRAPHS: "decode",
    Capability.ASYNC_SCHEDULING: None,
}
# Capabilities this backend does not deliver whatever its kernels declare: its packed and
# sparse reads take verification rows one at a time, so it passes no groups on.
NOT_DELIVERED = {
    Capability.GROUPED_VERIFY_ROWS: "required capability grouped_verify_rows: the flashloop "
    "backend reads verification rows one at a time (its packed and sparse kernels have no "
    "grouped form)"
}

# Every op with typed inputs (the table in ``kernels/op_inputs.py``) and the packed write.
WIRED_OPS = frozenset(OP_INPUTS) | {OpName.PACKED_KV_WRITE}


class FlashLoopSpec(BackendSpec):
    name = "flashloop"
    version = __version__
    priority = 50
    description = "FlashLoop: token-sparse prefill, sparse decode attention, INT4 residual KV"

    def _op_needs(
        self, request: SupportRequest, config: FlashLoopConfig
    ) -> dict[OpName, tuple[str, frozenset[Capability]]]:
        """op -> (why it is needed, capabilities its kernel must declare)."""
        needs = {r.op: (r.feature, r.capabilities) for r in required_ops(config)}
        for cap in request.required - NOT_DELIVERED.keys():
            ops = CAPABILITY_OPS[cap]
            if ops == "decode":
                ops = tuple(sorted(decode_route_ops(config), key=lambda o: o.value))
            targets = tuple(needs) if ops is None else ops
            # the configuration may route the packed-KV version of a listed op instead
            targets += tuple(PACKED_VERSION[o] for o in targets if PACKED_VERSION.get(o) in needs)
            for op in targets:
                why, caps = needs.get(op, (f"required capability {cap.value}", frozenset()))
                needs[op] = (why, caps | {cap})
        return needs

    def _choose(
        self, request: SupportRequest, config: FlashLoopConfig, registry: Registry
    ) -> tuple[dict[OpName, KernelChoice], list[str]]:
        choices: dict[OpName, KernelChoice] = {}
        reasons: list[str] = []
        for op, (why, caps) in self._op_needs(request, config).items():
            if op not in WIRED_OPS:
                reasons.append(
                    f"op {op.value!r} (needed by {why}) is not wired into the flashloop "
                    f"backend {__version__} (wired: {sorted(o.value for o in WIRED_OPS)})"
                )
                continue
            op_request = replace(request, required=caps)
            if op == OpName.SPARSE_PREFILL:
                retention = sparse_prefill_retention(config)
                op_request = replace(op_request, prefill_retention=retention)
            try:
                override = config.kernel_overrides.get(op.value)
                choices[op] = registry.select_kernel(op, op_request, override)
            except ValueError as exc:
                reasons.append(f"op {op.value!r} (needed by {why}): {exc}")
        return choices, reasons

    def capabilities(
        self, registry: Registry, config: FlashLoopConfig, env: Environment, device: str
    ) -> frozenset[Capability]:
        base = SupportRequest.default(env)
        base = SupportRequest(device, base.dtype if device == "cuda" else torch.float32)
        delivered = set()
        for cap in set(Capability) - NOT_DELIVERED.keys():
            _, reasons = self._choose(base.with_required({cap}), config, registry)
            if not reasons:
                delivered.add(cap)
        return frozenset(delivered)

    def not_supported_reasons(
        self, request: SupportRequest, config: FlashLoopConfig, registry: Registry, env: Environment
    ) -> list[str]:
        _, reasons = self._choose(
            request.with_required(config_capabilities(config)), config, registry
        )
        return [NOT_DELIVERED[c] for c in sorted(request.required & NOT_DELIVERED.keys())] + reasons

    def kernel_choices(
        self, request: SupportRequest, config: FlashLoopConfig, registry: Registry
    ) -> dict[str, str]:
        choices, _ = self._choose(request, config, registry)
        return {op.value: choice.provider.name for op, choice in choices.items()}

    def kv_encoding(self, config: FlashLoopConfig) -> dict[str, str | int] | None:
        quant = config.kv_residual_quantization
        if not quant.enabled:
            return None
        return encoding_descriptor(
            quant.group_size, quant.policy, quant.tail_size, config.token_sparse_prefill.enabled
        )

    def create(
        self,
        request: SupportRequest,
        config: FlashLoopConfig,
        registry: Registry,
        info: SelectionInfo,
    ) -> FlashLoopBackend:
        choices, reasons = self._choose(request, config, registry)
        if reasons:
            raise UnservableError("flashloop cannot serve this request: " + "; ".join(reasons))
        caps = self.capabilities(registry, config, registry.env, request.device)
        return FlashLoopBackend(config, choices, caps, info)


def factory() -> FlashLoopSpec:
    return FlashLoopSpec()
