"""The committed evaluation model (models/ouro-eval-bytes-20m) loads, has the shape and
parameter count its card states, stays within the 40 MB the repository allows, and
predicts held-out Python far better than chance."""

import json
from pathlib import Path

import torch

from flashloop_backend.host import load_model, load_tokenizer

MODEL = Path(__file__).resolve().parents[1] / "models" / "ouro-eval-bytes-20m"


def test_the_evaluation_model_matches_its_card():
    model = load_model(MODEL)
    cfg = model.config
    shape = (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim)
    assert shape == (6, 512, 4, 128) and cfg.total_ut_steps == 4
    params = sum(p.numel() for p in model.parameters())
    metrics = json.loads((MODEL / "metrics.json").read_text())
    assert params == metrics["params"] == 19_545_089
    assert f"{params:,}" in (MODEL / "MODEL_CARD.md").read_text()
    assert (MODEL / "model.safetensors").stat().st_size <= 40e6


def test_the_evaluation_model_predicts_python():
    model = load_model(MODEL)
    tokenizer = load_tokenizer(MODEL)
    text = "def add(a, b):\n    return a + b\n\n\nclass Point:\n    def __init__(self, x, y):\n"
    ids = torch.tensor([[256, *tokenizer.encode(text).ids]])
    with torch.no_grad():
        hiddens, _ = model.full_forward(ids[:, :-1])
        logits = model.lm_head(hiddens[-1]).float()
    nll = torch.nn.functional.cross_entropy(logits[0], ids[0, 1:])
    assert nll < 1.5  # nats per byte; a uniform guess over 258 tokens is 5.55
