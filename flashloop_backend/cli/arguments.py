"""What the host commands share: argument types, the common options (model, backend,
config, device, pool) and loading what they name, and the speculation settings.

The parser is built without torch; loading imports it when a command runs.
"""

from __future__ import annotations

import argparse
import math

from flashloop_backend.config import ConfigError
from flashloop_backend.host.embedded import embedded_model_path


# ------------------------------------------------------------------ argument types
def _int_at_least(minimum: int):
    """An argparse type: an integer >= ``minimum``, refused with the value and the bound."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} must be an integer >= {minimum}")
        return value

    return parse


positive_int = _int_at_least(1)
non_negative_int = _int_at_least(0)
at_least_two = _int_at_least(2)


def int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must list positive integers")
    return values


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number >= 0")
    return value


def positive_float(text: str) -> float:
    value = non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number > 0")
    return value


def positive_float_list(text: str) -> list[float]:
    """Comma-separated finite numbers > 0, each checked as :func:`positive_float`."""
    parts = [part for part in text.split(",") if part]
    if not parts:
        raise argparse.ArgumentTypeError(f"{text!r} must list numbers > 0")
    return [positive_float(part) for part in parts]


# ------------------------------------------------------------------ shared set-up
def pick_device(name: str):
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "device 'cuda' was requested but no CUDA GPU is available (choices: auto, cpu)"
        )
    if name not in ("cpu", "cuda"):
        raise ConfigError(f"device {name!r} is unknown; choices: auto, cpu, cuda")
    return name, (torch.bfloat16 if name == "cuda" else torch.float32)


def load_from_args(args: argparse.Namespace):
    """Device, dtype, FlashLoop config, model and tokenizer named by the common options."""
    from flashloop_backend.config import load_config
    from flashloop_backend.host.config import ModelError
    from flashloop_backend.host.loader import load_model, load_tokenizer

    device, dtype = pick_device(args.device)
    config = load_config(args.config)
    try:
        model = load_model(args.model, device, dtype, getattr(args, "tensor_parallel", None))
        tokenizer = load_tokenizer(args.model)
    except ModelError as exc:
        raise ConfigError(f"cannot load model {args.model!r}: {exc}") from None
    return device, dtype, config, model, tokenizer


def speculation_from_args(args: argparse.Namespace):
    """``--speculate K --draft-depth D --draft-confidence P`` as settings (None without
    ``--speculate``); a value off the allowed ones exits 2 naming it, and so does
    ``--draft-confidence`` without ``--speculate``."""
    from pydantic import ValidationError

    from flashloop_backend.host.speculation import SpeculationSettings

    confidence = getattr(args, "draft_confidence", None)
    if not args.speculate:
        if confidence is not None:
            raise ConfigError("--draft-confidence applies with --speculate K")
        return None
    given = {"block_size": args.speculate, "draft_depth": args.draft_depth}
    if confidence is not None:
        given["draft_confidence"] = confidence
    try:
        return SpeculationSettings(**given)
    except ValidationError as exc:
        error = exc.errors()[0]
        field, message = error["loc"][0], error["msg"].removeprefix("Value error, ")
        named = (
            message if message.startswith(f"{field}=") else f"{field}={error['input']}: {message}"
        )
        raise ConfigError(named) from None


# ------------------------------------------------------------------ common options
def add_common_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=str(embedded_model_path()),
        help="Ouro checkpoint directory (default: the embedded model)",
    )
    parser.add_argument("--backend", default="auto", help="backend name or 'auto' (default)")
    parser.add_argument("--config", help="FlashLoop config file (.json or .toml)")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument(
        "--num-blocks",
        type=positive_int,
        help="KV blocks in the pool (>= 1; default 512, or sized by --kv-memory-gib)",
    )
    parser.add_argument(
        "--kv-memory-gib",
        type=positive_float,
        help="size the KV pools (BF16 blocks, packed pages, slots) from this many GiB "
        "instead of --num-blocks, for requests of the model's context (docs/host.md)",
    )
    parser.add_argument(
        "--block-size", type=positive_int, default=16, help="tokens per KV block (>= 1)"
    )
