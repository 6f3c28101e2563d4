"""Kernel variants across batch shapes: an eager host's batches change their row count,
split count and the offset of their per-row lengths from step to step, and each new
specialization key is a compile on the GPU. The census computes, under the interpreter,
the key the NVIDIA backend's JIT would compile each launch under."""

import os

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
    """3 and 4 splits (one padded width), 1 to 3 rows, lengths aligned or not: one variant
    each. With the split count a constexpr and the split state's strides and the lengths'
    alignment specialized, both kernels compiled again for these shapes."""
    with specialization_census() as census:
        for rows, splits, offset in [(1, 3, 0), (3, 4, 1), (2, 3, 3), (3, 3, 0), (1, 4, 2)]:
            _launch(rng, rows, splits, offset)
    for kernel in ("merge_splits_kernel", "paged_attention_split_kernel"):
        keys = list(census[kernel])
        assert len(keys) == 1, f"{kernel}: {varying_arguments(keys)}"


def test_the_census_sees_a_constexpr_change(rng):
    """The census is not blind: a different padded split width is a different variant."""
    with specialization_census() as census:
        _launch(rng, 2, 3, 0)
        _launch(rng, 2, 8, 0)
    keys = list(census["merge_splits_kernel"])
    assert len(keys) == 2
    assert set(varying_arguments(keys)) == {"SPLITS_PAD"}


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
