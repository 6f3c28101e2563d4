"""Quality against speed over the grid (``flashloop-backend pareto``): each point's quality
from an ``eval --grid`` record joined by name with its decode and prefill speed ratios
from a ``bench e2e --grid`` record; the Pareto front; the budgets; and the recommended
configuration, the all-on point that meets every all-on budget with the fastest decode
(prefill breaking ties)."""

from __future__ import annotations

from dataclasses import dataclass

from flashloop_backend.tools.grid import point_name

# issue 24's targets: all on, and each feature alone (Δ bits/byte, percent)
ALL_ON_DELTA, ALL_ON_CI_UPPER, ALL_ON_TOP1, PASSKEY_POINTS = 1.0, 1.5, 0.98, 2.0
ALONE_DELTA = {
    "kv_residual_quantization": 0.5,
    "sparse_decode_attention": 1.0,
    "token_sparse_prefill": 1.0,
}


@dataclass(frozen=True)
class Point:
    name: str
    features: tuple[str, ...]  # the features on
    config: dict
    delta: float  # Δ bits/byte, percent
    ci: tuple[float, float]
    top1: float
    kl_mean: float
    passkey_gap: float  # points below dense at the worst passkey length
    decode_ratio: float | None = None  # dense TPOT / this TPOT
    prefill_ratio: float | None = None  # dense prefill latency / this one

    @property
    def measured(self) -> bool:
        return self.decode_ratio is not None and self.prefill_ratio is not None


def passkey_gap(accuracy: dict[str, dict[str, float]]) -> float:
    """How far the config falls below dense at its worst passkey length, in points
    (accuracy averaged over needle depths per length; cells are ``len{L}_depth{D}``)."""

    def by_length(cells: dict[str, float]) -> dict[str, float]:
        grouped: dict[str, list[float]] = {}
        for cell, value in cells.items():
            grouped.setdefault(cell.split("_")[0], []).append(value)
        return {length: sum(v) / len(v) for length, v in grouped.items()}

    dense, config = by_length(accuracy["dense"]), by_length(accuracy["config"])
    return max((100 * (dense[k] - config[k]) for k in dense), default=0.0)


def _speed_results(speed: dict, shape: tuple[int, int] | None) -> dict:
    runs = speed.get("runs", [])
    if shape is not None:
        runs = [r for r in runs if (r["context"], r["concurrency"]) == shape]
    if not runs:
        have = [(r["context"], r["concurrency"]) for r in speed.get("runs", [])]
        raise ValueError(f"the speed record has no run at {shape}; it has {have}")
    return runs[0]["results"]


def load_points(grid: dict, speed: dict | None = None, shape=None) -> list[Point]:
    """Every grid point but dense, with its speed ratios where ``speed`` measured it at
    ``shape`` (context, concurrency; None: the record's first run). A point measured with
    another config than the one scored under its name is refused by name."""
    results = _speed_results(speed, shape) if speed else {}
    baseline = next((r for r in results.values() if r.get("grid_point") is None), None)
    if results and baseline is None:
        raise ValueError("the speed record has no dense baseline (a result with no grid point)")
    timed = {r["grid_point"]: r for r in results.values() if r.get("grid_point")}
    points = []
    for combo in grid["combinations"]:
        if not combo["features"]:
            continue
        name = point_name(combo["features"])
        run = timed.get(name)
        if run is not None and run["point_config"] != combo["config"]:
            raise ValueError(f"grid point {name!r}: the speed record ran another config")
        decode = prefill = None
        if run is not None and baseline is not None:
            decode = baseline["tpot_ms"]["median"] / run["tpot_ms"]["median"]
            prefill = baseline["prefill_latency_s"] / run["prefill_latency_s"]
        enabled = tuple(k for k in ALONE_DELTA if combo["config"][k]["enabled"])
        points.append(
            Point(
                name=name,
                features=enabled,
                config=combo["config"],
                delta=combo["delta_bits_per_byte_percent"],
                ci=tuple(combo["delta_ci95_percent"]),
                top1=combo["top1_agreement"],
                kl_mean=combo["kl_mean"],
                passkey_gap=passkey_gap(combo["passkey_accuracy"]),
                decode_ratio=decode,
                prefill_ratio=prefill,
            )
        )
    return points


def budget_misses(point: Point) -> list[str]:
    """Each budget the point misses, naming the value and the bar (none: within budget)."""
    if len(point.features) == 1:
        bar = ALONE_DELTA[point.features[0]]
        return [f"Δ bits/byte {point.delta:+.2f}% > +{bar}%"] if point.delta > bar else []
    return all_on_misses(point.delta, point.ci[1], point.top1, point.passkey_gap)


def all_on_misses(
    delta: float, ci_upper: float, top1: float, passkey_gap: float = 0.0
) -> list[str]:
    """Each all-on budget a measurement misses (Δ bits/byte and its interval's upper end in
    percent, top-1 agreement as a fraction, passkey points below dense), naming the value
    and the bar."""
    misses = []
    if delta > ALL_ON_DELTA:
        misses.append(f"Δ bits/byte {delta:+.2f}% > +{ALL_ON_DELTA}%")
    if ci_upper > ALL_ON_CI_UPPER:
        misses.append(f"interval's upper end {ci_upper:+.2f}% > +{ALL_ON_CI_UPPER}%")
    if top1 < ALL_ON_TOP1:
        misses.append(f"top-1 agreement {top1:.2%} < {ALL_ON_TOP1:.0%}")
    if passkey_gap > PASSKEY_POINTS:
        misses.append(f"passkey {passkey_gap:.1f} points below dense > {PASSKEY_POINTS}")
    return misses


def pareto_front(points: list[Point]) -> list[Point]:
    """The measured points no other measured point beats on Δ bits/byte, decode ratio and
    prefill ratio at once, fastest decode first."""
    measured = [p for p in points if p.measured]

    def beats(a: Point, b: Point) -> bool:
        ge = a.delta <= b.delta and a.decode_ratio >= b.decode_ratio
        ge = ge and a.prefill_ratio >= b.prefill_ratio
        gt = a.delta < b.delta or a.decode_ratio > b.decode_ratio
        return ge and (gt or a.prefill_ratio > b.prefill_ratio)

    front = [p for p in measured if not any(beats(q, p) for q in measured)]
    return sorted(front, key=lambda p: -p.decode_ratio)


def recommend(points: list[Point]) -> tuple[Point | None, list[str]]:
    """The all-on point to recommend and the reasons: among the measured all-on points
    within every all-on budget, the fastest decode (then prefill). None, with the reasons,
    where no measured all-on point meets the budgets."""
    all_on = [p for p in points if len(p.features) == 3]
    if not all_on:
        return None, ["the grid record holds no all-on point"]
    unmeasured = [p.name for p in all_on if not p.measured]
    reasons = [f"{len(unmeasured)} all-on points have no speed measurement"] if unmeasured else []
    within = [p for p in all_on if p.measured and not budget_misses(p)]
    if not within:
        reasons.append(
            f"none of the {sum(p.measured for p in all_on)} measured all-on points meets the "
            "all-on budgets"
        )
        return None, reasons
    chosen = max(within, key=lambda p: (p.decode_ratio, p.prefill_ratio))
    reasons.insert(
        0,
        f"{chosen.name}: within every all-on budget (Δ {chosen.delta:+.2f}%, interval "
        f"[{chosen.ci[0]:+.2f}, {chosen.ci[1]:+.2f}], top-1 {chosen.top1:.2%}, passkey "
        f"{chosen.passkey_gap:.1f} points below dense) and the fastest decode of the "
        f"{len(within)} that are: {chosen.decode_ratio:.2f}x dense, prefill "
        f"{chosen.prefill_ratio:.2f}x",
    )
    return chosen, reasons


def recommended_config(point: Point) -> dict:
    """The point's feature settings in the form of ``configs/all_on.json``."""
    return {name: point.config[name] for name in ALONE_DELTA}


def draw(points: list[Point], front: list[Point], chosen: Point | None, plt):
    """Δ bits/byte against the decode and the prefill speed ratio (two panels); the front
    drawn as a line, the recommendation starred, the all-on budget dashed."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 5), sharey=True)
    colors = {1: "tab:blue", 3: "tab:red"}
    for ax, attr, title in (
        (axes[0], "decode_ratio", "decode (TPOT)"),
        (axes[1], "prefill_ratio", "prefill (time to first token)"),
    ):
        for n, label in ((1, "one feature"), (3, "all on")):
            chosen_n = [p for p in points if p.measured and len(p.features) == n]
            ax.scatter(
                [getattr(p, attr) for p in chosen_n],
                [p.delta for p in chosen_n],
                color=colors[n],
                label=label,
                alpha=0.7,
            )
        line = sorted(front, key=lambda p: getattr(p, attr))
        ax.plot([getattr(p, attr) for p in line], [p.delta for p in line], "k-", lw=0.8)
        if chosen is not None:
            ax.plot([getattr(chosen, attr)], [chosen.delta], "*", color="gold", ms=18, mec="k")
        ax.axhline(ALL_ON_DELTA, color="gray", ls="--", lw=0.8)
        ax.axvline(1.0, color="gray", lw=0.8)
        ax.set(xlabel=f"{title} speed vs dense (x)", title=title)
    axes[0].set_ylabel("Δ bits/byte vs dense (%)")
    axes[0].legend(loc="upper left", frameon=False)
    fig.suptitle("Quality vs speed over the grid (front: black line; recommended: star)")
    return fig
