"""Plots come from the committed records; a missing record skips only its plot."""

import json
import shutil
from pathlib import Path

import pytest

from flashloop_backend.tools.report import PLOTS, make_plots

pytest.importorskip("matplotlib")
RESULTS = Path(__file__).resolve().parents[1] / "results"


# The capacity plot waits for its first GPU record (bench capacity has not completed on the
# H200 yet); once a record is committed, it is required like every other plot.
AWAITING_RECORDS = (
    set() if any(RESULTS.glob("**/bench_capacity*.json")) else {"capacity_vs_budget.png"}
)


def test_every_plot_is_drawn_from_the_committed_records(tmp_path):
    written = make_plots(RESULTS, tmp_path, log=lambda m: None)
    assert sorted(p.name for p in written) == sorted(set(PLOTS) - AWAITING_RECORDS)
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
    result = subprocess.run([sys.executable, "-m", "flashloop_backend.cli.main", "report", "--results", str(missing),
                             "--out", str(tmp_path / "out")], capture_output=True, text=True)  # fmt: skip
    assert result.returncode == 2 and f"--results '{missing}' is not a directory" in result.stderr
    assert not (tmp_path / "out").exists()


def test_serving_ratios_compare_each_variant_to_dense_of_the_same_record():
    from flashloop_backend.tools.serving_plots import serving_ratios

    def run(variant, workload, tpot):
        return {"variant": variant, "workload": workload, "tpot_ms": {"p50": tpot}}

    record = {"runs": [run("dense", "a", 10.0), run("dense", "b", 6.0), run("x alone", "a", 20.0),
                       run("x alone", "b", 4.0), run("x alone", "c", 5.0),
                       {"variant": "y", "workload": "a", "tpot_ms": None}]}  # fmt: skip
    # c has no dense run and y finished nothing: both left out, never compared across runs
    assert serving_ratios(record) == {"x alone": {"a": 0.5, "b": 1.5}}


def test_superseded_records_are_named_real_files_and_left_out_of_every_plot(tmp_path):
    from flashloop_backend.tools.plot_records import SUPERSEDED, current_records
    from flashloop_backend.tools.serving_plots import graphs_tpot_panels

    assert all((RESULTS / name).is_file() for name in SUPERSEDED)  # the list names real files
    current = [p.name for p in current_records(RESULTS, "bench_e2e_graphs*.json")]
    assert {"bench_e2e_graphs_1k.json", "bench_e2e_graphs_32k.json"} <= set(current)
    assert not set(current) & set(SUPERSEDED)
    panels = graphs_tpot_panels(RESULTS)
    drawn = {
        v for backends in panels.values() for modes in backends.values() for v in modes.values()
    }
    for name in SUPERSEDED:
        if name.startswith("bench_e2e_graphs"):
            runs = json.loads((RESULTS / name).read_text())["runs"]
            old = {e["tpot_ms"]["median"] for run in runs for e in run["results"].values()}
            assert not old & drawn, name  # e.g. the 459.4 ms all-on step of 3425f19
    assert all("[" not in label for backends in panels.values() for label in backends)

    alone = tmp_path / "results"  # only a superseded record: its plot has nothing to draw
    alone.mkdir()
    shutil.copy(RESULTS / "bench_e2e_graphs_32k_3425f19.json", alone)
    messages = []
    assert make_plots(alone, tmp_path / "out", log=messages.append) == []
    assert any(m.startswith("  left out bench_e2e_graphs_32k_3425f19.json") for m in messages)
    assert any(m.startswith("  graphs_tpot.png: skipped") for m in messages)


def test_the_serving_plot_draws_cuda_graph_records_only():
    from flashloop_backend.tools.serving_plots import (
        serving_ratios,
        serving_records,
        serving_series,
    )

    assert "bench_serving_eager_partial" not in serving_records(RESULTS)
    series = dict(serving_series(RESULTS))
    assert list(series) == [
        "token-sparse prefill",
        "sparse decode",
        "INT4 KV",
        "token-sparse prefill + sparse decode",
        "all three",
    ]
    graphs = json.loads((RESULTS / "bench_serving_graphs_partial.json").read_text())
    assert series["token-sparse prefill"] == serving_ratios(graphs)["token_sparse_prefill alone"]


def test_context_lengths_read_as_the_docs_write_them():
    from flashloop_backend.tools.plot_records import tokens

    assert [tokens(n) for n in (1024, 8192, 32768, 1000)] == ["1K", "8K", "32K", "1000"]


def test_the_readme_results_table_is_the_one_the_records_give(tmp_path):
    """The README's measured-results table is generated from committed records
    (``report --readme``): a figure edited by hand, or a record changed without
    regenerating it, fails here."""
    import shutil
    from pathlib import Path

    from flashloop_backend.tools.results_table import BEGIN, END, rewrite

    repo = Path(__file__).resolve().parents[1]
    copy = tmp_path / "README.md"
    shutil.copy(repo / "README.md", copy)
    assert not rewrite(copy, repo / "results"), "README.md's table differs from its records"
    text = copy.read_text()
    block = text.split(BEGIN, 1)[1].split(END, 1)[0]
    assert block.count("\n| ") >= 7 and "results/decode_v3/" in block


def _report_readme(*args):
    import subprocess
    import sys

    command = [sys.executable, "-m", "flashloop_backend.cli.main", "report", "--readme", *args]
    return subprocess.run(command, capture_output=True, text=True)


def test_report_readme_names_a_missing_file_markers_or_record_and_writes_nothing(tmp_path):
    """``report --readme`` exits 2 naming the bad value: a document that is not a file, one
    without the table's markers, a results directory missing a record the table reads;
    the document is left as it was."""
    from flashloop_backend.tools.results_table import BEGIN, END

    missing = tmp_path / "none.md"
    result = _report_readme(str(missing), "--results", str(RESULTS))
    assert result.returncode == 2 and f"--readme '{missing}' is not a file" in result.stderr
    plain = tmp_path / "plain.md"
    plain.write_text("# no table here\n")
    result = _report_readme(str(plain), "--results", str(RESULTS))
    assert result.returncode == 2 and "has no results-table markers" in result.stderr
    assert plain.read_text() == "# no table here\n"
    marked = tmp_path / "marked.md"
    marked.write_text(f"before\n{BEGIN}\nold\n{END}\nafter\n")
    empty = tmp_path / "results"
    empty.mkdir()
    result = _report_readme(str(marked), "--results", str(empty))
    assert result.returncode == 2 and "cannot write the results table" in result.stderr
    assert "decode_v3/bench_e2e_all_on_32k16" in result.stderr  # the record it could not read
    assert marked.read_text() == f"before\n{BEGIN}\nold\n{END}\nafter\n"


def test_the_docs_quote_the_decode_ratios_of_the_readmes_records():
    """``docs/status.md`` and ``docs/flashloop.md`` restate the all-on TPOT ratios of the
    README's table by hand: each must be the ratio its record gives (to two decimals)."""
    from pathlib import Path

    from flashloop_backend.tools.results_table import ROWS, _ratio_of, _record

    repo = Path(__file__).resolve().parents[1]
    records = {row.what: row.record for row in ROWS}

    def ratio(shape: str) -> str:
        record = records[f"decode TPOT, {shape}, all on"]
        return f"{_ratio_of(_record(repo / 'results', record), 'tpot'):.2f}x"

    short, long, many = (
        ratio("8K x 1 (24 layers)"),
        ratio("32K x 1 (24 layers)"),
        ratio("32K x 16 (4 layers)"),
    )
    status = (repo / "docs" / "status.md").read_text()
    shapes = "dense TPOT at 8K x 1 / 32K x 1 / 32K x 16"
    assert f"End to end all on is {short} / {long} / {many} {shapes}" in status
    flashloop = " ".join((repo / "docs" / "flashloop.md").read_text().split())
    assert f"all on decodes {many} dense at 32K x 16 and {long} at 32K x 1" in flashloop
    assert f"(all on {short} / {long} dense TPOT at 8K x 1 / 32K x 1" in flashloop


def _capacity_record(gpu, points):
    """A bench capacity record: points are (GiB, context, variant, held, tokens/s, filled)."""
    runs = {}
    for gib, context, variant, held, rate, filled in points:
        run = runs.setdefault((gib, context), {"kv_memory_bytes": int(gib * 2**30),
                                               "context": context, "clients": 9, "records": []})  # fmt: skip
        run["records"].append({"variant": variant, "most_requests_held": held,
                               "throughput_tokens_s": rate, "pools_filled": filled})  # fmt: skip
    return {
        "kind": "capacity",
        "environment": {"gpu": gpu},
        "model": "tiny",
        "runs": list(runs.values()),
    }


def test_the_capacity_plot_draws_each_variant_against_the_budget(tmp_path):
    from flashloop_backend.tools.capacity_plot import capacity_series

    first = _capacity_record("H200", [(64, 32768, "dense", 2, 11.0, True),
                                      (64, 32768, "config", 2, 4.0, False)])  # fmt: skip
    later = _capacity_record("H200", [(64, 32768, "config", 5, 20.0, True),
                                      (96, 32768, "config", 8, 30.0, True),
                                      (96, 32768, "dense", 3, 15.0, True)])  # fmt: skip
    later["runs"][0]["records"].append({"variant": "kv alone", "error": "holds no request"})
    series = capacity_series([first, later])
    assert series == {
        (32768, "dense"): [(64.0, 2, 11.0, True), (96.0, 3, 15.0, True)],
        (32768, "config"): [(64.0, 5, 20.0, True), (96.0, 8, 30.0, True)],  # the later record
    }
    results = tmp_path / "results"
    (results / "capacity").mkdir(parents=True)
    for name, record in (("bench_capacity_a.json", first), ("bench_capacity_b.json", later)):
        (results / "capacity" / name).write_text(json.dumps(record))
    written = make_plots(results, tmp_path / "out", log=lambda m: None)
    assert [p.name for p in written] == ["capacity_vs_budget.png"]


def test_the_capacity_plot_draws_the_readme_s_record_where_records_share_a_point(tmp_path):
    """Record names are not in time order: the README's first quoted record
    (``CAPACITY_RECORDS``) is taken last, so its points replace any later-named record's
    and the figure shows a run the README's sentence quotes; history folders are left
    out."""
    from flashloop_backend.tools.capacity_plot import capacity_series, drawn_in_order
    from flashloop_backend.tools.results_table import CAPACITY_RECORDS

    results = tmp_path / "results"
    quoted = results / CAPACITY_RECORDS[0]
    later = quoted.parent / "bench_capacity_zz_later_name.json"
    old = quoted.parent / "history" / "bench_capacity_zzz.json"
    for path, rate in ((quoted, 20.0), (later, 99.0), (old, 7.0)):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            json.dumps(_capacity_record("H100", [(16, 32768, "config", 12, rate, True)]))
        )
    assert drawn_in_order(results) == [later, quoted]
    records = [json.loads(p.read_text()) for p in drawn_in_order(results)]
    assert capacity_series(records) == {(32768, "config"): [(16.0, 12, 20.0, True)]}


def test_a_range_of_ratios_is_one_figure_where_the_runs_agree():
    from flashloop_backend.tools.results_table import _span

    assert _span([1.161, 1.29], "x") == "1.16-1.29x"
    assert _span([2.001, 1.998], "x") == "2.00x"
    assert _span([0.91], "x") == "0.91x"


def test_the_served_capacity_sentence_refuses_runs_of_different_setups(tmp_path, monkeypatch):
    """The README's range over several capacity runs holds only for one setup: records
    that differ (here the context) are refused by name, not quoted as one range."""
    from flashloop_backend.tools import results_table

    names = ("capacity/bench_capacity_a.json", "capacity/bench_capacity_b.json")
    monkeypatch.setattr(results_table, "CAPACITY_RECORDS", names)
    results = tmp_path / "results"
    for name, context in zip(names, (32768, 8192), strict=True):
        record = _capacity_record("H100", [(16, context, "dense", 4, 10.0, True),
                                           (16, context, "config", 12, 22.0, True)])  # fmt: skip
        for entry, p99 in zip(record["runs"][0]["records"], (40.0, 48.0), strict=True):
            entry["itl_ms"] = {"p99": p99}
        record["model"] = "Ouro-1.4B shapes, 4 layers"
        (results / name).parent.mkdir(parents=True, exist_ok=True)
        (results / name).write_text(json.dumps(record))
    with pytest.raises(ValueError, match="CAPACITY_RECORDS measured different setups"):
        results_table._served_capacity(results)
