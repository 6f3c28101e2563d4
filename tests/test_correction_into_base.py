"""``correction_into_base``: a loop 3-4 correction writes the rows it serves into the
batch's base output in place, so the backend launches no ``where`` after it. Every
implementation declaring it gives, bit for bit, the plain correction at the rows it serves
and the base elsewhere."""

from __future__ import annotations

import pytest
import torch

from flashloop_backend.capabilities import Capability
from flashloop_backend.kernels.op_inputs import CorrectionInputs, PackedCorrectionInputs, into_base
from flashloop_backend.kernels.op_protocols import OpName
from flashloop_backend.kernels.validate import correction_target
from tests.test_kernels_triton import _case
from tests.test_packed_kv import _sparse_case

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _into_base(fn, args, state, rows: int, heads: int, dim: int, dtype) -> None:
    """``fn(*args, *state)`` into a base at alternate rows equals the plain call there and
    leaves the base's other rows untouched, bit for bit."""
    plain = fn(*args, *state)
    base = torch.randn((rows, heads, dim), dtype=torch.float32).to(DEVICE, dtype)
    serves = (torch.arange(rows) % 2 == 0).to(DEVICE)
    kept = base.clone()
    got = fn(*args, *state, base=base, serves=serves)
    assert got.data_ptr() == base.data_ptr()
    assert torch.equal(got[serves], plain[serves])
    assert torch.equal(got[~serves], kept[~serves])


@pytest.mark.parametrize("provider", ["torch_reference", "triton"])
def test_a_bf16_cache_correction_writes_its_rows_into_the_base(provider, rng):
    from flashloop_backend.kernels.torch_ref.sparse_decode import dense_source, sparse_correction
    from flashloop_backend.kernels.triton.sparse_decode import sparse_correction_triton

    q, kc, vc, tables, lengths = _case(rng, 4, 2, torch.float32)
    _, idx, mass, ref_out, contribution = dense_source(q, kc, vc, tables, lengths, 0.3, 32)
    fn = sparse_correction if provider == "torch_reference" else sparse_correction_triton
    state = (idx, mass, ref_out, contribution)
    _into_base(fn, (q, kc, vc, tables), state, *q.shape, q.dtype)


@pytest.mark.parametrize("provider", ["torch_reference", "triton"])
def test_a_packed_correction_writes_its_rows_into_the_base(provider, rng):
    from flashloop_backend.kernels.torch_ref.packed import (
        packed_dense_source,
        packed_sparse_correction,
    )
    from flashloop_backend.kernels.triton.packed_sparse import packed_sparse_correction_triton

    args, lengths = _sparse_case(rng)
    _, indices, mass, output, contribution = packed_dense_source(*args, lengths, 0.25, 16)
    fn = (
        packed_sparse_correction
        if provider == "torch_reference"
        else packed_sparse_correction_triton
    )
    q = args[0]
    _into_base(fn, args, (indices, mass, output, contribution), *q.shape, q.dtype)


@pytest.mark.gpu
@pytest.mark.parametrize(("levels", "sparse"), [(3, False), (4, True)])
def test_the_cuda_correction_writes_its_rows_into_the_base(levels, sparse):
    from flashloop_backend.kernels.cuda.packed_selected import packed_sparse_correction_cuda
    from flashloop_backend.kernels.torch_ref.packed import packed_dense_source
    from flashloop_backend.kv.levels import level_metadata
    from tests.test_cuda_kernels import _packed_rows

    args, lengths = _packed_rows(levels, sparse)
    q, store, layer, _, cache_k, cache_v, tables = args
    two = level_metadata(store, [0, 1, 2], [1, 1, 1], "cuda")
    _, indices, mass, output, contribution = packed_dense_source(
        q, store, layer, two, cache_k, cache_v, tables, lengths, 0.1, 128
    )
    state = (indices, mass, output, contribution)
    _into_base(packed_sparse_correction_cuda, args, state, *q.shape, q.dtype)


def test_a_base_names_what_it_must_be():
    q = torch.zeros(3, 2, 16)
    serves = torch.ones(3, dtype=torch.bool)
    with pytest.raises(ValueError, match="base and serves go together"):
        correction_target(q, torch.zeros_like(q), None)
    with pytest.raises(ValueError, match=r"base must be contiguous \(3, 2, 16\) torch.float32"):
        correction_target(q, torch.zeros(3, 2, 16, dtype=torch.float16), serves)
    with pytest.raises(ValueError, match="contiguous: False"):
        correction_target(q, torch.zeros(3, 16, 2).transpose(1, 2), serves)
    with pytest.raises(ValueError, match=r"serves must be \[3\] bool; got \(3,\) torch.int64"):
        correction_target(q, torch.zeros_like(q), torch.ones(3, dtype=torch.int64))
    assert correction_target(q, None, None).shape == q.shape
    from flashloop_backend.kernels.triton.paged_decode import merge_splits

    parts = (torch.zeros(3, 2, 1, 16), torch.zeros(3, 2, 1), torch.zeros(3, 2, 1))
    with pytest.raises(ValueError, match=r"serves must be \[3\] bool; got \(2,\) torch.bool"):
        merge_splits(*parts, torch.zeros_like(q), serves=torch.ones(2, dtype=torch.bool))


def test_correction_inputs_carry_a_base_only_with_its_rows():
    q = torch.zeros(2, 2, 16)
    fields = (q, q, q, q, q, q, q, q)
    with pytest.raises(ValueError, match="base and serves go together"):
        CorrectionInputs(*fields, base=q)
    plain = CorrectionInputs(*fields)
    assert plain.base_keywords() == {}
    serves = torch.ones(2, dtype=torch.bool)
    merged = into_base(plain, q, serves)
    assert merged.base is q and merged.serves is serves
    packed = into_base(PackedCorrectionInputs(None, plain), q, serves)
    assert packed.paged.base is q and packed.paged.serves is serves
    seen = {}
    merged.call(lambda *args, **kwargs: seen.update(kwargs))
    assert seen == {"base": q, "serves": serves}


def test_every_in_repo_correction_declares_it():
    """The in-repo providers' corrections merge into the base; their other ops do not
    claim it."""
    from flashloop_backend.registry import Registry

    registry = Registry.discover()
    for name in ("torch_reference", "triton", "cuda"):
        provider = registry.kernels.get(name)
        if provider is None:
            continue
        for op, impl in provider.impls.items():
            declared = Capability.CORRECTION_INTO_BASE in impl.support.capabilities
            correction = op in (OpName.SPARSE_CORRECTION, OpName.PACKED_CORRECTION)
            assert declared == correction, (name, op)
