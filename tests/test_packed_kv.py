"""Packed INT4 KV storage and its Triton decode reader (interpreter on CPU)."""

import dataclasses

import pytest
import torch

from flashloop_backend.algorithms import (
    encode_compact_chain,
    encode_residual_chain,
    reconstruct,
    reconstruct_compact,
)
from flashloop_backend.kv.encoding import encoding_descriptor
from flashloop_backend.kv.sequence_levels import OutOfPackedPagesError
from flashloop_backend.kv.store import PackedKVStore

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
G, L, H, D = 16, 2, 2, 32


def _versions(rng, rows, depths=4):
    base = torch.randn(rows, L, H, D, generator=rng)
    out = [base]
    for _ in range(depths - 1):  # later loops change less, like the model's K/V
        out.append(out[-1] + 0.3 * torch.randn(rows, L, H, D, generator=rng))
    return out


def test_dense_levels_reconstruct_like_the_reference_chain(rng):
    keys, values = _versions(rng, 32), _versions(rng, 32)
    store = PackedKVStore(16, L, H, D, G)
    store.encode(7, keys, values)
    k_chain = encode_residual_chain(keys, G, 0)
    v_chain = encode_residual_chain(values, G, -1)
    for depth in range(4):
        for layer in range(L):
            k, v = store.reconstruct(7, depth, layer)
            torch.testing.assert_close(k, reconstruct(k_chain, depth)[:, layer], atol=1e-6, rtol=0)
            torch.testing.assert_close(v, reconstruct(v_chain, depth)[:, layer], atol=1e-6, rtol=0)


def test_compact_levels_store_only_active_rows_and_inherit(rng):
    rows = 32
    active = [torch.ones(rows, dtype=torch.bool)] * 2
    active += [torch.rand(rows, generator=rng) < 0.5]
    active += [active[2] & (torch.rand(rows, generator=rng) < 0.5)]
    keys, values = _versions(rng, rows), _versions(rng, rows)
    store = PackedKVStore(16, L, H, D, G)
    store.encode(1, keys, values, active)
    k_chain = encode_compact_chain(keys, active, G, 0)
    entry = store.sequences[1]
    assert entry.maps[:2] == [None, None]
    for level in (2, 3):
        present = entry.maps[level] >= 0
        assert torch.equal(present, active[level])  # a map, not zero codes, marks absence
        host = entry.host_maps[level]  # the planning copy: no device read per batch
        assert host.device.type == "cpu" and torch.equal(host, entry.maps[level].cpu())
        assert len(entry.pages[level]) == -(-int(active[level].sum()) // G)
    for depth in range(4):
        k, _ = store.reconstruct(1, depth, 1)
        torch.testing.assert_close(k, reconstruct_compact(k_chain, depth)[:, 1], atol=1e-6, rtol=0)
    inactive = ~active[3]
    k2, _ = store.reconstruct(1, 2, 0)
    k3, _ = store.reconstruct(1, 3, 0)
    assert torch.equal(k3[inactive], k2[inactive])  # rows absent at depth 3 inherit depth 2


def test_accounting_comes_from_the_stored_pages(rng):
    store = PackedKVStore(32, L, H, D, G)
    store.encode(0, _versions(rng, 32), _versions(rng, 32))
    report = store.accounting()
    assert report["pages_used"] == 8 and report["map_bytes"] == 0
    per_page = sum(t[0].numel() * t.element_size() for t in store.pools)
    assert report["steady_bytes"] == 8 * per_page == store.page_bytes() * 8
    assert report["bytes_per_token_by_depth"] == [2 * per_page / 32] * 4
    store.release(0)
    assert store.accounting()["pages_used"] == 0 and len(store._free) == 32


def test_store_errors_name_the_problem(rng):
    store = PackedKVStore(2, L, H, D, G)
    with pytest.raises(ValueError, match="multiple of 16"):
        store.encode(0, _versions(rng, 20), _versions(rng, 20))
    with pytest.raises(MemoryError, match="sequence 0 needs 4 pages, 2 free of 2"):
        store.encode(0, _versions(rng, 32, 2), _versions(rng, 32, 2))
    assert len(store._free) == 2 and not store.sequences  # nothing taken by the failure
    with pytest.raises(ValueError, match="head_dim=24 must be a multiple"):
        PackedKVStore(2, L, H, 24, G)
    assert encoding_descriptor(64, "rolling", 64, True)["version"] == 3


def test_reserved_pages_are_drawn_by_their_sequence_only(rng):
    store = PackedKVStore(12, L, H, D, G)
    store.reserve(0, 8)  # two groups at four depths
    report = store.accounting()
    assert report["pages_reserved"] == 8 and report["pages_total"] == 12
    assert store.unreserved_pages() == 4 and len(store._free) == 12
    # a sequence without a reservation may take only the pages nobody holds
    with pytest.raises(OutOfPackedPagesError, match="sequence 1 needs 8 pages, 4 free of 12"):
        store.encode(1, _versions(rng, 32), _versions(rng, 32))
    assert not store.sequences and store.unreserved_pages() == 4  # the failure took nothing
    store.encode(1, _versions(rng, 16), _versions(rng, 16))  # 4 unreserved pages
    store.encode(0, _versions(rng, 16), _versions(rng, 16))  # from its reservation
    assert store.accounting()["pages_reserved"] == 4 and store.unreserved_pages() == 0
    store.append(0, _versions(rng, 16), _versions(rng, 16))
    assert store.accounting()["pages_reserved"] == 0 and not store._free
    store.release(1)
    assert store.unreserved_pages() == 4


def test_reserve_is_atomic_and_release_returns_the_unused_reservation(rng):
    store = PackedKVStore(10, L, H, D, G)
    store.reserve(3, 6)
    with pytest.raises(
        OutOfPackedPagesError,
        match=r"sequence 4 needs 5 pages, 4 free of 10 \(6 held by reservations",
    ):
        store.reserve(4, 5)
    assert store.accounting()["pages_reserved"] == 6  # the refusal reserved nothing
    assert issubclass(OutOfPackedPagesError, MemoryError)
    store.encode(3, _versions(rng, 16), _versions(rng, 16))
    assert store.accounting()["pages_reserved"] == 2 and store.accounting()["pages_used"] == 4
    store.release(3)  # pages and the rest of the reservation come back
    assert store.unreserved_pages() == 10 and store.accounting()["pages_reserved"] == 0
    store.reserve(5, 3)
    assert store.unreserve(5) == 3 and store.unreserved_pages() == 10
    store.release(6)  # never reserved nor encoded: nothing to return
    with pytest.raises(ValueError, match="pages=-1 must be >= 0"):
        store.reserve(7, -1)


def test_appends_past_a_reservation_use_only_unheld_pages(rng):
    store = PackedKVStore(12, L, H, D, G)
    store.reserve(0, 4)
    store.reserve(1, 6)
    with pytest.raises(
        OutOfPackedPagesError, match=r"sequence 0 needs 8 pages, 6 free of 12 \(4 reserved for it"
    ):
        store.encode(0, _versions(rng, 32), _versions(rng, 32))
    store.encode(0, _versions(rng, 16), _versions(rng, 16))  # its 4 reserved pages
    store.encode(2, _versions(rng, 16, 2), _versions(rng, 16, 2))  # the 2 unheld pages
    assert len(store._free) == 6  # all held for sequence 1: nobody else gets them
    with pytest.raises(OutOfPackedPagesError, match="sequence 2 needs 2 pages, 0 free of 12"):
        store.append(2, _versions(rng, 16, 2), _versions(rng, 16, 2))
    store.encode(1, _versions(rng, 16), _versions(rng, 16))  # from its reservation
    assert store.accounting()["pages_reserved"] == 2 and store.accounting()["pages_used"] == 10


def _attention(q, k, v, length):
    logits = torch.einsum("hd,thd->ht", q.float(), k[:length]) / D**0.5
    return torch.einsum("ht,thd->hd", torch.softmax(logits, -1), v[:length])


# group sizes: two V groups per row of D = 32 channels, or one
GROUPS = [G, 32]


@pytest.mark.parametrize("half", [True, False], ids=["half", "fp32"])
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_packed_decode_matches_reconstruction_plus_bf16_tail(dtype, group, half, rng):
    from flashloop_backend.kernels.triton.packed_decode import (
        PLAIN_READ_TOLERANCE,
        PackedTuning,
        packed_decode_triton,
    )
    from flashloop_backend.kv.levels import level_metadata

    rows, tail, block = 32, 20, 16
    store = PackedKVStore(24, L, H, D, group, device=DEVICE)
    active = [torch.ones(rows, dtype=torch.bool)] * 2 + [torch.arange(rows) % 3 == 0] * 2
    versions = {s: (_versions(rng, rows), _versions(rng, rows)) for s in (0, 1)}
    store.encode(0, [k.to(DEVICE) for k in versions[0][0]], [v.to(DEVICE) for v in versions[0][1]])
    store.encode(1, [k.to(DEVICE) for k in versions[1][0]], [v.to(DEVICE) for v in versions[1][1]],
                 [a.to(DEVICE) for a in active])  # fmt: skip
    # the BF16 paged cache holds the tail rows [32, 52) of both sequences (pages 2-3 / 6-7)
    cache_k = torch.randn(8, block, H, D, generator=rng)
    cache_v = torch.randn(8, block, H, D, generator=rng)
    tables = torch.tensor([[-1, -1, 2, 3], [-1, -1, 6, 7], [-1, -1, 2, 3], [-1, -1, 6, 7]] * 2)[:5]
    # the last row is routed to another op: length 0 although its sequence is packed
    sequences, depths = [0, 1, 0, 1, 0], [0, 3, 2, 2, 3]
    lengths = torch.tensor([52, 45, 33, 52, 0])
    q = torch.randn(5, H, D, generator=rng)
    layer = 1
    meta = level_metadata(store, sequences, depths, DEVICE)
    got = packed_decode_triton(
        q.to(DEVICE, dtype), store, layer, meta, cache_k.to(DEVICE, dtype), cache_v.to(DEVICE, dtype),
        tables.int().to(DEVICE), lengths.int().to(DEVICE), tuning=PackedTuning(half_products=half),
    )  # fmt: skip
    assert torch.equal(got[4].float().cpu(), torch.zeros(H, D))
    for i, (sequence, depth) in enumerate(zip(sequences[:4], depths[:4], strict=True)):
        k, v = store.reconstruct(sequence, depth, layer)
        tail_k = cache_k[tables[i, 2:]].reshape(-1, H, D)[:tail].to(dtype).float()
        tail_v = cache_v[tables[i, 2:]].reshape(-1, H, D)[:tail].to(dtype).float()
        k = torch.cat([k.cpu().to(dtype).float(), tail_k])
        v = torch.cat([v.cpu().to(dtype).float(), tail_v])
        expected = _attention(q[i].to(dtype).float(), k, v, int(lengths[i]))
        tol = 2e-5 if dtype == torch.float32 else 3e-3
        tol = max(tol, PLAIN_READ_TOLERANCE) if half else tol
        torch.testing.assert_close(got[i].float().cpu(), expected, atol=tol, rtol=tol)


def _sparse_case(rng, group: int = G):
    """Two packed sequences (dense levels; compact levels 2-3) with BF16 tails, 3 rows."""
    from flashloop_backend.kv.levels import level_metadata

    rows = 32
    store = PackedKVStore(24, L, H, D, group, device=DEVICE)
    active = [torch.ones(rows, dtype=torch.bool)] * 2 + [torch.arange(rows) % 4 == 1] * 2
    for s, act in ((0, None), (1, active)):
        keys, values = _versions(rng, rows), _versions(rng, rows)
        store.encode(s, [k.to(DEVICE) for k in keys], [v.to(DEVICE) for v in values],
                     None if act is None else [a.to(DEVICE) for a in act])  # fmt: skip
    cache_k = torch.randn(8, 16, H, D, generator=rng).to(DEVICE)
    cache_v = torch.randn(8, 16, H, D, generator=rng).to(DEVICE)
    tables = torch.tensor([[-1, -1, 2, 3], [-1, -1, 6, 7], [-1, -1, 6, 7]]).int().to(DEVICE)
    lengths = torch.tensor([40, 50, 32]).int().to(DEVICE)
    q = torch.randn(3, H, D, generator=rng).to(DEVICE)
    meta = level_metadata(store, [0, 1, 1], [3, 2, 3], DEVICE)
    return (q, store, 0, meta, cache_k, cache_v, tables), lengths


@pytest.mark.parametrize("half", [True, False], ids=["half", "fp32"])
@pytest.mark.parametrize("group", GROUPS)
def test_torch_reference_reader_agrees_with_the_triton_reader(group, half, rng):
    from flashloop_backend.kernels.torch_ref.packed import packed_decode_reference
    from flashloop_backend.kernels.triton.packed_decode import (
        PLAIN_READ_TOLERANCE,
        PackedTuning,
        packed_decode_triton,
    )

    args, lengths = _sparse_case(rng, group)
    tuning = PackedTuning(half_products=half)
    tol = PLAIN_READ_TOLERANCE if half else 2e-5
    torch.testing.assert_close(packed_decode_reference(*args, lengths),
                               packed_decode_triton(*args, lengths, tuning=tuning), atol=tol, rtol=tol)  # fmt: skip


def test_the_few_rows_hint_launches_one_program_per_row_and_head_with_the_same_result(rng):
    """``few_rows`` (a loop 3-4 fallback read) changes the launch, not the output: one
    split per (row, head) reads the whole history, rows of length 0 give zeros."""
    from flashloop_backend.kernels.torch_ref.packed import packed_decode_reference
    from flashloop_backend.kernels.triton.packed_decode import (
        PackedTuning,
        packed_decode_triton,
    )

    args, lengths = _sparse_case(rng, GROUPS[0])
    tuning = PackedTuning(half_products=False)
    lengths[1] = 0  # a row another op serves
    expected = packed_decode_reference(*args, lengths, few_rows=True)
    got = packed_decode_triton(*args, lengths, None, True, tuning=tuning)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)
    assert torch.equal(got[1], torch.zeros_like(got[1]))


@pytest.mark.parametrize("layers_per_pass", [2, 3])
def test_encoding_several_layers_per_pass_writes_the_same_pages(rng, layers_per_pass):
    """Layers encoded together (fewer launches, more scratch) give the one-layer pages and
    parameters bit for bit: dense and compact levels, two appends."""
    active = [torch.ones(32, dtype=torch.bool)] * 2 + [torch.arange(32) % 3 == 0] * 2
    chunks = [(_versions(rng, 32), _versions(rng, 32)) for _ in range(2)]
    stores = [PackedKVStore(24, L, H, D, G, layers_per_pass=n) for n in (1, layers_per_pass)]
    for store in stores:
        for keys, values in chunks:
            store.append(0, keys, values, active)
    for one, many in zip(stores[0].pools, stores[1].pools, strict=True):
        assert torch.equal(one, many)
    with pytest.raises(ValueError, match="layers_per_pass=0 must be >= 1"):
        PackedKVStore(4, L, H, D, G, layers_per_pass=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", GROUPS)
def test_the_triton_level_writer_writes_the_chains_pages_bit_for_bit(rng, dtype, group):
    """``encode_levels_triton`` (one kernel per level, reconstruction re-read from the
    pages already written) against the torch chain: dense levels, compact ones with a
    padded last page, a compact level of one row, a compact level of none, two appends;
    V groups of half a row or a whole row."""
    import functools

    from flashloop_backend.kernels.triton import encode

    tuning = encode.EncodeTuning(num_warps=4)
    encode_levels_triton = functools.partial(encode.encode_levels_triton, tuning=tuning)

    rows = 32
    dense = [torch.ones(rows, dtype=torch.bool)] * 4
    one_row = torch.zeros(rows, dtype=torch.bool)
    one_row[5] = True
    sparse = [*dense[:2], torch.arange(rows) % 3 == 0, one_row]
    nothing = [*dense[:3], torch.zeros(rows, dtype=torch.bool)]
    stores = [PackedKVStore(48, L, H, D, group, device=DEVICE) for _ in range(4)]
    for active in (dense, sparse, nothing):
        keys, values = ([x.to(DEVICE, dtype) for x in _versions(rng, rows)] for _ in range(2))
        marks = [a.to(DEVICE) for a in active]
        stores[0].append(0, keys, values, marks)
        stores[1].append(0, keys, values, marks, write=encode_levels_triton)
        # the same rows in place in paged pools, their blocks scattered
        paged = _paged(keys, values, rng, block_size=12)  # 32 rows: a partial last block
        stores[2].append_rows(0, paged, marks, write=encode_levels_triton)
        stores[3].append_rows(0, _paged(keys, values, rng), marks)
    for chain, *others in zip(*(store.pools for store in stores), strict=True):
        assert all(torch.equal(chain, other) for other in others)
    assert all(store.sequences[0].pages == stores[0].sequences[0].pages for store in stores)


@pytest.mark.parametrize("writer", ["chain", "triton"])
def test_a_prompt_packed_level_by_level_stores_the_pages_of_every_level_at_once(rng, writer):
    """Appends of one level at a time (each over the rows the levels below stored in the
    same appends) give the bytes (in level order), maps and marks of appends of every
    level at once: dense
    and compact levels, two appends; ``rows`` counts what every level holds."""
    import functools

    from flashloop_backend.kernels.triton import encode

    write = None
    if writer == "triton":
        tuning = encode.EncodeTuning(num_warps=4)
        write = functools.partial(encode.encode_levels_triton, tuning=tuning)
    rows = 32
    dense = torch.ones(rows, dtype=torch.bool)
    actives = [[dense] * 4, [dense, dense, torch.arange(rows) % 3 == 0, torch.arange(rows) < 5]]
    appends = []
    for active in actives:
        keys, values = ([x.to(DEVICE) for x in _versions(rng, rows)] for _ in range(2))
        appends.append((keys, values, [a.to(DEVICE) for a in active]))
    whole, by_level = (PackedKVStore(48, L, H, D, G, device=DEVICE) for _ in range(2))
    for keys, values, active in appends:
        whole.append(0, keys, values, active, write=write)
    for depth in range(4):
        for keys, values, active in appends:
            rows_by_depth = [None] * 4
            rows_by_depth[depth] = _paged([keys[depth]], [values[depth]], rng)[0]
            by_level.append_rows(0, rows_by_depth, active, write=write)
        expected = 2 * rows if depth == 3 else 0
        assert by_level.sequences[0].rows == expected
    a, b = whole.sequences[0], by_level.sequences[0]
    for pages_a, pages_b in zip(a.pages, b.pages, strict=True):  # page ids differ, bytes not
        assert torch.equal(whole.blocks[pages_a], by_level.blocks[pages_b])
    assert (a.marks, b.spans, b.ahead) == (b.marks, {}, {})
    assert all(
        (x is None and y is None) or torch.equal(x, y)
        for x, y in zip(a.host_maps, b.host_maps, strict=True)
    )


def test_a_level_appended_alone_needs_the_levels_below_over_the_same_rows(rng):
    """A level's append before the levels below hold its rows, or over rows the levels
    below appended differently, or levels that are not consecutive: refused by name,
    nothing taken."""
    keys = _versions(rng, 32)
    store = PackedKVStore(48, L, H, D, G)
    rows = [_paged([k], [k], rng)[0] for k in keys]
    with pytest.raises(ValueError, match="level 0 of sequence 0 has no append of rows"):
        store.append_rows(0, [None, rows[1], None, None])
    with pytest.raises(ValueError, match="consecutive levels"):
        store.append_rows(0, [rows[0], None, rows[2], None])
    store.append_rows(0, [rows[0], None, None, None])
    store.append_rows(0, [rows[0], None, None, None])
    half = [_paged([k[:16]], [k[:16]], rng)[0] for k in keys]
    with pytest.raises(ValueError, match=r"level 0 of sequence 0 has no append of rows \[0, 16\)"):
        store.append_rows(0, [None, half[1], None, None])
    free = len(store._free)
    store.append_rows(0, [None, rows[1], None, None])
    assert len(store._free) == free - 32 // G and store.sequences[0].rows == 0
    with pytest.raises(ValueError, match=r"levels \[1, 2\] of sequence 0 hold \[32, 0\] rows"):
        store.append_rows(0, [None, rows[1], rows[2], None])
    assert len(store._free) == free - 32 // G


def _paged(keys, values, rng, block_size=4):
    """The rows of each depth in a paged pool [NB, L, BS, H, D] at shuffled blocks among
    blocks of other values (a partial last block when BS does not divide T)."""
    from flashloop_backend.kv.rows import KVRows

    out = []
    for k, v in zip(keys, values, strict=True):
        count, layers, heads, dim = k.shape
        used = -(-count // block_size)
        shape = (2 * used + 1, layers, block_size, heads, dim)
        pools = [torch.randn(shape, generator=rng).to(k.device, k.dtype) for _ in range(2)]
        blocks = torch.randperm(shape[0], generator=rng)[:used].to(k.device)
        for pool, rows in zip(pools, (k, v), strict=True):
            for index in range(used):
                part = rows[index * block_size : (index + 1) * block_size]
                pool[blocks[index], :, : part.shape[0]] = part.transpose(0, 1)
        out.append(KVRows.paged(pools[0], pools[1], blocks, count))
    return out


def test_a_refused_append_takes_no_page_nor_reservation(rng):
    """Rows that do not fit the pools are refused by name before any page is taken; a
    writer that refuses its input (here the Triton writer, whose tiles need power-of-two
    groups) gives back the pages and the reservation it was handed."""

    from flashloop_backend.kernels.triton.encode import encode_levels_triton

    keys, values = ([x.to(DEVICE) for x in _versions(rng, 32)] for _ in range(2))
    store = PackedKVStore(24, L, H, D, G, device=DEVICE)
    with pytest.raises(ValueError, match=r"must be \[L, Hkv, D\] = \[2, 2, 32\].*got \[1, 2, 32\]"):
        store.append(0, [k[:, :1] for k in keys], [v[:, :1] for v in values])
    odd = PackedKVStore(24, L, H, 96, 12, device=DEVICE)  # group 12, head_dim 96
    odd.reserve(0, 8)
    free = list(odd._free)
    wide = [torch.cat([k[:24]] * 3, dim=-1) for k in keys]
    with pytest.raises(ValueError, match="group_size=12 and head_dim=96 must be powers of two"):
        odd.append(0, wide, wide, write=encode_levels_triton)
    assert odd._free == free and odd.unreserved_pages() == 24 - 8
    elsewhere = [k.to("meta") for k in keys]  # rows on another device than the pools
    with pytest.raises(ValueError, match=f"depth 0: K/V on meta, the store on {DEVICE}"):
        store.append(0, elsewhere, elsewhere, write=encode_levels_triton)
    for bad in (store, odd):
        assert bad.accounting()["pages_used"] == 0 and bad.sequences == {}


def test_each_provider_registers_a_level_writer_that_writes_the_chains_pages(rng):
    """``packed_kv_write`` of the torch and the Triton provider, as the backend takes it
    (``PackedState`` hands it to the store's append): the chain's pages, bit for bit."""
    from flashloop_backend.kernels import torch_ref, triton
    from flashloop_backend.kernels.op_protocols import OpName

    active = [torch.ones(32, dtype=torch.bool)] * 2 + [torch.arange(32) % 2 == 0] * 2
    keys, values = ([x.to(DEVICE) for x in _versions(rng, 32)] for _ in range(2))
    marks = [a.to(DEVICE) for a in active]
    chain = PackedKVStore(24, L, H, D, G, device=DEVICE)
    chain.append(0, keys, values, marks)
    for provider in (torch_ref.provider(), triton.provider()):
        store = PackedKVStore(24, L, H, D, G, device=DEVICE)
        write = provider.impls[OpName.PACKED_KV_WRITE].fn
        store.append(0, keys, values, marks, write=write)
        for expected, got in zip(chain.pools, store.pools, strict=True):
            assert torch.equal(expected, got), provider.name


def test_append_extends_levels_and_a_dense_level_turns_compact(rng):
    rows = 32
    first_k, first_v = _versions(rng, rows), _versions(rng, rows)
    second_k, second_v = _versions(rng, rows), _versions(rng, rows)
    active = [torch.ones(rows, dtype=torch.bool)] * 3 + [torch.arange(rows) % 2 == 0]
    store = PackedKVStore(32, L, H, D, G)
    store.append(4, first_k, first_v)  # dense on every level
    store.append(4, second_k, second_v, active)  # level 3: only even rows recomputed
    entry = store.sequences[4]
    assert entry.rows == 64 and entry.maps[:3] == [None, None, None]
    assert entry.maps[3][:32].tolist() == list(range(32))  # identity for the dense part
    assert (
        entry.maps[3][32::2].tolist() == list(range(32, 48)) and (entry.maps[3][33::2] == -1).all()
    )
    first = encode_compact_chain(first_k, [torch.ones(rows, dtype=torch.bool)] * 4, G, 0)
    second = encode_compact_chain(second_k, active, G, 0)
    for depth in range(4):
        k, _ = store.reconstruct(4, depth, 0)
        expected = torch.cat(
            [reconstruct_compact(first, depth), reconstruct_compact(second, depth)]
        )
        torch.testing.assert_close(k, expected[:, 0], atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="already encoded"):
        store.encode(4, first_k, first_v)


def test_info_reports_packed_bytes_from_a_real_store(tmp_path):
    import json
    import subprocess
    import sys

    config = tmp_path / "q.json"
    config.write_text(json.dumps({"kv_residual_quantization": {"enabled": True}}))
    result = subprocess.run(
        [sys.executable, "-m", "flashloop_backend.cli.main", "info", "--config", str(config), "--json"],
        capture_output=True, text=True,
    )  # fmt: skip
    kv = json.loads(result.stdout)["kv_bytes"]
    # Ouro-1.4B attention: 16 KV heads x 128 dims -> (64 + 8 + 64 + 8) bytes per head
    assert kv["packed_bytes_per_token_per_level_per_layer"] == 16 * 144
    assert kv["bf16_bytes_per_token_per_depth_per_layer"] == 16 * 512


def test_packed_reader_rejects_bad_metadata(rng):
    from flashloop_backend.kernels.triton.packed_decode import packed_decode_triton
    from flashloop_backend.kv.levels import level_metadata

    store = PackedKVStore(8, L, H, D, G, device=DEVICE)
    store.encode(
        0, [k.to(DEVICE) for k in _versions(rng, 16)], [v.to(DEVICE) for v in _versions(rng, 16)]
    )
    meta = level_metadata(store, [0], [1], DEVICE)
    cache = torch.zeros(2, 16, H, D, device=DEVICE)
    args = (torch.zeros(1, H, D, device=DEVICE), store, 0)
    tail = (cache, cache, torch.zeros(1, 2, dtype=torch.int32, device=DEVICE),
            torch.tensor([16], dtype=torch.int32, device=DEVICE))  # fmt: skip
    bad = dataclasses.replace(meta, packed_lengths=meta.packed_lengths.long())
    with pytest.raises(ValueError, match=r"meta\.packed_lengths must be int32"):
        packed_decode_triton(*args, bad, *tail)
    short = dataclasses.replace(meta, kinds=meta.kinds[:, :1])
    with pytest.raises(ValueError, match="metadata rows/levels disagree"):
        packed_decode_triton(*args, short, *tail)


def test_plane_rows_read_each_position_of_each_plane(rng):
    """Rows [start, end) of every plane in place, in position order, across blocks and a
    partial last block: gathered, what a slot-by-slot read of the pools gives."""
    from flashloop_backend.host.kvcache import PagedKVCache

    kv = PagedKVCache(40, 3, 4, 2, 8, 2, torch.float32, "cpu")
    kv.reserve(7, 4)
    kv.reserve(0, 22)  # interleaved with another request: its blocks are not consecutive
    kv.reserve(7, 16)
    kv.key_pool.copy_(torch.randn(kv.key_pool.shape, generator=rng))
    kv.value_pool.copy_(torch.randn(kv.value_pool.shape, generator=rng))
    planes = kv.plane_rows(0, 4, 22)
    assert all(p.keys.data_ptr() == kv.key_pool.data_ptr() for p in planes)  # no copy
    for depth in range(2):
        keys, values = planes[depth].gather()
        where = [divmod(slot, 4) for slot in kv.slots(0, depth, list(range(4, 22)))]
        expected_k = torch.stack([kv.key_pool[b, :, o] for b, o in where])
        expected_v = torch.stack([kv.value_pool[b, :, o] for b, o in where])
        torch.testing.assert_close(keys, expected_k, rtol=0, atol=0)
        torch.testing.assert_close(values, expected_v, rtol=0, atol=0)
        assert planes[depth].shape == keys.shape == (18, 3, 2, 8)


def test_cache_and_store_refuse_bad_packing_requests(rng):
    from flashloop_backend.host.kvcache import PagedKVCache

    kv = PagedKVCache(16, 1, 4, 1, 16, 2, torch.float32, "cpu")
    kv.reserve(0, 16)
    with pytest.raises(ValueError, match="num_tokens=6 is not a multiple of block_size=4"):
        kv.drop_prefix(0, 6)
    with pytest.raises(ValueError, match="start=2 is not a multiple of block_size=4"):
        kv.plane_rows(0, 2, 8)
    assert kv.drop_prefix(0, 8) == 4
    with pytest.raises(ValueError, match=r"positions \[0, 12\) of request 0 were freed"):
        kv.plane_rows(0, 0, 12)
    store = PackedKVStore(16, L, H, D, G)
    store.append(0, _versions(rng, 16), _versions(rng, 16))
    with pytest.raises(ValueError, match="sequence 0 has 4 depths; got 2"):
        store.append(0, _versions(rng, 16, 2), _versions(rng, 16, 2))


def test_a_cache_refuses_bad_plane_carries_by_name():
    """Bad carry_rows at reserve, carries out of order or past the carried rows, and a
    write slot on a block not yet carried: refused naming the values, nothing taken."""
    from flashloop_backend.host.kvcache import OutOfBlocksError, PagedKVCache

    kv = PagedKVCache(20, 1, 4, 1, 16, 3, torch.float32, "cpu")
    with pytest.raises(ValueError, match="carry_rows=6 must be a multiple of block_size=4"):
        kv.reserve(0, 16, carry_rows=6)
    with pytest.raises(ValueError, match="carry_rows=20 must be a multiple of block_size=4"):
        kv.reserve(0, 16, carry_rows=20)
    with pytest.raises(OutOfBlocksError, match=r"needs 44 more KV blocks .* 20 of 20 are free"):
        kv.reserve(0, 80, carry_rows=32)  # 20 blocks now, 2 x 12 promised
    assert (kv.free_blocks, kv.promised_blocks) == (20, 0) and not kv.has(0)
    kv.reserve(0, 18, carry_rows=12)  # 5 blocks a plane: 5 now, 2 x 2 promised
    assert (kv.free_blocks, kv.promised_blocks) == (11, 4)
    with pytest.raises(ValueError, match=r"no block for positions \[0\]\.\.\. on plane 1"):
        kv.slots(0, 1, [0])
    with pytest.raises(ValueError, match=r"plane 2 cannot take rows \[0, 12\) of plane 1"):
        kv.carry_plane(0, 1, 12)
    with pytest.raises(ValueError, match=r"plane 1 cannot take rows \[0, 16\) of plane 0"):
        kv.carry_plane(0, 0, 16)
    with pytest.raises(ValueError, match=r"plane 1 cannot take rows \[0, 8\) of plane 0 \(whole"):
        kv.carry_plane(0, 0, 8, whole=True)
    kv.carry_plane(0, 0, 12, whole=True, copy_rows=16)
    assert kv.slots(0, 1, [0, 17]) == [kv.block_table(0, 1)[0] * 4, kv.block_table(0, 1)[4] * 4 + 1]
    assert (kv.free_blocks, kv.promised_blocks) == (11, 2)
    kv.release(0)
    assert (kv.free_blocks, kv.promised_blocks) == (20, 0)


def test_backend_refuses_an_unplanned_packed_batch(rng):
    from flashloop_backend.backends.packed_state import PackedState
    from flashloop_backend.dispatch import BatchView

    state = PackedState(PackedKVStore(4, L, H, D, G), None, "fixed_prompt", 64)
    one = torch.zeros(1, dtype=torch.int64)
    view = BatchView(one, one, one.to(torch.int8), one, one, one, one, one.int() + 1,
                     torch.zeros(1, 1, 1, dtype=torch.int32))  # fmt: skip
    with pytest.raises(RuntimeError, match="packed KV metadata was not planned for this batch"):
        state.meta_for(view, torch.zeros(1, dtype=torch.long))
    state.plan(view, [-1], [0])  # a row without packed data reads BF16 only
    meta = state.meta_for(view, torch.zeros(1, dtype=torch.long))
    assert meta.packed_lengths.tolist() == [0] and meta.kinds.tolist() == [[2]]


def test_a_mixed_batch_plans_packed_metadata_for_its_decode_rows_only(rng):
    """The host lists the decode rows only: the plan covers them in the decode-first order
    the readers take, equal to those rows of a full plan."""
    from flashloop_backend.backends.packed_state import PackedState
    from flashloop_backend.dispatch import BatchView, RowMode
    from flashloop_backend.kv.levels import level_metadata

    (_, store, *_), _ = _sparse_case(rng)
    state = PackedState(store, None, "fixed_prompt", 64)
    modes = torch.tensor(
        [RowMode.PREFILL, RowMode.DECODE, RowMode.PREFILL, RowMode.DECODE], dtype=torch.int8
    )
    rows = torch.zeros(4, dtype=torch.int64)
    view = BatchView(rows, rows, modes, rows, rows, rows, rows, rows.int() + 1,
                     torch.zeros(1, 4, 1, dtype=torch.int32), decode_bound=2)  # fmt: skip
    state.plan(view, [1, 0], [2, 3])
    meta = state.meta_for(view, torch.tensor([1, 3, 0, 2]))
    expected = level_metadata(store, [1, 0], [2, 3], "cpu")
    names = ("tables", "maps", "kinds", "packed_lengths")
    assert all(torch.equal(getattr(meta, n), getattr(expected, n)) for n in names)
    with pytest.raises(ValueError, match="plan got 3 rows but the batch has decode_bound=2"):
        state.plan(view, [1, 1, 0], [2, 1, 3])


@pytest.mark.parametrize(
    ("sample", "block_n"), [(16, 32), (4096, 32), (4096, 16)],
    ids=["sample16", "sample64", "sample64_block16"],
)  # fmt: skip
def test_triton_packed_source_matches_the_reference_statistics(rng, sample, block_n):
    from flashloop_backend.kernels.torch_ref.packed import packed_dense_source
    from flashloop_backend.kernels.triton.dense_source import SelectTuning
    from flashloop_backend.kernels.triton.packed_sparse import (
        SELECTED_READ_TOLERANCE,
        packed_dense_source_triton,
    )

    args, lengths = _sparse_case(rng)
    ref = packed_dense_source(*args, lengths, 0.25, 16)
    small = SelectTuning(sample=min(sample, 64), candidates=64 if sample > 16 else 16, block=16)
    got = packed_dense_source_triton(*args, lengths, 0.25, 16, tuning=small, block_n=block_n)
    for name, r, g in zip(
        ("out", "indices", "mass", "output", "contribution"), ref, got, strict=True
    ):
        if name == "indices":  # both in position order, unused slots last
            assert torch.equal(r, g), name
        else:  # the contribution sums the selected keys' values in FP16 products
            tol = SELECTED_READ_TOLERANCE if name == "contribution" else 2e-5
            torch.testing.assert_close(g, r, atol=tol, rtol=tol, msg=name)
    assert (got[1] >= 0).sum(-1).tolist() == [[10, 10], [13, 13], [8, 8]]  # ceil(0.25 T)


@pytest.mark.parametrize("impl", ["dense_torch", "dense_triton", "packed_torch", "packed_triton"])
def test_every_source_gives_zeros_for_a_row_of_context_length_0(impl, rng):
    """The contract that lets a loop-2 source's output be a batch's base (BASE_OUTPUT_OPS):
    a row of length 0 (one the source does not serve) selects nothing and its out, dense
    output, mass and contribution are zeros, in every CPU implementation (the CUDA source
    equals the torch reference on such a row in its GPU test)."""
    from flashloop_backend.kernels.op_inputs import BASE_OUTPUT_OPS
    from flashloop_backend.kernels.op_protocols import OpName
    from flashloop_backend.kernels.torch_ref.packed import packed_dense_source
    from flashloop_backend.kernels.torch_ref.sparse_decode import dense_source
    from flashloop_backend.kernels.triton.dense_source import dense_source_triton
    from flashloop_backend.kernels.triton.packed_sparse import packed_dense_source_triton

    assert {OpName.DENSE_SOURCE, OpName.PACKED_SOURCE} <= BASE_OUTPUT_OPS
    args, lengths = _sparse_case(rng)
    lengths = lengths.clone()
    lengths[1] = 0
    q, cache_k, cache_v = args[0], args[4], args[5]
    paged = (q, cache_k, cache_v, args[6].clamp(min=0), lengths, 0.25, 16)  # BF16 pages only
    fn = {
        "dense_torch": lambda: dense_source(*paged),
        "dense_triton": lambda: dense_source_triton(*paged),
        "packed_torch": lambda: packed_dense_source(*args, lengths, 0.25, 16),
        "packed_triton": lambda: packed_dense_source_triton(*args, lengths, 0.25, 16),
    }[impl]
    out, indices, mass, output, contribution = fn()
    assert (indices[1] == -1).all()
    for t in (out, mass, output, contribution):
        assert not t[1].any()
    assert out[0].any() and out[2].any()


@pytest.mark.parametrize("group", GROUPS)
def test_a_row_without_selected_keys_gives_output_minus_contribution(group, rng):
    """The packed correction over dense and compact levels and BF16 tails, with unused
    (-1) slots, gives the reference correction; a row with no selected key (only a row
    routed elsewhere has none) gives output - contribution in every implementation, the
    reference included."""
    from flashloop_backend.kernels.torch_ref.packed import (
        packed_dense_source,
        packed_sparse_correction,
    )
    from flashloop_backend.kernels.triton.packed_sparse import packed_sparse_correction_triton

    args, lengths = _sparse_case(rng, group)
    _, indices, mass, output, contribution = packed_dense_source(*args, lengths, 0.25, 16)
    assert (indices < 0).any() and (indices >= 0).all(-1).logical_not().all()
    unselected = indices.clone()
    unselected[2] = -1
    for chosen in (indices, unselected):
        state = (chosen, mass, output, contribution)
        got = packed_sparse_correction_triton(*args, *state)
        reference = packed_sparse_correction(*args, *state)
        torch.testing.assert_close(got, reference, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(got[2], output[2] - contribution[2], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("block_n", [32, 16])
def test_triton_packed_correction_reads_only_the_selected_keys_like_the_reference(rng, block_n):
    from flashloop_backend.kernels.torch_ref.packed import (
        packed_dense_source,
        packed_sparse_correction,
    )
    from flashloop_backend.kernels.triton.packed_sparse import (
        SELECTED_READ_TOLERANCE,
        packed_sparse_correction_triton,
    )

    args, lengths = _sparse_case(rng)
    _, indices, mass, output, contribution = packed_dense_source(*args, lengths, 0.25, 16)
    state = (indices, mass, output, contribution)
    tol = SELECTED_READ_TOLERANCE
    torch.testing.assert_close(packed_sparse_correction_triton(*args, *state, block_n=block_n),
                               packed_sparse_correction(*args, *state), atol=tol, rtol=tol)  # fmt: skip


def test_packed_sparse_wrappers_name_bad_inputs(rng):
    from flashloop_backend.kernels.triton.packed_decode import packed_decode_triton
    from flashloop_backend.kernels.triton.packed_sparse import packed_dense_source_triton

    args, lengths = _sparse_case(rng)
    q, store, layer, meta, cache_k, cache_v, tables = args
    positions = torch.zeros(3, H, 4, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="k_bucket=4 cannot hold the 16 keys selected from 64"):
        packed_dense_source_triton(*args, lengths, 0.25, 4)
    short = torch.empty(3, H, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"logits must be \[3, 2, >= 64\]"):
        packed_decode_triton(*args, lengths, logits=short, lse=torch.empty(3, H, device=DEVICE))
    from flashloop_backend.kernels.triton.packed_sparse import packed_selected_parts

    with pytest.raises(ValueError, match=r"indices must be int32 \[3, 2, Kb\]; got torch.int64"):
        packed_selected_parts(*args, positions, 1.0)
    with pytest.raises(ValueError, match="block_n=8 must be one of 16, 32, 64"):
        packed_selected_parts(*args, positions.int(), 1.0, block_n=8)
    with pytest.raises(ValueError, match="num_warps=3 must be one of 1, 2, 4, 8"):
        packed_selected_parts(*args, positions.int(), 1.0, num_warps=3)
    with pytest.raises(ValueError, match="page_window=8 must be 16 or 32"):
        packed_selected_parts(*args, positions.int(), 1.0, page_window=8)
    with pytest.raises(ValueError, match="does not fit the store"):
        packed_selected_parts(q, store, layer, meta, cache_k[:, :, :1], cache_v[:, :, :1], tables,
                              positions.int(), 1.0)  # fmt: skip
    from flashloop_backend.kv.levels import level_metadata

    with pytest.raises(ValueError, match=r"metadata widths \(1, 1, 1\) are below this batch's"):
        level_metadata(store, [0, 1, 1], [3, 2, 3], DEVICE, widths=(1, 1, 1))


def test_level_metadata_repeats_and_unpacked_rows_cost_no_row_tensors(rng, monkeypatch):
    """Rows of one (sequence, depth) get the first such row's metadata; rows not packed
    (prefill chunks, padding) keep the fill values without any per-row tensor: a 32K x 16
    prefill step has 32K of them."""
    from flashloop_backend.kv.levels import level_metadata

    (_, store, *_), _ = _sparse_case(rng)
    sequences, depths = [0, 1, 1], [3, 2, 3]
    alone = level_metadata(store, sequences, depths, "cpu")
    made = []
    real = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: made.append(1) or real(*a, **k))
    batch = [None, 7, 0, 1, 0, 1] + [None] * 1000  # 7: not in the store
    meta = level_metadata(store, batch, [0, 0, 3, 2, 3, 3] + [1] * 1000, "cpu")
    per_row = len(made)
    for name in ("tables", "maps", "kinds", "packed_lengths"):
        tensor = getattr(meta, name)
        for i, j in ((2, 0), (3, 1), (4, 0), (5, 2)):
            assert torch.equal(tensor[i], getattr(alone, name)[j]), (name, i)
        empty = tensor[[0, 1, *range(6, 1006)]]
        fill = {"kinds": 2, "packed_lengths": 0}.get(name, -1)
        assert (empty == fill).all(), name
    made.clear()
    level_metadata(store, [0, 1, 1], [3, 2, 3], "cpu")
    assert per_row == len(made)  # the repeated and unpacked rows added no tensors


def test_triton_packed_selected_keys_split_over_programs(rng, monkeypatch):
    """Correction and loop-2 contribution with the selected keys split over several
    programs (4 keys per split) equal the reference, like one split does."""
    from flashloop_backend.kernels.torch_ref.packed import (
        packed_dense_source,
        packed_sparse_correction,
    )
    from flashloop_backend.kernels.triton import packed_sparse
    from flashloop_backend.kernels.triton.dense_source import SelectTuning

    monkeypatch.setattr(packed_sparse, "KEYS_PER_SPLIT", 4)
    args, lengths = _sparse_case(rng)
    ref = packed_dense_source(*args, lengths, 0.25, 16)
    small = SelectTuning(sample=16, candidates=16, block=16)
    got = packed_sparse.packed_dense_source_triton(*args, lengths, 0.25, 16, tuning=small)
    tol = packed_sparse.SELECTED_READ_TOLERANCE
    torch.testing.assert_close(got[4], ref[4], atol=tol, rtol=tol, msg="contribution")
    state = ref[1:]
    torch.testing.assert_close(packed_sparse.packed_sparse_correction_triton(*args, *state),
                               packed_sparse_correction(*args, *state), atol=tol, rtol=tol)  # fmt: skip


def test_torch_reference_reader_refuses_metadata_for_fewer_rows_than_queries(rng):
    from flashloop_backend.kernels.torch_ref.packed import packed_decode_reference
    from flashloop_backend.kv.levels import level_metadata

    store = PackedKVStore(8, L, H, D, G)
    store.encode(0, *(_versions(rng, G),) * 2)
    meta = level_metadata(store, [0], [0], "cpu")  # one row planned
    q = torch.randn(2, H, D, generator=rng)  # two query rows
    cache = torch.randn(4, 16, H, D, generator=rng)
    tables = torch.zeros(2, 4, dtype=torch.int32)
    lengths = torch.tensor([G, G], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"tables \(1, 1, 1\).*for 2 rows"):
        packed_decode_reference(q, store, 0, meta, cache, cache, tables, lengths)


def test_kv_rows_refuse_what_they_cannot_address_by_name():
    from flashloop_backend.kv.rows import KVRows

    pool = torch.zeros(6, 2, 4, 2, 8)
    blocks = torch.tensor([3, 1])
    rows = KVRows.paged(pool, pool.clone(), blocks, 7)
    assert rows.shape == (7, 2, 2, 8) and rows.block_size == 4
    with pytest.raises(ValueError, match=r"7 rows in blocks of 4 need blocks \[2\]; got \(3,\)"):
        KVRows.paged(pool, pool, torch.tensor([0, 1, 2]), 7)
    with pytest.raises(ValueError, match=r"\[blocks, L, block_size, Hkv, D\] pools of one shape"):
        KVRows.paged(pool, pool[:, :1], blocks, 7)
    with pytest.raises(ValueError, match="unit stride on D"):
        KVRows.paged(pool.transpose(3, 4), pool.transpose(3, 4), blocks, 7)
    with pytest.raises(ValueError, match=r"blocks must be int64; got torch\.int32"):
        KVRows.paged(pool, pool, blocks.int(), 7)
    with pytest.raises(ValueError, match=r"span devices \['cpu', 'meta'\]"):
        KVRows.paged(pool, pool, blocks.to("meta"), 7)
    with pytest.raises(ValueError, match=r"\[T, L, Hkv, D\] of one shape; got \(4, 2, 8\)"):
        KVRows.contiguous(pool[0, 0], pool[0, 0])
    empty = KVRows.contiguous(torch.zeros(0, 2, 2, 8), torch.zeros(0, 2, 2, 8))
    assert empty.shape == (0, 2, 2, 8) and empty.gather()[0].shape == (0, 2, 2, 8)
    strided = torch.randn(8, 2, 2, 16)[..., ::2]  # no unit stride: copied once
    k, _ = KVRows.contiguous(strided, strided).gather()
    assert torch.equal(k, strided)


def test_a_reused_sequence_id_gets_fresh_graph_metadata(rng):
    """A runtime may reuse a request id once the request has left: the store gives the new
    sequence a new entry version, so graph buffers holding the old one's page tables and
    maps rewrite them (a dense prompt, then a compact one under the same id)."""
    from flashloop_backend.backends.packed_state import PackedState
    from flashloop_backend.kv.levels import LevelKind, level_metadata

    store = PackedKVStore(24, L, H, D, G)
    state = PackedState(store, None, "fixed_prompt", G)
    state.reserve_graph_inputs(2, 64, 4)
    keys, values = _versions(rng, 32), _versions(rng, 32)
    store.append(5, keys, values)
    state.plan_graph_step([5, None], [3, 0])
    store.release(5)
    sparse = [torch.ones(32, dtype=torch.bool)] * 2 + [torch.arange(32) % 2 == 0] * 2
    store.append(5, keys, values, sparse)
    state.plan_graph_step([5, None], [3, 0])
    expected = level_metadata(store, [5], [3], "cpu")
    graph = state._graph.meta
    for depth in range(4):
        pages = expected.tables[0, depth]
        assert torch.equal(graph.tables[0, depth, : pages.numel()], pages)
        rows = expected.maps[0, depth]
        assert torch.equal(graph.maps[0, depth, : rows.numel()], rows)
    for depth in (0, 2, 1, 3):  # the kinds and lengths each step's depths read
        state.plan_graph_step([5, None], [depth, 0])
        expected = level_metadata(store, [5, None], [depth, 0], "cpu")
        assert torch.equal(graph.kinds[:, : depth + 1], expected.kinds)
        assert torch.equal(graph.packed_lengths, expected.packed_lengths)
    assert graph.kinds[0, 3] == LevelKind.COMPACT and graph.packed_lengths.tolist() == [32, 0]


def test_shared_rows_are_held_by_every_holder_and_freed_by_the_last(rng):
    """A sequence starts from another's first whole groups without copying them: it
    reconstructs their values, appends its own rows after them, and a page returns to the
    pool only when its last holder (owner, adopter or share) gives it back."""
    keys, values = _versions(rng, 48), _versions(rng, 48)
    store = PackedKVStore(40, L, H, D, G)
    store.encode(1, keys, values)
    assert store.share(1, 0) is None and store.share(9, 32) is None
    shared = store.share(1, 40)  # rounded down to whole groups
    assert shared.rows == 32 and [len(level) for level in shared.pages] == [2] * 4
    assert store.adopt(2, shared, 20) == 16  # at most what it asks, in whole groups
    more_k, more_v = _versions(rng, 32), _versions(rng, 32)
    store.append(2, [k[16:] for k in more_k], [v[16:] for v in more_v])
    assert store.sequences[2].rows == 32
    for depth in (0, 3):
        mine, theirs = store.reconstruct(2, depth, 1), store.reconstruct(1, depth, 1)
        torch.testing.assert_close(mine[0][:16], theirs[0][:16], atol=0, rtol=0)
        assert not torch.equal(mine[0][16:], theirs[0][16:32])  # its own rows after them
    assert store.accounting()["pages_used"] == 4 * 3 + 4 * 1  # sequence 1's 12, 2's own 4
    with pytest.raises(ValueError, match="sequence 2 is already stored"):
        store.adopt(2, shared, 16)
    store.release(1)  # the share and sequence 2 still hold its first two groups
    assert store.accounting()["pages_used"] == 4 * 2 + 4
    store.drop(shared)  # sequence 2 still holds the first group
    assert store.accounting()["pages_used"] == 4 + 4
    store.release(2)
    assert store.accounting()["pages_used"] == 0 and store.unreserved_pages() == 40


def test_a_compact_level_is_shared_only_whole_up_to_an_append_boundary(rng):
    """A compact level's pages follow its appends: rows that ended an append are shared
    with their map, and an adopter takes all of them or none; what it appends after them
    starts fresh pages and leaves the shared rows as they were."""

    def active(rows, offset):
        return [torch.ones(rows, dtype=torch.bool)] * 3 + [(torch.arange(rows) + offset) % 3 == 0]

    keys, values = _versions(rng, 64), _versions(rng, 64)
    store = PackedKVStore(40, L, H, D, G)
    store.encode(1, [k[:32] for k in keys], [v[:32] for v in values], active(32, 0))
    store.append(1, [k[32:] for k in keys], [v[32:] for v in values], active(32, 32))
    assert store.share(1, 48) is None  # inside the second append: its pages hold both sides
    shared = store.share(1, 40)  # rounded down to 32: the first append's end
    assert shared.rows == 32 and shared.compact and shared.maps[:3] == (None, None, None)
    assert store.adoptable(shared, 16) == 0 and store.adopt(2, shared, 16) == 0
    assert 2 not in store.sequences
    assert store.adopt(2, shared, 40) == 32
    own_k, own_v = _versions(rng, 32), _versions(rng, 32)
    store.append(2, own_k, own_v, active(32, 1))
    for depth in range(4):
        mine, theirs = store.reconstruct(2, depth, 0), store.reconstruct(1, depth, 0)
        torch.testing.assert_close(mine[0][:32], theirs[0][:32], atol=0, rtol=0)
        torch.testing.assert_close(mine[1][:32], theirs[1][:32], atol=0, rtol=0)
    assert torch.equal(store.sequences[2].host_maps[3][:32], store.sequences[1].host_maps[3][:32])
    store.release(1)
    store.drop(shared)
    store.release(2)
    assert store.accounting()["pages_used"] == 0


def test_an_encoding_2_export_is_refused_by_name(rng):
    """A request exported by an encoding-2 store (separate pools, V channel-major) is not
    read as blocks: the import names the version and takes nothing."""
    store = PackedKVStore(16, L, H, D, G)
    store.encode(0, _versions(rng, 32), _versions(rng, 32))
    exported = store.export_sequence(0)
    older = {"levels": exported["levels"]}
    for depth in range(4):
        for name in ("k_codes", "k_min", "k_scale", "v_codes", "v_min", "v_scale"):
            older[f"level{depth}.{name}"] = torch.zeros(2, 1, dtype=torch.uint8)
    fresh = PackedKVStore(16, L, H, D, G)
    with pytest.raises(ValueError, match=r"encoding version 2's.*encoding version 3"):
        fresh.import_sequence(1, older)
    assert fresh.sequences == {} and fresh.unreserved_pages() == 16
    fresh.import_sequence(1, exported)  # its own version's export round-trips
    for depth in range(4):
        got, want = fresh.reconstruct(1, depth, 1), store.reconstruct(0, depth, 1)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
