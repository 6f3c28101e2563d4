"""The loop-2 selection bucket holds what a source selects from the span its readers
cover, not only from ``max_context``: graph rows read block tables of the full graph
width, rounded to whole KV blocks and (KV quantization) whole packed groups. Without
that, the source refused its bucket in the first loop-2 step (``k_bucket=... cannot hold
the ... keys selected from ...``) at key retentions whose rounding adds keys."""

import math

import pytest
import torch

from flashloop_backend import FlashLoopConfig
from flashloop_backend.backends.base import EngineCapacity
from flashloop_backend.capabilities import SupportRequest
from flashloop_backend.host import Engine, SamplingParams
from flashloop_backend.host.graphs import GraphSettings
from flashloop_backend.registry import Registry

from .host_helpers import tiny_model

ALL_ON = {
    "token_sparse_prefill": {"enabled": True, "window_size": 64, "retention": [1, 1, 1, 0.75]},
    "kv_residual_quantization": {"enabled": True, "policy": "fixed_prompt", "group_size": 64},
}


@pytest.mark.parametrize("key_retention", [0.1, 0.15, 0.25, 0.4])  # the grid's
@pytest.mark.parametrize("max_context", [32768 + 16, 8192 + 16, 128 + 16])
def test_the_bucket_holds_the_packed_source_span_of_a_graph_row(key_retention, max_context):
    """The Triton packed source's own check (``check_bucket`` on ``packed_span``) on the
    inputs a graph step gives it: block tables of the graph's full width, the packed
    metadata ``reserve_graph_inputs`` allocated, the bucket ``reserve`` sized."""
    from flashloop_backend.kernels.triton.dense_source import check_bucket
    from flashloop_backend.kernels.triton.packed_decode import packed_span

    block_size = 16
    config = FlashLoopConfig(
        sparse_decode_attention={"enabled": True, "key_retention": key_retention}, **ALL_ON
    )
    request = SupportRequest(head_dim=64, block_size=block_size, num_q_heads=1, num_kv_heads=1)
    backend = Registry.discover().create("flashloop", request, config)
    backend.reserve(
        EngineCapacity(
            max_slots=1,
            max_context=max_context,
            num_layers=1,
            num_heads=1,
            num_kv_heads=1,
            head_dim=64,
            loops=4,
            num_blocks=64,
            block_size=block_size,
            device=torch.device("cpu"),
        )
    )
    width = math.ceil(max_context / block_size)  # DecodeGraphs.width
    backend.reserve_graph_inputs(1, width * block_size)
    meta = backend.packed._graph.meta.first_levels(1, 2)  # a loop-2 row
    tables = torch.full((1, width), -1, dtype=torch.int32)
    span = packed_span(backend.packed.store, meta, tables, block_size)
    check_bucket(span, 1, key_retention, backend.states.k_bucket)  # raised before the fix


def test_a_graph_runner_wider_than_max_context_grows_the_bucket():
    """Graph settings may name a wider capacity than the engine's max_context: the
    bucket grows to its span before any step runs."""
    from flashloop_backend.backends.sparse_state import key_bucket

    config = FlashLoopConfig(sparse_decode_attention={"enabled": True, "key_retention": 0.25})
    request = SupportRequest(head_dim=16, block_size=4, num_q_heads=4, num_kv_heads=2)
    backend = Registry.discover().create("flashloop", request, config)
    graphs = GraphSettings(buckets=(1,), max_context=200, capture=False)
    engine = Engine(
        tiny_model(), backend, num_blocks=64, block_size=4, max_context=100, cuda_graphs=graphs
    )
    states = engine.backend.states
    assert states.k_bucket == key_bucket(0.25, 200) > key_bucket(0.25, 100)
    # the regrown state keeps the model's layers and the engine's slots
    layers = engine.model.config.num_hidden_layers
    assert states.num_layers == layers and states.output.shape[0] == layers
    assert states.indices.shape[:2] == (layers, states.num_slots + 1)
    out = engine.generate([list(range(1, 40))], SamplingParams(max_new_tokens=3))
    assert len(out[0].output_token_ids) == 3


@pytest.mark.parametrize("graphs", [None, GraphSettings(buckets=(1, 2), capture=False)])
def test_sparse_decode_runs_when_rounding_adds_selected_keys(graphs):
    """Sparse decode alone at a grid retention (0.4) with 16-token blocks: a request of
    28 + 6 tokens (max_context 34) reads block tables of 48 positions, which select 20
    keys, more than the bucket of 16 sized from 34 (14 keys). The torch reference source
    refused the bucket in the first loop-2 step, eager or on the graph runner's buffers."""
    config = FlashLoopConfig(sparse_decode_attention={"enabled": True, "key_retention": 0.4})
    request = SupportRequest(head_dim=16, block_size=16, num_q_heads=4, num_kv_heads=2)
    backend = Registry.discover().create("flashloop", request, config)
    engine = Engine(
        tiny_model(seed=5),
        backend,
        num_blocks=32,
        block_size=16,
        max_context=34,
        cuda_graphs=graphs,
    )
    prompt = [(7 * i + 3) % 61 for i in range(28)]
    (result,) = engine.generate([prompt], SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert len(result.output_token_ids) == 6
    assert int(backend.states.missing_reference) == 0  # every later loop had its reference
    if graphs is not None:
        assert engine.graphs.stats()["eager_steps"] > 0  # decode steps on the fixed buffers
