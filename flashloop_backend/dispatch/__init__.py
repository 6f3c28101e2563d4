"""Batch views, the stable row partition and segment routing."""

from .batch import BatchView, RowMode
from .partition import RowPartition, partition_rows
from .router import (
    NOT_ROUTED,
    REFERENCE_DEPTH,
    ROUTE_CODES,
    SPARSE_START_DEPTH,
    OpRequirement,
    base_routes,
    config_capabilities,
    decode_route_ops,
    prefill_route_ops,
    required_ops,
    routable_ops,
    route_rows,
    with_references,
)

__all__ = [
    "NOT_ROUTED",
    "REFERENCE_DEPTH",
    "ROUTE_CODES",
    "SPARSE_START_DEPTH",
    "BatchView",
    "OpRequirement",
    "RowMode",
    "RowPartition",
    "base_routes",
    "config_capabilities",
    "decode_route_ops",
    "partition_rows",
    "prefill_route_ops",
    "required_ops",
    "routable_ops",
    "route_rows",
    "with_references",
]
