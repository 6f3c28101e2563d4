"""Kernel variants across batch shapes: an eager host's batches change their row count,
split count and the offset of their per-row lengths from step to step, and each new
specialization key is a compile on the GPU. The census computes, under the interpreter,
the key the NVIDIA backend's JIT would compile each launch under."""

import os
from contextlib import contextmanager

import pytest
import torch

from flashloop_backend.kernels.triton.paged_decode import paged_attention_triton
from flashloop_backend.kernels.triton.specialization import (
    specialization_census,
    varying_arguments,
)

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the census reads interpreter launches"
)


def _launch(rng, rows: int, splits: int, offset: int) -> None:
    """Paged decode of ``rows`` rows over ``splits`` splits, selection statistics on (the
    merge stores the LSE), its lengths a slice at ``offset`` of a longer tensor."""
    heads, dim, block = 4, 16, 16
    kc = torch.randn(8, block, heads, dim, generator=rng)
    vc = torch.randn(8, block, heads, dim, generator=rng)
    q = torch.randn(rows, heads, dim, generator=rng)
    tables = torch.arange(rows * 4, dtype=torch.int32).reshape(rows, 4) % 8
    lengths = torch.full((offset + rows,), 50, dtype=torch.int32)[offset:]
    logits = torch.zeros(rows, heads, 64)
    lse = torch.zeros(rows, heads)
    paged_attention_triton(q, kc, vc, tables, lengths, num_splits=splits, logits=logits, lse=lse)


def test_split_count_and_a_lengths_slice_do_not_compile_new_variants(rng):
    """3 to 40 splits, 1 to 3 rows, lengths aligned or not: one variant each. With the
    split count (or its padded width) a constexpr and the split state's strides and the
    lengths' alignment specialized, both kernels compiled again for these shapes: a
    context longer than the warm-up's then loaded a merge variant while serving."""
    with specialization_census() as census:
        shapes = [(1, 3, 0), (3, 4, 1), (2, 3, 3), (3, 3, 0), (1, 4, 2), (1, 20, 0), (1, 40, 1)]
        for rows, splits, offset in shapes:
            _launch(rng, rows, splits, offset)
    for kernel in ("merge_splits_kernel", "paged_attention_split_kernel"):
        keys = list(census[kernel])
        assert len(keys) == 1, f"{kernel}: {varying_arguments(keys)}"


def test_the_census_sees_a_constexpr_change(rng):
    """The census is not blind: a merge that also stores the LSE is a different variant."""
    from flashloop_backend.kernels.triton.paged_decode import merge_splits, split_buffers

    with specialization_census() as census:
        for lse in (None, torch.zeros(2, 4)):
            parts = split_buffers(2, 4, 3, 16, torch.device("cpu"))
            for t in parts:
                t.copy_(torch.randn(t.shape, generator=rng))
            merge_splits(*parts, torch.zeros(2, 4, 16), lse)
    keys = list(census["merge_splits_kernel"])
    assert len(keys) == 2
    assert "STORE_LSE" in set(varying_arguments(keys))


def test_every_unspecialized_argument_names_a_parameter_of_its_kernel():
    """A name in ``do_not_specialize`` that the kernel lacks is silently ignored by Triton."""
    import importlib
    import pkgutil

    from triton.runtime.interpreter import InterpretedFunction

    import flashloop_backend.kernels.triton as package

    checked = 0
    for info in pkgutil.iter_modules(package.__path__):
        if not info.name.endswith("_jit"):
            continue
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for name, kernel in vars(module).items():
            if not isinstance(kernel, InterpretedFunction):
                continue
            for option in ("do_not_specialize", "do_not_specialize_on_alignment"):
                listed = set(kernel.kwargs.get(option) or ())
                assert listed <= set(kernel.arg_names), f"{name}.{option}: {listed}"
                checked += bool(listed)
    assert checked >= 8


@pytest.fixture
def triton_on_cpu():
    """The Triton provider's declarations widened to CPU tensors (as the census script
    does), put back afterwards: other tests must keep choosing the torch reference."""
    from flashloop_backend.capabilities.support import Support
    from flashloop_backend.kernels import triton as triton_kernels

    supports = [v for v in vars(triton_kernels).values() if isinstance(v, Support)]
    saved = [s.devices for s in supports]
    for support in supports:
        object.__setattr__(support, "devices", support.devices | {"cpu"})
    yield
    for support, devices in zip(supports, saved, strict=True):
        object.__setattr__(support, "devices", devices)


class _LaunchOnlyCapture:
    """Graph capture that keeps nothing: the capture's own launches happen, a replay
    launches nothing, as with a CUDA graph (tokens are not checked here)."""

    class _Graph:
        def replay(self) -> None:
            pass

    def reserved(self) -> int:
        return 0

    def new_graph(self) -> "_LaunchOnlyCapture._Graph":
        return self._Graph()

    @contextmanager
    def capturing(self, graph):
        yield


@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graphs"])
def test_a_mixed_workload_after_the_engine_warm_up_compiles_nothing_new(triton_on_cpu, graphed):
    """``Engine.warm_up`` meets every Triton specialization a later mixed workload needs
    (all on, every op the Triton provider implements, the embedded model): prompts of 30
    to 300 tokens decoding together, then a prompt of 480 alone, add no key, so a GPU
    would compile nothing while serving them. With graphs (buckets 1, 2, 4, as ``tests/test_gpu_compiles.py``),
    decode steps replay and only mixed steps launch, at block-table widths the warm-up's
    captures did not use."""
    import random
    from pathlib import Path

    from flashloop_backend import embedded_model_path
    from flashloop_backend.config import load_config
    from flashloop_backend.host import Engine, SamplingParams, load_model
    from flashloop_backend.host.graphs import GraphSettings
    from flashloop_backend.registry import Registry

    config = load_config(Path(__file__).resolve().parents[1] / "configs" / "all_on.json")
    ops = {op.value: "triton" for op in Registry.discover().kernels["triton"].impls}
    config = config.model_copy(update={"kernel_overrides": ops})
    model = load_model(embedded_model_path(), "cpu", torch.float32)
    backend = Registry.discover().create("flashloop", model.support_request(16), config)
    graphs = {}
    if graphed:
        graphs = {
            "cuda_graphs": GraphSettings(buckets=(1, 2, 4), max_context=512),
            "graph_capture": _LaunchOnlyCapture(),
        }
    engine = Engine(model, backend, num_blocks=2048, prefill_chunk=128, max_context=512,
                    max_slots=4, **graphs)  # fmt: skip
    rng = random.Random(0)
    vocab = model.config.vocab_size
    with specialization_census() as census:
        engine.warm_up()
        warmed = {name: set(keys) for name, keys in census.items()}
        for size in (3, 1, 4, 2) if graphed else (4,):
            prompts = [
                [rng.randrange(vocab) for _ in range(rng.randint(30, 300))] for _ in range(size)
            ]
            engine.generate(prompts, SamplingParams(max_new_tokens=9, ignore_eos=True))
        # a long prompt alone: its chunks' few query tiles split their keys over programs
        long_prompt = [rng.randrange(vocab) for _ in range(480)]
        engine.generate([long_prompt], SamplingParams(max_new_tokens=9, ignore_eos=True))
    new = {
        name: varying_arguments([*warmed.get(name, ()), *(set(keys) - warmed.get(name, set()))])
        for name, keys in census.items()
        if set(keys) - warmed.get(name, set())
    }
    assert not new, f"new Triton variants while serving, by kernel and varying argument: {new}"
    assert len(warmed) >= 8  # the census saw the packed, selection and layer kernels
    if graphed:
        assert engine.graphs.stats()["replays"] > 0
