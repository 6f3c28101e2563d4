import json

import pytest
import torch

from flashloop_backend import embedded_model_path
from flashloop_backend.host import (
    ModelError,
    OuroConfig,
    load_model,
    load_tokenizer,
    save_checkpoint,
)
from flashloop_backend.host.loader import expected_shapes

from .host_helpers import tiny_model


@pytest.mark.parametrize("shard_size", [None, 7])
def test_round_trip_single_and_sharded(tmp_path, shard_size):
    model = tiny_model(seed=9)
    save_checkpoint(model, tmp_path, dtype=torch.float32, shard_size=shard_size)
    assert (tmp_path / "model.safetensors.index.json").is_file() == (shard_size is not None)
    loaded = load_model(tmp_path)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor, rtol=0, atol=0)


def _rewrite(tmp_path, mutate):
    from safetensors.torch import load_file, save_file

    save_checkpoint(tiny_model(), tmp_path, dtype=torch.float32)
    weights = load_file(str(tmp_path / "model.safetensors"))
    mutate(weights)
    save_file(weights, str(tmp_path / "model.safetensors"))


def test_missing_key_names_key_and_shape(tmp_path):
    _rewrite(tmp_path, lambda w: w.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(
        ModelError,
        match=r"missing key 'model.layers.1.mlp.up_proj.weight' \(expected shape \(96, 64\)\)",
    ):
        load_model(tmp_path)


def test_wrong_shape_names_key_and_expected(tmp_path):
    _rewrite(tmp_path, lambda w: w.__setitem__("model.norm.weight", torch.ones(63)))
    with pytest.raises(
        ModelError, match=r"'model.norm.weight' has shape \(63,\), expected \(64,\)"
    ):
        load_model(tmp_path)


def test_unexpected_key(tmp_path):
    _rewrite(tmp_path, lambda w: w.__setitem__("model.layers.9.extra.weight", torch.ones(2)))
    with pytest.raises(ModelError, match="unexpected keys"):
        load_model(tmp_path)


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"hidden_size": 0}, "hidden_size=0"),
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads=3"),
        ({"rope_theta": -1}, "rope_theta"),
        ({"eos_token_id": 1000}, "eos_token_id=1000"),
        ({"vocab_size": "big"}, "vocab_size='big'"),
    ],
)
def test_bad_config_fields(tmp_path, change, fragment):
    save_checkpoint(tiny_model(), tmp_path, dtype=torch.float32)
    data = json.loads((tmp_path / "config.json").read_text())
    data.update(change)
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ModelError, match=fragment):
        load_model(tmp_path)


def test_missing_config_field_and_files(tmp_path):
    save_checkpoint(tiny_model(), tmp_path, dtype=torch.float32)
    data = json.loads((tmp_path / "config.json").read_text())
    del data["intermediate_size"]
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ModelError, match=r"missing required fields \[.intermediate_size.\]"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match="not valid JSON"):
        load_model(tmp_path)
    with pytest.raises(ModelError, match="does not exist"):
        load_model(tmp_path / "nowhere")
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "config.json").write_text(json.dumps(tiny_model().config.to_dict()))
    with pytest.raises(ModelError, match=r"neither model\.safetensors nor"):
        load_model(tmp_path)
    with pytest.raises(ModelError, match=r"tokenizer\.json does not exist"):
        load_tokenizer(tmp_path)


def test_ouro_1p4b_key_layout():
    """The loader's expectations match Ouro-1.4B (DESIGN §3) key for key."""
    cfg = OuroConfig(hidden_size=2048, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
                     head_dim=128, intermediate_size=5632, vocab_size=49152)  # fmt: skip
    shapes = expected_shapes(cfg)
    assert len(shapes) == 5 + 24 * 11
    assert shapes["model.layers.23.self_attn.q_proj.weight"] == (2048, 2048)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (2048, 5632)
    assert shapes["model.layers.0.input_layernorm_2.weight"] == (2048,)
    assert shapes["model.early_exit_gate.bias"] == (1,)
    assert shapes["lm_head.weight"] == (49152, 2048)


def test_embedded_model_and_its_card():
    path = embedded_model_path()
    model = load_model(path)
    tokenizer = load_tokenizer(path)
    assert model.config.head_dim == 128 and model.config.total_ut_steps == 4
    assert tokenizer.encode("ab").ids == [97, 98]
    metrics = json.loads((path / "metrics.json").read_text())
    loss = metrics["loss_nats_per_loop"]
    assert loss[2] < loss[0] and loss[3] < loss[0]
    for key in ("relative_change_hidden", "relative_change_k", "relative_change_v"):
        change = metrics[key]
        assert change[0] > change[1] > change[2], key
    card = (path / "MODEL_CARD.md").read_text()
    assert f"{loss[0]:.3f}" in card and f"{loss[2]:.3f}" in card
