"""All eight on/off combinations of the three features run in the host on the CPU
reference kernels, in mixed batches with chunked prefill and padding, and batching is
invisible: a request gives the same tokens alone and among others."""

import itertools

import pytest

from flashloop_backend import FlashLoopConfig
from flashloop_backend.capabilities import SupportRequest
from flashloop_backend.host import Engine, SamplingParams
from flashloop_backend.registry import Registry, resolve

from .host_helpers import tiny_model

REQUEST = SupportRequest(head_dim=16, block_size=4, num_q_heads=4, num_kv_heads=2)
PROMPTS = [[(7 * i + 3) % 61 for i in range(n)] for n in (9, 40, 33)]
FEATURES = {
    "token_sparse_prefill": {"enabled": True, "window_size": 16, "retention": [1, 1, 0.5, 0.25]},
    "sparse_decode_attention": {"enabled": True, "key_retention": 0.3},
    "kv_residual_quantization": {"enabled": True, "group_size": 16},
}
COMBINATIONS = [
    dict(zip(FEATURES, flags, strict=True)) for flags in itertools.product([False, True], repeat=3)
]

COMBINATION_IDS = ["+".join(n for n, on in f.items() if on) or "dense" for f in COMBINATIONS]


def _config(flags: dict[str, bool]) -> FlashLoopConfig:
    return FlashLoopConfig(**{name: FEATURES[name] for name, on in flags.items() if on})


def _engine(model, config, **kwargs):
    backend = Registry.discover().create("flashloop", REQUEST, config)
    return Engine(model, backend, num_blocks=240, block_size=4, prefill_chunk=16, **kwargs)


@pytest.mark.parametrize(
    "flags", COMBINATIONS, ids=COMBINATION_IDS
)  # fmt: skip
def test_combination_runs_and_batching_is_invisible(flags):
    model = tiny_model(seed=7)
    config = _config(flags)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    mixed = _engine(model, config, max_batch_tokens=24, pad_to_multiple=8).generate(PROMPTS, params)
    alone = [_engine(model, config).generate([p], params)[0] for p in PROMPTS]
    assert [r.output_token_ids for r in mixed] == [r.output_token_ids for r in alone]
    assert all(len(r.output_token_ids) == 6 for r in mixed)
    effective = resolve(config, "flashloop", REQUEST)
    assert (effective.kv_encoding is not None) == flags["kv_residual_quantization"]


def test_graph_safety_is_asked_of_the_packed_ops_the_config_routes_to():
    from flashloop_backend.capabilities import Capability
    from flashloop_backend.kernels.op_protocols import OpName

    spec = Registry.discover().backends["flashloop"]
    both = _config({"token_sparse_prefill": False, "sparse_decode_attention": True,
                    "kv_residual_quantization": True})  # fmt: skip
    needs = spec._op_needs(REQUEST.with_required({Capability.GRAPH_SAFE_SPARSE}), both)
    for op in (OpName.PACKED_SOURCE, OpName.PACKED_CORRECTION):
        assert Capability.GRAPH_SAFE_SPARSE in needs[op][1]
    plain = spec._op_needs(REQUEST.with_required({Capability.GRAPH_SAFE_SPARSE}), FlashLoopConfig())
    assert OpName.PACKED_SOURCE not in plain  # nothing routes there without KV quantization


@pytest.mark.parametrize("flags", COMBINATIONS, ids=COMBINATION_IDS)
def test_an_h200_claims_graphs_and_graph_safe_sparse_for_every_combination(flags):
    """Only decode steps are captured, so an eager-only sparse prefill kernel must not take
    ``graph_safe_sparse`` away (it did: the H200 test found no combination claiming it)."""
    from flashloop_backend.capabilities import Capability, Environment

    registry = Registry.discover(Environment(True, (9, 0), "NVIDIA H200"))
    caps = registry.backends["flashloop"].capabilities(registry, _config(flags), registry.env, "cuda")  # fmt: skip
    assert {Capability.CUDA_GRAPHS, Capability.GRAPH_SAFE_SPARSE} <= caps


def test_host_reading_packed_references_do_not_claim_async_scheduling():
    from flashloop_backend.capabilities import Capability

    registry = Registry.discover()
    spec = registry.backends["flashloop"]
    plain = spec.capabilities(registry, FlashLoopConfig(), registry.env, "cpu")
    packed = spec.capabilities(registry, _config({"token_sparse_prefill": False,
                               "sparse_decode_attention": False, "kv_residual_quantization": True}),
                               registry.env, "cpu")  # fmt: skip
    assert Capability.ASYNC_SCHEDULING in plain
    assert Capability.ASYNC_SCHEDULING not in packed and Capability.PACKED_KV_READ in packed
