"""Triton kernels: ``@triton.jit`` code in ``*_jit.py``, validated wrappers beside it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from flashloop_backend._version import __version__
from flashloop_backend.capabilities import Capability, Support
from flashloop_backend.kernels.op_protocols import OpName
from flashloop_backend.kernels.ops import KernelImpl, KernelProvider

if TYPE_CHECKING:
    from flashloop_backend.kv.levels import LevelMetadata
    from flashloop_backend.kv.store import PackedKVStore

SUPPORT = Support(
    devices=frozenset({"cuda"}),
    dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}),
    head_dims=frozenset({16, 32, 64, 128, 256}),
    block_sizes=frozenset({1, 2, 4, 8, 16, 32, 64}),
    python_modules=("triton",),
    capabilities=frozenset(
        {
            Capability.NONCONSECUTIVE_QUERIES,
            Capability.DEVICE_POSITIONS,
            Capability.ASYNC_SCHEDULING,
            Capability.PACKED_PREFILL,
            Capability.CUDA_GRAPHS,
        }
    ),
)


def _paged(*args, **kwargs) -> torch.Tensor:
    from flashloop_backend.kernels.triton.paged_decode import (
        paged_attention_triton,  # imports triton only when used
    )

    return paged_attention_triton(*args, **kwargs)


def _sparse_prefill(*args, **kwargs) -> torch.Tensor:
    from flashloop_backend.kernels.triton.sparse_prefill import sparse_prefill_triton

    return sparse_prefill_triton(*args, **kwargs)


def _dense_source(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lengths: torch.Tensor,
    key_retention: float,
    k_bucket: int,
    scale: float | None = None,
) -> tuple[torch.Tensor, ...]:
    """``dense_source`` (the ``DenseSource`` contract) through ``dense_source_triton``."""
    from flashloop_backend.kernels.triton.dense_source import dense_source_triton

    return dense_source_triton(
        q, key_cache, value_cache, block_tables, context_lengths, key_retention, k_bucket, scale
    )


def _packed_decode(*args, **kwargs) -> torch.Tensor:
    from flashloop_backend.kernels.triton.packed_decode import packed_decode_triton

    return packed_decode_triton(*args, **kwargs)


def _packed_kv_write(*args, **kwargs) -> None:
    from flashloop_backend.kernels.triton.encode import encode_levels_triton

    encode_levels_triton(*args, **kwargs)


def _packed_source(
    q: torch.Tensor,
    store: PackedKVStore,
    layer: int,
    meta: LevelMetadata,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lengths: torch.Tensor,
    key_retention: float,
    k_bucket: int,
    scale: float | None = None,
) -> tuple[torch.Tensor, ...]:
    """``packed_dense_source`` (the ``PackedDenseSource`` contract) through
    ``packed_dense_source_triton``."""
    from flashloop_backend.kernels.triton.packed_sparse import packed_dense_source_triton

    return packed_dense_source_triton(
        q,
        store,
        layer,
        meta,
        key_cache,
        value_cache,
        block_tables,
        context_lengths,
        key_retention,
        k_bucket,
        scale,
    )


def _packed_correction(*args, **kwargs) -> torch.Tensor:
    from flashloop_backend.kernels.triton.packed_sparse import packed_sparse_correction_triton

    return packed_sparse_correction_triton(*args, **kwargs)


def _sparse_correction(*args, **kwargs) -> torch.Tensor:
    from flashloop_backend.kernels.triton.sparse_decode import sparse_correction_triton

    return sparse_correction_triton(*args, **kwargs)


SPARSE_SUPPORT = Support(
    devices=SUPPORT.devices,
    dtypes=SUPPORT.dtypes,
    head_dims=SUPPORT.head_dims,
    block_sizes=SUPPORT.block_sizes,
    python_modules=SUPPORT.python_modules,
    capabilities=SUPPORT.capabilities
    | {Capability.GRAPH_SAFE_SPARSE, Capability.SOURCE_STATISTICS},
)


# the decode kernel computes the rows of a verification group together (row_spans)
DENSE_ATTENTION_SUPPORT = SUPPORT.with_capabilities(Capability.GROUPED_VERIFY_ROWS)


def provider() -> KernelProvider:
    impl = {
        OpName.DENSE_ATTENTION: KernelImpl(OpName.DENSE_ATTENTION, _paged, DENSE_ATTENTION_SUPPORT),
        # the tiled kernel serves both: prefill rows of one sequence share each K/V tile,
        # where the decode kernel would re-read the context once per row
        OpName.DENSE_PREFILL: KernelImpl(OpName.DENSE_PREFILL, _sparse_prefill, SUPPORT),
        OpName.SPARSE_PREFILL: KernelImpl(OpName.SPARSE_PREFILL, _sparse_prefill, SUPPORT),
    }
    correction = SPARSE_SUPPORT.with_capabilities(Capability.CORRECTION_INTO_BASE)
    impl[OpName.SPARSE_CORRECTION] = KernelImpl(
        OpName.SPARSE_CORRECTION, _sparse_correction, correction
    )
    impl[OpName.DENSE_SOURCE] = KernelImpl(OpName.DENSE_SOURCE, _dense_source, SPARSE_SUPPORT)
    packed = Support(
        devices=SUPPORT.devices,
        dtypes=SUPPORT.dtypes,
        head_dims=frozenset({64, 128, 256}),
        block_sizes=SUPPORT.block_sizes,
        python_modules=SUPPORT.python_modules,
        capabilities=SUPPORT.capabilities | {Capability.PACKED_KV_READ},
    )
    impl[OpName.PACKED_DECODE] = KernelImpl(OpName.PACKED_DECODE, _packed_decode, packed)
    impl[OpName.PACKED_KV_WRITE] = KernelImpl(OpName.PACKED_KV_WRITE, _packed_kv_write, packed)
    packed_sparse = Support(
        devices=packed.devices,
        dtypes=packed.dtypes,
        head_dims=packed.head_dims,
        block_sizes=packed.block_sizes,
        python_modules=packed.python_modules,
        capabilities=packed.capabilities
        | {Capability.GRAPH_SAFE_SPARSE, Capability.SOURCE_STATISTICS},
    )
    impl[OpName.PACKED_SOURCE] = KernelImpl(OpName.PACKED_SOURCE, _packed_source, packed_sparse)
    packed_correction = packed_sparse.with_capabilities(Capability.CORRECTION_INTO_BASE)
    impl[OpName.PACKED_CORRECTION] = KernelImpl(
        OpName.PACKED_CORRECTION, _packed_correction, packed_correction
    )
    return KernelProvider(
        name="triton",
        version=__version__,
        priority=20,
        description=(
            "Triton paged decode, tiled nonconsecutive-query prefill, dense source with exact "
            "top-K statistics, sparse correction, packed INT4 KV (decode, source, correction)"
        ),
        impls=impl,
    )
