"""scripts/train_embedded.py: a CPU smoke run of a small model of another shape writes a
loadable checkpoint and metrics (per-loop loss, passkey at the asked lengths); a shape off
Ouro's head_dim 128 and lengths too short for a passkey are refused by name."""

import json
import subprocess
import sys
from pathlib import Path

from flashloop_backend.host import load_model

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train_embedded.py"
SMALL = [
    "--seconds",
    "1",
    "--layers",
    "2",
    "--hidden",
    "128",
    "--heads",
    "1",
    "--intermediate",
    "256",
    "--seq-len",
    "160",
    "--batch",
    "4",
    "--eval-windows",
    "2",
]


def _run(*args):
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600
    )


def test_a_small_model_of_another_shape_trains_and_loads(tmp_path):
    result = _run(
        "--out", str(tmp_path), *SMALL, "--passkey-lengths", "128,192", "--corpus-mb", "2"
    )
    assert result.returncode == 0, result.stderr
    model = load_model(tmp_path)
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads) == (2, 128, 1)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert len(metrics["loss_nats_per_loop"]) == 4
    assert {k.split("_")[0] for k in metrics["passkey_accuracy"]} == {"len128", "len192"}
    assert metrics["params"] == sum(p.numel() for p in model.parameters())
    corpus = metrics["corpus"]  # the cap stops reading after the file that crosses 2 MB
    assert 2e6 <= corpus["train_bytes"] + corpus["held_out_bytes"] < 4e6
    assert 0 < corpus["held_out_files"] < corpus["files"]


def test_shapes_and_lengths_off_the_recipe_are_refused(tmp_path):
    result = _run("--out", str(tmp_path), *SMALL[:-2], "--hidden", "256")
    assert result.returncode == 2 and "--hidden 256 must be 128 x --heads 1" in result.stderr
    result = _run("--out", str(tmp_path), *SMALL, "--passkey-lengths", "64")
    assert result.returncode == 2 and "must be >= 128" in result.stderr


def test_a_consistency_weight_trains_and_bad_ones_are_refused(tmp_path):
    """``--consistency`` adds the late loops' hidden-state change to the loss: a small run
    with it writes a checkpoint; a negative weight or a transition past the last loop is
    refused by name."""
    tiny = ["--passkey-lengths", "128", "--corpus-mb", "1", "--consistency", "0.3"]
    result = _run("--out", str(tmp_path), *SMALL, *tiny)
    assert result.returncode == 0, result.stderr
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["args"]["consistency"] == 0.3 and len(metrics["relative_change_k"]) == 3
    for bad in (["--consistency", "-1"], ["--consistency-after", "4"]):
        result = _run("--out", str(tmp_path), *SMALL, *bad)
        assert result.returncode == 2, bad
        assert "--consistency" in result.stderr and "one of 1, 2, 3" in result.stderr


def test_a_run_from_a_checkpoint_keeps_its_shape_and_a_directory_without_one_is_refused(
    tmp_path,
):
    """``--init DIR`` starts from a checkpoint: the shape flags are not used, the written
    model and its metrics' args have the checkpoint's shape, and its first step scores the same batch (same seed)
    far better than the random model the checkpoint's own run started from."""
    first, second = tmp_path / "first", tmp_path / "second"
    tiny = ["--passkey-lengths", "128", "--corpus-mb", "1", "--warmup-steps", "1"]
    quick = ["--lr", "1e-2", "--seconds", "300", "--max-steps", "40"]
    assert _run("--out", str(first), *SMALL, *tiny, *quick).returncode == 0
    other_shape = ["--layers", "3", "--hidden", "256", "--heads", "2"]
    rest = SMALL[:2] + SMALL[10:]  # SMALL without its shape flags
    result = _run("--out", str(second), "--init", str(first), *rest, *other_shape, *tiny)
    assert result.returncode == 0, result.stderr
    model = load_model(second)
    assert (model.config.num_hidden_layers, model.config.hidden_size) == (2, 128)
    recorded = json.loads((second / "metrics.json").read_text())["args"]
    assert (recorded["layers"], recorded["hidden"], recorded["heads"]) == (2, 128, 1)
    random_start = json.loads((first / "metrics.json").read_text())["log"][0]["loss"]
    trained = json.loads((first / "metrics.json").read_text())
    assert trained["steps"] == 40
    checkpoint_start = json.loads((second / "metrics.json").read_text())["log"][0]["loss"]
    assert checkpoint_start < random_start - 0.5
    result = _run("--out", str(tmp_path / "x"), "--init", str(tmp_path), *SMALL)
    assert result.returncode == 2 and "is not a checkpoint directory" in result.stderr
    result = _run("--out", str(tmp_path / "x"), *SMALL, "--warmup-steps", "0")
    assert result.returncode == 2 and "--warmup-steps 0 must be >= 1" in result.stderr
    result = _run("--out", str(tmp_path / "x"), *SMALL, "--max-steps", "-1")
    assert result.returncode == 2 and "--max-steps -1 must be >= 0" in result.stderr
