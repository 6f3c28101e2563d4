"""The torch reference kernel provider: every op, on CPU and GPU, the oracle every other
implementation is tested against (``torch_reference`` in configs and reports)."""

from __future__ import annotations

import torch

from flashloop_backend._version import __version__
from flashloop_backend.capabilities import Capability, Support
from flashloop_backend.kernels.op_protocols import OpName
from flashloop_backend.kernels.ops import KernelImpl, KernelProvider
from flashloop_backend.kernels.torch_ref.paged import paged_attention, paged_prefill

_FLOAT_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})

SUPPORT = Support(
    devices=frozenset({"cpu", "cuda"}),
    dtypes=_FLOAT_DTYPES,
    capabilities=frozenset(
        {
            Capability.NONCONSECUTIVE_QUERIES,
            Capability.DEVICE_POSITIONS,
            Capability.ASYNC_SCHEDULING,
            Capability.PACKED_PREFILL,
        }
    ),
)


SPARSE_DECODE_SUPPORT = Support(
    devices=SUPPORT.devices,
    dtypes=SUPPORT.dtypes,
    capabilities=SUPPORT.capabilities | {Capability.SOURCE_STATISTICS},
)


# The packed-KV references read which rows they serve on the host (``torch_ref/packed.py``), so
# they cannot be queued ahead asynchronously.
PACKED_SUPPORT = Support(
    devices=SUPPORT.devices,
    dtypes=SUPPORT.dtypes,
    capabilities=(SUPPORT.capabilities - {Capability.ASYNC_SCHEDULING})
    | {Capability.PACKED_KV_READ},
)


PACKED_SPARSE_SUPPORT = Support(
    devices=SUPPORT.devices,
    dtypes=SUPPORT.dtypes,
    capabilities=PACKED_SUPPORT.capabilities | {Capability.SOURCE_STATISTICS},
)


def provider() -> KernelProvider:
    from flashloop_backend.kernels.torch_ref.packed import (
        packed_decode_reference,
        packed_dense_source,
        packed_sparse_correction,
    )
    from flashloop_backend.kernels.torch_ref.sparse_decode import dense_source, sparse_correction
    from flashloop_backend.kv.codec import encode_levels_chain

    correction = SPARSE_DECODE_SUPPORT.with_capabilities(Capability.CORRECTION_INTO_BASE)
    packed_correction = PACKED_SPARSE_SUPPORT.with_capabilities(Capability.CORRECTION_INTO_BASE)

    return KernelProvider(
        name="torch_reference",
        version=__version__,
        priority=0,
        description="pure torch reference kernels (oracle; CPU and GPU)",
        impls={
            OpName.DENSE_ATTENTION: KernelImpl(OpName.DENSE_ATTENTION, paged_attention, SUPPORT),
            OpName.DENSE_PREFILL: KernelImpl(OpName.DENSE_PREFILL, paged_prefill, SUPPORT),
            OpName.SPARSE_PREFILL: KernelImpl(OpName.SPARSE_PREFILL, paged_prefill, SUPPORT),
            OpName.DENSE_SOURCE: KernelImpl(
                OpName.DENSE_SOURCE, dense_source, SPARSE_DECODE_SUPPORT
            ),
            OpName.SPARSE_CORRECTION: KernelImpl(
                OpName.SPARSE_CORRECTION, sparse_correction, correction
            ),
            OpName.PACKED_DECODE: KernelImpl(
                OpName.PACKED_DECODE, packed_decode_reference, PACKED_SUPPORT
            ),
            OpName.PACKED_KV_WRITE: KernelImpl(
                OpName.PACKED_KV_WRITE, encode_levels_chain, PACKED_SUPPORT
            ),
            OpName.PACKED_SOURCE: KernelImpl(
                OpName.PACKED_SOURCE, packed_dense_source, PACKED_SPARSE_SUPPORT
            ),
            OpName.PACKED_CORRECTION: KernelImpl(
                OpName.PACKED_CORRECTION, packed_sparse_correction, packed_correction
            ),
        },
    )
