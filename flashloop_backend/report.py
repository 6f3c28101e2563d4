"""PNG plots generated from the committed JSON records (``flashloop-backend report``):
speedup vs context, KV bytes per token, quality per feature combination, quality vs speed,
host decode eager vs CUDA graphs, serving TPOT vs dense.
Every number drawn is read from a record; a missing record skips its plot and says so."""

from __future__ import annotations

import json
from pathlib import Path


def _load(results: Path, name: str) -> dict | None:
    path = results / name
    return json.loads(path.read_text()) if path.is_file() else None


def _registered_depth1(case: dict) -> dict:
    """The depth-1 entry timed with today's registered launch (records keep sweeps)."""
    from .kernels.triton.packed_decode import DEFAULT_TUNING

    fields = ("num_warps", "programs_per_sm", "rows_per_step")  # older records: no rows
    want = tuple(getattr(DEFAULT_TUNING, f) for f in fields)
    for key, entry in case["depths"].items():
        tuning = entry.get("tuning", {})
        if key.startswith("dense_levels_depth1") and tuple(map(tuning.get, fields)) == want:
            return entry
    return case["depths"]["dense_levels_depth1"]


def _speedup_vs_context(results: Path, plt):
    sparse = _load(results, "bench_sparse_decode.json")
    prefill = _load(results, "bench_prefill_attention.json")
    packed = _load(results, "bench_packed_kv.json")
    if not (sparse and prefill and packed):
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for batch in sorted({c["concurrency"] for c in sparse["cases"]}):
        cases = sorted(
            (c for c in sparse["cases"] if c["concurrency"] == batch), key=lambda c: c["context"]
        )
        ax.plot([c["context"] for c in cases], [c["sparse_correction_speedup"] for c in cases], "o-",
                label=f"sparse correction {sparse['ratio']} vs FlashInfer decode, batch {batch}")  # fmt: skip
    for retention in sorted({s["retention"] for c in prefill["cases"] for s in c["sparse"]}):
        points = [(c["context"], c["dense_flashinfer_ms"] / s["ms"]) for c in prefill["cases"]
                  for s in c["sparse"] if s["retention"] == retention]  # fmt: skip
        ax.plot(
            *zip(*sorted(points), strict=True),
            "s--",
            label=f"token-sparse prefill kernel, retention {retention}",
        )
    for case in packed["decode"]:
        depth1 = _registered_depth1(case)
        ax.plot([case["context"]], [depth1["speedup_vs_flashinfer_bf16"]], "^", markersize=9,
                label=f"packed INT4 reader depth 1, batch {case['concurrency']}")  # fmt: skip
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="speedup vs dense (x)",
           title="FlashLoop kernels vs dense, H200 (per layer call, same run)")  # fmt: skip
    ax.legend(fontsize=7)
    return fig


def _bar_labels(fig, ax, ylabel: str, title: str):
    ax.set(ylabel=ylabel, title=title)
    ax.tick_params(axis="x", labelsize=8)  # long category names
    return fig


def _memory_per_token(results: Path, plt):
    packed = _load(results, "bench_packed_kv.json")
    if not packed:
        return None
    acc = packed["accounting"]
    names = [
        "BF16, 4 copy-on-exit planes",
        "INT4 base + 3 residuals",
        "INT4 + token sparsity [1,1,.25,.10]",
    ]
    values = [acc["bf16_bytes_per_token_4_depths"], acc["dense_levels"]["steady_bytes_per_token"],
              acc["token_sparse_1_1_0.25_0.10"]["steady_bytes_per_token"]]  # fmt: skip
    fig, ax = plt.subplots(figsize=(7, 4))
    bars = ax.bar(names, [v / 1024 for v in values], color=["gray", "tab:blue", "tab:green"])
    for bar, value in zip(bars, values, strict=True):
        ax.annotate(f"{values[0] / value:.2f}x smaller" if value != values[0] else "baseline",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom")  # fmt: skip
    return _bar_labels(fig, ax, "steady KV KiB per prompt token (24 layers)",
                       "KV bytes per token from the store's tensors")  # fmt: skip


def _quality_by_combination(results: Path, plt):
    record = _load(results, "eval_combinations_cpu.json")
    if not record:
        return None
    rows = record["combinations"]
    short = {
        "token_sparse_prefill": "TSP",
        "sparse_decode_attention": "SDA",
        "kv_residual_quantization": "KVQ",
    }
    labels = [(" + ".join(short[f] for f in r["features"]) or "dense") + f"\ntop-1 {r['top1_agreement']:.3f}"
              for r in rows]  # fmt: skip
    delta = [r["delta_bits_per_byte_percent"] for r in rows]
    low = [d - r["delta_ci95_percent"][0] for d, r in zip(delta, rows, strict=True)]
    high = [r["delta_ci95_percent"][1] - d for d, r in zip(delta, rows, strict=True)]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(labels, delta, yerr=[low, high], capsize=4, color="tab:purple")
    ax.axhline(0.0, color="gray", lw=0.8)
    return _bar_labels(fig, ax, "Δ bits/byte vs dense (%), 95% CI",
                       "Quality of every feature combination (embedded model, CPU)")  # fmt: skip


def _quality_vs_speed(results: Path, plt):
    """One point per feature alone: its measured speed figure (named on the point) against
    its Δ bits/byte on the embedded model."""
    sparse = _load(results, "bench_sparse_decode.json")
    packed = _load(results, "bench_packed_kv.json")
    e2e = _load(results, "bench_e2e_token_sparse_prefill_32768.json")
    evals = {n: _load(results, f) for n, f in (("sparse", "eval_sparse_decode_cpu.json"),
             ("prefill", "eval_token_sparse_w64_cpu.json"), ("quant", "eval_kv_quant_fixed_prompt_cpu.json"))}  # fmt: skip
    if not (sparse and packed and e2e) or not all(evals.values()):
        return None
    big = max(sparse["cases"], key=lambda c: (c["context"], c["concurrency"]))
    runs = e2e["runs"][0]["results"]
    first, last = next(iter(runs)), list(runs)[-1]  # the baseline first
    case = max(packed["decode"], key=lambda c: c["concurrency"])
    points = [
        ("sparse decode 0.10: 4-loop attention sum vs dense, 32K x 16",
         big["four_loop_speedup"], evals["sparse"]),
        ("token-sparse prefill [1,1,.25,.10]: 32K prompt through the host",
         runs[first]["prefill_latency_s"] / runs[last]["prefill_latency_s"], evals["prefill"]),
        ("INT4 KV: packed reader depth 1 vs FlashInfer BF16, 32K x 16",
         _registered_depth1(case)["speedup_vs_flashinfer_bf16"], evals["quant"]),
    ]  # fmt: skip
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, speed, ev in points:
        ax.plot([speed], [ev["delta_bits_per_byte_percent"]], "o", markersize=9, label=label)
    ax.axhline(0.0, color="gray", lw=0.8)
    ax.axvline(1.0, color="gray", lw=0.8)
    ax.set(xlabel="measured speedup (x), H200", ylabel="Δ bits/byte vs dense (%), embedded model",
           title="Quality vs speed, each feature alone")  # fmt: skip
    ax.legend(fontsize=7)
    return fig


def _graphs_tpot(results: Path, plt):
    """TPOT through the host of every entry of the ``bench_e2e_graphs*.json`` records, one
    panel per (context, concurrency, layers): eager and ``+graphs`` entries side by side,
    each bar naming its record (a 32K decode and a 1K one share no useful scale)."""
    panels: dict[str, list[tuple[str, float]]] = {}
    for path in sorted(results.glob("bench_e2e_graphs*.json")):
        record = path.stem.removeprefix("bench_e2e_graphs_")
        for run in json.loads(path.read_text())["runs"]:
            layers = run["model"].rpartition(", ")[2] if "layers" in run["model"] else "24 layers"
            shape = f"{run['context'] // 1024}K x {run['concurrency']}, {layers}"
            for name, entry in run["results"].items():
                bar = (f"{name}\n[{record}]", entry["tpot_ms"]["median"])
                panels.setdefault(shape, []).append(bar)
    if not panels:
        return None
    widths = [max(2, len(bars)) for bars in panels.values()]
    fig, axes = plt.subplots(1, len(panels), figsize=(1.3 * sum(widths) + 1, 4.5),
                             gridspec_kw={"width_ratios": widths}, squeeze=False)  # fmt: skip
    for ax, (shape, bars) in zip(axes[0], panels.items(), strict=True):
        drawn = ax.bar(range(len(bars)), [b[1] for b in bars],
                       color=["tab:orange" if "+graphs" in b[0] else "gray" for b in bars])  # fmt: skip
        ax.set_xticks(range(len(bars)), [b[0] for b in bars], rotation=60, ha="right", fontsize=7)
        for rect, (_, value) in zip(drawn, bars, strict=True):
            ax.annotate(f"{value:.1f}", (rect.get_x() + rect.get_width() / 2, rect.get_height()),
                        ha="center", va="bottom", fontsize=7)  # fmt: skip
        ax.set_title(shape, fontsize=9)
    axes[0][0].set_ylabel("TPOT ms (median)")
    fig.suptitle("Decode through the host, eager (gray) vs CUDA graphs (orange), H200")
    fig.tight_layout()
    return fig


def serving_ratios(record: dict) -> dict[str, dict[str, float]]:
    """Per variant, per workload: dense TPOT p50 / the variant's, both from ``record`` (one
    run: the machine's run-to-run spread cancels). Dense itself and workloads that only one
    of the two finished are left out."""
    dense = {run["workload"]: run["tpot_ms"]["p50"] for run in record["runs"]
             if run["variant"] == "dense" and run.get("tpot_ms")}  # fmt: skip
    out: dict[str, dict[str, float]] = {}
    for run in record["runs"]:
        if run["variant"] != "dense" and run.get("tpot_ms") and run["workload"] in dense:
            ratio = dense[run["workload"]] / run["tpot_ms"]["p50"]
            out.setdefault(run["variant"], {})[run["workload"]] = ratio
    return out


def _serving_speedup(results: Path, plt):
    """Each variant's TPOT p50 speedup over dense of the same ``bench_serving*.json`` record,
    per workload (bars below 1 are slower than dense)."""
    series = [(f"{variant} [{path.stem.removeprefix('bench_serving_')}]", ratios)
              for path in sorted(results.glob("bench_serving*.json"))
              for variant, ratios in serving_ratios(json.loads(path.read_text())).items()]  # fmt: skip
    if not series:
        return None
    workloads = list(dict.fromkeys(w for _, ratios in series for w in ratios))
    fig, ax = plt.subplots(figsize=(max(8, 1.7 * len(workloads)), 6))
    width = 0.8 / len(series)
    for index, (label, ratios) in enumerate(series):
        xs = [w + index * width for w, name in enumerate(workloads) if name in ratios]
        ax.bar(xs, [ratios[name] for name in workloads if name in ratios], width, label=label)
    ax.axhline(1.0, color="gray", lw=0.8)
    short = [w.replace("closed_ctx", "closed ").replace("_conc", " x ").replace("_", " ") for w in workloads]  # fmt: skip
    ax.set_xticks(
        [w + 0.4 - width / 2 for w in range(len(workloads))], short, fontsize=7, rotation=15
    )
    ax.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    return _bar_labels(fig, ax, "dense TPOT p50 / variant TPOT p50 (same run)",
                       "Serving benchmark through the host vs dense (H200)")  # fmt: skip


PLOTS = {
    "speedup_vs_context.png": _speedup_vs_context,
    "memory_per_token.png": _memory_per_token,
    "quality_by_combination.png": _quality_by_combination,
    "quality_vs_speed.png": _quality_vs_speed,
    "graphs_tpot.png": _graphs_tpot,
    "serving_speedup.png": _serving_speedup,
}


def make_plots(results: Path, out: Path, log=print) -> list[Path]:
    """Write every plot whose records exist; return the written paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written = []
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
