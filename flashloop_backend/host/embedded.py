"""Where the embedded default model lies: an Ouro-layout, byte-level model of 4 loops
trained for this package (``models/ouro-tiny-bytes``; card in its ``MODEL_CARD.md``)."""

from __future__ import annotations

from pathlib import Path


def embedded_model_path() -> Path:
    """Directory of the embedded default model (config.json, safetensors, tokenizer.json)."""
    return Path(__file__).resolve().parents[1] / "models" / "ouro-tiny-bytes"
