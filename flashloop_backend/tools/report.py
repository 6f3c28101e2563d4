"""PNG plots generated from the committed JSON records (``flashloop-backend report``):
speedup vs context, KV bytes per token, quality per feature combination, quality vs speed,
host decode eager vs CUDA graphs, serving TPOT vs dense, capacity against the KV budget.
Every number drawn is read from a record; a missing record skips its plot and says so.
Only current records are drawn: the ones :data:`SUPERSEDED` names are left out (and the
log says which), and the serving plot draws CUDA-graph records only (:data:`SERVING_METHOD`)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

from flashloop_backend.tools.capacity_plot import draw_capacity
from flashloop_backend.tools.results_table import dense_and_flashloop

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
QUALITY_BAR_PERCENT = 3.0  # issue 8's all-on target: Δ bits/byte at most +3%


def _load(results: Path, name: str) -> dict | None:
    path = results / name
    return json.loads(path.read_text()) if path.is_file() and name not in SUPERSEDED else None


def current_records(results: Path, pattern: str) -> list[Path]:
    """The records matching ``pattern`` that no later record superseded, by name."""
    return [p for p in sorted(results.glob(pattern)) if p.name not in SUPERSEDED]


def tokens(n: int) -> str:
    """A context length as the docs write it: 1K, 8K, 32K."""
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def _features_label(features: list[str]) -> str:
    if len(features) == len(FEATURE_NAMES):
        return "all three"
    return " + ".join(FEATURE_NAMES.get(f, f) for f in features) or "no feature"


# The registered packed reader (encoding v3, the CUDA kernel) at depth 1: 8K x 1 and
# 32K x 16, each beside FlashInfer BF16 decode of the same rows in its run.
PACKED_READER_RECORDS = (
    "decode_v3/bench_packed_first_8192_1.json",
    "decode_v3/bench_packed_stream_sweep_32768_16_67b355d.json",
)


def _cuda_depth1(case: dict) -> dict:
    """The CUDA reader's depth-1 entry at its registered launch."""
    return case["depths"]["dense_levels_depth1_cuda"]


def _speedup_vs_context(results: Path, plt):
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    sparse = _load(results, "bench_sparse_decode.json")
    prefill = _load(results, "bench_prefill_attention.json")
    packed = [_load(results, name) for name in PACKED_READER_RECORDS]
    if not (sparse and prefill and all(packed)):
        return None
    packed = {"decode": [case for record in packed for case in record["decode"]]}
    fig, ax = plt.subplots(figsize=(10, 6.6))

    def values(xs, ys, side=None, va="center"):  # each value outside its line: ends outwards
        for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
            right = side > 0 if side else i == len(xs) - 1
            ax.annotate(
                f"{y:.2f}x",
                (x, y),
                xytext=(9 if right else -9, 0),
                textcoords="offset points",
                ha="left" if right else "right",
                va=va,
                fontsize=9,
            )

    for batch in sorted({c["concurrency"] for c in sparse["cases"]}):
        cases = sorted(
            (c for c in sparse["cases"] if c["concurrency"] == batch), key=lambda c: c["context"]
        )
        xs, ys = [c["context"] for c in cases], [c["sparse_correction_speedup"] for c in cases]
        ax.plot(
            xs,
            ys,
            "o-",
            label=f"sparse correction (key retention {sparse['ratio']:.2f}) "
            f"vs FlashInfer decode, batch {batch}",
        )
        values(xs, ys)
    for retention in sorted({s["retention"] for c in prefill["cases"] for s in c["sparse"]}):
        points = [
            (c["context"], c["dense_flashinfer_ms"] / s["ms"])
            for c in prefill["cases"]
            for s in c["sparse"]
            if s["retention"] == retention
        ]
        xs, ys = zip(*sorted(points), strict=True)
        ax.plot(
            xs,
            ys,
            "s--",
            label=f"token-sparse prefill kernel (retention {retention:.2f}) "
            "vs FlashInfer causal prefill, one prompt",
        )
        values(xs, ys)
    packed_points = sorted(
        (
            (c["context"], _cuda_depth1(c)["speedup_vs_flashinfer_bf16"], c["concurrency"])
            for c in packed["decode"]
        ),
        key=lambda p: p[1],
    )
    for context, speedup, batch in packed_points:
        ax.plot(
            [context],
            [speedup],
            "^",
            markersize=10,
            label=f"packed INT4 reader (v3, CUDA), depth 1, vs FlashInfer BF16, batch {batch}",
        )
        values([context], [speedup], side=1)  # right of the point: the lines label left at 8K
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.annotate(
        "dense = 1x", (0.01, 1.0), xycoords=("axes fraction", "data"), va="bottom", color="gray"
    )
    contexts = sorted(
        {c["context"] for c in sparse["cases"]}
        | {c["context"] for c in prefill["cases"]}
        | {c["context"] for c in packed["decode"]}
    )
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(contexts))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: tokens(round(x))))
    ax.set_xlim(contexts[0] / 1.4, contexts[-1] * 1.4)
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(FixedLocator([1, 1.5, 2, 3, 4, 6, 8, 12, 16]))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}x"))
    ax.grid(axis="y", color="0.9")
    ax.set(
        xlabel="context (tokens)",
        ylabel="speedup vs dense, same run (log scale)",
        title="FlashLoop kernels vs dense per layer call (H200)",
    )
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), frameon=False)
    return fig


def _memory_per_token(results: Path, plt):
    packed = _load(results, "bench_packed_kv.json")
    if not packed:
        return None
    acc = packed["accounting"]
    names = [
        "BF16\n4 copy-on-exit planes",
        "INT4 base\n+ 3 residual levels",
        "INT4 + token sparsity\n[1, 1, 0.25, 0.10]",
    ]
    values = [
        acc["bf16_bytes_per_token_4_depths"],
        acc["dense_levels"]["steady_bytes_per_token"],
        acc["token_sparse_1_1_0.25_0.10"]["steady_bytes_per_token"],
    ]
    fig, ax = plt.subplots(figsize=(8, 4.8))
    bars = ax.bar(names, [v / 1024 for v in values], color=["0.55", "tab:blue", "tab:green"])
    for bar, value in zip(bars, values, strict=True):
        ratio = "baseline" if value == values[0] else f"{values[0] / value:.2f}x smaller"
        ax.annotate(
            f"{value / 1024:,.0f} KiB\n{ratio}",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            xytext=(0, 3),
            textcoords="offset points",
        )
    ax.set_ylim(0, max(values) / 1024 * 1.22)
    ax.set(
        ylabel=f"steady KV KiB per prompt token\n({acc['layers']} layers, 4 depths)",
        title="KV bytes per token, from the packed store's tensors",
    )
    return fig


def _quality_by_combination(results: Path, plt):
    """Δ bits/byte with its 95% CI per combination, one row each (a forest plot: the
    intervals are far wider than the deltas, so bars would show nothing but their whiskers),
    beside the all-on quality bar of issue 8 (+3%)."""
    record = _load(results, "eval_combinations_cpu.json")
    if not record:
        return None
    rows = record["combinations"][::-1]  # dense on top
    labels = [
        {"no feature": "dense (all off)", "all three": "all three (all on)"}.get(name, name)
        for name in (_features_label(r["features"]) for r in rows)
    ]
    delta = [r["delta_bits_per_byte_percent"] for r in rows]
    low = [d - r["delta_ci95_percent"][0] for d, r in zip(delta, rows, strict=True)]
    high = [r["delta_ci95_percent"][1] - d for d, r in zip(delta, rows, strict=True)]
    ys = list(range(len(rows)))
    fig, ax = plt.subplots(figsize=(11, 5.4))
    ax.errorbar(
        delta,
        ys,
        xerr=[low, high],
        fmt="o",
        color="tab:purple",
        ecolor="tab:purple",
        capsize=4,
        markersize=7,
        lw=1.5,
    )
    ax.axvline(0.0, color="gray", lw=0.8)
    ax.axvline(QUALITY_BAR_PERCENT, color="tab:red", lw=1, ls="--")
    ax.annotate(
        f"all-on bar +{QUALITY_BAR_PERCENT:g}%",
        (QUALITY_BAR_PERCENT, -0.55),
        xytext=(4, 0),
        textcoords="offset points",
        color="tab:red",
        va="bottom",
    )
    ax.set_yticks(ys, labels)
    ax.set_ylim(-0.6, len(rows) - 0.4)
    column = "{:>8}  {:>15}  {:>5}"  # monospace columns right of the axes
    for y, d, r in zip(ys, delta, rows, strict=True):
        lo, hi = r["delta_ci95_percent"]
        ax.annotate(
            column.format(f"{d:+.2f}%", f"[{lo:+.1f}, {hi:+.1f}]", f"{r['top1_agreement']:.3f}"),
            (1.02, y),
            xycoords=("axes fraction", "data"),
            va="center",
            family="monospace",
            fontsize=10,
        )
    ax.annotate(
        column.format("Δ", "95% CI", "top-1"),
        (1.02, len(rows) - 0.4),
        xycoords=("axes fraction", "data"),
        va="bottom",
        family="monospace",
        fontsize=10,
        weight="bold",
    )
    settings = rows[0]["settings"]
    ax.set_xlabel(
        f"Δ bits/byte vs dense (%), point and 95% bootstrap CI over "
        f"{settings['windows']} windows of {settings['context']} + "
        f"{settings['continuation']} tokens"
    )
    ax.set_title("Every feature combination vs dense (embedded model, CPU)", loc="left")
    ax.grid(axis="x", color="0.9")
    return fig


# (label, e2e record, its run's shape, the evaluation-grid point of the same configuration)
QUALITY_VS_SPEED = (
    ("all on (configs/all_on.json)", "decode_v3/bench_e2e_all_on_32k16_f483680.json", 13),
    ("KV quantization alone, fixed_prompt", "decode_v3/bench_e2e_kv_quant_32k16_f483680.json", 9),
)
QUALITY_GRID = "quality/eval_grid_h200.json"


def _quality_vs_speed(results: Path, plt):
    """One point per configuration: decode TPOT against dense's in the same run (Ouro-1.4B
    shapes, random weights, H200) and Δ bits/byte against dense on the evaluation model
    (H200) at the same configuration: one model and one machine per axis."""
    grid = _load(results, QUALITY_GRID)
    runs = [(label, _load(results, name), index) for label, name, index in QUALITY_VS_SPEED]
    if grid is None or any(record is None for _, record, _ in runs):
        return None
    points = []
    for label, record, index in runs:
        run = record["runs"][0]
        dense, mine = dense_and_flashloop(record)
        speed = dense["tpot_ms"]["median"] / mine["tpot_ms"]["median"]
        point = grid["combinations"][index]
        low, high = point["delta_ci95_percent"]
        points.append((label, speed, point["delta_bits_per_byte_percent"], low, high))
    shape = f"{tokens(run['context'])} x {run['concurrency']}"
    fig, ax = plt.subplots(figsize=(9, 5.2))
    for label, speed, quality, low, high in points:
        ax.errorbar([speed], [quality], yerr=[[quality - low], [high - quality]], fmt="o",
                    markersize=9, capsize=4)  # fmt: skip
        ax.annotate(f"{label}\n{speed:.2f}x, Δ {quality:+.2f}%", (speed, quality),
                    xytext=(10, 8), textcoords="offset points", va="bottom")  # fmt: skip
    ax.axhline(0.0, color="gray", lw=0.8)
    ax.axvline(1.0, color="gray", lw=0.8)
    speeds = [p[1] for p in points]
    ax.set_xlim(min(0.5, *speeds) - 0.05, max(1.5, *speeds) + 0.3)
    ax.set(
        xlabel=f"decode speed vs dense, TPOT ratio (x): Ouro-1.4B shapes, random weights, "
        f"{shape}, H200",
        ylabel="Δ bits/byte vs dense (%, 95% CI)\nevaluation model, 256 windows, H200",
        title="Quality (evaluation model) vs decode speed (Ouro-1.4B shapes), H200",
    )
    return fig


def _backend_label(name: str, config: dict) -> str:
    base = name.removesuffix("+graphs")
    if base != "flashloop":
        return BACKEND_NAMES.get(base, base)
    enabled = [f for f in FEATURE_NAMES if config.get(f, {}).get("enabled")]
    features = (
        "all three features" if len(enabled) == len(FEATURE_NAMES) else _features_label(enabled)
    )
    overrides = config.get("kernel_overrides") or {}
    return f"FlashLoop\n{features}" + ("\n(kernel overrides)" if overrides else "")


def graphs_tpot_panels(results: Path) -> dict[str, dict[str, dict[str, float]]]:
    """Per shape ("1K x 1, 24 layers"), per backend label, TPOT median ms under "eager" and
    "graphs", from the current ``bench_e2e_graphs*.json`` records."""
    panels: dict[str, dict[str, dict[str, float]]] = {}
    for path in current_records(results, "bench_e2e_graphs*.json"):
        for run in json.loads(path.read_text())["runs"]:
            layers = run["model"].rpartition(", ")[2] if "layers" in run["model"] else "24 layers"
            shape = f"{tokens(run['context'])} x {run['concurrency']}, {layers}"
            for name, entry in run["results"].items():
                mode = "graphs" if name.endswith("+graphs") else "eager"
                label = _backend_label(name, run.get("config") or {})
                tpot = entry["tpot_ms"]["median"]
                panels.setdefault(shape, {}).setdefault(label, {})[mode] = tpot
    return panels


def _graphs_tpot(results: Path, plt):
    """Decode TPOT through the host, one panel per shape (a 32K decode and a 1K one share no
    useful scale): eager (gray) beside CUDA graphs (orange) where a record has both."""
    from matplotlib.patches import Patch

    panels = graphs_tpot_panels(results)
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels) + 1, 5.2), squeeze=False)
    for ax, (shape, backends) in zip(axes[0], panels.items(), strict=True):
        has_eager = any("eager" in modes for modes in backends.values())
        width = 0.38 if has_eager else 0.55
        for x, modes in enumerate(backends.values()):
            drawn = [m for m in ("eager", "graphs") if m in modes]
            for i, mode in enumerate(drawn):
                offset = (i - (len(drawn) - 1) / 2) * width
                rect = ax.bar(
                    x + offset,
                    modes[mode],
                    width * 0.95,
                    color=EAGER_COLOR if mode == "eager" else GRAPHS_COLOR,
                )[0]
                ax.annotate(
                    f"{modes[mode]:.1f}",
                    (rect.get_x() + rect.get_width() / 2, rect.get_height()),
                    ha="center",
                    va="bottom",
                    xytext=(0, 2),
                    textcoords="offset points",
                )
        ticks = [
            label
            + (
                f"\ngraphs {modes['eager'] / modes['graphs']:.1f}x faster"
                if {"eager", "graphs"} <= modes.keys()
                else ""
            )
            for label, modes in backends.items()
        ]
        ax.set_xticks(range(len(backends)), ticks)
        ax.set_xlim(-0.6, len(backends) - 0.4)
        ax.set_ylim(0, max(v for m in backends.values() for v in m.values()) * 1.18)
        ax.set_title(shape + ("" if has_eager else " (CUDA graphs only)"))
        ax.set_ylabel("TPOT ms (median)")
    fig.legend(
        handles=[
            Patch(color=EAGER_COLOR, label="eager"),
            Patch(color=GRAPHS_COLOR, label="CUDA graphs"),
        ],
        loc="upper right",
        ncol=2,
        frameon=False,
    )
    fig.suptitle("Decode through the host, eager vs CUDA graphs (H200)", x=0.02, ha="left")
    return fig


def serving_ratios(record: dict) -> dict[str, dict[str, float]]:
    """Per variant, per workload: dense TPOT p50 / the variant's, both from ``record`` (one
    run: the machine's run-to-run spread cancels). Dense itself and workloads that only one
    of the two finished are left out."""
    dense = {
        run["workload"]: run["tpot_ms"]["p50"]
        for run in record["runs"]
        if run["variant"] == "dense" and run.get("tpot_ms")
    }
    out: dict[str, dict[str, float]] = {}
    for run in record["runs"]:
        if run["variant"] != "dense" and run.get("tpot_ms") and run["workload"] in dense:
            ratio = dense[run["workload"]] / run["tpot_ms"]["p50"]
            out.setdefault(run["variant"], {})[run["workload"]] = ratio
    return out


def _variant_features(variant: str) -> list[str]:
    return variant.removesuffix(" alone").split(" + ")


def _variant_order(variant: str) -> list[int]:
    """Single features before combinations, each in the config's feature order."""
    features = _variant_features(variant)
    order = list(FEATURE_NAMES)
    return [len(features)] + [order.index(f) if f in order else len(order) for f in features]


def serving_records(results: Path) -> dict[str, dict]:
    """The current ``bench_serving*.json`` records measured from CUDA graphs, by file stem."""
    records = {
        path.stem: json.loads(path.read_text())
        for path in current_records(results, "bench_serving*.json")
    }
    return {
        stem: record
        for stem, record in records.items()
        if record.get("method", "").startswith(SERVING_METHOD)
    }


def serving_series(results: Path) -> list[tuple[str, dict[str, float]]]:
    """(variant label, ratios per workload) from :func:`serving_records`, single features
    first, then cumulative ones; a variant measured in two records names its record."""
    found = [
        (variant, stem.removeprefix("bench_serving_"), ratios)
        for stem, record in serving_records(results).items()
        for variant, ratios in serving_ratios(record).items()
    ]
    found.sort(key=lambda f: _variant_order(f[0]))
    names = [v for v, _, _ in found]
    return [
        (
            _features_label(_variant_features(v)) + (f" [{rec}]" if names.count(v) > 1 else ""),
            ratios,
        )
        for v, rec, ratios in found
    ]


def _workload_label(workload: str) -> str:
    if m := re.fullmatch(r"closed_ctx(\d+)_conc(\d+)", workload):
        return f"{tokens(int(m[1]))} x {m[2]}"
    if m := re.fullmatch(r"fixed_arrival_([\d.]+)/s", workload):
        return f"fixed arrival\n{float(m[1]):g} req/s"
    return workload.replace("_", " ")


def _serving_speedup(results: Path, plt):
    """Each variant's TPOT p50 speedup over dense of the same record, per workload (bars
    below 1 are slower than dense)."""
    series = serving_series(results)
    if not series:
        return None
    records = serving_records(results).values()
    dense = sorted(
        {
            BACKEND_NAMES.get(run["backend"], run["backend"])
            for record in records
            for run in record["runs"]
            if run["variant"] == "dense"
        }
    )
    models = sorted({record["model"].rpartition(", ")[2] for record in records})
    workloads = list(dict.fromkeys(w for _, ratios in series for w in ratios))
    fig, ax = plt.subplots(figsize=(11, 5.2))
    width = 0.8 / len(series)
    for index, (label, ratios) in enumerate(series):
        xs = [
            w + (index - (len(series) - 1) / 2) * width
            for w, name in enumerate(workloads)
            if name in ratios
        ]
        ax.bar(xs, [ratios[n] for n in workloads if n in ratios], width * 0.95, label=label)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.annotate(
        "dense = 1", (0.005, 1.0), xycoords=("axes fraction", "data"), va="bottom", color="gray"
    )
    ax.set_xticks(range(len(workloads)), [_workload_label(w) for w in workloads])
    ax.set_ylim(0, max(1.0, *(r for _, ratios in series for r in ratios.values())) * 1.12)
    ax.grid(axis="y", color="0.9")
    ax.set_axisbelow(True)
    ax.set(
        xlabel="workload (context x concurrency, closed loop; or fixed arrival)",
        ylabel="TPOT speedup vs dense\n(dense p50 / variant p50, same run)",
        title=f"Serving from CUDA graphs vs {' / '.join(dense)} of the same run "
        f"(H200, {' / '.join(models)})",
    )
    ax.legend(title="features on", loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    return fig


PLOTS: dict[str, Callable] = {
    "speedup_vs_context.png": _speedup_vs_context,
    "memory_per_token.png": _memory_per_token,
    "quality_by_combination.png": _quality_by_combination,
    "quality_vs_speed.png": _quality_vs_speed,
    "graphs_tpot.png": _graphs_tpot,
    "serving_speedup.png": _serving_speedup,
    "capacity_vs_budget.png": draw_capacity,
}


def make_plots(results: Path, out: Path, log: Callable[[str], None] = print) -> list[Path]:
    """Write every plot whose records exist; return the written paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    for name, reason in SUPERSEDED.items():
        if (results / name).is_file():
            log(f"  left out {name}: superseded ({reason})")
    written = []
    with plt.rc_context(STYLE):
        for name, draw in PLOTS.items():
            fig = draw(results, plt)
            if fig is None:
                log(f"  {name}: skipped, its records are not in {results}")
                continue
            fig.tight_layout()
            fig.savefig(out / name, dpi=110)
            plt.close(fig)
            written.append(out / name)
            log(f"  wrote {out / name}")
    return written
