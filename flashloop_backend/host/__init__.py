"""The compact looped-model host: Ouro model, checkpoint loader, per-depth paged KV,
batch builder and a continuous-batching generate loop, driving attention backends through
the registry the way vllm-rlt would."""

from .config import ModelError, OuroConfig
from .engine import Engine, GenerationResult, SamplingParams
from .kvcache import OutOfBlocksError, PagedKVCache
from .loader import load_model, load_tokenizer, save_checkpoint
from .model import OuroModel

__all__ = [
    "Engine",
    "GenerationResult",
    "ModelError",
    "OuroConfig",
    "OuroModel",
    "OutOfBlocksError",
    "PagedKVCache",
    "SamplingParams",
    "load_model",
    "load_tokenizer",
    "save_checkpoint",
]
