"""scripts/profile_conversion.py: a CPU smoke run times each chunk size and profiles one
conversion; bad chunk sizes are refused by name before any work."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "profile_conversion.py"
TINY = ["--context", "128", "--layers", "2", "--heads", "2", "--head-dim", "64", "--repeats", "1",
        "--rows", "3", "--device", "cpu"]  # fmt: skip


def test_a_cpu_smoke_run_times_every_chunk_size_and_layers_per_pass():
    result = subprocess.run([sys.executable, str(SCRIPT), *TINY, "--chunks", "64,0", "--layers-per-pass", "1,2"],
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout.strip().splitlines()[-1])
    # on CPU only the torch chain runs (the fused writer is a GPU kernel)
    keys = {f"chain_chunk_{c}_layers_{n}" for c in ("64", "whole") for n in (1, 2)}
    assert set(record["seconds"]) == keys and all(s > 0 for s in record["seconds"].values())
    calls = record["aten_calls"]  # JSON keys: writer and layers per pass
    assert calls["chain_layers_2"] < calls["chain_layers_1"]
    assert set(record["device_launches"].values()) == {0}


def test_an_unknown_writer_is_refused_by_name():
    result = subprocess.run([sys.executable, str(SCRIPT), *TINY, "--writers", "fused,fast"],
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 2 and "--writers ['fast']" in result.stderr


def test_chunks_off_the_group_are_refused_by_name():
    result = subprocess.run([sys.executable, str(SCRIPT), *TINY, "--chunks", "96"],
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert (
        result.returncode == 2
        and "--chunks [96]" in result.stderr
        and "--group 64" in result.stderr
    )
