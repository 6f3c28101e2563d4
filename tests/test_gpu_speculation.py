"""Speculation on the H200 gives the tokens of plain greedy decoding. The embedded model
runs in FP32, so that batching a block's verification rows cannot flip an argmax through
last-bit differences. Cases: dense, token-sparse prefill, KV quantization (`fixed_prompt`,
the packed readers), sparse decode (each row's own loop-2 reference) and all three. Draft
and verification rows replay from CUDA graphs (a block of two requests' rows fits the
largest bucket)."""

import pytest
import torch

from flashloop_backend import FlashLoopConfig, embedded_model_path
from flashloop_backend.capabilities import Capability, SupportRequest
from flashloop_backend.host import Engine, SamplingParams, load_model, load_tokenizer
from flashloop_backend.host.graphs import GraphSettings
from flashloop_backend.host.speculation import SpeculationSettings
from flashloop_backend.registry import Registry

pytestmark = pytest.mark.gpu
SPARSE_PREFILL = {"enabled": True, "window_size": 64, "retention": [1, 1, 0.75, 0.5]}
PACKED = {"enabled": True, "policy": "fixed_prompt", "group_size": 64}
SPARSE = {"enabled": True, "key_retention": 0.25}
CONFIGS = {
    "dense": FlashLoopConfig(),
    "token_sparse_prefill": FlashLoopConfig.from_dict({"token_sparse_prefill": SPARSE_PREFILL}),
    "kv_residual_quantization": FlashLoopConfig.from_dict({"kv_residual_quantization": PACKED}),
    "sparse_decode_attention": FlashLoopConfig.from_dict({"sparse_decode_attention": SPARSE}),
    "all_on": FlashLoopConfig.from_dict(
        {
            "token_sparse_prefill": SPARSE_PREFILL,
            "sparse_decode_attention": SPARSE,
            "kv_residual_quantization": PACKED,
        }
    ),
}


def _engine(model, config, speculation=None, backend_name="flashloop"):
    request = SupportRequest(
        "cuda", torch.float32, 128, 16, 2, 2, frozenset({Capability.CUDA_GRAPHS})
    )
    backend = Registry.discover().create(backend_name, request, config)
    graphs = GraphSettings(buckets=(1, 2, 4, 8), max_context=512)
    return Engine(
        model,
        backend,
        num_blocks=512,
        prefill_chunk=128,
        cuda_graphs=graphs,
        speculation=speculation,
    )


@pytest.mark.parametrize("name", list(CONFIGS))
def test_speculation_on_the_gpu_gives_the_greedy_tokens(name):
    model = load_model(embedded_model_path(), "cuda", torch.float32)
    tokenizer = load_tokenizer(embedded_model_path())
    text = "def merge(a, b):\n    out = []\n    while a and b:\n        out.append(a.pop(0))\n"
    prompts = [[256, *tokenizer.encode(text * 2).ids], [256, *tokenizer.encode("import os\n").ids]]
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    plain = _engine(model, CONFIGS[name]).generate(prompts, params)
    engine = _engine(model, CONFIGS[name], SpeculationSettings(block_size=4))
    speculative = engine.generate(prompts, params)
    assert [r.output_token_ids for r in speculative] == [r.output_token_ids for r in plain]
    assert engine.graphs.replays > 0 and engine.counters()["speculation_accepted"] > 0
    assert not engine.graphs.fallbacks  # every draft and verification step replayed


def test_grouped_verification_rows_on_triton_give_the_greedy_tokens():
    """The dense Triton backend computes each block's verification rows in one program
    (grouped_verify_rows); two requests verify in one step. With a draft confidence the
    blocks stop at unsure drafts, so the groups hold 1 to 4 rows."""
    model = load_model(embedded_model_path(), "cuda", torch.float32)
    tokenizer = load_tokenizer(embedded_model_path())
    text = "class Stack:\n    def push(self, item):\n        self.items.append(item)\n"
    prompts = [[256, *tokenizer.encode(text * 3).ids], [256, *tokenizer.encode(text).ids]]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    plain = _engine(model, FlashLoopConfig(), backend_name="triton").generate(prompts, params)
    engine = _engine(model, FlashLoopConfig(), SpeculationSettings(block_size=4), "triton")
    assert Capability.GROUPED_VERIFY_ROWS in engine.backend.impl.support.capabilities
    speculative = engine.generate(prompts, params)
    assert [r.output_token_ids for r in speculative] == [r.output_token_ids for r in plain]
    assert engine.graphs.verify_rows == 4 and engine.counters()["speculation_accepted"] > 0
    assert not engine.graphs.fallbacks
    unsure = SpeculationSettings(block_size=4, draft_confidence=0.8)
    engine = _engine(model, FlashLoopConfig(), unsure, "triton")
    speculative = engine.generate(prompts, params)
    assert [r.output_token_ids for r in speculative] == [r.output_token_ids for r in plain]
    assert engine.counters()["speculation_stopped"] > 0 and not engine.graphs.fallbacks
