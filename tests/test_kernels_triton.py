"""The Triton paged attention against the torch reference (interpreter on CPU, real on GPU)."""

import dataclasses

import pytest
import torch

from flashloop_backend.kernels.torch_ref.paged import paged_attention
from flashloop_backend.kernels.triton.paged_decode import DecodeTuning, paged_attention_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# CPU runs the interpreter: fp32/fp16 only (its bf16 arithmetic is broken).
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _case(rng, hq, hkv, dtype, dim=16, block=16):
    kc = torch.randn(12, block, hkv, dim, generator=rng).to(DEVICE, dtype)
    vc = torch.randn(12, block, hkv, dim, generator=rng).to(DEVICE, dtype)
    q = torch.randn(5, hq, dim, generator=rng).to(DEVICE, dtype)
    # padded with -1, 0 and a stale id past each row's context; one padding row (length 0)
    tables = torch.tensor(
        [[3, 5, 7, -1], [1, 0, 0, 0], [0, 2, 4, 6], [9, 9, 9, 9], [11, 10, 8, 3]], dtype=torch.int32
    )
    lengths = torch.tensor([40, 3, 64, 0, 49], dtype=torch.int32)
    return q, kc, vc, tables.to(DEVICE), lengths.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("hq", "hkv"), [(2, 2), (4, 2), (6, 2)])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("use_dot", [False, True], ids=["reduce", "dot"])
def test_matches_reference(dtype, hq, hkv, splits, use_dot, rng):
    q, kc, vc, tables, lengths = _case(rng, hq, hkv, dtype)
    tuning = DecodeTuning(use_dot=use_dot, keys_per_iter=32)
    out = paged_attention_triton(q, kc, vc, tables, lengths, num_splits=splits, tuning=tuning)
    ref = paged_attention(q.float(), kc.float(), vc.float(), tables, lengths)
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(out[3], torch.zeros_like(out[3]))  # padding row: finite zeros


def _verify_case(rng, hq, hkv, dtype, dim=16, block=16):
    """Two verification groups (4 and 2 rows, each sharing one table, lengths one apart),
    a single decode row and a padding row between them."""
    kc = torch.randn(12, block, hkv, dim, generator=rng).to(DEVICE, dtype)
    vc = torch.randn(12, block, hkv, dim, generator=rng).to(DEVICE, dtype)
    q = torch.randn(8, hq, dim, generator=rng).to(DEVICE, dtype)
    first, second, single = [3, 5, 7, 1], [0, 2, 4, 6], [11, 10, 8, 9]
    tables = torch.tensor([first] * 4 + [single, [9, 9, 9, 9]] + [second] * 2, dtype=torch.int32)
    lengths = torch.tensor([46, 47, 48, 49, 17, 0, 31, 32], dtype=torch.int32)
    spans = torch.tensor([4, 0, 0, 0, 1, 1, 2, 0], dtype=torch.int32)
    return q, kc, vc, tables.to(DEVICE), lengths.to(DEVICE), spans.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("hq", "hkv"), [(2, 2), (4, 2)])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("use_dot", [False, True], ids=["reduce", "dot"])
def test_rows_in_spans_match_the_per_row_reference(dtype, hq, hkv, splits, use_dot, rng):
    q, kc, vc, tables, lengths, spans = _verify_case(rng, hq, hkv, dtype)
    tuning = DecodeTuning(use_dot=use_dot, keys_per_iter=32)
    out = paged_attention_triton(
        q, kc, vc, tables, lengths, num_splits=splits, tuning=tuning, row_spans=spans, max_span=4
    )
    ref = paged_attention(q.float(), kc.float(), vc.float(), tables, lengths)
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(out[5], torch.zeros_like(out[5]))  # padding row: finite zeros


@pytest.mark.parametrize(
    ("spans", "max_span", "logits", "fragment"),
    [
        (None, 4, False, "max_span=4 needs row_spans"),
        ("ok", 0, False, "max_span=0 must be >= 1"),
        ("short", 4, False, r"row_spans must be \[rows=8\] int32; got \(7,\)"),
        ("int64", 4, False, "torch.int64"),
        ("ok", 4, True, "give max_span=1 with logits"),
    ],
)
def test_row_spans_are_checked(spans, max_span, logits, fragment, rng):
    q, kc, vc, tables, lengths, good = _verify_case(rng, 2, 2, torch.float32)
    given = {"ok": good, "short": good[:7], "int64": good.long(), None: None}[spans]
    stats = torch.zeros(8, 2, 64, device=DEVICE) if logits else None
    with pytest.raises(ValueError, match=fragment):
        paged_attention_triton(
            q, kc, vc, tables, lengths, row_spans=given, max_span=max_span, logits=stats
        )


def test_strided_layer_view_and_small_blocks(rng):
    pool = torch.randn(10, 3, 4, 2, 16, generator=rng).to(DEVICE)  # [blocks, layers, bs, H, D]
    layer_k, layer_v = pool[:, 1], pool[:, 2]
    q = torch.randn(2, 2, 16, generator=rng).to(DEVICE)
    tables = torch.tensor([[4, 1, 7], [2, 9, -1]], dtype=torch.int32, device=DEVICE)
    lengths = torch.tensor([11, 6], dtype=torch.int32, device=DEVICE)
    out = paged_attention_triton(q, layer_k, layer_v, tables, lengths)
    torch.testing.assert_close(
        out, paged_attention(q, layer_k, layer_v, tables, lengths), atol=2e-5, rtol=2e-5
    )


def test_empty_batch():
    q = torch.zeros(0, 2, 16, device=DEVICE)
    kc = torch.zeros(2, 16, 2, 16, device=DEVICE)
    out = paged_attention_triton(
        q,
        kc,
        kc,
        torch.zeros(0, 1, dtype=torch.int32, device=DEVICE),
        torch.zeros(0, dtype=torch.int32, device=DEVICE),
    )
    assert out.shape == (0, 2, 16)


@pytest.mark.parametrize(
    ("dim", "block", "fragment"),
    [
        (24, 16, "head_dim=24 must be a power of two"),
        (16, 12, "block_size=12 must be a power of two"),
    ],
)
def test_wrapper_rejects_unsupported_shapes(dim, block, fragment):
    kc = torch.zeros(2, block, 1, dim, device=DEVICE)
    q = torch.zeros(1, 1, dim, device=DEVICE)
    one = torch.ones(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=fragment):
        paged_attention_triton(q, kc, kc, one[:, None], one)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("hq", "hkv"), [(2, 2), (4, 2)])
def test_sparse_correction_matches_reference(dtype, hq, hkv, rng):
    from flashloop_backend.kernels.torch_ref.sparse_decode import dense_source, sparse_correction
    from flashloop_backend.kernels.triton.sparse_decode import sparse_correction_triton

    q, kc, vc, tables, lengths = _case(rng, hq, hkv, dtype)
    _, idx, mass, ref_out, contribution = dense_source(
        q.float(), kc.float(), vc.float(), tables, lengths, 0.3, 32
    )
    k2 = torch.randn(kc.shape, generator=rng).to(DEVICE, dtype)  # a later loop's K/V
    expected = sparse_correction(
        q.float(), k2.float(), vc.float(), tables, idx, mass, ref_out, contribution
    )
    out = sparse_correction_triton(q, k2, vc, tables, idx, mass, ref_out, contribution)
    torch.testing.assert_close(out.float(), expected, atol=TOL[dtype], rtol=TOL[dtype])


def test_sparse_correction_rejects_mismatched_state(rng):
    from flashloop_backend.kernels.triton.sparse_decode import sparse_correction_triton

    q, kc, vc, tables, _ = _case(rng, 2, 2, torch.float32)
    state = torch.zeros(5, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="indices must start with shape"):
        sparse_correction_triton(
            q,
            kc,
            vc,
            tables,
            torch.zeros(4, 2, 8, dtype=torch.int32, device=DEVICE),
            state[..., 0],
            state,
            state,
        )


def _dense_source_impls():
    from flashloop_backend.kernels.triton import dense_source as module

    # tiny sample/candidate sizes make the interpreter run both selection paths: a bracket
    # that fits the candidate list, and one that overflows it (exact radix-select
    # fallback); 16-position splits spread every row over several programs
    small = {"block": 16, "compact_block": 16, "chunk_min": 16, "programs_per_sm": 64}
    bracket = module.SelectTuning(sample=16, candidates=64, value_block=16, **small)
    fallback = module.SelectTuning(sample=16, candidates=16, value_block=16, **small)
    return {
        "bracket": lambda *a: module.dense_source_triton(*a, tuning=bracket),
        "radix": lambda *a: module.dense_source_triton(*a, tuning=fallback),
    }


SOURCE_IMPLS = ["bracket", "radix"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("hq", "hkv"), [(2, 2), (4, 2)])
@pytest.mark.parametrize("impl", SOURCE_IMPLS)
def test_dense_source_matches_reference(dtype, hq, hkv, impl, rng):
    from flashloop_backend.kernels.torch_ref.sparse_decode import dense_source

    q, kc, vc, tables, lengths = _case(rng, hq, hkv, dtype)
    expected = dense_source(q.float(), kc.float(), vc.float(), tables, lengths, 0.3, 32)
    got = _dense_source_impls()[impl](q, kc, vc, tables, lengths, 0.3, 32)
    torch.testing.assert_close(got[0].float(), expected[0], atol=TOL[dtype], rtol=TOL[dtype])
    if dtype == torch.float32:  # 16-bit logits may reorder near-ties; fp32 must agree exactly
        # the selected set is the contract; its order is the implementation's
        assert torch.equal(got[1].sort(-1).values, expected[1].sort(-1).values)
    for mine, ref in zip(got[2:], expected[2:], strict=True):
        torch.testing.assert_close(mine, ref, atol=TOL[dtype] * 10, rtol=TOL[dtype] * 10)


@pytest.mark.parametrize("impl", SOURCE_IMPLS)
def test_dense_source_ties_go_to_the_earlier_positions(impl, rng):
    q, _, vc, tables, lengths = _case(rng, 2, 2, torch.float32)
    # integer queries against all-one keys: every logit is the same small integer times a
    # power-of-two scale, exact in any summation order, so the ties are true ties
    q = torch.randint(-3, 4, q.shape, generator=rng).to(q)
    equal_keys = torch.ones_like(vc)
    _, idx, mass, _, _ = _dense_source_impls()[impl](q, equal_keys, vc, tables, lengths, 0.3, 32)
    for row, length in enumerate(lengths.tolist()):
        count = -(-length * 3 // 10)
        expected = list(range(count)) + [-1] * (32 - count)
        assert sorted(idx[row, 0].tolist(), key=lambda p: (p < 0, p)) == expected
        torch.testing.assert_close(mass[row], torch.full_like(mass[row], count / max(length, 1)))


def test_dense_source_rejects_a_small_bucket(rng):
    q, kc, vc, tables, lengths = _case(rng, 2, 2, torch.float32)
    with pytest.raises(ValueError, match="k_bucket=8 cannot hold the 20 keys"):
        _dense_source_impls()["radix"](q, kc, vc, tables, lengths, 0.3, 8)


@pytest.mark.parametrize(
    ("shape", "dim", "group"),
    [((70, 3, 8), 0, 16), ((5, 2, 64), -1, 16), ((3, 40), 1, 16), ((128, 2, 64), 0, 64)],
)
def test_quantize_int4_is_bit_identical_to_the_reference(shape, dim, group, rng):
    from flashloop_backend.algorithms import quantize_int4
    from flashloop_backend.kernels.triton.quantize import quantize_int4_triton

    x = torch.randn(shape, generator=rng)
    expected = quantize_int4(x, group, dim)
    got = quantize_int4_triton(x.to(DEVICE), group, dim)
    assert torch.equal(got.codes.cpu(), expected.codes)
    assert torch.equal(got.minimum.cpu(), expected.minimum)
    assert torch.equal(got.scale.cpu(), expected.scale)
    assert (got.shape, got.dim, got.group_size) == (
        expected.shape,
        expected.dim,
        expected.group_size,
    )


def test_quantize_int4_rounding_constant_groups_and_errors():
    from flashloop_backend.algorithms import unpack_codes
    from flashloop_backend.kernels.triton.quantize import quantize_int4_triton

    halves = torch.tensor([0.0, 0.5, 1.5, 2.5] + [15.0] * 12, device=DEVICE)
    assert unpack_codes(quantize_int4_triton(halves, 16))[0, :4].tolist() == [0, 0, 2, 2]
    constant = quantize_int4_triton(torch.full((32,), 3.25, device=DEVICE), 16)
    assert constant.scale.tolist() == [0.0, 0.0] and (constant.codes == 0).all()
    with pytest.raises(ValueError, match="group_size=24"):
        quantize_int4_triton(halves, 24)


@pytest.mark.parametrize("impl", SOURCE_IMPLS)
def test_dense_source_ties_mixed_with_larger_keys(impl, rng):
    """Two logit values: every larger key is taken, then the earliest ties up to K."""
    from flashloop_backend.kernels.torch_ref.sparse_decode import dense_source

    q, kc, vc, tables, lengths = _case(rng, 2, 2, torch.float32)
    q = torch.ones_like(q)
    larger = torch.rand(kc.shape[:2], generator=rng) < 0.15
    kc = torch.where(larger[:, :, None, None], 2.0, 1.0).expand_as(kc).contiguous().to(DEVICE)
    expected = dense_source(q, kc, vc, tables, lengths, 0.3, 32)
    got = _dense_source_impls()[impl](q, kc, vc, tables, lengths, 0.3, 32)
    assert torch.equal(got[1].sort(-1).values, expected[1].sort(-1).values)
    # mass, output and contribution: the value pass takes exactly the compaction's ties
    for mine, ref in zip(got[2:], expected[2:], strict=True):
        torch.testing.assert_close(mine, ref)


def test_a_row_without_selected_keys_gives_output_minus_contribution_everywhere(rng):
    """The one definition for an empty S (``SparseCorrection``): O_ref - C_ref, from the
    torch reference and the Triton correction alike, whatever the row's pages hold."""
    from flashloop_backend.kernels.torch_ref.sparse_decode import sparse_correction
    from flashloop_backend.kernels.triton.sparse_decode import sparse_correction_triton

    rows, heads, dim, block = 3, 2, 16, 16
    kc, vc = (torch.randn(4, block, heads, dim, generator=rng).to(DEVICE) for _ in range(2))
    q = torch.randn(rows, heads, dim, generator=rng).to(DEVICE)
    tables = torch.tensor([[0, 1], [2, 3], [1, 0]], dtype=torch.int32, device=DEVICE)
    indices = torch.randint(0, 2 * block, (rows, heads, 8), generator=rng).int().to(DEVICE)
    indices[1] = -1
    mass = torch.rand(rows, heads, generator=rng).to(DEVICE)
    output, contribution = (
        torch.randn(rows, heads, dim, generator=rng).to(DEVICE) for _ in range(2)
    )
    state = (indices, mass, output, contribution)
    reference = sparse_correction(q, kc, vc, tables, *state)
    triton_out = sparse_correction_triton(q, kc, vc, tables, *state)
    torch.testing.assert_close(reference[1], output[1] - contribution[1])
    torch.testing.assert_close(triton_out, reference, atol=1e-5, rtol=1e-5)


def test_selection_tuning_names_the_tile_that_is_not_a_power_of_two(rng):
    from flashloop_backend.kernels.triton.dense_source import SelectTuning, dense_source_triton

    q, kc, vc, tables, lengths = _case(rng, 2, 2, torch.float32)
    tuning = SelectTuning(compact_block=48, sample=16)
    with pytest.raises(ValueError, match=r"\{'compact_block': 48\} must be powers of two"):
        dense_source_triton(q, kc, vc, tables, lengths, 0.3, 32, tuning=tuning)


def test_the_selection_plan_names_the_last_tie_the_compaction_took(rng):
    """A value pass takes the keys above the threshold and the ties at or before the plan's
    last tie: the same keys the compaction wrote, when only some ties are taken (two
    logit values, K inside the lower one's run), all of them, or none."""
    from flashloop_backend.kernels.triton.paged_decode import merge_lse
    from flashloop_backend.kernels.triton.threshold_select import SelectTuning, select_positions

    rows, heads, span = 3, 2, 96
    higher = torch.rand(rows, heads, span, generator=rng) < 0.2
    logits = torch.where(higher, 2.0, 1.0).to(DEVICE)
    logits[2] = torch.arange(span, dtype=torch.float32)  # no ties but the threshold itself
    lengths = torch.tensor([96, 61, 80], dtype=torch.int32, device=DEVICE)
    parts = logits.view(rows, heads, 3, span // 3)
    part_max = parts.amax(-1)
    part_sum = (parts - part_max[..., None]).exp().sum(-1)
    lse = merge_lse(part_max, part_sum, torch.empty(rows, heads, device=DEVICE))
    torch.testing.assert_close(lse, logits.logsumexp(-1))
    lse = torch.stack([logits[r, :, :n].logsumexp(-1) for r, n in enumerate(lengths.tolist())])
    indices = torch.empty(rows, heads, 48, dtype=torch.int32, device=DEVICE)
    # 16-position splits: the ties spread over several compaction programs
    small = SelectTuning(sample=16, candidates=64, block=16, compact_block=16, chunk_min=16)
    tuning = dataclasses.replace(small, programs_per_sm=64)
    plan = select_positions(logits, lse, lengths, indices, 0.3, tuning).plan
    for r, n in enumerate(lengths.tolist()):
        for h in range(heads):
            chosen = indices[r, h][indices[r, h] >= 0].tolist()
            threshold = logits[r, h, chosen].min().item()
            ties = [p for p in chosen if logits[r, h, p].item() == threshold]
            assert plan[r, h, 2].item() == max(ties)
            rule = (logits[r, h, :n] > threshold) | (
                (logits[r, h, :n] == threshold) & (torch.arange(n, device=DEVICE) <= max(ties))
            )
            assert rule.nonzero().flatten().tolist() == chosen


@pytest.mark.parametrize("bits, radix_bits", [(1, 8), (12, 8), (32, 8), (12, 4), (7, 2), (20, 1)])
def test_the_selection_is_exact_whatever_bits_the_bracket_searches(bits, radix_bits, rng):
    """A bracket found to few top bits is wider (more candidates, or the radix select
    over the row when they overflow the list), never wrong: the selected set is the
    reference's at every ``bracket_bits`` and every digit width of the searches."""
    from flashloop_backend.kernels.triton.threshold_select import SelectTuning, select_positions

    rows, heads, span = 2, 2, 128
    logits = (torch.randn(rows, heads, span, generator=rng) * 3.0).to(DEVICE)
    lengths = torch.tensor([128, 77], dtype=torch.int32, device=DEVICE)
    lse = torch.stack([logits[r, :, :n].logsumexp(-1) for r, n in enumerate(lengths.tolist())])
    indices = torch.empty(rows, heads, 48, dtype=torch.int32, device=DEVICE)
    tuning = SelectTuning(
        sample=32,
        bracket_bits=bits,
        radix_bits=radix_bits,
        candidates=64,
        block=16,
        compact_block=16,
        chunk_min=32,
    )
    select_positions(logits, lse, lengths, indices, 0.3, tuning)
    for r, n in enumerate(lengths.tolist()):
        count = -(-n * 3 // 10)
        for h in range(heads):
            want = logits[r, h, :n].topk(count).indices.sort().values.tolist()
            assert indices[r, h, :count].tolist() == want
            assert (indices[r, h, count:] == -1).all()


def test_the_selection_ties_negative_and_positive_zero_as_torch_does(rng):
    """-0.0 and +0.0 compare equal in torch (the reference): among a run of zeros of both
    signs at the threshold the earlier positions are taken, whatever their sign."""
    from flashloop_backend.kernels.triton.threshold_select import SelectTuning, select_positions

    logits = torch.full((1, 1, 32), -1.0)
    logits[0, 0, 4:12] = torch.tensor([-0.0, 0.0] * 4)
    logits[0, 0, 20] = 1.0
    logits = logits.to(DEVICE)
    lengths = torch.tensor([32], dtype=torch.int32, device=DEVICE)
    lse = logits.logsumexp(-1)
    indices = torch.empty(1, 1, 16, dtype=torch.int32, device=DEVICE)
    small = SelectTuning(sample=16, candidates=16, block=16, compact_block=16, chunk_min=16)
    select_positions(logits, lse, lengths, indices, 0.1, small)  # K = 4
    assert indices[0, 0, :4].tolist() == [4, 5, 6, 20]
    assert logits[0, 0, 4].item() == 0.0 and str(logits[0, 0, 4].item()) == "-0.0"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("bracket_bits", 0, "bracket_bits=0 must be in 1..32"),
        ("bracket_bits", 33, "bracket_bits=33 must be in 1..32"),
        ("radix_bits", 0, "radix_bits=0 must be one of 1, 2, 4, 8"),
        ("radix_bits", 3, "radix_bits=3 must be one of 1, 2, 4, 8"),
        ("radix_bits", 16, "radix_bits=16 must be one of 1, 2, 4, 8"),
    ],
)
def test_selection_tuning_names_a_search_width_outside_its_range(field, value, message, rng):
    from flashloop_backend.kernels.triton.threshold_select import SelectTuning, select_positions

    logits = torch.randn(1, 1, 32, generator=rng).to(DEVICE)
    lengths = torch.tensor([32], dtype=torch.int32, device=DEVICE)
    indices = torch.empty(1, 1, 16, dtype=torch.int32, device=DEVICE)
    tuning = SelectTuning(sample=16, **{field: value})
    with pytest.raises(ValueError, match=message):
        select_positions(logits, logits.logsumexp(-1), lengths, indices, 0.3, tuning)


def test_merge_lse_refuses_split_states_of_different_strides():
    from flashloop_backend.kernels.triton.paged_decode import merge_lse

    part_max = torch.zeros(2, 3, 4, device=DEVICE)
    part_sum = torch.ones(2, 4, 3, device=DEVICE).transpose(1, 2)
    with pytest.raises(ValueError, match="part_max and part_sum must share strides"):
        merge_lse(part_max, part_sum, torch.empty(2, 3, device=DEVICE))


@pytest.mark.parametrize("strided", ["out", "output", "contribution", "mass"])
def test_the_split_merge_refuses_a_buffer_without_unit_inner_stride(strided):
    """The merge kernel steps along the last dimension of out and the correction's tensors
    one element at a time: a view with another inner stride is refused by name, before
    any launch, not read at the wrong addresses."""
    from flashloop_backend.kernels.triton.paged_decode import merge_splits, split_buffers

    rows, heads, dim = 2, 4, 16
    parts = split_buffers(rows, heads, 3, dim, torch.device("cpu"))
    tensors = {
        "out": torch.zeros(rows, heads, dim),
        "output": torch.zeros(rows, heads, dim),
        "contribution": torch.zeros(rows, heads, dim),
        "mass": torch.ones(rows, heads),
    }
    wide = (*tensors[strided].shape[:-1], 2 * tensors[strided].shape[-1])
    tensors[strided] = torch.zeros(wide)[..., ::2]  # every other element: inner stride 2
    correction = (tensors["output"], tensors["contribution"], tensors["mass"])
    with pytest.raises(ValueError, match=rf"unit stride in the last dimension.*'{strided}': 2"):
        merge_splits(*parts, tensors["out"], correction=correction)
