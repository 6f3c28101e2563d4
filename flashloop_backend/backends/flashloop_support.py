"""What the ``flashloop`` backend serves beyond plain batches, a mixin of
``FlashLoopBackend``: which decode traversals a CUDA graph can capture, and which features
verify speculative rows or split over tensor-parallel ranks, each refusal as a phrase
that names the value and the supported set."""

from __future__ import annotations

from typing import TYPE_CHECKING

from flashloop_backend.capabilities import Capability
from flashloop_backend.config import FlashLoopConfig
from flashloop_backend.dispatch import routable_ops
from flashloop_backend.kernels.op_inputs import CORRECTION_OPS, SOURCE_OPS
from flashloop_backend.kernels.op_protocols import OpName

if TYPE_CHECKING:
    from flashloop_backend.registry import KernelChoice

# Whether each feature's state serves speculative verification rows (and under which KV
# quantization policies). Token-sparse prefill shapes the prompt's KV only, and
# `fixed_prompt` packs only the prompt: VERIFY rows read both as decode rows do. Sparse
# decode keeps one loop-2 reference per token-state slot and incarnation, and the host
# gives every block row its own. `rolling` packs generated groups only between blocks,
# from accepted rows, and blocks end before a flush (`speculation_rows`).
SPECULATION_SUPPORT = {
    "token_sparse_prefill": True,
    "sparse_decode_attention": True,
    "kv_residual_quantization": True,
}
SPECULATION_POLICIES = ("fixed_prompt", "rolling")
# Whether each feature's state splits with the heads under tensor parallelism: token
# selection reads the hidden state every rank holds whole, top-K keys and loop-2
# references are per head, packed pages per KV head, so no rank needs another's state.
TENSOR_PARALLEL_SUPPORT = {
    "token_sparse_prefill": True,
    "sparse_decode_attention": True,
    "kv_residual_quantization": True,
}


def feature_support() -> dict[str, dict[str, bool]]:
    """Which features serve speculative verification rows and which split over
    tensor-parallel ranks (``info`` reports it; the engine refuses the rest by name)."""
    return {
        "speculation": dict(SPECULATION_SUPPORT),
        "tensor_parallel": dict(TENSOR_PARALLEL_SUPPORT),
    }


class FlashLoopSupport:
    """The refusal methods of :class:`FlashLoopBackend` (they read its ``config`` and
    ``kernels``)."""

    config: FlashLoopConfig
    kernels: dict[OpName, KernelChoice]

    def graph_blockers(self) -> list[str]:
        """Why a CUDA graph cannot capture this backend's decode traversal (none: it can).
        Every op a decode row can route to must run on a kernel that declares
        ``cuda_graphs`` (sparse ops also ``graph_safe_sparse``)."""
        sparse = SOURCE_OPS | CORRECTION_OPS
        reasons = []
        for op in sorted(routable_ops(self.config, decode_only=True), key=lambda o: o.value):
            declared = self.kernels[op].impl.support.capabilities
            needed = {Capability.CUDA_GRAPHS} | (
                {Capability.GRAPH_SAFE_SPARSE} if op in sparse else set()
            )
            missing = sorted(c.value for c in needed - declared)
            if missing:
                reasons.append(
                    f"op {op.value!r} runs on kernel provider {self.kernels[op].provider.name!r}, "
                    f"which does not declare {missing} (create the backend with required "
                    f"capability {Capability.CUDA_GRAPHS.value!r})"
                )
        return reasons

    def speculation_blockers(self) -> list[str]:
        supported = sorted(name for name, ok in SPECULATION_SUPPORT.items() if ok)
        blockers = [
            f"feature {name!r} does not verify speculative rows (features that do: {supported})"
            for name in self.config.enabled_features()
            if not SPECULATION_SUPPORT[name]
        ]
        quantization = self.config.kv_residual_quantization
        if quantization.enabled and quantization.policy not in SPECULATION_POLICIES:
            blockers.append(
                f"kv_residual_quantization policy {quantization.policy!r} does not verify "
                f"speculative rows (policies that do: {list(SPECULATION_POLICIES)})"
            )
        return blockers

    def tensor_parallel_blockers(self) -> list[str]:
        supported = sorted(name for name, ok in TENSOR_PARALLEL_SUPPORT.items() if ok)
        return [
            f"feature {name!r} does not split over tensor-parallel ranks (features that do: "
            f"{supported})"
            for name in self.config.enabled_features()
            if not TENSOR_PARALLEL_SUPPORT[name]
        ]
