"""CUDA C++ kernels built on first use with NVRTC (``loader``): no compiler or extension
build on the host, only the driver and NVRTC libraries a CUDA build of torch loads. The
``cuda`` kernel provider serves the packed-KV decode ops (``packed_decode``,
``packed_dense_source``, ``packed_sparse_correction``) and the packed append
(``packed_kv_write``) for BF16 rows of head_dim 128 on compute capability 8.0 or newer,
above the Triton provider in automatic selection."""

from __future__ import annotations

import torch

from flashloop_backend._version import __version__
from flashloop_backend.capabilities import Capability, Support
from flashloop_backend.kernels.op_protocols import OpName
from flashloop_backend.kernels.ops import KernelImpl, KernelProvider


def _packed_decode(*args, **kwargs) -> torch.Tensor:
    from flashloop_backend.kernels.cuda.packed_stream import packed_decode_cuda

    return packed_decode_cuda(*args, **kwargs)


def _packed_source(*args, **kwargs) -> tuple[torch.Tensor, ...]:
    from flashloop_backend.kernels.cuda.packed_source import packed_dense_source_cuda

    return packed_dense_source_cuda(*args, **kwargs)


def _packed_kv_write(*args, **kwargs) -> None:
    from flashloop_backend.kernels.cuda.encode_level import encode_levels_cuda

    encode_levels_cuda(*args, **kwargs)


def _packed_correction(*args, **kwargs) -> torch.Tensor:
    from flashloop_backend.kernels.cuda.packed_selected import packed_sparse_correction_cuda

    return packed_sparse_correction_cuda(*args, **kwargs)


PACKED = Support(
    devices=frozenset({"cuda"}),
    dtypes=frozenset({torch.bfloat16}),
    head_dims=frozenset({128}),
    block_sizes=frozenset({1, 2, 4, 8, 16, 32, 64}),
    min_compute_capability=(8, 0),
    # the splits merge and the loop-2 selection run as Triton kernels
    python_modules=("triton",),
    capabilities=frozenset(
        {
            Capability.DEVICE_POSITIONS,
            Capability.ASYNC_SCHEDULING,
            Capability.CUDA_GRAPHS,
            Capability.PACKED_KV_READ,
        }
    ),
)
SPARSE = Support(
    devices=PACKED.devices,
    dtypes=PACKED.dtypes,
    head_dims=PACKED.head_dims,
    block_sizes=PACKED.block_sizes,
    min_compute_capability=PACKED.min_compute_capability,
    python_modules=PACKED.python_modules,
    capabilities=PACKED.capabilities | {Capability.GRAPH_SAFE_SPARSE, Capability.SOURCE_STATISTICS},
)

# a correction merges into the batch's output at the rows it serves
CORRECTION = SPARSE.with_capabilities(Capability.CORRECTION_INTO_BASE)
# the source writes its statistics on a stream it is given, beside its dense output
SOURCE = SPARSE.with_capabilities(Capability.STATISTICS_STREAM)


def provider() -> KernelProvider:
    return KernelProvider(
        name="cuda",
        version=__version__,
        priority=30,
        description=(
            "CUDA C++ packed INT4 KV readers built on first use with NVRTC: the streaming "
            "decode read (cp.async rings, tensor-core K products), the loop-2 source as a "
            "keys pass and a values pass around the selection, and the selected-key read "
            "of the loop 3-4 correction; the packed append's level writer"
        ),
        impls={
            OpName.PACKED_DECODE: KernelImpl(OpName.PACKED_DECODE, _packed_decode, PACKED),
            OpName.PACKED_SOURCE: KernelImpl(OpName.PACKED_SOURCE, _packed_source, SOURCE),
            OpName.PACKED_KV_WRITE: KernelImpl(OpName.PACKED_KV_WRITE, _packed_kv_write, PACKED),
            OpName.PACKED_CORRECTION: KernelImpl(
                OpName.PACKED_CORRECTION, _packed_correction, CORRECTION
            ),
        },
    )
