"""Plots come from the committed records; a missing record skips only its plot."""

import shutil
from pathlib import Path

import pytest

from flashloop_backend.report import PLOTS, make_plots

pytest.importorskip("matplotlib")
RESULTS = Path(__file__).resolve().parents[1] / "results"


def test_every_plot_is_drawn_from_the_committed_records(tmp_path):
    written = make_plots(RESULTS, tmp_path, log=lambda m: None)
    assert sorted(p.name for p in written) == sorted(PLOTS)
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in written)


def test_a_missing_record_skips_its_plot_and_says_so(tmp_path):
    partial = tmp_path / "results"
    partial.mkdir()
    shutil.copy(RESULTS / "bench_packed_kv.json", partial)
    messages = []
    written = make_plots(partial, tmp_path / "out", log=messages.append)
    assert [p.name for p in written] == ["memory_per_token.png"]
    assert sum("skipped" in m for m in messages) == len(PLOTS) - 1


def test_report_cli_names_a_missing_results_directory(tmp_path):
    import subprocess
    import sys

    missing = tmp_path / "none"
    result = subprocess.run([sys.executable, "-m", "flashloop_backend.cli", "report", "--results", str(missing),
                             "--out", str(tmp_path / "out")], capture_output=True, text=True)  # fmt: skip
    assert result.returncode == 2 and f"--results '{missing}' is not a directory" in result.stderr
    assert not (tmp_path / "out").exists()


def test_serving_ratios_compare_each_variant_to_dense_of_the_same_record():
    from flashloop_backend.report import serving_ratios

    def run(variant, workload, tpot):
        return {"variant": variant, "workload": workload, "tpot_ms": {"p50": tpot}}

    record = {"runs": [run("dense", "a", 10.0), run("dense", "b", 6.0), run("x alone", "a", 20.0),
                       run("x alone", "b", 4.0), run("x alone", "c", 5.0),
                       {"variant": "y", "workload": "a", "tpot_ms": None}]}  # fmt: skip
    # c has no dense run and y finished nothing: both left out, never compared across runs
    assert serving_ratios(record) == {"x alone": {"a": 0.5, "b": 1.5}}
