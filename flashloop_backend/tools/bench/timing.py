"""Timing and records shared by the benchmarks: CUDA-event timers (eager and graph
replays), sample statistics, the environment record and the H200 limits ratios are taken
against.

Candidates run interleaved in one process (round robin per repetition) so every ratio is
measured side by side. Times come from CUDA events after warm-up; each sample times
``calls_per_sample`` back-to-back launches. Caches rotate among copies that together
exceed the L2 cache, so the numbers are HBM numbers.
"""

from __future__ import annotations

import statistics
import sys
import time
from importlib.metadata import PackageNotFoundError, version

import torch

from flashloop_backend._version import __version__
from flashloop_backend.config import ConfigError

HBM_BYTES_PER_S = 4.3e12  # the H200's HBM copy bandwidth (DESIGN §5-6)
BF16_FLOPS = 790e12  # the H200's dense BF16 tensor-core rate (DESIGN §5)
# several times the H200's L2 cache, so every timed call reads its caches from HBM
# (results/README.md, "Dense decode attention")
ROTATION_BYTES = 512 * 2**20


def environment_record() -> dict:
    versions = {"flashloop_backend": __version__, "torch": torch.__version__}
    for name, dist in (("triton", "triton"), ("flashinfer", "flashinfer-python")):
        try:
            versions[name] = version(dist)
        except PackageNotFoundError:
            versions[name] = None
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"gpu": gpu, "versions": versions, "date": time.strftime("%Y-%m-%d")}


def require_cuda() -> torch.device:
    if not torch.cuda.is_available():
        raise ConfigError(
            "benchmarks time GPU kernels with CUDA events; no CUDA GPU is available here"
        )
    return torch.device("cuda")


def sample_stats(samples_ms: list[float]) -> dict:
    ordered = sorted(samples_ms)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {
        "median_ms": statistics.median(ordered),
        "p10_ms": pick(0.1),
        "p90_ms": pick(0.9),
        "samples": len(ordered),
    }


def capture_calls(fn, q, caches, tables, lengths, calls: int):
    """A CUDA graph of ``calls`` launches over the rotating caches, or why none could be made
    (graph timing removes host launch overhead, which dominates small shapes)."""
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                fn(q, *caches[i % len(caches)], tables, lengths)
        return graph
    except Exception as exc:  # a kernel that cannot be captured is reported, not fatal
        torch.cuda.synchronize()
        return f"{type(exc).__name__}: {exc}"[:200]


def progress_log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def graph_ms(fn, reps: int = 30, calls: int = 10, rotate: list | None = None) -> float:
    """Median ms per call of ``fn`` replayed from a CUDA graph of ``calls`` launches. With
    ``rotate``, call i is ``fn(rotate[i % len(rotate)])``: inputs larger than the L2 cache
    together time reads from memory, as a traversal reads each layer's tensors once."""
    call = (lambda i: fn(rotate[i % len(rotate)])) if rotate else (lambda i: fn())
    calls = max(calls, len(rotate or ()))  # every rotated input once at least
    call(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            call(i)
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / calls)
    return statistics.median(samples)


def eager_ms(fn, reps: int = 30, calls: int = 10) -> float:
    fn()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / calls)
    return statistics.median(samples)
