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
