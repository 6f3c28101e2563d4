import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashloop_backend.capabilities import Capability
from flashloop_backend.cli.main import main


def run(*args):
    return subprocess.run(
        [sys.executable, "-m", "flashloop_backend.cli.main", *args], capture_output=True, text=True
    )


def test_info_json_reports_truthful_capabilities(capsys):
    assert main(["info", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    caps = report["backends"]["flashloop"]["capabilities"]
    assert set(caps) == {c.value for c in Capability}
    assert report["capability_names"] == [c.value for c in Capability]
    if "cuda" not in report["machine"]["devices"]:
        assert caps["cuda_graphs"] is False
    assert report["auto"]["selected"] == "flashloop"
    assert len(report["digest"]) == 16
    assert report["effective_config"]["kernels"]["dense_attention"] == "torch_reference"


def test_info_reports_which_features_serve_speculation_and_tensor_parallel(capsys, monkeypatch):
    from flashloop_backend.backends import flashloop_support as flashloop

    declared = dict(flashloop.TENSOR_PARALLEL_SUPPORT, kv_residual_quantization=False)
    monkeypatch.setattr(flashloop, "TENSOR_PARALLEL_SUPPORT", declared)
    assert main(["info", "--json"]) == 0
    support = json.loads(capsys.readouterr().out)["feature_support"]
    assert support["tensor_parallel"] == declared
    assert support["speculation"] == flashloop.SPECULATION_SUPPORT
    assert main(["info"]) == 0
    text = capsys.readouterr().out
    assert "  tensor_parallel: token_sparse_prefill, sparse_decode_attention\n" in text


def test_info_text_mentions_choice(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "auto picks: flashloop" in out
    assert "digest" in out


def test_info_reports_how_many_requests_fit_a_kv_budget(capsys):
    """The allocator's accounting at Ouro-1.4B's shapes: a dense request of 32K holds 24
    GiB of BF16 KV on four planes; all on holds it until its prompt is packed, then far
    less, so one budget holds more requests."""
    all_on = str(Path(__file__).resolve().parents[1] / "configs" / "all_on.json")
    args = ["info", "--config", all_on, "--context", "32768", "--json"]
    assert main([*args, "--kv-memory-gib", "64"]) == 0
    capacity = json.loads(capsys.readouterr().out)["capacity"]
    dense, mine = capacity["dense"], capacity["config"]
    assert dense["prefill_bytes_per_request"] == dense["decode_bytes_per_request"] == 24 * 2**30
    assert mine["decode_bytes_per_request"] * 3 < dense["decode_bytes_per_request"]
    assert (dense["requests"], capacity["prompt_tokens"]) == (2, 32768 - 256)
    assert mine["requests"] > dense["requests"]
    assert main(["info", "--config", all_on, "--context", "32768"]) == 0
    assert "this config / dense: " in capsys.readouterr().out


def test_info_names_a_request_shape_it_cannot_plan():
    result = run("info", "--context", "1024", "--new-tokens", "1024")
    assert result.returncode == 2
    assert "--new-tokens 1024 must be at least 1 and below --context 1024" in result.stderr
    assert "Traceback" not in result.stderr


def test_unknown_backend_exits_nonzero_without_traceback():
    result = run("info", "--backend", "nope")
    assert result.returncode == 3
    assert "unknown backend 'nope'" in result.stderr
    assert "Traceback" not in result.stderr


def test_unservable_backend_lists_reasons(tmp_path):
    cfg = tmp_path / "c.json"
    if torch.cuda.is_available():
        pytest.skip("the Triton packed reader is servable on a GPU")
    # the Triton packed reader named for packed_decode on a machine without CUDA
    unservable = {
        "kv_residual_quantization": {"enabled": True},
        "kernel_overrides": {"packed_decode": "triton"},
    }
    cfg.write_text(json.dumps(unservable))
    result = run("info", "--backend", "flashloop", "--config", str(cfg), "--json")
    assert result.returncode == 3
    assert "packed_decode='triton'" in result.stderr and "cuda" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ('{"kv_residual_quantization": {"group_size": 48}}', "group_size"),
        ("{oops", "cannot be parsed"),
    ],
)
def test_bad_config_is_a_clean_error(tmp_path, content, fragment):
    cfg = tmp_path / "c.json"
    cfg.write_text(content)
    result = run("info", "--config", str(cfg))
    assert result.returncode == 2
    assert fragment in result.stderr
    assert "Traceback" not in result.stderr
