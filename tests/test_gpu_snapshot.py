"""Snapshot, restore and prefix reuse on the H200: the embedded model in BF16 from CUDA graphs, every
feature combination (the Triton packed readers reading imported pages): a request saved
after 6 tokens and restored into a fresh engine makes the tokens of the uninterrupted
run (one request: the same batch shapes, so the same kernels' plans)."""

import json
from pathlib import Path

import pytest
import torch

from flashloop_backend import FlashLoopConfig, embedded_model_path
from flashloop_backend.capabilities import Capability, SupportRequest
from flashloop_backend.host import Engine, SamplingParams, load_model, load_tokenizer
from flashloop_backend.host.graphs import GraphSettings
from flashloop_backend.host.snapshot import load_snapshot, save_snapshot
from flashloop_backend.registry import Registry
from flashloop_backend.tools.grid import feature_combinations

pytestmark = pytest.mark.gpu
ALL_ON = Path(__file__).resolve().parents[1] / "configs" / "all_on.json"
COMBOS = feature_combinations(FlashLoopConfig.from_dict(json.loads(ALL_ON.read_text())))


def _engine(model, config, prefix_cache=False):
    request = SupportRequest(
        "cuda", torch.bfloat16, 128, 16, 2, 2, frozenset({Capability.CUDA_GRAPHS})
    )
    backend = Registry.discover().create("flashloop", request, config)
    graphs = GraphSettings(buckets=(1,), max_context=512)
    return Engine(
        model,
        backend,
        num_blocks=512,
        prefill_chunk=128,
        cuda_graphs=graphs,
        prefix_cache=prefix_cache,
    )


@pytest.mark.parametrize(
    "config", [c for _, c in COMBOS], ids=["+".join(f) or "dense" for f, _ in COMBOS]
)
def test_a_restored_request_makes_the_uninterrupted_tokens(config, tmp_path):
    model = load_model(embedded_model_path(), "cuda", torch.bfloat16)
    text = "def merge(a, b):\n    out = []\n    while a and b:\n        out.append(a.pop(0))\n" * 3
    prompt = [256, *load_tokenizer(embedded_model_path()).encode(text).ids][:150]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    whole = _engine(model, config).generate([prompt], params)[0]
    engine = _engine(model, config)
    rid = engine.add_request(prompt, params)
    while engine.output_count(rid) < 6 or not engine.at_token_boundary(rid):
        engine.step()
    save_snapshot(engine.snapshot(rid), tmp_path / "r.safetensors")
    fresh = _engine(model, config)
    restored = fresh.restore(load_snapshot(tmp_path / "r.safetensors"))
    done = {}
    while fresh.has_unfinished():
        done.update({r.request_id: r for r in fresh.step()})
    assert done[restored].output_token_ids == whole.output_token_ids
    assert done[restored].exit_depths == whole.exit_depths


@pytest.mark.parametrize(
    "config", [c for _, c in COMBOS], ids=["+".join(f) or "dense" for f, _ in COMBOS]
)
def test_a_prompt_sharing_a_published_prefix_makes_its_lone_tokens(config):
    """Prefix reuse on the H200 from CUDA graphs: the second prompt shares the first's
    128 leading positions (two 64-token windows) and makes the tokens it makes alone."""
    model = load_model(embedded_model_path(), "cuda", torch.bfloat16)
    text = "def merge(a, b):\n    out = []\n    while a and b:\n        out.append(a.pop(0))\n" * 4
    tokens = [256, *load_tokenizer(embedded_model_path()).encode(text).ids]
    first, second = tokens[:150], tokens[:128] + tokens[200:260]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    alone = _engine(model, config).generate([second], params)[0].output_token_ids
    engine = _engine(model, config, prefix_cache=True)
    engine.generate([first], params)
    assert engine.generate([second], params)[0].output_token_ids == alone
    assert engine.prefix_counters()["prefix_reused_tokens"] == 128
