"""Tensor parallelism over NCCL on two GPUs gives one GPU's greedy tokens, eager and from
CUDA graphs (the all-reduce captured in each rank's graphs). The embedded model runs in
FP32 so that summing partial products in another order cannot flip an argmax. Cases:
dense, each feature alone and all three (`configs/all_on.json`'s settings)."""

import json

import pytest
import torch

from flashloop_backend import FlashLoopConfig, embedded_model_path
from flashloop_backend.capabilities import Capability, SupportRequest
from flashloop_backend.host import Engine, SamplingParams, load_model, load_tokenizer
from flashloop_backend.host.graphs import GraphSettings
from flashloop_backend.host.tensor_parallel import run_ranks
from flashloop_backend.registry import Registry

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (tensor parallel over NCCL)"
    ),
]
ALL_ON = json.load(open("configs/all_on.json"))
CONFIGS = {"dense": {}, **{name: {name: ALL_ON[name]} for name in ALL_ON}, "all_on": ALL_ON}
TEXT = "def merge(a, b):\n    out = []\n    while a and b:\n        out.append(a.pop(0))\n"


def _tokens(model, config: dict, graphs: bool) -> list[list[int]]:
    cfg = model.config
    required = frozenset({Capability.CUDA_GRAPHS}) if graphs else frozenset()
    request = SupportRequest(
        "cuda",
        torch.float32,
        cfg.head_dim,
        16,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        required,
    )
    backend = Registry.discover().create("flashloop", request, FlashLoopConfig.from_dict(config))
    settings = GraphSettings(buckets=(1, 2, 4), max_context=1024) if graphs else None
    engine = Engine(model, backend, num_blocks=512, prefill_chunk=128, cuda_graphs=settings)
    tokenizer = load_tokenizer(embedded_model_path())
    prompts = [[256, *tokenizer.encode(TEXT * 4).ids], [256, *tokenizer.encode("import os\n").ids]]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    return [r.output_token_ids for r in engine.generate(prompts, params)]


def _rank(tp, out_path: str, graphs: bool) -> int:
    model = load_model(embedded_model_path(), "cuda", torch.float32, tp)
    tokens = {name: _tokens(model, config, graphs) for name, config in CONFIGS.items()}
    if tp.rank == 0:
        with open(out_path, "w") as handle:
            json.dump(tokens, handle)
    return 0


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_two_gpus_give_one_gpus_greedy_tokens_for_each_feature(tmp_path, graphs):
    out = tmp_path / "tokens.json"
    assert run_ranks(2, _rank, (str(out), graphs), "cuda") == 0
    ranks = json.loads(out.read_text())
    model = load_model(embedded_model_path(), "cuda", torch.float32)
    for name, config in CONFIGS.items():
        assert ranks[name] == _tokens(model, config, graphs), name
