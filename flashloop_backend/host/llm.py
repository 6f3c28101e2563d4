"""Text in, text out through the host: a checkpoint, its tokenizer, a backend chosen by the
registry for the model's attention shapes, and an engine around them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from flashloop_backend.backends.base import AttentionBackend
from flashloop_backend.config import FlashLoopConfig
from flashloop_backend.host.embedded import embedded_model_path
from flashloop_backend.host.engine import Engine
from flashloop_backend.host.loader import load_model, load_tokenizer
from flashloop_backend.host.requests import SamplingParams
from flashloop_backend.registry import Registry, SelectionInfo


@dataclass(frozen=True)
class Completion:
    prompt: str
    text: str
    token_ids: list[int]
    finish_reason: str


class LLM:
    """``LLM(config=..., backend="auto").generate(["def f(x):"])``.

    ``model``: an Ouro checkpoint directory (default: the embedded model); ``device``
    ``"auto"`` picks CUDA when present (bfloat16) else the CPU (float32). Engine options
    (``num_blocks``, ``block_size``, ``max_batch_tokens``, ...) pass through."""

    def __init__(
        self,
        model: str | Path | None = None,
        config: FlashLoopConfig | None = None,
        backend: str = "auto",
        device: str = "auto",
        block_size: int = 16,
        **engine_options,
    ) -> None:
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        path = Path(model) if model is not None else embedded_model_path()
        self.model = load_model(path, device, dtype)
        self.tokenizer = load_tokenizer(path)
        self.request = self.model.support_request(block_size)
        self.backend: AttentionBackend = Registry.discover().create(
            backend, self.request, config or FlashLoopConfig()
        )
        self.selection: SelectionInfo = self.backend.info
        self.engine = Engine(
            self.model,
            self.backend,
            block_size=block_size,
            detokenize=self.tokenizer.decode,
            **engine_options,
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` with the model's BOS token first (when it has one)."""
        bos = self.model.config.bos_token_id
        return ([bos] if bos is not None else []) + self.tokenizer.encode(text).ids

    def generate(
        self, prompts: list[str], params: SamplingParams | None = None
    ) -> list[Completion]:
        """Complete every prompt (one batch; greedy unless ``params`` say otherwise)."""
        results = self.engine.generate([self.encode(p) for p in prompts], params)
        decode = self.tokenizer.decode
        return [
            Completion(p, decode(r.output_token_ids), r.output_token_ids, r.finish_reason)
            for p, r in zip(prompts, results, strict=True)
        ]
