"""Support declarations as data, and the reasons a request cannot be served.

A declaration lists what one backend or kernel implementation handles: devices, dtypes,
head dims, block sizes, minimum compute capability, required Python modules and
capabilities. ``not_supported_reasons`` compares it with a request and the machine and
returns phrases naming the value and the supported set (xformers ``ops/fmha/common.py``).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from functools import cache

import torch

from flashloop_backend.capabilities.names import Capability

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


@dataclass(frozen=True)
class Environment:
    """Facts about this machine that decide what is usable."""

    cuda_available: bool
    compute_capability: tuple[int, int] | None
    device_name: str

    @staticmethod
    @cache
    def detect() -> Environment:
        if torch.cuda.is_available():
            return Environment(
                True, torch.cuda.get_device_capability(0), torch.cuda.get_device_name(0)
            )
        return Environment(False, None, "cpu")

    def devices(self) -> tuple[str, ...]:
        return ("cpu", "cuda") if self.cuda_available else ("cpu",)


@dataclass(frozen=True)
class SupportRequest:
    """What a caller needs from an attention implementation."""

    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    head_dim: int = 128
    block_size: int = 16
    num_q_heads: int = 16
    num_kv_heads: int = 16
    required: frozenset[Capability] = frozenset()
    # the least fraction of a prompt's rows a token-sparse loop keeps (1.0: none drops);
    # a backend sets it per op from its config, so ``describe`` leaves it out
    prefill_retention: float = 1.0

    @staticmethod
    def default(env: Environment | None = None) -> SupportRequest:
        """Ouro-1.4B attention shapes on the best device here."""
        env = env or Environment.detect()
        if env.cuda_available:
            return SupportRequest(device="cuda", dtype=torch.bfloat16)
        return SupportRequest()

    def with_required(self, extra: Iterable[Capability]) -> SupportRequest:
        return replace(self, required=self.required | frozenset(extra))

    def describe(self) -> dict[str, object]:
        return {
            "device": self.device,
            "dtype": dtype_name(self.dtype),
            "head_dim": self.head_dim,
            "block_size": self.block_size,
            "num_q_heads": self.num_q_heads,
            "num_kv_heads": self.num_kv_heads,
            "required": sorted(c.value for c in self.required),
        }


@dataclass(frozen=True)
class Support:
    """A declaration of what one implementation handles. ``None`` means any value."""

    devices: frozenset[str]
    dtypes: frozenset[torch.dtype]
    capabilities: frozenset[Capability] = frozenset()
    head_dims: frozenset[int] | None = None
    max_head_dim: int | None = None
    block_sizes: frozenset[int] | None = None
    min_compute_capability: tuple[int, int] | None = None
    python_modules: tuple[str, ...] = ()
    # the least token-sparse retention served (None: any)
    min_prefill_retention: float | None = None
    # capabilities that only hold on these devices (e.g. cuda_graphs only on cuda)
    device_capabilities: dict[str, frozenset[Capability]] = field(default_factory=dict)

    def with_capabilities(self, *extra: Capability) -> Support:
        """The same declaration, also claiming ``extra``."""
        return replace(self, capabilities=self.capabilities | frozenset(extra))

    def capabilities_on(self, device: str) -> frozenset[Capability]:
        return self.capabilities | self.device_capabilities.get(device, frozenset())

    def usable_capabilities(self, env: Environment) -> frozenset[Capability]:
        """Capabilities this implementation delivers on this machine (empty if unusable)."""
        usable = [d for d in env.devices() if not self.machine_reasons(d, env)]
        result: frozenset[Capability] = frozenset()
        for device in usable:
            result |= self.capabilities_on(device)
        return result

    def machine_reasons(self, device: str, env: Environment) -> list[str]:
        """Why this implementation cannot run on ``device`` of this machine."""
        reasons: list[str] = []
        if device not in self.devices:
            reasons.append(
                f"device={device!r} is not supported (supported: {sorted(self.devices)})"
            )
        elif device not in env.devices():
            reasons.append(
                f"device={device!r} is not available on this machine ({env.device_name})"
            )
        elif device == "cuda" and self.min_compute_capability is not None:
            cc = env.compute_capability
            if cc is None or cc < self.min_compute_capability:
                need = ".".join(map(str, self.min_compute_capability))
                have = "none" if cc is None else ".".join(map(str, cc))
                reasons.append(f"compute capability {have} is below the required {need}")
        for module in self.python_modules:
            if not module_available(module):
                reasons.append(f"python module {module!r} is not installed")
        return reasons


@cache
def module_available(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def not_supported_reasons(
    support: Support, request: SupportRequest, env: Environment | None = None
) -> list[str]:
    """Every reason ``support`` cannot serve ``request`` here; empty when it can."""
    env = env or Environment.detect()
    reasons = support.machine_reasons(request.device, env)
    if request.dtype not in support.dtypes:
        allowed = sorted(dtype_name(d) for d in support.dtypes)
        reasons.append(f"dtype={dtype_name(request.dtype)} is not supported (supported: {allowed})")
    if support.head_dims is not None and request.head_dim not in support.head_dims:
        reasons.append(
            f"head_dim={request.head_dim} is not supported (supported: {sorted(support.head_dims)})"
        )
    if support.max_head_dim is not None and request.head_dim > support.max_head_dim:
        reasons.append(f"head_dim={request.head_dim} exceeds the maximum {support.max_head_dim}")
    if support.block_sizes is not None and request.block_size not in support.block_sizes:
        reasons.append(
            f"block_size={request.block_size} is not supported "
            f"(supported: {sorted(support.block_sizes)})"
        )
    if request.num_kv_heads <= 0 or request.num_q_heads % request.num_kv_heads:
        reasons.append(
            f"num_q_heads={request.num_q_heads} is not a positive multiple of "
            f"num_kv_heads={request.num_kv_heads}"
        )
    least = support.min_prefill_retention
    if least is not None and request.prefill_retention < least:
        reasons.append(
            f"token-sparse prefill retention {request.prefill_retention} is below "
            f"{least}, the least this implementation serves"
        )
    missing = request.required - support.capabilities_on(request.device)
    if missing:
        have = sorted(c.value for c in support.capabilities_on(request.device))
        reasons.append(
            f"missing capabilities {sorted(c.value for c in missing)} on {request.device} "
            f"(declared: {have})"
        )
    return reasons
