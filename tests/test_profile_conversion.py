"""scripts/profile_conversion.py: a CPU smoke run times each chunk size and profiles one
conversion; bad chunk sizes are refused by name before any work."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "profile_conversion.py"
TINY = ["--context", "128", "--layers", "1", "--heads", "2", "--head-dim", "64", "--repeats", "1",
        "--rows", "3", "--device", "cpu"]  # fmt: skip


def test_a_cpu_smoke_run_times_every_chunk_size():
    result = subprocess.run([sys.executable, str(SCRIPT), *TINY, "--chunks", "64,0"],
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(record["seconds"]) == {"64", "whole"} and all(
        s > 0 for s in record["seconds"].values()
    )
    assert record["aten_calls"] > 0 and record["device_launches"] == 0


def test_chunks_off_the_group_are_refused_by_name():
    result = subprocess.run([sys.executable, str(SCRIPT), *TINY, "--chunks", "96"],
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert (
        result.returncode == 2
        and "--chunks [96]" in result.stderr
        and "--group 64" in result.stderr
    )
