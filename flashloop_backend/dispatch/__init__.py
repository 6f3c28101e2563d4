"""Batch views, the stable row partition and segment routing."""

from .batch import BatchView, RowMode
from .partition import RowPartition, partition_rows
from .router import (
    NOT_ROUTED,
    REFERENCE_DEPTH,
    ROUTE_CODES,
    SPARSE_START_DEPTH,
    OpRequirement,
    config_capabilities,
    required_ops,
    routable_ops,
    route_rows,
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
    "config_capabilities",
    "partition_rows",
    "required_ops",
    "routable_ops",
    "route_rows",
]
