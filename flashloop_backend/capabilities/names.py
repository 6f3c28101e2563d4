"""Capability names a backend or kernel implementation may declare (RFC §4, DESIGN §3)."""

from __future__ import annotations

from enum import Enum


class Capability(str, Enum):
    """What an implementation can do beyond plain dense paged attention."""

    # FlashLoop operations (RFC §4)
    SOURCE_STATISTICS = "source_statistics"  # dense pass also yields per-key selection stats
    NONCONSECUTIVE_QUERIES = "nonconsecutive_queries"  # queries at arbitrary absolute positions
    PACKED_KV_READ = "packed_kv_read"  # reads INT4 base + residual KV directly
    GRAPH_SAFE_SPARSE = "graph_safe_sparse"  # sparse paths capture into CUDA graphs
    DEVICE_POSITIONS = "device_positions"  # positions/depths stay on the device, no host reads
    # one program computes a verification group's rows, reading their shared keys once
    GROUPED_VERIFY_ROWS = "grouped_verify_rows"
    # a correction writes the rows it serves into the batch's output in place (base, serves)
    CORRECTION_INTO_BASE = "correction_into_base"
    # plans from the host's sequence plan of its rows (sequence_plan), never reading the
    # device's tables and lengths back
    HOST_SEQUENCE_PLAN = "host_sequence_plan"
    # a nonconsecutive-query prefill computes the positions its rows span (taking the
    # host's span plan, span_plan, where given), so the host bounds such chunks by positions
    SPAN_PREFILL = "span_prefill"
    # a loop-2 source given a statistics stream writes its selection statistics there,
    # beside its dense output on the caller's stream (StatisticsStream)
    STATISTICS_STREAM = "statistics_stream"
    # vllm-rlt's existing BackendCapabilities flags
    PACKED_PREFILL = "packed_prefill"
    CUDA_GRAPHS = "cuda_graphs"
    ASYNC_SCHEDULING = "async_scheduling"

    def __str__(self) -> str:
        return self.value


VLLM_RLT_FLAGS = (Capability.PACKED_PREFILL, Capability.CUDA_GRAPHS, Capability.ASYNC_SCHEDULING)
