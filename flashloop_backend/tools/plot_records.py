"""What the report's plots share: which committed records are current (the ones
:data:`SUPERSEDED` names are not), how the docs name features, backends and contexts, and
the plots' style."""

from __future__ import annotations

import json
from pathlib import Path

# Records measured at an older tree than a later record of the same shape (results/README.md
# lists both): drawn beside it, they would show two figures for one measurement with nothing
# to tell the reader which one holds.
SUPERSEDED: dict[str, str] = {
    "bench_e2e_graphs_flashloop_1k.json": "1K x 1 all on, eager vs graphs, tree 175dae0; "
    "re-measured by bench_e2e_graphs_1k.json after max_context sizing and batched host reads",
    "bench_e2e_graphs_32k_3425f19.json": "32K x 16 before the packed reader stopped at each "
    "row's length (all on 459.4 ms)",
    "bench_e2e_graphs_32k_2f85039.json": "32K x 16 before the prefill-planning fix and the "
    "1-warp 32-row deep reader launch",
    "bench_e2e_graphs_32k_a01ffc7.json": "32K x 16 before the 16 x 2 selected-key launch",
    "bench_e2e_graphs_32k_streamed_a01ffc7.json": "32K x 16 with the streamed-correction "
    "override, before the 16 x 2 selected-key launch",
}
# Serving TPOT from an eager host and from CUDA graphs measure different hosts; the plot
# compares features from graphs, so it reads the records whose method says so.
SERVING_METHOD = "decode-only steps from CUDA graphs"

FEATURE_NAMES = {
    "token_sparse_prefill": "token-sparse prefill",
    "sparse_decode_attention": "sparse decode",
    "kv_residual_quantization": "INT4 KV",
}
BACKEND_NAMES = {"triton": "dense Triton", "flashinfer": "dense FlashInfer"}
STYLE = {  # readable at the docs page's width (figures 9-11 in wide at 110 dpi)
    "font.size": 11,
    "axes.titlesize": 12,
    "axes.labelsize": 11,
    "xtick.labelsize": 10,
    "ytick.labelsize": 10,
    "legend.fontsize": 10,
    "figure.titlesize": 13,
}
EAGER_COLOR, GRAPHS_COLOR = "0.55", "tab:orange"


def load_record(results: Path, name: str) -> dict | None:
    path = results / name
    return json.loads(path.read_text()) if path.is_file() and name not in SUPERSEDED else None


def current_records(results: Path, pattern: str) -> list[Path]:
    """The records matching ``pattern`` that no later record superseded, by name."""
    return [p for p in sorted(results.glob(pattern)) if p.name not in SUPERSEDED]


def tokens(n: int) -> str:
    """A context length as the docs write it: 1K, 8K, 32K."""
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def features_label(features: list[str]) -> str:
    if len(features) == len(FEATURE_NAMES):
        return "all three"
    return " + ".join(FEATURE_NAMES.get(f, f) for f in features) or "no feature"
