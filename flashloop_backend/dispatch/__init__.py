"""Batch views, the stable row partition and segment routing."""

from flashloop_backend.dispatch.batch import BatchView, HostRows, RowMode
from flashloop_backend.dispatch.partition import RowPartition, partition_rows, verify_spans
from flashloop_backend.dispatch.router import (
    NOT_ROUTED,
    REFERENCE_DEPTH,
    ROUTE_CODES,
    SPARSE_START_DEPTH,
    OpRequirement,
    base_routes,
    base_routes_of,
    config_capabilities,
    decode_route_ops,
    prefill_route_ops,
    required_ops,
    routable_ops,
    route_rows,
    sparse_decode_ops,
    sparse_prefill_depth,
    sparse_prefill_retention,
    with_references,
)

__all__ = [
    "NOT_ROUTED",
    "REFERENCE_DEPTH",
    "ROUTE_CODES",
    "SPARSE_START_DEPTH",
    "BatchView",
    "HostRows",
    "OpRequirement",
    "RowMode",
    "RowPartition",
    "base_routes",
    "base_routes_of",
    "config_capabilities",
    "decode_route_ops",
    "partition_rows",
    "prefill_route_ops",
    "required_ops",
    "routable_ops",
    "route_rows",
    "sparse_decode_ops",
    "sparse_prefill_depth",
    "sparse_prefill_retention",
    "verify_spans",
    "with_references",
]
