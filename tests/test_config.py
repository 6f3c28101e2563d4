import json

import pytest

from flashloop_backend import ConfigError, EffectiveConfig, FlashLoopConfig, load_config


def test_defaults_are_dense_baseline():
    config = FlashLoopConfig()
    assert config.enabled_features() == ()
    assert config.num_loops == 4
    assert config.token_sparse_prefill.retention == (1.0, 1.0, 0.25, 0.10)
    assert config.sparse_decode_attention.key_retention == 0.10
    quant = config.kv_residual_quantization
    assert (quant.bits, quant.group_size, quant.param_dtype, quant.policy, quant.tail_size) == (
        4,
        64,
        "float16",
        "fixed_prompt",
        64,
    )


REJECTIONS = [
    # (config, field named in the message, fragment of the explanation)
    (
        {"token_sparse_prefill": {"enabled": True, "retention": [1, 1, 0.5]}},
        "retention",
        "num_loops=4",
    ),
    ({"token_sparse_prefill": {"retention": [1, 1, 0.1, 0.5]}}, "retention[3]", "non-increasing"),
    ({"token_sparse_prefill": {"retention": [1, 0.5, 0.25, 0.1]}}, "retention[1]", "dense"),
    ({"token_sparse_prefill": {"retention": [1, 1, 0.0, 0.0]}}, "retention[2]", "(0, 1]"),
    ({"token_sparse_prefill": {"retention": [1, 1, 1.5, 1.0]}}, "retention[2]", "(0, 1]"),
    ({"token_sparse_prefill": {"retention": []}}, "retention", "empty"),
    ({"token_sparse_prefill": {"window_size": 8}}, "window_size", "16"),
    ({"sparse_decode_attention": {"key_retention": 0}}, "key_retention", "(0, 1]"),
    ({"sparse_decode_attention": {"key_retention": 1.01}}, "key_retention", "(0, 1]"),
    ({"kv_residual_quantization": {"group_size": 48}}, "group_size", "power of two in [16, 128]"),
    ({"kv_residual_quantization": {"group_size": 256}}, "group_size", "power of two in [16, 128]"),
    ({"kv_residual_quantization": {"group_size": 8}}, "group_size", "power of two in [16, 128]"),
    ({"kv_residual_quantization": {"tail_size": 32}}, "tail_size", "group_size"),
    ({"kv_residual_quantization": {"bits": 8}}, "bits", "4"),
    ({"kv_residual_quantization": {"policy": "streaming"}}, "policy", "rolling"),
    (
        {"num_loops": 2, "sparse_decode_attention": {"enabled": True}},
        "sparse_decode_attention",
        "num_loops >= 3",
    ),
    ({"layout": "shared"}, "layout", "last_exited"),
    ({"layout": "banana"}, "layout", "last_exited"),
    ({"unknown_field": 1}, "unknown_field", "not permitted"),
    ({"token_sparse_prefill": {"enabled": True, "extra": 1}}, "extra", "not permitted"),
]


@pytest.mark.parametrize(("data", "field", "fragment"), REJECTIONS)
def test_rejections_name_field_and_allowed(data, field, fragment):
    with pytest.raises(ConfigError) as info:
        FlashLoopConfig.from_dict(data)
    message = str(info.value)
    assert field in message
    assert fragment in message


def test_bad_value_is_named():
    with pytest.raises(ConfigError, match="group_size=48"):
        FlashLoopConfig.from_dict({"kv_residual_quantization": {"group_size": 48}})


def test_frozen_and_no_unvalidated_updates():
    config = FlashLoopConfig()
    with pytest.raises(Exception, match="frozen"):
        config.num_loops = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        config.kernel_overrides["dense_attention"] = "x"  # type: ignore[index]


def test_disabled_token_sparsity_ignores_retention_length():
    config = FlashLoopConfig(num_loops=3)
    assert config.num_loops == 3


def test_load_from_json_toml_and_dict(tmp_path):
    data = {"sparse_decode_attention": {"enabled": True, "key_retention": 0.2}}
    json_file = tmp_path / "c.json"
    json_file.write_text(json.dumps(data))
    toml_file = tmp_path / "c.toml"
    toml_file.write_text("[sparse_decode_attention]\nenabled = true\nkey_retention = 0.2\n")
    configs = [load_config(json_file), load_config(toml_file), load_config(data)]
    assert configs[0] == configs[1] == configs[2]
    assert configs[0].sparse_decode_attention.key_retention == 0.2


@pytest.mark.parametrize(
    ("name", "text", "fragment"),
    [
        ("c.yaml", "a: 1", "suffix"),
        ("c.json", "{not json", "cannot be parsed"),
        ("c.toml", "= broken", "cannot be parsed"),
        ("c.json", "[1, 2]", "top level"),
    ],
)
def test_bad_files(tmp_path, name, text, fragment):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=fragment):
        load_config(path)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.json")


def _effective(config: FlashLoopConfig) -> EffectiveConfig:
    return EffectiveConfig(
        config=config,
        backend="flashloop",
        kernels={"dense_attention": "torch_reference"},
        package_version="0",
    )


def test_digest_is_stable_and_sensitive():
    a = _effective(
        FlashLoopConfig(kernel_overrides={"sparse_prefill": "x", "dense_attention": "y"})
    )
    b = _effective(
        FlashLoopConfig(kernel_overrides={"dense_attention": "y", "sparse_prefill": "x"})
    )
    assert a.digest() == b.digest()
    assert len(a.digest()) == 16
    c = _effective(FlashLoopConfig(sparse_decode_attention={"enabled": True}))
    assert c.digest() != a.digest()
    # canonical JSON round-trips to the same config
    again = FlashLoopConfig.from_dict(json.loads(a.config.canonical_json()))
    assert again == a.config


def test_an_unknown_kernel_override_op_is_refused_at_selection():
    """The config holds overrides as data; the registry knows the ops and names them."""
    from flashloop_backend.capabilities import SupportRequest
    from flashloop_backend.registry import Registry

    config = FlashLoopConfig.from_dict({"kernel_overrides": {"not_an_op": "torch_reference"}})
    with pytest.raises(
        ConfigError, match=r"unknown op 'not_an_op'; allowed ops: .*dense_attention"
    ):
        Registry.discover().select_backend("auto", SupportRequest(), config)
