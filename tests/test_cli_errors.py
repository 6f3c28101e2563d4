"""User mistakes end with an exit code and a named reason, never a traceback: damaged
checkpoints, zero-sized pools, non-finite or negative values, and configs no backend can
serve (exit 3 in every command). Commands run in process (``main``) where they can."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from flashloop_backend.cli.main import EXIT_UNSERVABLE, EXIT_USAGE, main
from flashloop_backend.host.embedded import embedded_model_path

UNKNOWN_KERNEL = {"kernel_overrides": {"dense_attention": "no_such_kernels"}}


def _exit(argv: list[str]) -> int:
    """``main``'s status, counting argparse's own exit (bad arguments) as a status too."""
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code)


@pytest.fixture
def model_copy(tmp_path):
    """A copy of the embedded model whose weights file a test may damage."""
    target = tmp_path / "model"
    shutil.copytree(embedded_model_path(), target)
    return target


@pytest.mark.parametrize(
    ("damage", "fragment"),
    [
        ("truncated", "damaged or not a safetensors file"),
        ("empty", "0 bytes, shorter than the 8-byte header"),
        ("random", "damaged or not a safetensors file"),
    ],
)
@pytest.mark.parametrize("command", ["generate", "demo", "eval"])
def test_a_damaged_checkpoint_exits_2_naming_the_file(
    model_copy, damage, fragment, command, capsys
):
    weights = model_copy / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(
        {"truncated": data[:1000], "empty": b"", "random": os.urandom(4096)}[damage]
    )
    argv = [command, "--model", str(model_copy)]
    argv += {"generate": ["--prompt", "x"], "demo": ["--no-compare"], "eval": []}[command]
    assert _exit(argv) == EXIT_USAGE
    err = capsys.readouterr().err
    assert str(weights) in err and fragment in err


@pytest.mark.parametrize("flag", ["--num-blocks", "--block-size"])
@pytest.mark.parametrize("value", ["0", "-3", "x"])
def test_zero_or_negative_pool_sizes_are_refused_at_parsing(flag, value, capsys):
    assert _exit(["generate", "--prompt", "a", flag, value]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert flag in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["generate", "--prompt", "a", "--temperature", "nan"], "finite number >= 0"),
        (["generate", "--prompt", "a", "--temperature", "-1"], "finite number >= 0"),
        (["generate", "--prompt", "a", "--max-new-tokens", "0"], "integer >= 1"),
        (["eval", "--passkey-samples", "-1"], "integer >= 0"),
        (["eval", "--windows", "0"], "integer >= 1"),
    ],
)
def test_bad_values_are_refused_at_parsing(argv, fragment, capsys):
    assert _exit(argv) == EXIT_USAGE
    assert fragment in capsys.readouterr().err


def test_a_non_boolean_enabled_is_refused(tmp_path, capsys):
    path = tmp_path / "yes.json"
    path.write_text(json.dumps({"sparse_decode_attention": {"enabled": "yes"}}))
    assert _exit(["info", "--config", str(path)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "sparse_decode_attention.enabled: must be a boolean: true or false" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["info"],
        ["info", "--backend", "flashloop"],
        ["info", "--backend", "torch"],
        ["generate", "--prompt", "a"],
        ["generate", "--prompt", "a", "--backend", "flashloop"],
        ["eval", "--windows", "1"],
    ],
)
def test_a_config_no_backend_can_serve_exits_3_everywhere(argv, tmp_path, capsys):
    path = tmp_path / "unknown_kernel.json"
    path.write_text(json.dumps(UNKNOWN_KERNEL))
    assert _exit([*argv, "--config", str(path)]) == EXIT_UNSERVABLE
    err = capsys.readouterr().err
    assert "no_such_kernels" in err


def test_auto_does_not_pick_a_dense_backend_that_ignores_kernel_overrides():
    from flashloop_backend.capabilities import SupportRequest
    from flashloop_backend.config import FlashLoopConfig, UnservableError
    from flashloop_backend.registry import AUTO, Registry

    registry = Registry.discover()
    config = FlashLoopConfig.from_dict(UNKNOWN_KERNEL)
    with pytest.raises(UnservableError) as caught:
        registry.select_backend(AUTO, SupportRequest(), config)
    assert "the torch backend runs only its own" in str(caught.value)


def test_unknown_backend_exits_3_in_generate(capsys):
    assert _exit(["generate", "--prompt", "a", "--backend", "nope"]) == EXIT_UNSERVABLE
    assert "unknown backend 'nope'" in capsys.readouterr().err


def test_generate_defaults_to_the_embedded_model_and_reports_a_depth_per_token(capsys):
    assert main(["generate", "--prompt", "def f(x):", "--max-new-tokens", "5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["exit_depths"]) == len(out["output_token_ids"]) == 5
    assert out["exit_depths"][0] == 3  # the prompt runs every loop of the 4


def test_help_does_not_import_torch():
    code = (
        "import sys; from flashloop_backend.cli.main import build_parser; build_parser(); "
        "print('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


@pytest.mark.parametrize("command", [["demo", "--no-compare"], ["generate", "--prompt", "x" * 40]])
def test_a_pool_too_small_for_the_request_exits_2(command, capsys):
    """Requests that need more than 4 KV blocks: refused with the counts, exit 2."""
    assert _exit([*command, "--num-blocks", "4", "--max-new-tokens", "8"]) == EXIT_USAGE
    assert "KV blocks" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("100", "passkey contexts [100] are too short"),
        ("0", "'0' must list positive integers"),
        ("256,x", "'256,x' is not a comma-separated list of integers"),
    ],
)
def test_eval_refuses_passkey_contexts_that_cannot_hold_a_needle(value, fragment, capsys):
    assert _exit(["eval", "--windows", "1", "--passkey-contexts", value]) == EXIT_USAGE
    assert fragment in capsys.readouterr().err
