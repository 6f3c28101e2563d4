"""Grid records written by parallel processes join into one: points in the grid's order,
each once; records of another model, config or settings, and points two records disagree
on, are refused by name."""

import json
import re
import subprocess
import sys

import pytest

from flashloop_backend import FlashLoopConfig
from flashloop_backend.tools.grid import (
    feature_combinations,
    feature_grid,
    merge_records,
    point_name,
)

ALL_ON = FlashLoopConfig.from_dict(json.load(open("configs/all_on.json")))
GRID = feature_grid(ALL_ON)
SETTINGS = {"windows": 4, "context": 64}


def _record(indices, kl=0.5, settings=SETTINGS, model="models/m"):
    points = [
        {
            "features": list(GRID[i][0]),
            "config": GRID[i][1].model_dump(mode="json"),
            "settings": settings,
            "kl_mean": kl,
        }
        for i in indices
    ]
    identity = {"kind": "eval_grid", "model": model, "text_source": "t", "dtype": "bf16"}
    return {**identity, "config": ALL_ON.model_dump(mode="json"), "device": "cuda:0"} | {
        "combinations": points
    }


def _names(record):
    return [point_name(p["features"]) for p in record["combinations"]]


def test_parts_join_in_the_grid_order_each_point_once():
    shared = [0, 3]  # both parts resumed the same finished points
    merged = merge_records([_record([*shared, 20, 13]), _record([*shared, 9, 40])])
    assert _names(merged) == [point_name(GRID[i][0]) for i in (0, 3, 9, 13, 20, 40)]
    assert merged["model"] == "models/m" and merged["device"] == "cuda:0"
    assert "settings" not in merged  # each point carries its own


@pytest.mark.parametrize(
    ("other", "fragment"),
    [
        (_record([5], model="models/other"), "the record's model is"),
        (_record([5], settings={"windows": 8, "context": 64}), "the record's settings is"),
    ],
)
def test_a_part_of_another_run_is_refused_by_field(other, fragment):
    with pytest.raises(ValueError, match=fragment):
        merge_records([_record([1]), other])


def test_a_point_two_parts_disagree_on_is_refused_by_name():
    name = point_name(GRID[7][0])
    with pytest.raises(ValueError, match=re.escape(f"disagree on point {name!r}")):
        merge_records([_record([7], kl=0.5), _record([7], kl=0.6)])


def test_nothing_or_a_record_of_another_kind_is_refused():
    with pytest.raises(ValueError, match="give at least one record"):
        merge_records([])
    bench = dict(_record([0]), kind="end_to_end_host")
    with pytest.raises(ValueError, match="the first is 'end_to_end_host'"):
        merge_records([bench])


def test_combinations_parts_join_in_their_order():
    combos = feature_combinations(ALL_ON)

    def part(indices, points=combos):
        chosen = [
            {"features": list(points[i][0]), "config": points[i][1].model_dump(mode="json")}
            for i in indices
        ]
        return dict(_record([]), kind="eval_combinations", combinations=chosen)

    merged = merge_records([part([0, 7, 3]), part([0, 5])])
    assert _names(merged) == [point_name(combos[i][0]) for i in (0, 3, 5, 7)]
    with pytest.raises(ValueError, match="are not in the eval_combinations of the records'"):
        merge_records([part([0]), part([20], points=GRID)])


def test_the_script_writes_the_merge_and_refuses_a_missing_part(tmp_path):
    parts = []
    for i, indices in enumerate(([0, 2], [0, 1])):
        parts.append(tmp_path / f"part{i}.json")
        parts[-1].write_text(json.dumps(_record(indices)))
    out = tmp_path / "merged.json"
    script = [sys.executable, "scripts/merge_eval_records.py"]
    done = subprocess.run([*script, str(out), *map(str, parts)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert _names(json.loads(out.read_text())) == [point_name(GRID[i][0]) for i in (0, 1, 2)]
    missing = subprocess.run(
        [*script, str(out), str(tmp_path / "none.json")], text=True, capture_output=True
    )
    assert missing.returncode == 2 and "no such record" in missing.stderr
    clash = tmp_path / "clash.json"
    clash.write_text(json.dumps(_record([2], kl=9.0)))
    refused = subprocess.run(
        [*script, str(out), str(parts[0]), str(clash)], text=True, capture_output=True
    )
    assert refused.returncode == 1 and "disagree on point" in refused.stderr
