import json
import subprocess
import sys

import torch

from flashloop_backend import embedded_model_path
from flashloop_backend.host import save_checkpoint
from flashloop_backend.host.tokenizer import build_byte_tokenizer

from .host_helpers import tiny_model


def cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "flashloop_backend.cli.main", *args], capture_output=True, text=True
    )


def test_generate_json_greedy_matches_engine_and_is_deterministic():
    args = (
        "generate",
        "--model",
        str(embedded_model_path()),
        "--prompt",
        "def f(x):",
        "--max-new-tokens",
        "6",
        "--json",
    )
    first, second = cli(*args), cli(*args)
    assert first.returncode == 0, first.stderr
    out = json.loads(first.stdout)
    assert out["prompt_token_ids"] == [256, *list(b"def f(x):")]
    assert len(out["output_token_ids"]) == 6
    assert json.loads(second.stdout)["output_token_ids"] == out["output_token_ids"]


def test_demo_runs_and_reports_speed_and_kv(monkeypatch, capsys):
    """The main job's wiring on smaller table shapes (the README times the real one)."""
    from flashloop_backend.cli import showcase
    from flashloop_backend.cli.main import main
    from flashloop_backend.tools.evaluation import EvalSettings

    monkeypatch.setattr(showcase, "TABLE_PROMPTS", 2)
    monkeypatch.setattr(showcase, "TABLE_PROMPT_TOKENS", 160)
    monkeypatch.setattr(showcase, "TABLE_NEW_TOKENS", 3)
    quick = EvalSettings(windows=2, context=64, continuation=8, passkey_contexts=(128,),
                         passkey_samples=1, bootstrap=20)  # fmt: skip
    monkeypatch.setattr(showcase, "QUICK_EVAL", quick)
    assert main(["demo", "--max-new-tokens", "4"]) == 0
    out, err = capsys.readouterr()
    assert "backend: " in out
    assert "tokens/s" in out and "bytes per token position" in out
    assert "(stopped: " in out and "traversals" not in out
    assert "demo: generate [" in err  # the progress bar
    # the closing side-by-side table, measured in the same run, with what each row measures
    assert "| | dense | FlashLoop, all on | ratio |" in out
    for row in (
        "tokens/s on this machine (a)",
        "KV bytes per held token (b)",
        "Δ bits/byte vs dense",
    ):
        assert row in out
    for note in ("(a) ", "(b) ", "(c) "):
        assert note in out
    kv_row = next(line for line in out.splitlines() if line.startswith("| KV bytes"))
    assert float(kv_row.split("|")[4].split("x")[0]) > 2  # whole prompt groups are packed


def test_demo_without_the_table():
    skipped = cli("demo", "--max-new-tokens", "2", "--no-compare")
    assert skipped.returncode == 0 and "FlashLoop, all on" not in skipped.stdout


def _model_dir(tmp_path, **overrides):
    save_checkpoint(tiny_model(**overrides), tmp_path, dtype=torch.float32)
    build_byte_tokenizer().save(str(tmp_path / "tokenizer.json"))
    return str(tmp_path)


def test_prompt_longer_than_max_positions(tmp_path):
    model_dir = _model_dir(tmp_path, vocab_size=258, max_position_embeddings=32)
    result = cli("generate", "--model", model_dir, "--prompt", "x" * 40, "--max-new-tokens", "4")
    assert result.returncode == 2
    assert "exceeds the engine's max_context=32" in result.stderr
    assert "Traceback" not in result.stderr


def test_out_of_kv_blocks(tmp_path):
    model_dir = _model_dir(tmp_path, vocab_size=258)
    result = cli(
        "generate",
        "--model",
        model_dir,
        "--prompt",
        "hello",
        "--num-blocks",
        "2",
        "--block-size",
        "4",
    )
    assert result.returncode == 2
    assert "KV blocks" in result.stderr and "Traceback" not in result.stderr


def test_generate_sizes_its_pools_from_a_kv_budget_and_reports_the_plan(tmp_path):
    model_dir = _model_dir(tmp_path, vocab_size=258)
    args = ("generate", "--model", model_dir, "--prompt", "hello", "--max-new-tokens", "3")
    result = cli(*args, "--kv-memory-gib", "0.01", "--block-size", "4", "--json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)["capacity_plan"]
    assert plan["requests"] >= 1 and plan["used_bytes"] <= 0.01 * 2**30
    assert "KV pools from 0.01 GiB: " in result.stderr
    both = cli(*args, "--kv-memory-gib", "0.01", "--num-blocks", "64")
    assert both.returncode == 2
    assert "give it or --num-blocks, not both" in both.stderr
    small = cli(*args, "--kv-memory-gib", "0.000001")
    assert small.returncode == 2 and "cannot hold one request" in small.stderr


def test_unknown_backend_and_bad_model(tmp_path):
    result = cli(
        "generate", "--model", str(embedded_model_path()), "--prompt", "a", "--backend", "nope"
    )
    assert result.returncode == 3 and "unknown backend 'nope'" in result.stderr
    result = cli("generate", "--model", str(tmp_path / "missing"), "--prompt", "a")
    assert result.returncode == 2 and "does not exist" in result.stderr
    assert "Traceback" not in result.stderr
