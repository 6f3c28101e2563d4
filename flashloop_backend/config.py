"""FlashLoop configuration: three independent feature groups plus shared fields (RFC §7).

Every model is frozen and forbids unknown fields. All features are off by default, which
is the dense baseline. Build configs with :func:`load_config`, :meth:`FlashLoopConfig.from_dict`
or the constructor; never with ``model_copy(update=...)`` (it skips validation).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationError,
    field_serializer,
    field_validator,
    model_validator,
)

DEFAULT_RETENTION = (1.0, 1.0, 0.25, 0.10)
DENSE_LOOPS = 2  # loops 1 and 2 always run dense; loop 2 is the decode reference
ALLOWED_LAYOUTS = ("last_exited",)
ALLOWED_POLICIES = ("fixed_prompt", "rolling")


class ConfigError(ValueError):
    """A configuration was rejected; the message names every bad field and value."""


class UnservableError(ConfigError):
    """A valid request that no backend (or not the named one) can serve on this machine:
    an unknown or unusable backend, or a config whose kernels are not installed here. The
    CLI exits 3 for it everywhere, 2 for other configuration errors."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)


def _check_ratio(name: str, value: float) -> float:
    if not (0.0 < value <= 1.0) or math.isnan(value):
        raise ValueError(f"{name}={value!r} is outside the allowed range (0, 1]")
    return value


class TokenSparsePrefillConfig(_Frozen):
    """RFC §3.1 / §7.1: recompute only changing prompt tokens in loops 3+."""

    enabled: StrictBool = False
    window_size: StrictInt = Field(
        default=256, ge=16, description="selection window length in prompt tokens"
    )
    retention: tuple[StrictFloat, ...] = Field(
        default=DEFAULT_RETENTION,
        description="fraction of each window's tokens kept per loop (one ratio per loop)",
    )

    @field_validator("retention")
    @classmethod
    def _retention_shape(cls, value: tuple[float, ...]) -> tuple[float, ...]:
        if not value:
            raise ValueError("retention is empty; give one ratio per loop")
        for i, ratio in enumerate(value):
            _check_ratio(f"retention[{i}]", ratio)
        for i in range(min(DENSE_LOOPS, len(value))):
            if value[i] != 1.0:
                raise ValueError(
                    f"retention[{i}]={value[i]!r}: loops 1-{DENSE_LOOPS} must be dense (ratio 1.0)"
                )
        for i in range(1, len(value)):
            if value[i] > value[i - 1]:
                raise ValueError(
                    f"retention[{i}]={value[i]!r} exceeds retention[{i - 1}]={value[i - 1]!r}; "
                    "ratios must be non-increasing because active sets are nested"
                )
        return value


class SparseDecodeAttentionConfig(_Frozen):
    """RFC §3.2 / §7.2: loop 2 is the reference for loops 3 and 4 (a contract, not a switch)."""

    enabled: StrictBool = False
    key_retention: StrictFloat = Field(
        default=0.10, description="fraction of visible keys kept per (layer, query, head)"
    )

    @field_validator("key_retention")
    @classmethod
    def _ratio(cls, value: float) -> float:
        return _check_ratio("key_retention", value)


class KVResidualQuantizationConfig(_Frozen):
    """RFC §3.3 / §7.3: INT4 base for loop 1 plus INT4 residuals against the reconstruction."""

    enabled: StrictBool = False
    bits: Literal[4] = 4
    group_size: StrictInt = Field(default=64, description="elements per affine quantization group")
    param_dtype: Literal["float16"] = "float16"
    policy: Literal["fixed_prompt", "rolling"] = "fixed_prompt"
    tail_size: StrictInt = Field(default=64, description="minimum BF16 tail (rolling policy)")

    @field_validator("group_size")
    @classmethod
    def _group_size(cls, value: int) -> int:
        if value < 16 or value > 128 or value & (value - 1):
            raise ValueError(
                f"group_size={value!r} is not allowed; use a power of two in [16, 128] "
                "(16, 32, 64, 128)"
            )
        return value

    @model_validator(mode="after")
    def _tail_holds_a_group(self) -> KVResidualQuantizationConfig:
        if self.tail_size < self.group_size:
            raise ValueError(
                f"tail_size={self.tail_size!r} is smaller than one group "
                f"(group_size={self.group_size}); tail_size must be >= group_size"
            )
        return self


class FlashLoopConfig(_Frozen):
    """The whole FlashLoop configuration. Every feature defaults to off (dense baseline)."""

    num_loops: StrictInt = Field(default=4, ge=1, le=16)
    layout: str = Field(default="last_exited", description="logical KV history layout")
    kernel_overrides: Mapping[str, str] = Field(
        default_factory=dict, description="op name -> kernel implementation name"
    )
    token_sparse_prefill: TokenSparsePrefillConfig = TokenSparsePrefillConfig()
    sparse_decode_attention: SparseDecodeAttentionConfig = SparseDecodeAttentionConfig()
    kv_residual_quantization: KVResidualQuantizationConfig = KVResidualQuantizationConfig()

    @field_validator("layout")
    @classmethod
    def _layout(cls, value: str) -> str:
        if value == "shared":
            raise ValueError(
                "layout='shared' is outside FlashLoop's scope (RFC §1: SHARED history is not "
                f"supported); allowed: {list(ALLOWED_LAYOUTS)}"
            )
        if value not in ALLOWED_LAYOUTS:
            raise ValueError(f"layout={value!r} is unknown; allowed: {list(ALLOWED_LAYOUTS)}")
        return value

    @field_validator("kernel_overrides")
    @classmethod
    def _freeze_overrides(cls, value: Mapping[str, str]) -> Mapping[str, str]:
        # the op names are the registry's to check (``registry.check_override_ops``)
        return MappingProxyType(dict(sorted(value.items())))

    @field_serializer("kernel_overrides")
    def _plain_overrides(self, value: Mapping[str, str]) -> dict[str, str]:
        return dict(value)

    @model_validator(mode="after")
    def _cross_checks(self) -> FlashLoopConfig:
        retention = self.token_sparse_prefill.retention
        if self.token_sparse_prefill.enabled and len(retention) != self.num_loops:
            raise ValueError(
                f"token_sparse_prefill.retention has {len(retention)} ratios but "
                f"num_loops={self.num_loops}; give exactly one ratio per loop"
            )
        if self.sparse_decode_attention.enabled and self.num_loops < DENSE_LOOPS + 1:
            raise ValueError(
                f"sparse_decode_attention.enabled needs num_loops >= {DENSE_LOOPS + 1} "
                f"(loop 2 is the reference for later loops); got num_loops={self.num_loops}"
            )
        return self

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FlashLoopConfig:
        """Validate a plain mapping; raise :class:`ConfigError` naming every bad field."""
        try:
            return cls.model_validate(dict(data))
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc)) from None

    def canonical_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))

    def enabled_features(self) -> tuple[str, ...]:
        groups = ("token_sparse_prefill", "sparse_decode_attention", "kv_residual_quantization")
        return tuple(name for name in groups if getattr(self, name).enabled)


# Scalars are strict (no "yes" for true, no "64" for 64): the wording names what is allowed.
_STRICT_MESSAGES = {
    "bool_type": "must be a boolean: true or false",
    "int_type": "must be an integer number",
    "float_type": "must be a number",
}


def format_validation_error(exc: ValidationError) -> str:
    """One line per problem: ``field.path: message (got value)``."""
    lines = []
    for err in exc.errors():
        field = ".".join(str(part) for part in err["loc"]) or "<config>"
        message = _STRICT_MESSAGES.get(err["type"], err["msg"].removeprefix("Value error, "))
        got = err.get("input")
        shown = "" if isinstance(got, dict) or repr(got) in message else f" (got {got!r})"
        lines.append(f"{field}: {message}{shown}")
    return "invalid FlashLoop config:\n  " + "\n  ".join(lines)


def load_config(source: str | Path | Mapping[str, Any] | FlashLoopConfig | None) -> FlashLoopConfig:
    """Load a config from a JSON or TOML file, a plain dict, or pass one through."""
    if source is None:
        return FlashLoopConfig()
    if isinstance(source, FlashLoopConfig):
        return source
    if isinstance(source, Mapping):
        return FlashLoopConfig.from_dict(source)
    path = Path(source)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    text = path.read_text(encoding="utf-8")
    suffix = path.suffix.lower()
    try:
        if suffix == ".json":
            data = json.loads(text)
        elif suffix == ".toml":
            data = _toml_loads(text)
        else:
            raise ConfigError(
                f"config file {str(path)!r} has suffix {suffix!r}; allowed: ['.json', '.toml']"
            )
    except (json.JSONDecodeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"config file {str(path)!r} cannot be parsed: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a table/object at top level")
    return FlashLoopConfig.from_dict(data)


def _toml_loads(text: str) -> dict[str, Any]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    return tomllib.loads(text)


class EffectiveConfig(_Frozen):
    """The one immutable configuration a stage runs with: the user's config plus every
    choice resolved from it (backend, kernel implementation per op). Its digest goes into
    diagnostics and benchmark records."""

    config: FlashLoopConfig
    backend: str
    kernels: Mapping[str, str] = Field(description="op name -> selected implementation")
    package_version: str
    kv_encoding: Mapping[str, str | int] | None = Field(
        default=None, description="versioned packed-KV encoding descriptor (KV quantization on)"
    )

    @field_validator("kernels", "kv_encoding")
    @classmethod
    def _freeze_mapping(cls, value: Mapping | None) -> Mapping | None:
        return None if value is None else MappingProxyType(dict(sorted(value.items())))

    @field_serializer("kernels", "kv_encoding")
    def _plain_mapping(self, value: Mapping | None) -> dict | None:
        return None if value is None else dict(value)

    def canonical_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))

    def digest(self) -> str:
        """Stable 16-hex-digit SHA-256 prefix of the canonical JSON."""
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()[:16]
