"""The CUDA level writer (``kernels/cuda/encode_level.cu``, ``packed_kv_write``) against
the torch chain, bit for bit, on the GPU; the inputs it refuses, by name, anywhere."""

import pytest
import torch

from flashloop_backend.kernels.cuda.encode_level import (
    LevelWriterTuning,
    encode_levels_cuda,
)
from flashloop_backend.kv.rows import KVRows
from flashloop_backend.kv.store import PackedKVStore

from .test_packed_kv import _paged

LAYERS, HEADS, DIM = 2, 4, 128


def _versions(gen, rows, device, depths=4):
    """K or V of ``rows`` rows at every depth [T, L, H, D] bf16; later depths change less."""
    base = torch.randn(rows, LAYERS, HEADS, DIM, generator=gen, device=device)
    out = [base]
    for _ in range(depths - 1):
        out.append(
            out[-1] + 0.3 * torch.randn(rows, LAYERS, HEADS, DIM, generator=gen, device=device)
        )
    out[0][:, 0, 0, :8] = 0.5  # K groups (channels across rows) of scale 0 at level 0
    out[0][0, 1, 0, :] = 0.25  # and V groups (a row across channels) of scale 0
    return [x.to(torch.bfloat16) for x in out]


@pytest.mark.gpu
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("rows_per_thread", [1, 2, 4])
def test_the_cuda_level_writer_writes_the_chains_pages_bit_for_bit(group, rows_per_thread):
    """Dense levels, compact ones with a padded last page, a compact level of one row and
    one of none, an append of each: contiguous rows and rows in paged pools (a partial last
    block) give the chain's pools and pages, byte for byte."""
    if 16 * group // rows_per_thread > 1024:
        pytest.skip("more threads than a CTA holds")
    gen = torch.Generator(device="cuda").manual_seed(group + rows_per_thread)
    tuning = LevelWriterTuning(rows_per_thread=rows_per_thread)

    def write(*args):
        encode_levels_cuda(*args, tuning=tuning)

    rows = 3 * group  # an append holds whole groups; compact levels pad their last page
    dense = [torch.ones(rows, dtype=torch.bool, device="cuda")] * 4
    one_row = torch.zeros(rows, dtype=torch.bool, device="cuda")
    one_row[5] = True
    every_third = torch.arange(rows, device="cuda") % 3 == 0
    sparse = [*dense[:2], every_third, one_row]
    nothing = [*dense[:3], torch.zeros(rows, dtype=torch.bool, device="cuda")]
    pages = 4 * (3 * (rows // group + 1) + 2)
    stores = [PackedKVStore(pages, LAYERS, HEADS, DIM, group, device="cuda") for _ in range(3)]
    for active in (dense, sparse, nothing):
        keys, values = _versions(gen, rows, "cuda"), _versions(gen, rows, "cuda")
        stores[0].append(0, keys, values, active)
        stores[1].append(0, keys, values, active, write=write)
        paged = _paged(keys, values, torch.Generator().manual_seed(group), block_size=12)
        stores[2].append_rows(0, paged, active, write=write)
    for chain, *others in zip(*(store.pools for store in stores), strict=True):
        for other in others:
            assert torch.equal(chain, other)
    assert all(store.sequences[0].pages == stores[0].sequences[0].pages for store in stores)


@pytest.mark.gpu
def test_the_cuda_provider_serves_packed_kv_write_with_the_chains_pages():
    """``packed_kv_write`` as the registry picks it on a GPU for BF16 rows of head_dim 128:
    the CUDA provider's writer, the chain's pages."""
    from flashloop_backend.capabilities import SupportRequest
    from flashloop_backend.kernels.op_protocols import OpName
    from flashloop_backend.registry import Registry

    request = SupportRequest(device="cuda", dtype=torch.bfloat16, head_dim=DIM)
    choice = Registry.discover().select_kernel(OpName.PACKED_KV_WRITE, request)
    assert choice.provider.name == "cuda"
    gen = torch.Generator(device="cuda").manual_seed(7)
    keys, values = _versions(gen, 192, "cuda"), _versions(gen, 192, "cuda")
    active = [torch.ones(192, dtype=torch.bool, device="cuda")] * 3
    active.append(torch.arange(192, device="cuda") % 4 != 0)
    chain, cuda = (PackedKVStore(32, LAYERS, HEADS, DIM, 64, device="cuda") for _ in range(2))
    chain.append(0, keys, values, active)
    cuda.append(0, keys, values, active, write=choice.impl.fn)
    for expected, got in zip(chain.pools, cuda.pools, strict=True):
        assert torch.equal(expected, got)


def test_the_cuda_level_writer_names_what_it_does_not_write():
    """Group sizes, head sizes, dtypes, rows it cannot read as 4-byte pairs and launches of
    more than 1,024 threads are refused by name before any launch or build (the store's
    append then gives its pages back)."""
    rows = [torch.zeros(64, LAYERS, HEADS, DIM, dtype=torch.bfloat16)] * 4
    kv = [KVRows.contiguous(x, x) for x in rows]
    pages = [[0], [1], [2], [3]]
    with pytest.raises(ValueError, match=r"group_size=16 \(the CUDA level writer writes"):
        encode_levels_cuda(PackedKVStore(8, LAYERS, HEADS, DIM, 16), kv, [None] * 4, pages)
    with pytest.raises(ValueError, match="head_dim=64"):
        encode_levels_cuda(PackedKVStore(8, LAYERS, HEADS, 64, 64), kv, [None] * 4, pages)
    half = [KVRows.contiguous(x.half(), x.half()) for x in rows]
    with pytest.raises(ValueError, match=r"K/V must be bfloat16 \(got torch.float16\)"):
        encode_levels_cuda(PackedKVStore(8, LAYERS, HEADS, DIM, 64), half, [None] * 4, pages)
    shape = (1, LAYERS, 64, HEADS, DIM)
    flat = torch.zeros(1 + torch.Size(shape).numel(), dtype=torch.bfloat16)
    odd = flat[1:].view(shape)  # starts at an odd element: not 4-byte pairs
    shifted = [KVRows.paged(odd, odd, torch.zeros(1, dtype=torch.long), 64)] * 4
    with pytest.raises(ValueError, match=r"depth 0: K/V must start at an even element"):
        encode_levels_cuda(PackedKVStore(8, LAYERS, HEADS, DIM, 64), shifted, [None] * 4, pages)
    whole = torch.zeros(128, LAYERS, HEADS, DIM, dtype=torch.bfloat16)
    store = PackedKVStore(8, LAYERS, HEADS, DIM, 128)
    wide = LevelWriterTuning(rows_per_thread=1)
    with pytest.raises(ValueError, match=r"group_size=128 at rows_per_thread=1 needs 2048"):
        encode_levels_cuda(store, [KVRows.contiguous(whole, whole)] * 4, [None] * 4, pages, wide)
    with pytest.raises(ValueError, match="rows_per_thread=3 must be 1, 2 or 4"):
        encode_levels_cuda(
            PackedKVStore(8, LAYERS, HEADS, DIM, 64),
            kv,
            [None] * 4,
            pages,
            tuning=LevelWriterTuning(rows_per_thread=3),
        )
