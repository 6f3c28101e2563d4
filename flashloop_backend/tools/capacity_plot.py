"""The capacity plot of ``report``: per variant and context, the most requests held at once
and the output tokens/s against the KV memory budget, from ``bench capacity`` records
(``bench_capacity*.json`` anywhere under the results but in a ``history`` folder, where
the records of superseded designs stay). Where two records measured the same point, the
first run the README quotes (``results_table.CAPACITY_RECORDS``) is drawn, else the later
by file name, so the figure shows a run of the README's sentence."""

from __future__ import annotations

import json
from pathlib import Path

# (budget GiB, most requests held, output tokens/s, the pools filled)
Point = tuple[float, int, float, bool]


def capacity_series(records: list[dict]) -> dict[tuple[int, str], list[Point]]:
    """(context, variant) -> its points by budget; a variant whose budget held no request
    (its record carries the error) has no point there."""
    points: dict[tuple[int, str], dict[float, Point]] = {}
    for record in records:
        for run in record["runs"]:
            gib = run["kv_memory_bytes"] / 2**30
            for entry in run["records"]:
                if "error" in entry:
                    continue
                point = (
                    gib,
                    entry["most_requests_held"],
                    entry["throughput_tokens_s"],
                    entry["pools_filled"],
                )
                points.setdefault((run["context"], entry["variant"]), {})[gib] = point
    return {key: [by_gib[g] for g in sorted(by_gib)] for key, by_gib in points.items()}


def drawn_in_order(results: Path) -> list[Path]:
    """The capacity records under ``results`` but in ``history`` folders, in the order
    their points are taken (a later one replaces an earlier one's point): by file name,
    the README's first quoted record last."""
    from flashloop_backend.tools.results_table import CAPACITY_RECORDS

    quoted = results / CAPACITY_RECORDS[0]
    found = (p for p in results.glob("**/bench_capacity*.json") if "history" not in p.parts)
    return sorted(found, key=lambda p: (p == quoted, p.name))


def _context_label(context: int) -> str:
    return f"{context // 1024}K" if context % 1024 == 0 else str(context)


def variant_label(variant: str, records: list[dict]) -> str:
    """A variant as the docs name it: bench capacity's "config" (the configuration under
    test) by the features its records enable, feature names as the plots write them."""
    from flashloop_backend.tools.plot_records import FEATURE_NAMES, features_label

    configs = [r["config"] for r in records if "config" in r]
    if variant == "config" and configs:
        enabled = {tuple(f for f in FEATURE_NAMES if c.get(f, {}).get("enabled")) for c in configs}
        names = [features_label(list(e)) for e in sorted(enabled)]
        return " / ".join("all three features" if n == "all three" else n for n in names) + " on"
    for name, label in FEATURE_NAMES.items():
        variant = variant.replace(name, label)
    return variant


def draw_capacity(results: Path, plt):
    """Two panels against the budget: requests held at once and output tokens/s; an x
    marks a run whose requests ended before the pools filled (``pools_filled`` false)."""
    paths = drawn_in_order(results)
    if not paths:
        return None
    records = [json.loads(p.read_text()) for p in paths]
    series = capacity_series(records)
    if not series:
        return None
    fig, (held_ax, rate_ax) = plt.subplots(1, 2, figsize=(11, 4.9))
    for index, ((context, variant), points) in enumerate(sorted(series.items())):
        label = f"{variant_label(variant, records)}, {_context_label(context)} tokens"
        budgets = [p[0] for p in points]
        # hollow rings that shrink series by series: variants that held as many requests
        # stay visible one inside the other
        size = max(4, 13 - 3 * index)
        style = {"marker": "o", "markerfacecolor": "none", "markersize": size, "markeredgewidth": 2}
        (line,) = held_ax.plot(budgets, [p[1] for p in points], label=label, **style)
        rate_ax.plot(budgets, [p[2] for p in points], color=line.get_color(), **style)
        unfilled = [p for p in points if not p[3]]
        held_ax.plot([p[0] for p in unfilled], [p[1] for p in unfilled], "kx", ms=9)
    gpus = sorted({r["environment"]["gpu"] or "CPU" for r in records})
    models = sorted({r["model"] for r in records})
    held_ax.set(xlabel="KV memory budget (GiB)", ylabel="most requests held at once")
    rate_ax.set(xlabel="KV memory budget (GiB)", ylabel="output tokens/s")
    for ax in (held_ax, rate_ax):
        ax.grid(color="0.9")
        ax.set_axisbelow(True)
        ax.set_ylim(bottom=0, top=1.12 * ax.get_ylim()[1])  # room above the highest ring
    held_ax.legend(loc="lower right", frameon=False)
    fig.suptitle(
        f"Capacity at a fixed KV budget ({' / '.join(gpus)}, {' / '.join(models)})\n"
        "x: requests ended before the pools filled"
    )
    return fig
