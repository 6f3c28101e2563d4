import pytest
import torch

from flashloop_backend import ConfigError, FlashLoopConfig
from flashloop_backend.capabilities import Capability, SupportRequest
from flashloop_backend.registry import Registry, resolve

from .conftest import write_distribution

REQUEST = SupportRequest(device="cpu", dtype=torch.float32)


def test_builtin_discovery():
    registry = Registry.discover()
    assert "flashloop" in registry.backend_names()
    assert "torch_reference" in registry.kernel_names()
    assert not [f for f in registry.failures.values() if f.name in ("flashloop", "torch_reference")]


def test_explicit_selection_never_falls_back():
    registry = Registry.discover()
    selection = registry.select_backend("flashloop", REQUEST, FlashLoopConfig())
    assert selection.info.requested_backend == selection.info.selected_backend == "flashloop"
    # an op its named kernel cannot serve here: explicit refuses, naming op and reason
    config = FlashLoopConfig(
        kv_residual_quantization={"enabled": True},
        sparse_decode_attention={"enabled": True},
        kernel_overrides={"packed_sparse_correction": "example_blockwise"},
    )
    with pytest.raises(ValueError) as info:
        registry.select_backend("flashloop", REQUEST, config)
    assert "packed_sparse_correction" in str(info.value) and "example_blockwise" in str(info.value)


def test_unknown_backend_lists_valid_names():
    with pytest.raises(ValueError, match=r"unknown backend 'nope'.*'auto'.*'flashloop'"):
        Registry.discover().select_backend("nope", REQUEST, FlashLoopConfig())


def test_auto_reports_choice_and_rejections():
    registry = Registry.discover()
    selection = registry.select_backend("auto", REQUEST, FlashLoopConfig())
    assert selection.info.requested_backend == "auto"
    assert selection.info.selected_backend in registry.backends
    assert "priority" in selection.info.selection_reason
    with pytest.raises(ValueError, match="auto found no usable backend"):
        registry.select_backend(
            "auto", REQUEST.with_required({Capability.CUDA_GRAPHS}), FlashLoopConfig()
        )


def test_broken_plugin_becomes_a_reason(installed_plugins, on_path):
    registry = on_path(installed_plugins["broken"])
    assert "broken_kernels" in registry.kernel_names()
    failure = registry.failures[("flashloop_backend.kernels", "broken_kernels")]
    assert "flashloop_missing_dependency" in failure.reason()
    # explicit selection of the broken backend names the import failure
    with pytest.raises(ValueError, match="flashloop_missing_dependency"):
        registry.select_backend("broken_backend", REQUEST, FlashLoopConfig())
    # auto skips it with that reason and still selects something usable
    selection = registry.select_backend("auto", REQUEST, FlashLoopConfig())
    assert selection.info.selected_backend == "flashloop"
    # naming the broken kernel in a config is refused with its reason
    config = FlashLoopConfig(kernel_overrides={"dense_attention": "broken_kernels"})
    with pytest.raises(ConfigError, match="flashloop_missing_dependency"):
        resolve(config, "flashloop", REQUEST, registry)


def test_kernel_override_by_config(installed_plugins, on_path):
    registry = on_path(installed_plugins["example"])
    assert "example_blockwise" in registry.kernels
    default = resolve(FlashLoopConfig(), "flashloop", REQUEST, registry)
    assert default.kernels["dense_attention"] == "torch_reference"  # plugin priority is lower
    config = FlashLoopConfig(kernel_overrides={"dense_attention": "example_blockwise"})
    chosen = resolve(config, "flashloop", REQUEST, registry)
    assert chosen.kernels["dense_attention"] == "example_blockwise"
    assert chosen.digest() != default.digest()
    backend = registry.create("flashloop", REQUEST, config)
    assert backend.kernels[next(iter(backend.kernels))].provider.name == "example_blockwise"
    # the override covers one op only; the other op keeps the default
    wrong_op = FlashLoopConfig(
        token_sparse_prefill={"enabled": True},
        kernel_overrides={"sparse_prefill": "example_blockwise"},
    )
    with pytest.raises(ConfigError, match="does not implement op 'sparse_prefill'"):
        resolve(wrong_op, "flashloop", REQUEST, registry)


def test_override_of_uninstalled_kernel_names_installed_ones():
    config = FlashLoopConfig(kernel_overrides={"dense_attention": "no_such_impl"})
    with pytest.raises(ConfigError, match=r"kernel_overrides.dense_attention.*torch_reference"):
        resolve(config, "flashloop", REQUEST)


def test_duplicate_names(tmp_path, on_path):
    module = "from flashloop_backend.kernels.torch_ref import provider as _p\n"
    a = write_distribution(
        tmp_path / "a",
        "dup_a",
        {"flashloop_backend.kernels": {"dup_kernels": "dup_mod_a:provider"}},
        {"dup_mod_a.py": module + "provider = _p\n"},
    )
    b = write_distribution(
        tmp_path / "b",
        "dup_b",
        {"flashloop_backend.kernels": {"dup_kernels": "dup_mod_b:provider"}},
        {"dup_mod_b.py": module + "provider = _p\n"},
    )
    registry = on_path(a, b)
    failure = registry.failures[("flashloop_backend.kernels", "dup_kernels")]
    assert "more than one plugin" in failure.reason()
    assert "dup_mod_a:provider" in failure.reason() and "dup_mod_b:provider" in failure.reason()
    assert "dup_kernels" not in registry.kernels


def test_same_target_twice_is_one_plugin(tmp_path, on_path):
    module = {
        "same_mod.py": "from flashloop_backend.kernels.torch_ref import provider as _p\n\n\ndef provider():\n    p = _p()\n    import dataclasses\n    return dataclasses.replace(p, name='same_kernels')\n"
    }
    group = {"flashloop_backend.kernels": {"same_kernels": "same_mod:provider"}}
    a = write_distribution(tmp_path / "a", "same_a", group, module)
    b = write_distribution(tmp_path / "b", "same_a", group, module)
    registry = on_path(a, b)
    assert "same_kernels" in registry.kernels
    assert ("flashloop_backend.kernels", "same_kernels") not in registry.failures


def test_factory_returning_wrong_type_is_a_reason(tmp_path, on_path):
    folder = write_distribution(
        tmp_path / "w",
        "wrong_t",
        {"flashloop_backend.backends": {"wrong": "wrong_mod:factory"}},
        {"wrong_mod.py": "def factory():\n    return 42\n"},
    )
    registry = on_path(folder)
    with pytest.raises(ValueError, match="returned int, expected BackendSpec"):
        registry.select_backend("wrong", REQUEST, FlashLoopConfig())
