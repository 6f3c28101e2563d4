"""Compile at start, never while serving (on the GPU): after ``Engine.warm_up`` a mixed
workload of all on (configs/all_on.json, the embedded model, CUDA graphs) loads no new
Triton variant, builds no new CUDA kernel and captures no new graph. The CPU census
(``tests/test_specialization.py``) predicts the Triton keys; this counts what the GPU
stack really does."""

import json
import random
from pathlib import Path

import pytest
import torch

from flashloop_backend import FlashLoopConfig, embedded_model_path
from flashloop_backend.capabilities import Capability, SupportRequest
from flashloop_backend.host import Engine, SamplingParams, load_model
from flashloop_backend.host.graphs import GraphSettings
from flashloop_backend.registry import Registry

pytestmark = pytest.mark.gpu
ALL_ON = Path(__file__).resolve().parents[1] / "configs" / "all_on.json"


class _TritonLoads:
    """Triton's in-memory cache misses (a compile, or a load from its disk cache) through
    the runtime's cache hook, while installed: per kernel, each variant as {argument:
    type, specialization attributes or constexpr value} plus its launch options."""

    def __init__(self) -> None:
        self.variants: dict[str, list[dict[str, str]]] = {}

    def __call__(self, **hook) -> bool:
        compile = hook["compile"]
        names = list(compile["signature"])
        variant = {name: str(kind) for name, kind in compile["signature"].items()}
        for path, value in compile["constants"].items():
            variant[names[path[0]]] = f"={value}"
        for path, attrs in compile["configs"][0].items():
            variant[names[path[0]]] += str(attrs)
        variant["options"] = f"warps={compile['num_warps']} stages={compile['num_stages']}"
        self.variants.setdefault(hook["fn"].name, []).append(variant)
        return False  # compile as usual

    def __enter__(self):
        from triton import knobs

        self._saved = knobs.runtime.jit_cache_hook
        knobs.runtime.jit_cache_hook = self
        return self

    def __exit__(self, *exc) -> None:
        from triton import knobs

        knobs.runtime.jit_cache_hook = self._saved


def _unmet(warmed: _TritonLoads, loaded: _TritonLoads) -> dict[str, list[dict]]:
    """Per kernel loaded while serving, how each new variant differs from the nearest
    variant the warm-up loaded: the arguments whose specialization the warm-up missed."""
    out = {}
    for name, variants in loaded.variants.items():
        seen = warmed.variants.get(name, [])
        for new in variants:
            near = min(
                seen, key=lambda old: sum(old.get(k) != v for k, v in new.items()), default={}
            )
            diff = {k: (near.get(k), v) for k, v in new.items() if near.get(k) != v}
            out.setdefault(name, []).append(diff)
    return out


def test_a_mixed_workload_after_warm_up_compiles_builds_and_captures_nothing():
    from flashloop_backend.kernels.cuda import loader

    config = FlashLoopConfig.from_dict(json.loads(ALL_ON.read_text()))
    model = load_model(embedded_model_path(), "cuda", torch.bfloat16)
    request = SupportRequest(
        "cuda", torch.bfloat16, 128, 16, 2, 2, frozenset({Capability.CUDA_GRAPHS})
    )
    backend = Registry.discover().create("flashloop", request, config)
    graphs = GraphSettings(buckets=(1, 2, 4), max_context=512)
    engine = Engine(model, backend, num_blocks=2048, prefill_chunk=128, max_context=512,
                    max_slots=4, cuda_graphs=graphs)  # fmt: skip
    with _TritonLoads() as warmed:
        engine.warm_up()
    builds = loader._build_file.cache_info().misses
    captured = set(engine.graphs.graphs)
    rng = random.Random(0)
    vocab = model.config.vocab_size
    with _TritonLoads() as loads:
        for size in (3, 1, 4, 2):
            prompts = [
                [rng.randrange(vocab) for _ in range(rng.randint(30, 300))] for _ in range(size)
            ]
            engine.generate(prompts, SamplingParams(max_new_tokens=9, ignore_eos=True))
        # a long prompt alone: its chunks' few query tiles split their keys over programs
        long_prompt = [rng.randrange(vocab) for _ in range(480)]
        engine.generate([long_prompt], SamplingParams(max_new_tokens=9, ignore_eos=True))
        torch.cuda.synchronize()
    assert not loads.variants, (
        f"Triton variants loaded while serving (argument: (warm-up's, new)): "
        f"{_unmet(warmed, loads)}"
    )
    assert loader._build_file.cache_info().misses == builds, "CUDA kernels built while serving"
    assert set(engine.graphs.graphs) == captured, (
        f"graphs captured while serving: {sorted(set(engine.graphs.graphs) - captured)}"
    )
