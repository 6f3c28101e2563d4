"""``generate --snapshot FILE --snapshot-after M`` then ``generate --restore FILE``: the two
outputs joined equal one uninterrupted greedy run (prompt long enough to be packed); a
damaged, truncated or mismatched snapshot and contradictory flags exit 2 with a one-line
error that names the problem and no traceback."""

import json
from pathlib import Path

import pytest

from flashloop_backend.cli.main import EXIT_USAGE, main

ALL_ON = "configs/all_on.json"
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fib"


def _run(capsys, *argv):
    code = main(["generate", "--json", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def saved(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    path = tmp_path / "req.safetensors"
    code, out, err = _run(
        capsys,
        "--prompt",
        PROMPT,
        "--max-new-tokens",
        "16",
        "--config",
        ALL_ON,
        "--snapshot",
        str(path),
        "--snapshot-after",
        "6",
    )
    assert code == 0, err
    return path, json.loads(out)


def test_snapshot_then_restore_joins_into_the_uninterrupted_run(saved, capsys):
    path, first = saved
    code, out, err = _run(capsys, "--prompt", PROMPT, "--max-new-tokens", "16", "--config", ALL_ON)
    assert code == 0, err
    whole = json.loads(out)
    assert first["finish_reason"] == "snapshot" and len(first["output_token_ids"]) == 6
    parts = first["snapshot_bytes"]  # the prompt's whole groups packed, the rest in BF16
    assert parts["packed"] > 0 and parts["bf16"] > 0 and parts["other"] > 0
    code, out, err = _run(
        capsys, "--restore", str(path), "--max-new-tokens", "10", "--config", ALL_ON
    )
    assert code == 0, err
    rest = json.loads(out)
    assert first["output_token_ids"] + rest["output_token_ids"] == whole["output_token_ids"]
    assert first["exit_depths"] + rest["exit_depths"] == whole["exit_depths"]
    assert rest["prompt_token_ids"] == whole["prompt_token_ids"]


@pytest.mark.parametrize(
    ("damage", "fragment"),
    [
        ("truncated", "is damaged or truncated"),
        ("flipped", "does not match its checksum"),
        ("dense config", "identity config_digest: snapshot"),
    ],
)
def test_a_bad_snapshot_exits_2_with_one_line_naming_it(saved, damage, fragment, capsys):
    path, _ = saved
    data = path.read_bytes()
    config = ["--config", ALL_ON]
    if damage == "truncated":
        path.write_bytes(data[: len(data) - 100])
    elif damage == "flipped":
        path.write_bytes(data[:-5] + bytes([data[-5] ^ 0x10]) + data[-4:])
    else:
        config = []
    code, out, err = _run(capsys, "--restore", str(path), "--max-new-tokens", "4", *config)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == EXIT_USAGE and out == "" and "Traceback" not in err
    assert len(errors) == 1 and fragment in errors[0]


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--max-new-tokens", "4"], "give exactly one of --prompt TEXT and --restore FILE"),
        (["--prompt", "a", "--restore", "x"], "give exactly one of --prompt"),
        (
            ["--prompt", "a", "--snapshot", "x"],
            "--snapshot FILE and --snapshot-after M go together",
        ),
        (
            ["--prompt", "a", "--snapshot", "x", "--snapshot-after", "4", "--max-new-tokens", "4"],
            "--snapshot-after 4 must be below --max-new-tokens 4",
        ),
        (["--restore", "absent.safetensors"], "no snapshot file at 'absent.safetensors'"),
        (["--restore", "x", "--temperature", "0.5"], "--temperature and --seed come from the"),
    ],
)
def test_contradictory_flags_exit_2_naming_them(argv, fragment, capsys):
    code, _, err = _run(capsys, *argv)
    assert code == EXIT_USAGE and fragment in err and "Traceback" not in err
