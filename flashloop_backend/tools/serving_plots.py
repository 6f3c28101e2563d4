"""The report's host plots: host decode eager against CUDA graphs per backend and shape
(``bench e2e`` records with graphs), and serving TPOT against dense per feature variant
and workload (``bench serving`` records from CUDA graphs only: :data:`SERVING_METHOD`)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from flashloop_backend.tools.plot_records import (
    BACKEND_NAMES,
    EAGER_COLOR,
    FEATURE_NAMES,
    GRAPHS_COLOR,
    SERVING_METHOD,
    current_records,
    features_label,
    tokens,
)


def backend_label(name: str, config: dict) -> str:
    base = name.removesuffix("+graphs")
    if base != "flashloop":
        return BACKEND_NAMES.get(base, base)
    enabled = [f for f in FEATURE_NAMES if config.get(f, {}).get("enabled")]
    features = (
        "all three features" if len(enabled) == len(FEATURE_NAMES) else features_label(enabled)
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
                label = backend_label(name, run.get("config") or {})
                tpot = entry["tpot_ms"]["median"]
                panels.setdefault(shape, {}).setdefault(label, {})[mode] = tpot
    return panels


def draw_graphs_tpot(results: Path, plt):
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
            features_label(_variant_features(v)) + (f" [{rec}]" if names.count(v) > 1 else ""),
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


def draw_serving_speedup(results: Path, plt):
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
