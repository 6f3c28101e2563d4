"""The vllm-rlt adapter called exactly as vllm-rlt calls its factory."""

import types
from dataclasses import dataclass

import pytest
import torch

from flashloop_backend.kernels.torch_ref.paged import paged_attention


@pytest.fixture
def adapter(installed_plugins, on_path):
    on_path(installed_plugins["vllm_rlt"])
    import flashloop_vllm_rlt

    return flashloop_vllm_rlt


def _inputs(rng, hq, hkv, dim, block=4):
    kc = torch.randn(10, block, hkv, dim, generator=rng)
    vc = torch.randn(10, block, hkv, dim, generator=rng)
    q = torch.randn(3, hq, dim, generator=rng)
    tables = torch.tensor([[2, 7, -1], [5, 0, 0], [9, 9, 9]], dtype=torch.int32)
    lengths = torch.tensor([6, 3, 0], dtype=torch.int32)
    return q, kc, vc, tables, lengths


@pytest.mark.parametrize(("hq", "hkv", "dim"), [(2, 2, 20), (4, 2, 12), (6, 3, 16)])
def test_contract_torch(adapter, rng, hq, hkv, dim):
    backend = adapter.create_backend("torch", "cpu", torch.float32, dim, 4)
    args = _inputs(rng, hq, hkv, dim)
    out = backend(*args)
    torch.testing.assert_close(out, paged_attention(*args))
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    assert backend.info.requested_backend == backend.info.selected_backend == "torch"
    assert isinstance(backend.capabilities.cuda_graphs, bool)
    assert backend.capabilities.cuda_graphs is False  # CPU reference


def test_head_count_mismatch_names_both(adapter, rng):
    backend = adapter.create_backend("torch", "cpu", torch.float32, 16, 4)
    q, kc, vc, tables, lengths = _inputs(rng, 3, 2, 16)
    with pytest.raises(
        ValueError, match=r"query heads \(3\) must be a positive multiple of KV heads \(2\)"
    ):
        backend(q, kc, vc, tables, lengths)


def test_auto_and_explicit_selection(adapter):
    auto = adapter.create_backend("auto", "cpu", torch.float32, 128, 16)
    assert auto.info.requested_backend == "auto" and auto.info.selected_backend in (
        "flashloop",
        "torch",
    )
    assert "priority" in auto.info.selection_reason
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device='cpu' is not supported"):
            adapter.create_backend("triton", "cpu", torch.float32, 128, 16)
    with pytest.raises(ValueError, match="unknown backend 'fa5'"):
        adapter.create_backend("fa5", "cpu", torch.float32, 128, 16)


def test_required_capabilities_as_names_and_flags(adapter):
    @dataclass
    class Flags:
        packed_prefill: bool = False
        cuda_graphs: bool = False
        async_scheduling: bool = True

    ok = adapter.create_backend(
        "torch", "cpu", torch.float32, 64, 16, required_capabilities=Flags()
    )
    assert ok.capabilities.async_scheduling
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cuda_graphs"):
            adapter.create_backend(
                "torch", "cpu", torch.float32, 64, 16, required_capabilities=["cuda_graphs"]
            )
    with pytest.raises(ValueError, match="unknown capability 'warp_drive'"):
        adapter.create_backend(
            "torch", "cpu", torch.float32, 64, 16, required_capabilities=["warp_drive"]
        )


def test_prefill_equals_per_row_calls(adapter, rng):
    backend = adapter.create_backend("torch", "cpu", torch.float32, 16, 4)
    kc = torch.randn(10, 4, 2, 16, generator=rng)
    q = torch.randn(5, 2, 16, generator=rng)
    tables = torch.tensor([[1, 2, 3], [4, 5, -1]], dtype=torch.int32)
    lengths = torch.tensor([10, 6], dtype=torch.int32)  # seq 0: rows 0-2 = positions 7..9
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    out = backend.prefill(q, kc, kc, tables, lengths, cu, 3)
    per_row_tables = tables[torch.tensor([0, 0, 0, 1, 1])]
    per_row_lengths = torch.tensor([8, 9, 10, 5, 6], dtype=torch.int32)
    torch.testing.assert_close(out, paged_attention(q, kc, kc, per_row_tables, per_row_lengths))


def test_install_hook_routes_known_names(adapter):
    calls = []

    def original(backend, device, dtype, head_dim, block_size, *, required_capabilities=()):
        calls.append(backend)
        return "original"

    fake = types.ModuleType("fake_vllm_rlt_backend")
    fake.create_backend = original
    adapter.install(fake)
    assert fake.create_backend("FA4", "cpu", torch.float32, 128, 16) == "original"
    routed = fake.create_backend("flashloop", "cpu", torch.float32, 128, 16)
    assert routed.info.selected_backend == "flashloop"
    adapter.uninstall(fake)
    assert fake.create_backend is original and calls == ["FA4"]
