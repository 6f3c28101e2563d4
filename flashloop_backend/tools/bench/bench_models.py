"""What the benchmarks run on: Ouro-1.4B's shapes, a model with random bf16 weights or a
trained checkpoint on the GPU, prompts from the held-out text, and a benchmark entry's
backend and CUDA-graph settings (``name+graphs``)."""

from __future__ import annotations

import math

import torch

from flashloop_backend.config import ConfigError
from flashloop_backend.tools.bench.timing import require_cuda


def ouro_1p4b_shapes(layers: int | None = None):
    """Ouro-1.4B's configuration, with ``layers`` layers (None: its 24)."""
    from flashloop_backend.host.config import OuroConfig

    return OuroConfig(
        hidden_size=2048,
        num_hidden_layers=layers or 24,
        num_attention_heads=16,
        num_key_value_heads=16,
        head_dim=128,
        intermediate_size=5632,
        vocab_size=49152,
        rope_theta=1e6,
        total_ut_steps=4,
        max_position_embeddings=65536,
    )


def random_ouro(layers: int | None, block_size: int, fused: bool = True):
    """Ouro-1.4B shapes with random bf16 weights on the GPU (no download), and the
    matching support request. ``fused``: one QKV and one gate-up GEMM per layer and the
    fused layer kernels (False: separate projections and the torch reference ops)."""
    from flashloop_backend.host.model import OuroModel

    device = require_cuda()
    cfg = ouro_1p4b_shapes(layers)
    torch.manual_seed(0)
    with torch.device(device):
        model = OuroModel(cfg).to(torch.bfloat16).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    if fused:
        model.fuse_projections()
    request = model.support_request(block_size)
    return model, request


def heldout_prompts(tokenizer, context: int, concurrency: int) -> tuple[list[list[int]], str]:
    """``concurrency`` prompts of ``context`` tokens, consecutive windows of the held-out
    text, and that text's description."""
    from flashloop_backend.tools.evaluation import heldout_text

    text, source = heldout_text(limit_bytes=max(400_000, 8 * context * concurrency))
    tokens = tokenizer.encode(text).ids
    if len(tokens) < context * concurrency:
        raise ConfigError(
            f"the held-out text ({source}) has {len(tokens)} tokens; {concurrency} prompts "
            f"of {context} need {context * concurrency}"
        )
    return [tokens[i * context : (i + 1) * context] for i in range(concurrency)], source


def checkpoint_workload(
    directory: str, block_size: int, context: int, concurrency: int, fused: bool = True
):
    """A trained checkpoint in BF16 on the GPU, its support request, and prompts from the
    held-out text (:func:`heldout_prompts`: a trained model's drafts are accepted as on
    real text) with that text's description."""
    from flashloop_backend.host.config import ModelError
    from flashloop_backend.host.loader import load_model, load_tokenizer

    device = require_cuda()
    try:
        model = load_model(directory, device, torch.bfloat16).eval()
        tokenizer = load_tokenizer(directory)
    except ModelError as exc:
        raise ConfigError(f"cannot load model {directory!r}: {exc}") from None
    if fused:
        model.fuse_projections()
    prompts, source = heldout_prompts(tokenizer, context, concurrency)
    return model, model.support_request(block_size), prompts, source


def graph_variant(name: str, concurrency: int, max_context: int):
    """(backend name, GraphSettings or None) of a benchmark entry: ``name+graphs`` captures
    buckets of powers of two up to ``concurrency`` rows for contexts up to ``max_context``."""
    from flashloop_backend.host.graphs import GraphSettings

    base, _, suffix = name.partition("+")
    if suffix not in ("", "graphs"):
        raise ConfigError(f"benchmark entry {name!r}: the only suffix is '+graphs'")
    if not suffix:
        return base, None
    buckets = tuple(2**i for i in range(math.ceil(math.log2(max(1, concurrency))) + 1))
    return base, GraphSettings(buckets=buckets, max_context=max_context)
