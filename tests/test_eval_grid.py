"""The quality grid of ``eval --grid``: dense, each feature alone at each of its settings,
all on at every combination of them; a config without every feature is refused by name."""

import json

import pytest

from flashloop_backend import FlashLoopConfig
from flashloop_backend.cli.main import EXIT_USAGE, main
from flashloop_backend.tools.grid import (
    KEY_RETENTIONS,
    POLICIES,
    RETENTION_SCHEDULES,
    feature_combinations,
    feature_grid,
    point_name,
    selected,
)

ALL_ON = FlashLoopConfig.from_dict(json.load(open("configs/all_on.json")))


def test_the_grid_holds_each_feature_alone_and_all_on_at_every_setting():
    grid = feature_grid(ALL_ON)
    alone = len(KEY_RETENTIONS) + len(RETENTION_SCHEDULES) + len(POLICIES)
    product = len(KEY_RETENTIONS) * len(RETENTION_SCHEDULES) * len(POLICIES)
    assert len(grid) == 1 + alone + product
    label, dense = grid[0]
    assert label == () and dense.enabled_features() == ()
    enabled = [config.enabled_features() for _, config in grid]
    assert sum(len(e) == 1 for e in enabled) == alone
    assert sum(len(e) == 3 for e in enabled) == product
    decode = [c.sparse_decode_attention.key_retention for _, c in grid[1:5]]
    assert decode == list(KEY_RETENTIONS)
    points = {
        (
            c.sparse_decode_attention.key_retention,
            tuple(c.token_sparse_prefill.retention),
            c.kv_residual_quantization.policy,
        )
        for _, c in grid[1 + alone :]
    }
    assert len(points) == product  # every combination once
    # settings that do not vary come from the config
    assert all(
        c.kv_residual_quantization.group_size == 64
        for _, c in grid
        if c.kv_residual_quantization.enabled
    )
    label, _ = grid[-1]
    assert label[0].startswith("sparse_decode_attention key_retention=")


def test_a_config_without_every_feature_is_refused_by_name():
    config = ALL_ON.model_copy(
        update={"kv_residual_quantization": FlashLoopConfig().kv_residual_quantization}
    )
    with pytest.raises(ValueError, match=r"\['kv_residual_quantization'\] are off"):
        feature_grid(config)


def test_combinations_and_grid_together_are_refused(capsys):
    assert main(["eval", "--combinations", "--grid", "--windows", "1"]) == EXIT_USAGE
    assert "--combinations and --grid are two runs" in capsys.readouterr().err


SMALL_RUN = ["--windows", "1", "--context", "32", "--continuation", "4", "--passkey-samples", "0"]


def _eval(out, *extra):
    argv = ["eval", "--config", "configs/all_on.json", "--combinations", *SMALL_RUN]
    return main([*argv, "--out", str(out), *extra])


def test_a_resumed_run_keeps_the_finished_points_and_runs_the_rest(tmp_path, capsys):
    out = tmp_path / "combinations.json"
    assert _eval(out) == 0
    whole = json.loads(out.read_text())
    cut = dict(whole, combinations=whole["combinations"][:5])
    cut["combinations"][1]["kl_mean"] = 123.0  # a kept point is kept, not recomputed
    out.write_text(json.dumps(cut))
    capsys.readouterr()
    assert _eval(out, "--resume") == 0
    assert capsys.readouterr().out.count(": kept from") == 5
    resumed = json.loads(out.read_text())
    assert [c["features"] for c in resumed["combinations"]] == [
        c["features"] for c in whole["combinations"]
    ]
    assert resumed["combinations"][1]["kl_mean"] == 123.0
    timed = ("seconds",)  # wall time differs from run to run; every figure must not
    last, first_run = (
        {k: v for k, v in c["combinations"][7].items() if k not in timed} for c in (resumed, whole)
    )
    assert last == first_run


def test_a_resumed_run_stopped_early_keeps_the_points_it_had_not_reached(tmp_path, monkeypatch):
    import flashloop_backend.tools.evaluation as evaluation

    out = tmp_path / "combinations.json"
    assert _eval(out) == 0
    whole = json.loads(out.read_text())["combinations"]
    out.write_text(
        json.dumps(dict(json.loads(out.read_text()), combinations=[whole[0], *whole[3:]]))
    )
    real, calls = evaluation.evaluate, []

    def stops_at_the_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the device call's time limit
        return real(*args, **kwargs)

    monkeypatch.setattr(evaluation, "evaluate", stops_at_the_second)
    with pytest.raises(KeyboardInterrupt):
        _eval(out, "--resume")
    kept = json.loads(out.read_text())["combinations"]
    assert [c["features"] for c in kept] == [c["features"] for c in [*whole[:2], *whole[3:]]]
    assert kept[3:] == whole[4:]  # as they were


def test_combinations_run_only_the_chosen_points(tmp_path):
    out = tmp_path / "combinations.json"
    assert _eval(out, "--grid-points", "!token_sparse_prefill", "--grid-points", "kv_res") == 0
    assert [c["features"] for c in json.loads(out.read_text())["combinations"]] == [
        ["kv_residual_quantization"],
        ["sparse_decode_attention", "kv_residual_quantization"],
    ]


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (["--windows", "2"], "the record's settings is"),
        (["--config", "configs/kv_quant_rolling.json"], "the record's config is"),
    ],
)
def test_a_run_with_other_settings_does_not_resume_a_record(tmp_path, capsys, change, fragment):
    out = tmp_path / "combinations.json"
    assert _eval(out) == 0
    before = out.read_text()
    capsys.readouterr()
    assert _eval(out, "--resume", *change) == EXIT_USAGE
    assert f"cannot resume: {fragment}" in capsys.readouterr().err
    assert out.read_text() == before  # nothing lost


def test_resume_needs_a_readable_out_record(tmp_path, capsys):
    argv = ["eval", "--config", "configs/all_on.json", "--combinations", *SMALL_RUN]
    assert main([*argv, "--resume"]) == EXIT_USAGE
    assert "--resume continues the --out record" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert _eval(bad, "--resume") == EXIT_USAGE
    assert f"cannot resume {bad}: not a readable record" in capsys.readouterr().err


def test_grid_points_choose_the_points_holding_every_text():
    names = [point_name(label) for label, _ in feature_grid(ALL_ON)]
    assert selected(names, None) == [True] * len(names)
    chosen = selected(names, ["retention=[1, 1, 1, 0.75]", "policy=rolling"])
    assert [n for n, c in zip(names, chosen, strict=True) if c] == [
        f"sparse_decode_attention key_retention={r} + token_sparse_prefill retention="
        "[1, 1, 1, 0.75] + kv_residual_quantization policy=rolling"
        for r in KEY_RETENTIONS
    ]
    with pytest.raises(ValueError, match=r"\['retention=\[9\]'\] match no grid point"):
        selected(names, ["policy=rolling", "retention=[9]"])
    with pytest.raises(ValueError, match="no grid point satisfies all of"):
        selected(names, ["key_retention=0.1", "key_retention=0.4"])


def test_grid_points_written_with_a_bang_exclude_the_points_holding_the_text():
    names = [point_name(label) for label, _ in feature_combinations(ALL_ON)]
    chosen = selected(names, ["!token_sparse_prefill"])
    assert [n for n, c in zip(names, chosen, strict=True) if c] == [
        "dense",
        "sparse_decode_attention",
        "kv_residual_quantization",
        "sparse_decode_attention + kv_residual_quantization",
    ]
    both = selected(names, ["kv_residual", "!sparse_decode"])
    assert [n for n, c in zip(names, both, strict=True) if c] == [
        "kv_residual_quantization",
        "token_sparse_prefill + kv_residual_quantization",
    ]
    with pytest.raises(ValueError, match=r"\['nothing'\] match no grid point"):
        selected(names, ["!nothing"])
    with pytest.raises(ValueError, match="'!' needs the text to exclude"):
        selected(names, ["!"])
    with pytest.raises(ValueError, match="no grid point satisfies all of"):
        selected(names, ["dense", "!dense"])


ONE_POINT = ["--grid-points", "key_retention=0.4", "--grid-points", "[1, 1, 1, 0.75]"]


def test_a_chosen_grid_run_keeps_the_points_it_resumes_and_adds_the_chosen(tmp_path, capsys):
    out = tmp_path / "grid.json"
    argv = ["eval", "--config", "configs/all_on.json", "--grid", *SMALL_RUN, "--out", str(out)]
    assert main([*argv, *ONE_POINT, "--grid-points", "policy=rolling"]) == 0
    first = json.loads(out.read_text())["combinations"]
    assert [point_name(c["features"]) for c in first] == [
        "sparse_decode_attention key_retention=0.4 + token_sparse_prefill retention="
        "[1, 1, 1, 0.75] + kv_residual_quantization policy=rolling"
    ]
    assert main([*argv, "--resume", *ONE_POINT, "--grid-points", "policy=fixed_prompt"]) == 0
    both = json.loads(out.read_text())["combinations"]
    # grid order: fixed_prompt before rolling; the first run's point kept as it was
    assert [c["config"]["kv_residual_quantization"]["policy"] for c in both] == [
        "fixed_prompt",
        "rolling",
    ]
    assert both[1] == first[0]


@pytest.mark.parametrize("command", [["eval"], ["bench", "e2e", "--backends", "flashloop"]])
def test_grid_points_without_grid_are_refused(capsys, command):
    assert main([*command, "--grid-points", "rolling"]) == EXIT_USAGE
    assert "--grid-points chooses points of --grid" in capsys.readouterr().err
