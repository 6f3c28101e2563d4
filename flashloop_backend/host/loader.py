"""Load and save Ouro checkpoints: ``config.json``, safetensors (single or sharded with
``model.safetensors.index.json``) and ``tokenizer.json``. Real Ouro-1.4B / 2.6B directories
load unchanged; every mismatch names the key and the expected shape."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from flashloop_backend.host.config import ModelError, OuroConfig
from flashloop_backend.host.model import OuroModel
from flashloop_backend.host.tensor_parallel import TensorParallel, shard_config, shard_state

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def expected_shapes(cfg: OuroConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter an Ouro checkpoint holds, with its shape."""
    hidden, q_out = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim
    kv_out, inter = cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, hidden),
        "model.norm.weight": (hidden,),
        "model.early_exit_gate.weight": (1, hidden),
        "model.early_exit_gate.bias": (1,),
        "lm_head.weight": (cfg.vocab_size, hidden),
    }
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (q_out, hidden),
                p + "self_attn.k_proj.weight": (kv_out, hidden),
                p + "self_attn.v_proj.weight": (kv_out, hidden),
                p + "self_attn.o_proj.weight": (hidden, q_out),
                p + "mlp.gate_proj.weight": (inter, hidden),
                p + "mlp.up_proj.weight": (inter, hidden),
                p + "mlp.down_proj.weight": (hidden, inter),
            }
        )
        for norm in (
            "input_layernorm",
            "input_layernorm_2",
            "post_attention_layernorm",
            "post_attention_layernorm_2",
        ):
            shapes[p + norm + ".weight"] = (hidden,)
    return shapes


def _load_file(path: Path) -> dict[str, torch.Tensor]:
    """One safetensors file's tensors (CPU); a damaged file is a :class:`ModelError` that
    names it and says what is wrong."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    size = path.stat().st_size
    if size < 8:
        raise ModelError(
            f"{path} is not a safetensors file: {size} bytes, shorter than the 8-byte header "
            "length (empty or truncated)"
        )
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise ModelError(
            f"{path} is damaged or not a safetensors file ({size} bytes): {exc}"
        ) from None


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory (CPU)."""
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise ModelError(f"{index} is malformed: {exc}") from None
        weights: dict[str, torch.Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            if not (directory / shard).is_file():
                raise ModelError(f"shard {shard} named in {index.name} is missing from {directory}")
            weights.update(_load_file(directory / shard))
        missing = sorted(set(weight_map) - set(weights))
        if missing:
            raise ModelError(
                f"keys {missing[:5]} are listed in {index.name} but absent from the shards"
            )
        return weights
    single = directory / SINGLE_FILE
    if not single.is_file():
        raise ModelError(f"{directory} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    return _load_file(single)


def check_weights(cfg: OuroConfig, weights: dict[str, torch.Tensor]) -> None:
    expected = expected_shapes(cfg)
    missing = [k for k in expected if k not in weights]
    if missing:
        raise ModelError(
            f"checkpoint is missing key {missing[0]!r} (expected shape {expected[missing[0]]})"
            + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
        )
    unexpected = sorted(
        k for k in weights if k not in expected and not k.endswith("rotary_emb.inv_freq")
    )
    if unexpected:
        raise ModelError(f"checkpoint has unexpected keys {unexpected[:5]} for this config")
    for key, shape in expected.items():
        if tuple(weights[key].shape) != shape:
            raise ModelError(f"key {key!r} has shape {tuple(weights[key].shape)}, expected {shape}")


def load_model(
    directory: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    tensor_parallel: TensorParallel | None = None,
) -> OuroModel:
    """The checkpoint in ``directory`` on ``device`` in ``dtype``, projections fused;
    with ``tensor_parallel``, only that rank's heads and MLP channels."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ModelError(f"model directory {str(directory)!r} does not exist")
    cfg = OuroConfig.from_file(directory / "config.json")
    weights = read_weights(directory)
    check_weights(cfg, weights)
    state = {k: v.to(dtype) for k, v in weights.items() if k in expected_shapes(cfg)}
    if tensor_parallel is not None:
        try:
            state = shard_state(cfg, state, tensor_parallel)
            cfg = shard_config(cfg, tensor_parallel.world_size)
        except ValueError as exc:
            raise ModelError(str(exc)) from None
    with torch.device("meta"):
        model = OuroModel(cfg)
    model.load_state_dict(state, assign=True)
    model = model.to(device=device).eval()
    model.tensor_parallel = tensor_parallel
    model.fuse_projections()
    return model


def save_checkpoint(
    model: OuroModel,
    directory: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    shard_size: int | None = None,
) -> None:
    """Write config.json and safetensors (sharded by ``shard_size`` tensors if given)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(model.config.to_dict(), indent=2) + "\n")
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model.state_dict().items()}
    if shard_size is None:
        save_file(state, str(directory / SINGLE_FILE), metadata={"format": "pt"})
        return
    keys = sorted(state)
    shards = [keys[i : i + shard_size] for i in range(0, len(keys), shard_size)]
    weight_map = {}
    for n, names in enumerate(shards, 1):
        filename = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        save_file(
            {k: state[k] for k in names}, str(directory / filename), metadata={"format": "pt"}
        )
        weight_map.update(dict.fromkeys(names, filename))
    (directory / INDEX_FILE).write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2)
    )


def load_tokenizer(directory: str | Path):
    """The checkpoint's ``tokenizer.json`` through the ``tokenizers`` package."""
    from tokenizers import Tokenizer

    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        raise ModelError(f"{path} does not exist")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:
        raise ModelError(f"{path} cannot be loaded: {exc}") from None
