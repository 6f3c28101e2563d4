"""scripts/profile_host.py: a CPU run on the tiny model records every prefill step's rows
(each prompt row once per loop it runs) with its host and wait time."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "profile_host.py"


def _record(tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "host.json"
    tiny = ["--tiny", "--context", "128", "--prefill-chunk", "64", "--layers", "2"]
    result = subprocess.run(
        [sys.executable, str(SCRIPT), *tiny, "--json", str(out), *extra],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(out.read_text())


def test_dense_runs_every_prompt_row_at_every_loop(tmp_path):
    record = _record(tmp_path, "--backend", "torch")
    rows = [s["prefill_rows"] for s in record["steps"]]
    assert rows == [64] * 8  # 2 chunks x 4 loops
    assert all(s["host_s"] > 0 and s["wait_s"] >= 0 for s in record["steps"])
    assert record["host_s"] == sum(s["host_s"] for s in record["steps"])


def test_token_sparse_prefill_runs_fewer_rows_after_loop_two(tmp_path):
    record = _record(tmp_path, "--config", "configs/token_sparse_prefill.json")
    rows = [s["prefill_rows"] for s in record["steps"]]
    assert rows[:4] == [64] * 4  # loops 1-2 dense
    assert 0 < sum(rows[4:]) < 2 * 128
