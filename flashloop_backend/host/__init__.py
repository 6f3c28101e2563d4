"""The compact looped-model host: Ouro model, checkpoint loader, per-depth paged KV,
batch builder and a continuous-batching generate loop, driving attention backends through
the registry the way vllm-rlt would.

Names load on first use, so the CLI's parser (``cli/host_commands.py``,
``cli/generate_command.py``) imports without torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_WHERE = {
    "ModelError": ".config",
    "OuroConfig": ".config",
    "Engine": ".engine",
    "GenerationResult": ".engine",
    "SamplingParams": ".engine",
    "OutOfBlocksError": ".kvcache",
    "PagedKVCache": ".kvcache",
    "load_model": ".loader",
    "load_tokenizer": ".loader",
    "save_checkpoint": ".loader",
    "OuroModel": ".model",
    "embedded_model_path": ".embedded",
    "LLM": ".llm",
    "Completion": ".llm",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_WHERE[name], __name__), name)
