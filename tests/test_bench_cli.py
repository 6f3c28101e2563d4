import subprocess
import sys

import pytest
import torch


def cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "flashloop_backend.cli.main", *args], capture_output=True, text=True
    )


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (("bench", "kernel", "--backends", "nope"), "unknown backends ['nope']"),
        (("bench", "kernel", "--contexts", "0,5"), "must list positive integers"),
        (("bench", "kernel", "--concurrency", "a"), "not a comma-separated list"),
        (("bench", "fast"), "invalid choice"),
        (("bench", "prefill", "--retention", "0.5,1.5"), "must list retention values in (0, 1]"),
        (("bench", "e2e", "--config", "/nonexistent.json"), "/nonexistent.json"),
        (
            ("bench", "kernel", "--backends", "triton+graphs"),
            "apply to e2e, serving and capacity only",
        ),
        (("bench", "serving"), "--config must enable at least one"),
        (("bench", "capacity", "--kv-memory-gib", "64,0"), "'0' must be a finite number > 0"),
        (("bench", "capacity", "--kv-memory-gib", ","), "',' must list numbers > 0"),
        (
            ("bench", "capacity", "--config", "configs/all_on.json", "--one-traversal-mixed-steps"),
            "--one-traversal-mixed-steps needs CUDA graphs: name the baseline",
        ),
        (
            ("bench", "serving", "--config", "configs/all_on.json", "--variants", "dense,all"),
            "unknown serving variants ['all']",
        ),
        (("bench", "kernel", "--grid"), "--grid applies to bench e2e, not bench kernel"),
        (
            ("bench", "packed", "--sync-every-step"),
            "--sync-every-step applies to bench e2e, serving and capacity, not bench packed",
        ),
        (("bench", "serving", "--speculate", "4"), "--speculate applies to bench e2e, not"),
        (("bench", "e2e", "--speculate", "1"), "1 must be an integer >= 2"),
        (("bench", "e2e", "--speculate", "2", "--draft-depth", "0"), "draft_depth=0 is not built"),
        (
            ("bench", "e2e", "--speculate", "2", "--draft-confidence", "-0.5"),
            "draft_confidence=-0.5: Input should be greater than or equal to 0",
        ),
        (("bench", "e2e", "--draft-confidence", "0.5"), "--draft-confidence applies with"),
        (
            ("bench", "kernel", "--draft-confidence", "0.5"),
            "--draft-confidence applies to bench e2e",
        ),
        (
            ("bench", "e2e", "--grid", "--config", "configs/sparse_decode.json"),
            "--grid needs a config that enables every feature",
        ),
        (
            ("bench", "e2e", "--grid", "--config", "configs/all_on.json", "--backends", "triton"),
            "--grid runs the flashloop backend; --backends ['triton'] has none",
        ),
    ],
)
def test_bench_argument_errors(args, fragment):
    result = cli(*args)
    assert result.returncode == (3 if "unknown backends" in fragment else 2)
    assert fragment in result.stderr and "Traceback" not in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_bench_capacity_takes_a_graphed_baseline():
    """``scripts/device_capacity.sh`` runs dense from CUDA graphs: the entry passes the
    argument checks and stops only where the GPU is missing."""
    result = cli(
        *("bench", "capacity", "--backends", "triton+graphs", "--config", "configs/all_on.json"),
        *("--contexts", "4096", "--new-tokens", "64", "--kv-memory-gib", "8"),
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "no CUDA GPU is available" in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
@pytest.mark.parametrize("mode", ["kernel", "prefill", "sparse", "packed"])
def test_bench_without_gpu_is_a_clean_error(mode):
    result = cli("bench", mode, "--backends", "torch")
    assert result.returncode == 2 and "no CUDA GPU" in result.stderr


def test_graph_variant_names():
    from flashloop_backend.config import ConfigError
    from flashloop_backend.tools.bench.bench_models import graph_variant

    assert graph_variant("triton", 16, 1040) == ("triton", None)
    name, settings = graph_variant("flashloop+graphs", 12, 1040)
    assert name == "flashloop" and settings.buckets == (1, 2, 4, 8, 16)
    assert settings.max_context == 1040 and settings.capture
    with pytest.raises(ConfigError, match="the only suffix is '\\+graphs'"):
        graph_variant("triton+fast", 1, 8)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"max_batch_tokens": 0}, "max_batch_tokens=0 must be >= 1"),
        ({"warmup_context": -1}, "warmup_context=-1 must be >= 1"),
        ({"passes": 0}, "passes=0 must be >= 1"),
        ({"layer_ops": ("fused", "fast")}, "each must be 'fused' or 'reference'"),
        ({"layer_ops": ()}, "each must be 'fused' or 'reference'"),
    ],
)
def test_end_to_end_rejects_bad_step_sizes_before_touching_the_gpu(kwargs, fragment):
    from flashloop_backend.config import ConfigError
    from flashloop_backend.tools.bench.e2e import bench_end_to_end

    with pytest.raises(ConfigError, match=fragment):
        bench_end_to_end(["triton"], 1024, 1, **kwargs)


def test_the_timed_workload_probes_the_hand_over_step():
    """The KV probe is taken after the step that follows every first token, when the
    prompts have been packed: the packed store holds them, their BF16 blocks are free."""
    from flashloop_backend import FlashLoopConfig
    from flashloop_backend.capabilities import SupportRequest
    from flashloop_backend.host import Engine
    from flashloop_backend.registry import Registry
    from flashloop_backend.tools.bench.e2e import _timed_workload

    from .host_helpers import tiny_model

    request = SupportRequest(head_dim=16, block_size=4, num_q_heads=4, num_kv_heads=2)
    config = FlashLoopConfig(kv_residual_quantization={"enabled": True, "group_size": 16})
    backend = Registry.discover().create("flashloop", request, config)
    # 32 rows a step: the two prompts' first tokens come steps apart
    engine = Engine(
        tiny_model(seed=1),
        backend,
        num_blocks=120,
        block_size=4,
        prefill_chunk=32,
        max_batch_tokens=32,
    )
    probe: dict = {}
    second: dict = {}
    prompts = [[(5 * i + 1) % 61 for i in range(n)] for n in (32, 48)]
    ids, first, done, _ = _timed_workload(engine, prompts, 8, probe, second=second)
    assert set(first) == set(done) == set(second) == set(ids)
    assert all(first[i] < second[i] <= done[i] for i in ids)  # the steady decode's start
    assert probe["tokens"] >= 32 + 48 + 2  # the prompts and each first token
    packed = engine.backend.packed.store.accounting()["steady_bytes"]
    assert packed == 0  # all left: the pages came back
    bf16_per_token = engine.kv.bytes_per_token()
    # both prompts packed (a probe after the first prompt's first token would find the
    # second still in BF16)
    assert probe["kv_bytes"] < 0.5 * bf16_per_token * probe["tokens"]
    assert probe["peak_before_bytes"] == probe["hand_over_step_peak_bytes"] == 0  # on CPU


def test_the_timed_workload_counts_exits_per_loop():
    """Every generated token that ran loops is counted once, at the loop it left after."""
    from flashloop_backend.capabilities import SupportRequest
    from flashloop_backend.host import Engine
    from flashloop_backend.registry import Registry
    from flashloop_backend.tools.bench.e2e import _timed_workload

    from .test_host_engine import early_exit_model

    request = SupportRequest(head_dim=16, block_size=4, num_q_heads=4, num_kv_heads=2)
    backend = Registry.discover().create("torch", request)
    engine = Engine(early_exit_model(), backend, num_blocks=96, block_size=4)
    exits = [0] * 4
    prompts = [[(3 * i + 2) % 61 for i in range(n)] for n in (12, 20)]
    ids, _, done, _ = _timed_workload(engine, prompts, 9, exits=exits)
    assert set(done) == set(ids)
    assert sum(exits) == 2 * 8  # the first token comes from the prompt's loops
    assert sum(1 for n in exits[:-1] if n) >= 2  # this model's tokens leave early


def test_a_grid_run_measures_the_flashloop_entries_at_every_point():
    from flashloop_backend import FlashLoopConfig
    from flashloop_backend.tools.bench.e2e import planned_runs

    a = FlashLoopConfig()
    runs = planned_runs(("fused",), ["triton+graphs", "flashloop+graphs"], [("p", a), ("q", a)])
    assert [(entry, point) for _, entry, point, _, _ in runs] == [
        ("triton+graphs", None),
        ("flashloop+graphs", "p"),
        ("flashloop+graphs", "q"),
    ]
    plain = planned_runs(("fused", "reference"), ["flashloop"], None)
    assert [(variant, point) for variant, _, point, _, _ in plain] == [
        ("fused", None),
        ("reference", None),
    ]
    both = planned_runs(("fused",), ["triton", "flashloop"], [("p", a)], speculate=True)
    assert [(entry, point, s) for _, entry, point, _, s in both] == [
        ("triton", None, False),
        ("triton", None, True),
        ("flashloop", "p", False),
        ("flashloop", "p", True),
    ]


EVAL_MODEL = "models/ouro-eval-bytes-20m"


def test_checkpoint_prompts_are_consecutive_windows_of_the_held_out_text():
    from flashloop_backend.config import ConfigError
    from flashloop_backend.host.loader import load_tokenizer
    from flashloop_backend.tools.bench.bench_models import heldout_prompts
    from flashloop_backend.tools.evaluation import heldout_text

    tokenizer = load_tokenizer(EVAL_MODEL)
    prompts, source = heldout_prompts(tokenizer, 300, 3)
    text, described = heldout_text(limit_bytes=400_000)
    assert source == described
    assert [len(p) for p in prompts] == [300, 300, 300]
    assert [t for p in prompts for t in p] == tokenizer.encode(text).ids[:900]
    with pytest.raises(ConfigError, match=r"has \d+ tokens; 4 prompts of 10000000 need 40000000"):
        heldout_prompts(tokenizer, 10_000_000, 4)


def test_a_checkpoint_runs_its_own_layers_and_only_in_e2e(capsys):
    from flashloop_backend.cli.main import EXIT_USAGE, main
    from flashloop_backend.config import ConfigError
    from flashloop_backend.tools.bench.e2e import bench_end_to_end

    with pytest.raises(ConfigError, match=r"layers=2: a checkpoint \(.*\) runs its own layers"):
        bench_end_to_end(["triton"], 64, 1, layers=2, checkpoint=EVAL_MODEL)
    argv = ["bench", "serving", "--backends", "triton", "--model", EVAL_MODEL]
    assert main(argv) == EXIT_USAGE
    assert "--model applies to bench e2e, not bench serving" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({}, r"exit_threshold=0.9 needs a trained checkpoint \(--model\)"),
        ({"checkpoint": EVAL_MODEL, "exit_threshold": 1.5}, r"exit_threshold=1.5 must be in"),
        ({"checkpoint": EVAL_MODEL, "exit_threshold": 0.0}, r"exit_threshold=0.0 must be in"),
    ],
)
def test_the_exit_rule_needs_a_checkpoint_and_a_threshold_in_range(kwargs, fragment):
    from flashloop_backend.config import ConfigError
    from flashloop_backend.tools.bench.e2e import bench_end_to_end

    kwargs = {"exit_threshold": 0.9, **kwargs}
    with pytest.raises(ConfigError, match=fragment):
        bench_end_to_end(["triton"], 64, 1, **kwargs)


def test_the_exit_rule_applies_to_bench_e2e_only(capsys):
    from flashloop_backend.cli.main import EXIT_USAGE, main

    assert main(["bench", "serving", "--exit-threshold", "0.9"]) == EXIT_USAGE
    assert "--exit-threshold applies to bench e2e, not bench serving" in capsys.readouterr().err
