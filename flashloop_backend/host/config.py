"""Ouro model configuration, read from (and written as) an Ouro ``config.json``."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any


class ModelError(ValueError):
    """A checkpoint or model config is malformed; the message names what and where."""


_INT_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "total_ut_steps",
    "max_position_embeddings",
)


@dataclass(frozen=True)
class OuroConfig:
    """The fields of an Ouro ``config.json`` the host uses (DESIGN §3 gives Ouro-1.4B's)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    total_ut_steps: int = 4
    max_position_embeddings: int = 65536
    early_exit_threshold: float | None = None  # None or >= 1: always run every loop
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ModelError(f"config field {name}={value!r} must be a positive integer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if not self.rope_theta > 0:
            raise ModelError(f"config field rope_theta={self.rope_theta!r} must be positive")
        if not self.rms_norm_eps > 0:
            raise ModelError(f"config field rms_norm_eps={self.rms_norm_eps!r} must be positive")
        threshold = self.early_exit_threshold
        if threshold is not None and not 0.0 < threshold:
            raise ModelError(f"config field early_exit_threshold={threshold!r} must be > 0")
        for name in ("bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < self.vocab_size:
                raise ModelError(f"config field {name}={value!r} is outside [0, {self.vocab_size})")

    @property
    def exits_early(self) -> bool:
        return self.early_exit_threshold is not None and self.early_exit_threshold < 1.0

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> OuroConfig:
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        if "head_dim" not in values and "hidden_size" in values and "num_attention_heads" in values:
            values["head_dim"] = values["hidden_size"] // max(1, values["num_attention_heads"])
        if "num_key_value_heads" not in values and "num_attention_heads" in values:
            values["num_key_value_heads"] = values["num_attention_heads"]
        eos = values.get("eos_token_id")
        if isinstance(eos, list):  # HF allows a list; the first is the one generation stops on
            values["eos_token_id"] = eos[0] if eos else None
        required = [f.name for f in fields(cls) if f.name in _INT_FIELDS]
        missing = [name for name in required if name not in values]
        if missing:
            raise ModelError(f"config.json is missing required fields {missing}")
        try:
            return cls(**values)
        except TypeError as exc:
            raise ModelError(f"config.json has a bad field: {exc}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> OuroConfig:
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ModelError(f"{path} does not exist") from None
        except json.JSONDecodeError as exc:
            raise ModelError(f"{path} is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ModelError(f"{path} must hold a JSON object")
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(
            model_type="ouro",
            architectures=["OuroForCausalLM"],
            hidden_act="silu",
            tie_word_embeddings=False,
            torch_dtype="bfloat16",
        )
        return data
