"""A CPU stand-in for CUDA-graph capture: records every aten call made while capturing
and replays them on the same tensors, without running any Python. Like a CUDA graph, a
replay sees new contents of the captured tensors but nothing decided on the host during
the capture changes: a stale host-side plan or a host read baked into the capture gives
stale results here too. (Unlike a CUDA graph, the capture also executes once.)"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class RecordedGraph:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def replay(self) -> None:
        for func, args, kwargs, out in self.calls:
            result = func(*args, **kwargs)
            for old, new in zip(tree_flatten(out)[0], tree_flatten(result)[0], strict=True):
                if isinstance(old, torch.Tensor) and old.data_ptr() != new.data_ptr():
                    old.copy_(new)  # later calls read the captured output tensors


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: RecordedGraph) -> None:
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.graph.calls.append((func, args, kwargs, out))
        return out


class RecordingCapture:
    """The ``graph_capture`` interface of the host (see ``host.graphs.CudaCapture``)."""

    def reserved(self) -> int:
        return 0

    def new_graph(self) -> RecordedGraph:
        return RecordedGraph()

    @contextmanager
    def capturing(self, graph: RecordedGraph):
        with _Recorder(graph):
            yield
