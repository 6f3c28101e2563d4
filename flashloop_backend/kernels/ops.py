"""Kernel providers and their implementations of the ops (``kernels/op_protocols.py``).

Each op is implemented by one or more kernel providers (torch reference, Triton, CUDA,
FlashInfer, plugins) registered under the ``flashloop_backend.kernels`` entry-point group.
The backend calls an implementation through :class:`KernelImpl` with the op's inputs
object (``kernels/op_inputs.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from flashloop_backend.capabilities import Support
from flashloop_backend.kernels.op_inputs import OP_INPUTS, OpInputs
from flashloop_backend.kernels.op_protocols import OpFunction, OpName, SourceOutputs

__all__ = ["KernelImpl", "KernelProvider"]


@dataclass(frozen=True)
class KernelImpl:
    """One implementation of one op, with what it supports.

    ``fn`` follows the op's protocol and stays callable with explicit arguments; calling the
    impl itself with the op's inputs object (:data:`OP_INPUTS`) checks the inputs' class
    and calls ``fn`` in the protocol's argument order."""

    op: OpName
    fn: OpFunction
    support: Support

    def __call__(self, inputs: OpInputs) -> torch.Tensor | SourceOutputs:
        expected = OP_INPUTS.get(self.op)
        if expected is None:
            raise TypeError(
                f"op {self.op.value!r} takes no inputs object: call KernelImpl.fn with the "
                "protocol's arguments"
            )
        if not isinstance(inputs, expected):
            raise TypeError(
                f"op {self.op.value!r} takes {expected.__name__}; got {type(inputs).__name__}"
            )
        return inputs.call(self.fn)


@dataclass(frozen=True)
class KernelProvider:
    """What a ``flashloop_backend.kernels`` entry point returns when called.

    ``priority`` orders automatic selection (higher first); explicit overrides ignore it.
    """

    name: str
    version: str
    impls: Mapping[OpName, KernelImpl]
    priority: int = 0
    description: str = ""
    extras: dict[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for op, impl in self.impls.items():
            if impl.op != op:
                raise ValueError(f"provider {self.name!r}: impl for {op} declares op {impl.op}")
