"""Which op serves which rows, decided from the config and each row's mode and depth.

The static half (:func:`required_ops`) tells selection which kernels and capabilities a
configuration needs, so an unservable configuration fails at configuration time. The
dynamic half (:func:`route_rows`) labels each row on the device, without host reads.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from flashloop_backend.capabilities import Capability
from flashloop_backend.config import DENSE_LOOPS, FlashLoopConfig
from flashloop_backend.dispatch.batch import BatchView, RowMode
from flashloop_backend.kernels.op_inputs import PACKED_VERSION
from flashloop_backend.kernels.op_protocols import OpName

REFERENCE_DEPTH = DENSE_LOOPS - 1  # zero-based depth of loop 2, the decode reference
SPARSE_START_DEPTH = DENSE_LOOPS  # zero-based depth of loop 3, the first sparse loop
ROUTE_CODES: dict[OpName, int] = {op: i for i, op in enumerate(OpName)}
NOT_ROUTED = -1


@dataclass(frozen=True)
class OpRequirement:
    op: OpName
    feature: str  # the config group that needs it, or "dense"
    capabilities: frozenset[Capability]


def decode_op(config: FlashLoopConfig, op: OpName) -> OpName:
    """The op that serves ``op``'s decode rows: its packed-KV version when KV quantization
    is on (``kernels.op_inputs.PACKED_VERSION``)."""
    return PACKED_VERSION[op] if config.kv_residual_quantization.enabled else op


def sparse_decode_ops(config: FlashLoopConfig) -> tuple[OpName, OpName]:
    """(source op, correction op) of decode rows under ``config``."""
    return decode_op(config, OpName.DENSE_SOURCE), decode_op(config, OpName.SPARSE_CORRECTION)


def required_ops(config: FlashLoopConfig) -> tuple[OpRequirement, ...]:
    """Ops (and the capabilities their kernels need) that ``config`` can route rows to.

    With KV quantization (``fixed_prompt``) a prompt is packed once it has run every loop,
    so prefill reads BF16 and only decode reads packed KV."""
    quantized = config.kv_residual_quantization.enabled
    needs = [
        OpRequirement(OpName.DENSE_ATTENTION, "dense", frozenset()),
        OpRequirement(OpName.DENSE_PREFILL, "dense", frozenset()),
    ]
    if config.token_sparse_prefill.enabled:
        needs.append(
            OpRequirement(
                OpName.SPARSE_PREFILL,
                "token_sparse_prefill",
                frozenset({Capability.NONCONSECUTIVE_QUERIES}),
            )
        )
    packed = frozenset({Capability.PACKED_KV_READ}) if quantized else frozenset()
    if config.sparse_decode_attention.enabled:
        source, correction = sparse_decode_ops(config)
        needs.append(
            OpRequirement(
                source, "sparse_decode_attention", packed | {Capability.SOURCE_STATISTICS}
            )
        )
        needs.append(OpRequirement(correction, "sparse_decode_attention", packed))
    if quantized:
        needs.append(OpRequirement(OpName.PACKED_DECODE, "kv_residual_quantization", packed))
        needs.append(OpRequirement(OpName.PACKED_KV_WRITE, "kv_residual_quantization", packed))
    return tuple(needs)


def decode_route_ops(
    config: FlashLoopConfig, depths: Iterable[int] | None = None
) -> frozenset[OpName]:
    """Ops :func:`route_rows` can give a decode (or verify) row at one of ``depths`` (None:
    at any depth)."""
    dense = decode_op(config, OpName.DENSE_ATTENTION)
    if not config.sparse_decode_attention.enabled:
        return frozenset({dense})
    source, correction = sparse_decode_ops(config)
    if depths is None:
        return frozenset({dense, source, correction})
    ops: set[OpName] = set()
    for depth in depths:
        if depth == REFERENCE_DEPTH:
            ops.add(source)
        elif depth >= SPARSE_START_DEPTH:
            ops |= {correction, dense}  # dense when the token's reference is not ready
        else:
            ops.add(dense)
    return frozenset(ops)


def sparse_prefill_depth(config: FlashLoopConfig) -> int:
    """The first zero-based depth whose prompt rows are a subset (token-sparse retention
    below 1.0), ``num_loops`` when none is. Rows of a loop that keeps every token are
    consecutive, so the dense prefill op serves them (the same attention, by the kernel
    made for consecutive rows)."""
    sparse = config.token_sparse_prefill
    if not sparse.enabled:
        return config.num_loops
    subsets = [d for d, ratio in enumerate(sparse.retention) if ratio < 1.0]
    return max(SPARSE_START_DEPTH, subsets[0]) if subsets else config.num_loops


def sparse_prefill_retention(config: FlashLoopConfig) -> float:
    """The least fraction of a prompt's rows any loop the sparse prefill op serves keeps
    (1.0 where it serves none)."""
    first_sparse = sparse_prefill_depth(config)
    kept = config.token_sparse_prefill.retention[first_sparse : config.num_loops]
    return min(kept, default=1.0)


def prefill_route_ops(
    config: FlashLoopConfig, depths: Iterable[int] | None = None
) -> frozenset[OpName]:
    """Ops :func:`route_rows` can give an active prefill row at one of ``depths`` (None: at
    any depth)."""
    first_sparse = sparse_prefill_depth(config)
    if depths is None:
        depths = range(config.num_loops)
    return frozenset(
        OpName.SPARSE_PREFILL if depth >= first_sparse else OpName.DENSE_PREFILL for depth in depths
    )


def routable_ops(
    config: FlashLoopConfig,
    decode_only: bool,
    decode_depths: Iterable[int] | None = None,
    prefill_depths: Iterable[int] | None = None,
) -> frozenset[OpName]:
    """Ops :func:`route_rows` can give some row of a batch: with ``decode_only`` only those
    of decode rows (prefill ops would run on no rows); with ``decode_depths`` (or
    ``prefill_depths``) only those decode (or prefill) rows at these depths can take."""
    if decode_only:
        return decode_route_ops(config, decode_depths)
    return decode_route_ops(config, decode_depths) | prefill_route_ops(config, prefill_depths)


def config_capabilities(config: FlashLoopConfig) -> frozenset[Capability]:
    """Backend-level capabilities a configuration implies (RFC §4)."""
    caps: set[Capability] = set()
    if config.token_sparse_prefill.enabled:
        caps.add(Capability.NONCONSECUTIVE_QUERIES)
    if config.sparse_decode_attention.enabled:
        caps.add(Capability.SOURCE_STATISTICS)
    if config.kv_residual_quantization.enabled:
        caps.add(Capability.PACKED_KV_READ)
    return frozenset(caps)


def route_rows(
    view: BatchView,
    config: FlashLoopConfig,
    reference_ready: torch.Tensor | None = None,
) -> torch.Tensor:
    """[R] int64 route code per row (``ROUTE_CODES``), ``NOT_ROUTED`` for inactive/padding.

    ``reference_ready`` ([R] bool) says which decode rows hold a valid loop-2 reference;
    rows without one run dense at sparse loops (RFC §3.2: never consume stale state).
    """
    routes, correctable = base_routes(view, config)
    return with_references(routes, correctable, config, reference_ready)


def base_routes(
    view: BatchView, config: FlashLoopConfig
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The layer-independent half of :func:`route_rows`: each row's route as if no decode
    row held a reference, and [R] bool the decode rows that would correct if one did
    (None without sparse decode)."""
    return base_routes_of(view.row_modes, view.depths, config)


def base_routes_of(
    row_modes: torch.Tensor, depths: torch.Tensor, config: FlashLoopConfig
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`base_routes` of rows with modes [R] and depths [R] on any device: a prompt
    row's route depends on its mode and depth alone, so the host's copy of them gives the
    routes of a view without decode rows without reading the device. One lookup of
    :func:`route_table` per output (a batch plans in a few launches, not one per rule);
    depths beyond the last loop route as the last loop's rows do. ``row_modes`` hold
    ``RowMode`` values (the host's row groups are checked when made)."""
    routes, correctable = route_table(config, depths.device)
    loops = config.num_loops
    key = depths.clamp(0, loops).add_(row_modes, alpha=loops + 1)
    return routes[key], None if correctable is None else correctable[key]


# (id(config), device) -> its table; an entry leaves with its config (so no later
# config reuses the id while the entry stands)
_ROUTE_TABLES: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor | None]] = {}


def route_table(
    config: FlashLoopConfig, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(route code [M * (loops + 1)] int64, correctable [M * (loops + 1)] bool or None) of
    a row of each mode (M ``RowMode`` values) at each depth 0..loops, at index
    ``mode * (loops + 1) + depth``: :func:`routes_by_rule` over every pair, made on
    ``device`` once per config. Kernels captured in a CUDA graph do not run until it
    replays, so the table must exist before a capture first needs it: a backend makes
    it when it reserves its device state, and a first use while capturing is refused."""
    device = torch.device(device)
    key = (id(config), device)
    cached = _ROUTE_TABLES.get(key)
    if cached is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"the route table of this config on {device} is first needed inside a CUDA "
                "graph capture, where it would stay unwritten until the graph replays: make "
                "it before capturing (route_table(config, device), as reserve does)"
            )
        index = torch.arange(len(RowMode) * (config.num_loops + 1), device=device)
        modes, depths = index // (config.num_loops + 1), index % (config.num_loops + 1)
        cached = _ROUTE_TABLES[key] = routes_by_rule(modes, depths, config)
        weakref.finalize(config, _ROUTE_TABLES.pop, key, None)
    return cached


def routes_by_rule(
    row_modes: torch.Tensor, depths: torch.Tensor, config: FlashLoopConfig
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`base_routes_of` by its rules, one tensor operation each (the table's
    source and its test oracle)."""
    modes = row_modes.long()
    decode = (modes == RowMode.DECODE) | (modes == RowMode.VERIFY)
    prefill = modes == RowMode.PREFILL
    routes = torch.full_like(depths, NOT_ROUTED)
    routes = torch.where(decode, ROUTE_CODES[decode_op(config, OpName.DENSE_ATTENTION)], routes)
    routes = torch.where(prefill, ROUTE_CODES[OpName.DENSE_PREFILL], routes)
    first_sparse = sparse_prefill_depth(config)
    if first_sparse < config.num_loops:
        sparse_rows = prefill & (depths >= first_sparse)
        routes = torch.where(sparse_rows, ROUTE_CODES[OpName.SPARSE_PREFILL], routes)
    if not config.sparse_decode_attention.enabled:
        return routes, None
    source = decode & (depths == REFERENCE_DEPTH)
    routes = torch.where(source, ROUTE_CODES[sparse_decode_ops(config)[0]], routes)
    return routes, decode & (depths >= SPARSE_START_DEPTH)


def with_references(
    routes: torch.Tensor,
    correctable: torch.Tensor | None,
    config: FlashLoopConfig,
    reference_ready: torch.Tensor | None,
) -> torch.Tensor:
    """Routes of :func:`base_routes` with the correction for rows whose reference is ready
    (row order of the inputs is kept: any gathered order works)."""
    if correctable is None:
        return routes
    ready = reference_ready if reference_ready is not None else torch.zeros_like(correctable)
    correction = ROUTE_CODES[sparse_decode_ops(config)[1]]
    return torch.where(correctable & ready, correction, routes)
