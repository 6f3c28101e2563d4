"""PNG plots generated from the committed JSON records (``flashloop-backend report``):
speedup vs context, KV bytes per token, quality per feature combination, quality vs speed,
host decode eager vs CUDA graphs, serving TPOT vs dense, capacity against the KV budget.
Every number drawn is read from a record; a missing record skips its plot and says so.
Only current records are drawn: the ones ``plot_records.SUPERSEDED`` names are left out
(and the log says which), and the serving plot draws CUDA-graph records only
(``plot_records.SERVING_METHOD``). The host plots are ``serving_plots``'."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from flashloop_backend.tools.capacity_plot import draw_capacity
from flashloop_backend.tools.plot_records import (
    STYLE,
    SUPERSEDED,
    features_label,
    load_record,
    tokens,
)
from flashloop_backend.tools.results_table import dense_and_flashloop
from flashloop_backend.tools.serving_plots import draw_graphs_tpot, draw_serving_speedup

QUALITY_BAR_PERCENT = 3.0  # issue 8's all-on target: Δ bits/byte at most +3%


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

    sparse = load_record(results, "bench_sparse_decode.json")
    prefill = load_record(results, "bench_prefill_attention.json")
    packed = [load_record(results, name) for name in PACKED_READER_RECORDS]
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
    packed = load_record(results, "bench_packed_kv.json")
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
    record = load_record(results, "eval_combinations_cpu.json")
    if not record:
        return None
    rows = record["combinations"][::-1]  # dense on top
    labels = [
        {"no feature": "dense (all off)", "all three": "all three (all on)"}.get(name, name)
        for name in (features_label(r["features"]) for r in rows)
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
    grid = load_record(results, QUALITY_GRID)
    runs = [(label, load_record(results, name), index) for label, name, index in QUALITY_VS_SPEED]
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


PLOTS: dict[str, Callable] = {
    "speedup_vs_context.png": _speedup_vs_context,
    "memory_per_token.png": _memory_per_token,
    "quality_by_combination.png": _quality_by_combination,
    "quality_vs_speed.png": _quality_vs_speed,
    "graphs_tpot.png": draw_graphs_tpot,
    "serving_speedup.png": draw_serving_speedup,
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
