"""``flashloop-backend pareto``: grid points joined by name with their measured speed
ratios, the budgets named when missed, the Pareto front, and the recommended all-on
configuration (the fastest decode within every all-on budget); records of the wrong kind,
unknown shapes and speed runs of another config are refused by name."""

import json

import pytest

from flashloop_backend import FlashLoopConfig
from flashloop_backend.cli.main import EXIT_USAGE, main
from flashloop_backend.tools import pareto
from flashloop_backend.tools.grid import feature_grid, point_name

ALL_ON = FlashLoopConfig.from_dict(json.load(open("configs/all_on.json")))
GRID = feature_grid(ALL_ON)
PERFECT = dict.fromkeys(
    ("len512_depth0.1", "len512_depth0.5", "len1024_depth0.1", "len1024_depth0.5"), 1.0
)


def _combo(index: int, delta: float, upper: float | None = None, top1=0.99, passkey=None):
    label, config = GRID[index]
    return {
        "features": list(label),
        "config": config.model_dump(mode="json"),
        "delta_bits_per_byte_percent": delta,
        "delta_ci95_percent": [delta - 0.3, upper if upper is not None else delta + 0.3],
        "top1_agreement": top1,
        "kl_mean": 0.01,
        "passkey_accuracy": {"dense": PERFECT, "config": passkey or PERFECT},
    }


def _speed(ratios: dict[int, tuple[float, float]], context=32768) -> dict:
    """A bench e2e --grid record: dense at TPOT 10 ms and prefill 2 s, each point at the
    given (decode, prefill) speed ratios."""
    results = {"triton+graphs": {"grid_point": None, "tpot_ms": {"median": 10.0},
                                 "prefill_latency_s": 2.0}}  # fmt: skip
    for index, (decode, prefill) in ratios.items():
        label, config = GRID[index]
        results[f"flashloop+graphs [{point_name(label)}]"] = {
            "grid_point": point_name(label),
            "point_config": config.model_dump(mode="json"),
            "tpot_ms": {"median": 10.0 / decode},
            "prefill_latency_s": 2.0 / prefill,
        }
    run = {"context": context, "concurrency": 1, "results": results}
    return {"kind": "end_to_end_host", "runs": [run]}


ALL_ON_START = 1 + 4 + 4 + 2  # dense, sparse decode x4, token-sparse x4, KV quantization x2
GRID_RECORD = {
    "kind": "eval_grid",
    "combinations": [
        _combo(0, 0.0),
        _combo(1, 0.1),  # sparse decode alone: within +1%
        _combo(5, 1.2),  # token-sparse alone: over +1%
        _combo(ALL_ON_START, 0.5),  # within every all-on budget
        _combo(ALL_ON_START + 1, 0.8),  # within, faster decode
        _combo(ALL_ON_START + 2, 0.9, upper=1.7),  # interval over +1.5%
        _combo(ALL_ON_START + 3, 0.4, top1=0.97),  # top-1 under 98%
        _combo(ALL_ON_START + 4, 0.4, passkey={**PERFECT, "len1024_depth0.1": 0.9}),
    ],
}
SPEED = _speed({1: (1.1, 1.0), 5: (1.0, 1.4), ALL_ON_START: (1.2, 1.3),
                ALL_ON_START + 1: (1.5, 1.1), ALL_ON_START + 2: (2.0, 2.0),
                ALL_ON_START + 3: (2.0, 2.0), ALL_ON_START + 4: (2.0, 2.0)})  # fmt: skip


def test_points_carry_their_speed_ratios_and_name_the_budgets_they_miss():
    points = {p.name: p for p in pareto.load_points(GRID_RECORD, SPEED)}
    assert len(points) == 7  # dense is the baseline, not a point
    first = points[point_name(GRID[ALL_ON_START][0])]
    assert first.decode_ratio == pytest.approx(1.2) and first.prefill_ratio == pytest.approx(1.3)
    misses = {name: pareto.budget_misses(p) for name, p in points.items()}
    assert misses[point_name(GRID[1][0])] == []
    assert misses[point_name(GRID[5][0])] == ["Δ bits/byte +1.20% > +1.0%"]
    assert misses[point_name(GRID[ALL_ON_START + 2][0])] == ["interval's upper end +1.70% > +1.5%"]
    assert misses[point_name(GRID[ALL_ON_START + 3][0])] == ["top-1 agreement 97.00% < 98%"]
    passkey = misses[point_name(GRID[ALL_ON_START + 4][0])]
    assert passkey == ["passkey 5.0 points below dense > 2.0"]  # 1024: (1.0 + 0.9) / 2


def test_the_recommendation_is_the_fastest_decode_within_every_all_on_budget():
    points = pareto.load_points(GRID_RECORD, SPEED)
    chosen, reasons = pareto.recommend(points)
    assert chosen.name == point_name(GRID[ALL_ON_START + 1][0])
    assert "fastest decode of the 2 that are: 1.50x dense" in reasons[0]
    config = pareto.recommended_config(chosen)
    assert set(config) == {"token_sparse_prefill", "sparse_decode_attention",
                           "kv_residual_quantization"}  # fmt: skip
    assert FlashLoopConfig.from_dict(config).enabled_features() == ALL_ON.enabled_features()


def test_the_front_drops_every_point_another_beats_on_all_three_axes():
    points = pareto.load_points(GRID_RECORD, SPEED)
    front = {p.name for p in pareto.pareto_front(points)}
    best = point_name(GRID[ALL_ON_START + 3][0])  # +0.4% at 2.0x / 2.0x
    assert best in front
    for beaten in (ALL_ON_START, 5):  # +0.5% at 1.2x / 1.3x; +1.2% at 1.0x / 1.4x
        assert point_name(GRID[beaten][0]) not in front
    cheapest = point_name(GRID[1][0])  # +0.1% at 1.1x / 1.0x: nothing is as good in quality
    assert cheapest in front


def test_no_recommendation_without_a_measured_all_on_point_within_budget():
    quality_only = pareto.load_points(GRID_RECORD)
    chosen, reasons = pareto.recommend(quality_only)
    assert chosen is None
    assert reasons == ["5 all-on points have no speed measurement",
                       "none of the 0 measured all-on points meets the all-on budgets"]  # fmt: skip
    alone = dict(GRID_RECORD, combinations=GRID_RECORD["combinations"][:3])
    assert pareto.recommend(pareto.load_points(alone)) == (
        None,
        ["the grid record holds no all-on point"],
    )


def test_speed_records_that_cannot_be_joined_are_refused_by_name():
    other = json.loads(json.dumps(SPEED))
    name = point_name(GRID[1][0])
    other["runs"][0]["results"][f"flashloop+graphs [{name}]"]["point_config"] = {}
    with pytest.raises(ValueError, match="the speed record ran another config"):
        pareto.load_points(GRID_RECORD, other)
    with pytest.raises(ValueError, match=r"no run at \(8192, 1\); it has \[\(32768, 1\)\]"):
        pareto.load_points(GRID_RECORD, SPEED, (8192, 1))
    headless = json.loads(json.dumps(SPEED))
    del headless["runs"][0]["results"]["triton+graphs"]
    with pytest.raises(ValueError, match="no dense baseline"):
        pareto.load_points(GRID_RECORD, headless)


def test_the_command_writes_the_plot_and_the_recommended_config(tmp_path, capsys):
    grid, speed = tmp_path / "grid.json", tmp_path / "speed.json"
    grid.write_text(json.dumps(GRID_RECORD))
    speed.write_text(json.dumps(SPEED))
    plot, config = tmp_path / "pareto.png", tmp_path / "all_on.json"
    argv = ["pareto", "--grid", str(grid), "--speed", str(speed), "--shape", "32768x1"]
    assert main([*argv, "--plot", str(plot), "--write-config", str(config)]) == 0
    assert plot.stat().st_size > 10_000
    written = FlashLoopConfig.from_dict(json.loads(config.read_text()))
    assert (
        written.sparse_decode_attention.key_retention
        == GRID[ALL_ON_START + 1][1].sparse_decode_attention.key_retention
    )
    assert "recommended:" in capsys.readouterr().out
    assert main(["pareto", "--grid", str(grid)]) == 1  # nothing to recommend without speed


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--grid", "SPEED"], "is a 'end_to_end_host' record; this needs a 'eval_grid' record"),
        (["--grid", "GRID", "--speed", "GRID"], "this needs a 'end_to_end_host' record"),
        (["--grid", "MISSING"], "is not a readable JSON record"),
        (["--grid", "GRID", "--shape", "32k"], "'32k' is not CONTEXTxCONCURRENCY"),
    ],
)
def test_bad_records_and_shapes_exit_2_by_name(tmp_path, capsys, argv, fragment):
    paths = {"GRID": tmp_path / "g.json", "SPEED": tmp_path / "s.json",
             "MISSING": tmp_path / "none.json"}  # fmt: skip
    paths["GRID"].write_text(json.dumps(GRID_RECORD))
    paths["SPEED"].write_text(json.dumps(SPEED))
    args = [str(paths.get(a, a)) for a in argv]
    try:
        code = main(["pareto", *args])
    except SystemExit as exc:
        code = exc.code
    assert code == EXIT_USAGE and fragment in capsys.readouterr().err
