"""Typed op inputs: each op takes one frozen inputs class, which calls an implementation with
the op protocol's arguments in order; a ``KernelImpl`` refuses another op's inputs; every
in-tree implementation names its arguments as the protocol does."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from flashloop_backend.kernels import (
    OP_INPUTS,
    CorrectionInputs,
    DenseSource,
    KernelImpl,
    OpName,
    PackedCorrectionInputs,
    PackedDecode,
    PackedDecodeInputs,
    PackedDenseSource,
    PackedKV,
    PackedSourceInputs,
    PackedSparseCorrection,
    PagedAttention,
    PagedInputs,
    SourceInputs,
    SourceOutputs,
    SparseCorrection,
    over_packed,
)
from flashloop_backend.kernels.torch_ref import SUPPORT

PROTOCOL = {
    PagedInputs: PagedAttention,
    SourceInputs: DenseSource,
    CorrectionInputs: SparseCorrection,
    PackedDecodeInputs: PackedDecode,
    PackedSourceInputs: PackedDenseSource,
    PackedCorrectionInputs: PackedSparseCorrection,
}
PAGED_OF = {
    PackedDecodeInputs: PagedInputs,
    PackedSourceInputs: SourceInputs,
    PackedCorrectionInputs: CorrectionInputs,
}


def _argument_names(fn) -> list[str]:
    params = inspect.signature(fn).parameters.values()
    return [p.name for p in params if p.name != "self"]


def _sentinels(cls) -> tuple[object, dict[str, object]]:
    """An instance of ``cls`` whose every leaf field holds its own sentinel, and the
    sentinels by field name (a packed class's ``kv`` and ``paged`` fields flattened)."""
    if cls in PAGED_OF:
        kv = PackedKV(store="store", layer="layer", meta="meta")
        paged, named = _sentinels(PAGED_OF[cls])
        named |= {f.name: getattr(kv, f.name) for f in dataclasses.fields(PackedKV)}
        own = {f.name: f"<{f.name}>" for f in dataclasses.fields(cls)[2:]}  # after kv, paged
        return cls(kv, paged, **own), named | own
    named = {f.name: f"<{f.name}>" for f in dataclasses.fields(cls)}
    return cls(**named), named


def test_every_op_but_the_kv_write_has_an_inputs_class():
    assert set(OP_INPUTS) == set(OpName) - {OpName.PACKED_KV_WRITE}
    assert set(OP_INPUTS.values()) == set(PROTOCOL)


@pytest.mark.parametrize("cls", list(PROTOCOL), ids=lambda c: c.__name__)
def test_inputs_call_the_implementation_in_the_protocols_order(cls):
    inputs, named = _sentinels(cls)
    seen, keywords = [], []

    def fn(*args, **kwargs):
        seen.append(args)
        keywords.append(kwargs)
        return ("out", "indices", "mass", "output", "contribution")

    inputs.call(fn)
    expected = [named[name] for name in _argument_names(PROTOCOL[cls].__call__)]
    assert list(seen[0]) == expected
    # verification groups, a correction's base and a source's statistics stream travel by
    # keyword, to a kernel declaring grouped_verify_rows, correction_into_base,
    # host_sequence_plan, span_prefill or statistics_stream only
    by_keyword = {
        PagedInputs: {
            "row_spans": "<row_spans>",
            "max_span": "<max_span>",
            "sequence_plan": "<sequence_plan>",
            "span_plan": "<span_plan>",
        },
        CorrectionInputs: {"base": "<base>", "serves": "<serves>"},
        PackedCorrectionInputs: {"base": "<base>", "serves": "<serves>"},
        PackedSourceInputs: {"statistics_stream": "<statistics_stream>"},
    }
    assert keywords[0] == by_keyword.get(cls, {})
    if cls is PagedInputs:
        dataclasses.replace(inputs, row_spans=None, sequence_plan=None, span_plan=None).call(fn)
        assert keywords[1] == {} and list(seen[1]) == expected
        dataclasses.replace(inputs, row_spans=None, span_plan=None).call(fn)
        assert keywords[2] == {"sequence_plan": "<sequence_plan>"}
        dataclasses.replace(inputs, row_spans=None, sequence_plan=None).call(fn)
        assert keywords[3] == {"span_plan": "<span_plan>"}
    if cls is CorrectionInputs:
        dataclasses.replace(inputs, base=None, serves=None).call(fn)
        assert keywords[1] == {} and list(seen[1]) == expected


def test_an_impl_refuses_another_ops_inputs_and_the_kv_write_takes_none():
    def fn(*args):
        raise AssertionError("not called")

    source = KernelImpl(OpName.DENSE_SOURCE, fn, SUPPORT)
    paged, _ = _sentinels(PagedInputs)
    with pytest.raises(TypeError, match="op 'dense_source' takes SourceInputs; got PagedInputs"):
        source(paged)
    write = KernelImpl(OpName.PACKED_KV_WRITE, fn, SUPPORT)
    with pytest.raises(TypeError, match="'packed_kv_write' takes no inputs object"):
        write(paged)


def test_over_packed_gives_each_paged_ops_packed_version():
    kv = PackedKV(store="store", layer=0, meta="meta")
    for packed, paged in PAGED_OF.items():
        inputs, _ = _sentinels(paged)
        assert over_packed(kv, inputs) == packed(kv, inputs)


def _in_tree_functions():
    from flashloop_backend.kernels import torch_ref, triton
    from flashloop_backend.kernels.cuda.packed_selected import packed_sparse_correction_cuda
    from flashloop_backend.kernels.cuda.packed_source import packed_dense_source_cuda
    from flashloop_backend.kernels.cuda.packed_stream import packed_decode_cuda
    from flashloop_backend.kernels.flashinfer import paged_attention_flashinfer
    from flashloop_backend.kernels.triton import dense_source, packed_sparse, sparse_decode
    from flashloop_backend.kernels.triton.packed_decode import packed_decode_triton
    from flashloop_backend.kernels.triton.paged_decode import paged_attention_triton
    from flashloop_backend.kernels.triton.sparse_prefill import sparse_prefill_triton

    found = [(impl.op, impl.fn) for impl in torch_ref.provider().impls.values()]
    found += [(impl.op, impl.fn) for impl in triton.provider().impls.values()]
    found += [
        (OpName.DENSE_ATTENTION, paged_attention_flashinfer),
        (OpName.DENSE_ATTENTION, paged_attention_triton),
        (OpName.SPARSE_PREFILL, sparse_prefill_triton),
        (OpName.DENSE_SOURCE, dense_source.dense_source_triton),
        (OpName.SPARSE_CORRECTION, sparse_decode.sparse_correction_triton),
        (OpName.PACKED_DECODE, packed_decode_triton),
        (OpName.PACKED_SOURCE, packed_sparse.packed_dense_source_triton),
        (OpName.PACKED_CORRECTION, packed_sparse.packed_sparse_correction_triton),
        (OpName.PACKED_DECODE, packed_decode_cuda),
        (OpName.PACKED_SOURCE, packed_dense_source_cuda),
        (OpName.PACKED_CORRECTION, packed_sparse_correction_cuda),
    ]
    return [(op, fn) for op, fn in found if op in OP_INPUTS]


@pytest.mark.parametrize(
    ("op", "fn"), _in_tree_functions(), ids=lambda x: getattr(x, "__name__", str(x))
)
def test_in_tree_implementations_name_their_arguments_as_the_protocol(op, fn):
    """Named explicitly, an implementation's leading arguments are the protocol's (so
    ``key_retention`` keeps its name from the config to the kernel); lazy wrappers that
    pass ``*args`` on are checked through the functions above."""
    names = _argument_names(fn)
    if "args" in names:
        return
    protocol = _argument_names(PROTOCOL[OP_INPUTS[op]].__call__)
    assert names[: len(protocol)] == protocol


def test_the_reference_source_through_its_impl_returns_named_outputs(rng):
    from flashloop_backend.kernels.torch_ref import provider
    from flashloop_backend.kernels.torch_ref.sparse_decode import dense_source

    kc, vc = torch.randn(2, 6, 4, 2, 16, generator=rng)
    q = torch.randn(3, 4, 16, generator=rng)
    tables = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32)
    lengths = torch.tensor([5, 8, 0], dtype=torch.int32)
    impl = provider().impls[OpName.DENSE_SOURCE]
    result = impl(SourceInputs(q, kc, vc, tables, lengths, key_retention=0.5, k_bucket=8))
    assert isinstance(result, SourceOutputs)
    direct = dense_source(q, kc, vc, tables, lengths, 0.5, 8)
    for got, want in zip(result[:5], direct, strict=True):
        torch.testing.assert_close(got, want)
    assert result.statistics is None  # written on the caller's stream
    assert result.indices.shape == (3, 4, 8) and result.mass.shape == (3, 4)
