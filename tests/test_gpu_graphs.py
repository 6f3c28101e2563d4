"""CUDA graphs through the host on the GPU: the evidence behind ``cuda_graphs`` and
``graph_safe_sparse``. Every feature combination of configs/all_on.json on the embedded
model, several requests at different depths in bucketed batches with padding rows:
replays equal the same traversal run eagerly on the graph's buffers (bit for bit), and
agree with the plain eager engine (other shapes: other split counts) as bf16 runs do."""

import json
from pathlib import Path

import pytest
import torch

from flashloop_backend import FlashLoopConfig, embedded_model_path
from flashloop_backend.capabilities import Capability, SupportRequest
from flashloop_backend.host import Engine, SamplingParams, load_model, load_tokenizer
from flashloop_backend.host.graphs import GraphSettings
from flashloop_backend.registry import Registry
from flashloop_backend.tools.grid import feature_combinations

pytestmark = pytest.mark.gpu
ALL_ON = Path(__file__).resolve().parents[1] / "configs" / "all_on.json"
COMBOS = feature_combinations(FlashLoopConfig.from_dict(json.loads(ALL_ON.read_text())))
BUCKETS = (1, 2, 4)


def _prompts() -> list[list[int]]:
    tokenizer = load_tokenizer(embedded_model_path())
    text = "def merge(a, b):\n    out = []\n    while a and b:\n        out.append(a.pop(0))\n" * 4
    tokens = [256, *tokenizer.encode(text).ids]
    return [tokens[:150], tokens[20:120], tokens[5:200]]  # packed groups, a BF16 tail, mixed depths


def _engine(model, name, config, graphs):
    request = SupportRequest(
        "cuda", torch.bfloat16, 128, 16, 2, 2, frozenset({Capability.CUDA_GRAPHS})
    )
    backend = Registry.discover().create(name, request, config)
    return Engine(model, backend, num_blocks=512, prefill_chunk=128, cuda_graphs=graphs)


@pytest.mark.parametrize(
    ("name", "config"),
    [pytest.param("triton", FlashLoopConfig(), id="dense_triton")]
    + [pytest.param("flashloop", c, id="+".join(f) or "flashloop_dense") for f, c in COMBOS],
)
def test_replay_equals_eager_on_its_buffers(name, config):
    model = load_model(embedded_model_path(), "cuda", torch.bfloat16)
    prompts = _prompts()
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    forced = [p[-16:] for p in prompts]
    runs = {}
    for label, graphs in (
        ("replay", GraphSettings(buckets=BUCKETS, max_context=512)),
        ("buffers", GraphSettings(buckets=BUCKETS, max_context=512, capture=False)),
        ("plain", None),
    ):
        engine = _engine(model, name, config, graphs)
        tokens = None  # free-running tokens of the plain engine are not compared (other shapes)
        if graphs is not None:
            tokens = [r.output_token_ids for r in engine.generate(prompts, params)]
        logprobs = engine.generate(prompts, forced=forced, keep_logprobs=True)
        runs[label] = (tokens, torch.stack([r.logprobs for r in logprobs]))
        if label == "replay":
            stats = engine.graphs.stats()
            assert stats["replays"] > 0 and stats["graphs"], stats
            assert set(stats["fallbacks"]) <= {"the step has prefill rows"}, stats
    (tokens, logprobs), (eager_tokens, eager_logprobs) = runs["replay"], runs["buffers"]
    assert tokens == eager_tokens, ("replay vs eager on the same buffers", tokens, eager_tokens)
    diff = (logprobs - eager_logprobs).abs().max().item()
    assert diff == 0.0, f"replayed log-probs differ from eager on the same buffers by {diff}"
    # the plain engine's shapes differ (natural table widths, no padding: other split counts)
    plain = runs["plain"][1]
    agreement = (logprobs.argmax(-1) == plain.argmax(-1)).float().mean().item()
    kl = (plain.exp() * (plain - logprobs)).sum(-1).mean().item()
    assert agreement >= 0.95 and kl < 0.02, (agreement, kl)


def test_flashinfer_is_refused_for_capture_by_name():
    request = SupportRequest("cuda", torch.bfloat16, 128, 16, 2, 2)
    backend = Registry.discover().create("flashinfer", request, FlashLoopConfig())
    model = load_model(embedded_model_path(), "cuda", torch.bfloat16)
    with pytest.raises(Exception, match="does not declare 'cuda_graphs'"):
        Engine(model, backend, cuda_graphs=GraphSettings())


def test_capabilities_report_graphs_on_the_gpu():
    registry = Registry.discover()
    spec = registry.backends["flashloop"]
    for _, config in COMBOS:
        caps = spec.capabilities(registry, config, registry.env, "cuda")
        assert {Capability.CUDA_GRAPHS, Capability.GRAPH_SAFE_SPARSE} <= caps
