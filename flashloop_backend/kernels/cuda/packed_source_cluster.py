"""Wrapper of the one-launch cluster source (``packed_source_cluster.cu``): the
``packed_dense_source`` contract for few (row, head) pairs as one launch of 8-CTA thread-block
clusters, the logits and the selection kept in the cluster's shared memory. BF16 queries
and caches, head_dim 128, dense levels, compute capability 9.0 (clusters)."""

from __future__ import annotations

import ctypes

import torch

from flashloop_backend.algorithms.sparse_decode import key_retention_fraction
from flashloop_backend.kernels.cuda import loader
from flashloop_backend.kv.levels import LevelMetadata
from flashloop_backend.kv.store import PackedKVStore

CLUSTER = 8  # CTAs per (row, head)
WARPS = 8
STAGES = 2
# the kernel's static shared memory (histograms, gather, merge area) and the per-SM limit
STATIC_SHARED = 35 * 1024
SHARED_LIMIT = 227 * 1024


class _ClusterParams(ctypes.Structure):
    # the C layout of ClusterParams in packed_source_cluster.cu
    _fields_ = [
        ("q", ctypes.c_void_p),
        ("blocks", ctypes.c_void_p),
        ("page_bytes", ctypes.c_int64),
        *(
            (name, ctypes.c_void_p)
            for name in (
                "tables kinds packed k_cache v_cache block_tables lengths out indices mass "
                "output contribution"
            ).split()
        ),
        ("scale", ctypes.c_float),
        *(
            (name, ctypes.c_int)
            for name in (
                "q_row q_head t_row t_level kind_row k_block k_slot k_head v_block v_slot "
                "v_head bt_row out_row out_head i_row i_head mass_row output_row output_head "
                "contrib_row contrib_head ratio_num ratio_den bucket groups_per_cta group_q "
                "block_size"
            ).split()
        ),
    ]


def dynamic_shared(levels: int, group: int, head_dim: int, groups_per_cta: int) -> int:
    """Dynamic shared memory of a CTA: its warps' rings (one pass's half of every level's
    block a stage), its logits and a bit per position taken."""
    ring = WARPS * STAGES * levels * (group * head_dim // 2 + 4 * head_dim)
    positions = groups_per_cta * group
    return ring + 4 * positions + positions // 8


def shared_reason(levels: int, group: int, head_dim: int, span: int) -> str | None:
    """Why a CTA's shared memory cannot hold a span of ``span`` positions (None: it can)."""
    groups_per_cta = -(-span // (group * CLUSTER))
    need = STATIC_SHARED + dynamic_shared(levels, group, head_dim, groups_per_cta)
    if need > SHARED_LIMIT:
        return (
            f"a span of {span} positions at {levels} levels needs {need} B of shared memory "
            f"per CTA; at most {SHARED_LIMIT} B fit"
        )
    return None


def cluster_unsupported(
    q: torch.Tensor, store: PackedKVStore, levels: int, span: int
) -> str | None:
    """Why the cluster source cannot serve these rows (None: it can)."""
    if torch.cuda.get_device_capability(q.device)[0] < 9:
        return "thread-block clusters need compute capability 9.0 or newer"
    return shared_reason(levels, store.group_size, q.shape[-1], span)


def source_cluster(
    q: torch.Tensor,
    store: PackedKVStore,
    layer: int,
    meta: LevelMetadata,
    caches: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    outputs: tuple[torch.Tensor, ...],
    span: int,
    key_retention: float,
    scale: float,
) -> None:
    """Writes ``outputs`` = (out [R, Hq, D] bf16, indices [R, Hq, Kb] int32, mass [R, Hq],
    output [R, Hq, D], contribution [R, Hq, D] FP32) of q [R, Hq, D] BF16 over dense packed
    levels and ``caches`` = (key_cache, value_cache [NB, BS, Hkv, D] BF16, block_tables [R,
    MB], context_lengths [R] int32) covering ``span`` positions. Inputs are checked by the
    caller (``packed_dense_source_cuda``), which also checks ``cluster_unsupported``."""
    key_cache, value_cache, block_tables, lengths = caches
    out, indices, mass, output, contribution = outputs
    rows, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = store.group_size
    groups_per_cta = -(-span // (group * CLUSTER))
    levels = meta.tables.shape[1]
    num, den = key_retention_fraction(key_retention)
    codes = store.blocks[:, layer]
    t = lambda x: x.data_ptr()  # noqa: E731
    params = _ClusterParams(
        t(q),
        t(codes),
        codes.stride(0),
        *(t(meta.tables), t(meta.kinds), t(meta.packed_lengths), t(key_cache), t(value_cache)),
        *(t(block_tables), t(lengths), t(out), t(indices), t(mass), t(output), t(contribution)),
        scale,
        *(q.stride(0), q.stride(1), meta.tables.stride(0), meta.tables.stride(1)),
        *(meta.kinds.stride(0), *key_cache.stride()[:3], *value_cache.stride()[:3]),
        *(block_tables.stride(0), out.stride(0), out.stride(1), indices.stride(0)),
        *(indices.stride(1), mass.stride(0), output.stride(0), output.stride(1)),
        *(contribution.stride(0), contribution.stride(1), num, den, indices.shape[-1]),
        *(groups_per_cta, num_q_heads // num_kv_heads, block_size),
    )
    defines = {
        "HEAD_DIM": head_dim,
        "GROUP": group,
        "LEVELS": levels,
        "WARPS": WARPS,
        "STAGES": STAGES,
        "CLUSTER": CLUSTER,
    }
    # allowed all the dynamic shared memory a CTA can take, once: no attribute changes at
    # a longer span (or inside a graph capture)
    kernel = loader.build_file("packed_source_cluster", defines, SHARED_LIMIT - STATIC_SHARED)
    shared = dynamic_shared(levels, group, head_dim, groups_per_cta)
    kernel((CLUSTER * num_q_heads, rows, 1), (WARPS * 32, 1, 1), [params], shared)
