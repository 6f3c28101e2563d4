"""The torch reference paged attention against a deliberately naive recomputation."""

import math

import pytest
import torch

from flashloop_backend.kernels.torch_ref.paged import paged_attention, paged_prefill

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def naive(q, k_seq, v_seq, scale):
    """q [Hq, D]; k_seq, v_seq [T, Hkv, D]: one query over a contiguous history."""
    group = q.shape[0] // k_seq.shape[1]
    out = []
    for h in range(q.shape[0]):
        k = k_seq[:, h // group].double()
        v = v_seq[:, h // group].double()
        w = torch.softmax((k @ q[h].double()) * scale, dim=0)
        out.append(w @ v)
    return torch.stack(out)


def build_paged(seqs, block_size, num_blocks, gen, pad_value=-1):
    """Scatter contiguous K/V sequences into shuffled pages; return caches and tables."""
    heads, dim = seqs[0][0].shape[1:]
    kc = torch.randn(num_blocks, block_size, heads, dim, generator=gen)  # stale garbage
    vc = torch.randn(num_blocks, block_size, heads, dim, generator=gen)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(math.ceil(len(k) / block_size) for k, _ in seqs) + 1
    tables = torch.full((len(seqs), max_blocks), pad_value, dtype=torch.int32)
    for r, (k, v) in enumerate(seqs):
        for b in range(math.ceil(len(k) / block_size)):
            blk = free.pop()
            tables[r, b] = blk
            n = min(block_size, len(k) - b * block_size)
            kc[blk, :n] = k[b * block_size : b * block_size + n]
            vc[blk, :n] = v[b * block_size : b * block_size + n]
    return kc, vc, tables


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("pad_value", [-1, 0, 7])
def test_matches_naive(dtype, hq, hkv, pad_value, rng):
    dim, block_size = 24, 4
    lengths = [1, 5, 8, 13]
    seqs = [
        (torch.randn(t, hkv, dim, generator=rng), torch.randn(t, hkv, dim, generator=rng))
        for t in lengths
    ]
    kc, vc, tables = build_paged(seqs, block_size, 16, rng, pad_value)
    q = torch.randn(len(lengths), hq, dim, generator=rng)
    ctx = torch.tensor(lengths, dtype=torch.int32)
    out = paged_attention(q.to(dtype), kc.to(dtype), vc.to(dtype), tables, ctx)
    scale = 1 / math.sqrt(dim)
    for r, (k, v) in enumerate(seqs):
        ref = naive(q[r].to(dtype).float(), k.to(dtype).float(), v.to(dtype).float(), scale)
        torch.testing.assert_close(out[r].double(), ref, atol=TOL[dtype], rtol=TOL[dtype])


def test_padding_rows_and_empty_batch(rng):
    kc = torch.randn(4, 4, 2, 16, generator=rng)
    q = torch.randn(2, 2, 16, generator=rng)
    tables = torch.tensor([[0, 1], [-1, -1]], dtype=torch.int32)
    out = paged_attention(q, kc, kc, tables, torch.tensor([3, 0], dtype=torch.int32))
    assert torch.isfinite(out).all()
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    empty = paged_attention(q[:0], kc, kc, tables[:0], torch.zeros(0, dtype=torch.int32))
    assert empty.shape == (0, 2, 16)


def test_strided_per_layer_views(rng):
    pool = torch.randn(6, 3, 4, 2, 16, generator=rng)  # [blocks, layers, block, heads, dim]
    layer = pool[:, 1]
    assert not layer.is_contiguous()
    q = torch.randn(1, 2, 16, generator=rng)
    tables = torch.tensor([[2, 5]], dtype=torch.int32)
    ctx = torch.tensor([7], dtype=torch.int32)
    out = paged_attention(q, layer, layer, tables, ctx)
    ref = paged_attention(q, layer.contiguous(), layer.contiguous(), tables, ctx)
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (lambda a: {**a, "q": a["q"][0]}, "q must be"),
        (lambda a: {**a, "q": torch.randn(2, 3, 16)}, "positive multiple"),
        (lambda a: {**a, "value_cache": a["value_cache"][:2]}, "value_cache shape"),
        (lambda a: {**a, "block_tables": a["block_tables"].float()}, "int32 or int64"),
        (lambda a: {**a, "block_tables": a["block_tables"][:1]}, "block_tables must be"),
        (lambda a: {**a, "context_lengths": a["context_lengths"][:1]}, "context_lengths must be"),
        (lambda a: {**a, "q": torch.randn(2, 2, 8)}, "head_dim"),
        (lambda a: {**a, "q": a["q"].half()}, "dtype"),
    ],
)
def test_wrapper_rejects_bad_inputs(change, fragment, rng):
    args = {
        "q": torch.randn(2, 2, 16, generator=rng),
        "key_cache": torch.randn(4, 4, 2, 16, generator=rng),
        "value_cache": torch.randn(4, 4, 2, 16, generator=rng),
        "block_tables": torch.zeros(2, 2, dtype=torch.int32),
        "context_lengths": torch.ones(2, dtype=torch.int32),
    }
    with pytest.raises(ValueError, match=fragment):
        paged_attention(**change(args))


@pytest.mark.parametrize("fn", [paged_attention, paged_prefill])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rows_sharing_a_table_give_what_each_row_alone_gives(dtype, fn):
    """``paged_prefill`` on the CPU groups rows that share a block table (a prompt's rows,
    each seeing one more key) and gathers their pages once; every row still equals the
    naive recomputation of its own prefix, beside rows of other tables and a padding row,
    as ``paged_attention``'s rows do."""
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, dim, block = 4, 2, 16, 4
    seqs = [(torch.randn(n, kv_heads, dim, generator=gen),) * 2 for n in (11, 7)]
    seqs = [(k, torch.randn(k.shape, generator=gen)) for k, _ in seqs]
    kc, vc, tables = build_paged(seqs, block, 16, gen)
    # rows 0-4: sequence 0's last five prefixes (a prompt chunk); 5: sequence 1; 6: padding
    which = torch.tensor([0, 0, 0, 0, 0, 1, 0])
    lengths = torch.tensor([7, 8, 9, 10, 11, 7, 0], dtype=torch.int32)
    q = torch.randn(len(which), heads, dim, generator=gen)
    out = fn(q.to(dtype), kc.to(dtype), vc.to(dtype), tables[which], lengths)
    scale = 1.0 / math.sqrt(dim)
    for r in range(len(which)):
        k, v = seqs[int(which[r])]
        n = int(lengths[r])
        if n == 0:
            assert torch.equal(out[r], torch.zeros_like(out[r]))
            continue
        want = naive(
            q[r].to(dtype).float(), k[:n].to(dtype).float(), v[:n].to(dtype).float(), scale
        )
        torch.testing.assert_close(out[r].double(), want, atol=TOL[dtype], rtol=TOL[dtype])
