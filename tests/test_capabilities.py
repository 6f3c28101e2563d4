"""Cases generated from the declarations themselves: a new capability, backend or kernel
implementation is covered by these tests the moment it is registered."""

import pytest
import torch

from flashloop_backend import FlashLoopConfig
from flashloop_backend.capabilities import (
    Capability,
    Environment,
    Support,
    SupportRequest,
    dtype_name,
    module_available,
    not_supported_reasons,
)
from flashloop_backend.registry import Registry

REGISTRY = Registry.discover()
CPU = Environment(False, None, "cpu")
H200 = Environment(True, (9, 0), "NVIDIA H200")
T4 = Environment(True, (7, 5), "Tesla T4")
IMPLS = [
    (provider.name, op.value, impl)
    for provider in REGISTRY.kernels.values()
    for op, impl in provider.impls.items()
]


@pytest.mark.parametrize(("provider", "op", "impl"), IMPLS, ids=[f"{p}-{o}" for p, o, _ in IMPLS])
def test_declared_sets_are_enforced(provider, op, impl):
    support: Support = impl.support
    device = sorted(support.devices)[0]
    env = H200
    ok = SupportRequest(device=device, dtype=sorted(support.dtypes, key=str)[0])
    missing_modules = [
        f"python module {m!r} is not installed"
        for m in support.python_modules
        if not module_available(m)
    ]
    assert not_supported_reasons(support, ok, env) == missing_modules, (provider, op)

    if support.head_dims is not None:
        odd = SupportRequest(device=device, dtype=ok.dtype, head_dim=max(support.head_dims) + 1)
        assert any(
            f"head_dim={odd.head_dim}" in r for r in not_supported_reasons(support, odd, env)
        )

    bad_dtype = SupportRequest(device=device, dtype=torch.float64)
    reasons = not_supported_reasons(support, bad_dtype, env)
    assert any("float64" in r and dtype_name(next(iter(support.dtypes))) in r for r in reasons)

    bad_device = SupportRequest(device="xpu", dtype=ok.dtype)
    assert any(
        "'xpu'" in r and sorted(support.devices)[0] in r
        for r in not_supported_reasons(support, bad_device, env)
    )

    for cap in set(Capability) - support.capabilities_on(device):
        needs = SupportRequest(device=device, dtype=ok.dtype, required=frozenset({cap}))
        assert any(cap.value in r for r in not_supported_reasons(support, needs, env))


def test_machine_reasons_from_fake_environments():
    gpu_only = Support(
        devices=frozenset({"cuda"}),
        dtypes=frozenset({torch.bfloat16}),
        min_compute_capability=(8, 0),
        python_modules=("definitely_not_installed_module",),
    )
    request = SupportRequest(device="cuda", dtype=torch.bfloat16)
    on_cpu = not_supported_reasons(gpu_only, request, CPU)
    assert any("not available on this machine" in r for r in on_cpu)
    on_t4 = not_supported_reasons(gpu_only, request, T4)
    assert any("7.5" in r and "8.0" in r for r in on_t4)
    assert any("definitely_not_installed_module" in r for r in on_t4)
    assert gpu_only.usable_capabilities(CPU) == frozenset()


def test_device_specific_capabilities():
    support = Support(
        devices=frozenset({"cpu", "cuda"}),
        dtypes=frozenset({torch.float32}),
        device_capabilities={"cuda": frozenset({Capability.CUDA_GRAPHS})},
    )
    assert Capability.CUDA_GRAPHS not in support.usable_capabilities(CPU)
    assert Capability.CUDA_GRAPHS in support.usable_capabilities(H200)


def test_head_and_block_limits():
    support = Support(
        devices=frozenset({"cpu"}),
        dtypes=frozenset({torch.float32}),
        head_dims=frozenset({64, 128}),
        block_sizes=frozenset({16}),
    )
    reasons = not_supported_reasons(support, SupportRequest(head_dim=80, block_size=32), CPU)
    assert any("head_dim=80" in r and "[64, 128]" in r for r in reasons)
    assert any("block_size=32" in r and "[16]" in r for r in reasons)
    gqa = not_supported_reasons(
        support, SupportRequest(head_dim=64, block_size=16, num_q_heads=6, num_kv_heads=4), CPU
    )
    assert any("num_q_heads=6" in r and "num_kv_heads=4" in r for r in gqa)


@pytest.mark.parametrize("backend", sorted(REGISTRY.backends))
@pytest.mark.parametrize("cap", list(Capability), ids=[c.value for c in Capability])
def test_backend_claims_match_selection(backend, cap):
    """A claimed capability can be required and served; an unclaimed one is refused by name."""
    config = FlashLoopConfig()
    env = REGISTRY.env
    device = env.devices()[-1]
    claimed = REGISTRY.backends[backend].capabilities(REGISTRY, config, env, device)
    base = SupportRequest.default(env)
    request = base.with_required({cap})
    if cap in claimed:
        selection = REGISTRY.select_backend(backend, request, config)
        assert selection.info.selected_backend == backend
    else:
        with pytest.raises(ValueError) as info:
            REGISTRY.select_backend(backend, request, config)
        if not REGISTRY.backend_reasons(backend, base, config):  # usable, so the cap is why
            assert cap.value in str(info.value) or "not wired" in str(info.value)


def test_cpu_machine_does_not_claim_cuda_graphs():
    if torch.cuda.is_available():
        pytest.skip("CPU-only check")
    caps = REGISTRY.backends["flashloop"].capabilities(
        REGISTRY, FlashLoopConfig(), REGISTRY.env, "cpu"
    )
    assert Capability.CUDA_GRAPHS not in caps
    assert Capability.GRAPH_SAFE_SPARSE not in caps
