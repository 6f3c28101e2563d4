"""Tensor parallelism over heads: a rank's slice of each weight, the refusal of a model
that does not split, and ranks joined by gloo giving the same greedy tokens as one
engine for every feature combination (2 and 4 ranks, spawned processes)."""

import dataclasses
import json

import pytest
import torch

from flashloop_backend.capabilities import SupportRequest
from flashloop_backend.host import Engine, SamplingParams
from flashloop_backend.host.tensor_parallel import (
    TensorParallel,
    run_ranks,
    shard_config,
    shard_model,
    shard_reasons,
    shard_state,
)
from flashloop_backend.registry import Registry

from .host_helpers import TINY, tiny_model
from .test_feature_combinations import COMBINATION_IDS, COMBINATIONS, _config

FOUR_KV_HEADS = {"num_key_value_heads": 4}
PROMPTS = [[(7 * i + 3) % 61 for i in range(n)] for n in (9, 40)]
PARAMS = SamplingParams(max_new_tokens=5, ignore_eos=True)


def _tokens(model, config) -> list[list[int]]:
    cfg = model.config
    request = SupportRequest(
        head_dim=cfg.head_dim,
        block_size=4,
        num_q_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads,
    )
    backend = Registry.discover().create("flashloop", request, config)
    engine = Engine(model, backend, num_blocks=240, block_size=4, prefill_chunk=16)
    return [r.output_token_ids for r in engine.generate(PROMPTS, PARAMS)]


def test_the_ranks_slices_put_together_are_the_whole_weights():
    model = tiny_model(seed=3, **FOUR_KV_HEADS)
    whole = model.state_dict()
    slices = [shard_state(model.config, dict(whole), TensorParallel(r, 4)) for r in range(4)]
    for name, tensor in whole.items():
        parts = [s[name] for s in slices]
        if any(f".{p}." in name for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
            assert torch.equal(torch.cat(parts, dim=0), tensor)
            assert parts[0].shape[0] == tensor.shape[0] // 4
        elif ".o_proj." in name or ".down_proj." in name:
            assert torch.equal(torch.cat(parts, dim=1), tensor)
            assert parts[0].shape[1] == tensor.shape[1] // 4
        else:
            assert all(p is tensor for p in parts)  # shared, not copied
    cfg = shard_config(model.config, 4)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size) == (1, 1, 24)


def test_a_model_that_does_not_split_is_refused_naming_the_value_and_the_counts():
    reasons = shard_reasons(TINY, 4)  # 2 KV heads
    assert reasons == [
        "num_key_value_heads=2 does not split over 4 ranks (rank counts that divide it: [1, 2])"
    ]
    assert shard_reasons(TINY, 2) == []
    assert "must be at least 1" in shard_reasons(TINY, 0)[0]
    with pytest.raises(ValueError, match="num_key_value_heads=2 does not split over 4"):
        shard_config(TINY, 4)
    with pytest.raises(ValueError, match="rank 2 is outside"):
        TensorParallel(2, 2)
    odd = dataclasses.replace(TINY, intermediate_size=90)
    assert "intermediate_size=90 does not split over 4" in shard_reasons(odd, 4)[-1]


def test_a_fused_model_is_refused_before_sharding():
    model = tiny_model(seed=3)
    model.fuse_projections()
    with pytest.raises(ValueError, match="before fuse_projections"):
        shard_model(model, TensorParallel(0, 2))


def _write_rank_tokens(tp, model, out_path: str) -> int:
    """Every combination's tokens on this rank's shard; rank 0 writes them."""
    combinations = zip(COMBINATION_IDS, COMBINATIONS, strict=True)
    tokens = {name: _tokens(model, _config(flags)) for name, flags in combinations}
    if tp.rank == 0:
        with open(out_path, "w") as handle:
            json.dump(tokens, handle)
    return 0


def _rank_tokens(tp, out_path: str, overrides: dict) -> int:
    return _write_rank_tokens(tp, shard_model(tiny_model(seed=7, **overrides), tp), out_path)


# 2 ranks: grouped-query heads (4 query heads over 2 KV heads), each rank a whole group;
# 4 ranks: one query and one KV head each
@pytest.mark.parametrize(("world_size", "overrides"), [(2, {}), (4, FOUR_KV_HEADS)])
def test_ranks_give_one_engines_greedy_tokens_for_every_combination(
    tmp_path, world_size, overrides
):
    out = tmp_path / "tokens.json"
    assert run_ranks(world_size, _rank_tokens, (str(out), overrides), "cpu") == 0
    ranks = json.loads(out.read_text())
    model = tiny_model(seed=7, **overrides)
    for name, flags in zip(COMBINATION_IDS, COMBINATIONS, strict=True):
        assert ranks[name] == _tokens(model, _config(flags)), name


def _rank_embedded_tokens(tp, out_path: str) -> int:
    from flashloop_backend.host.embedded import embedded_model_path
    from flashloop_backend.host.loader import load_model

    model = load_model(embedded_model_path(), "cpu", torch.float32, tp)
    return _write_rank_tokens(tp, model, out_path)


def test_two_ranks_give_the_embedded_models_tokens_for_every_combination(tmp_path):
    from flashloop_backend.host.embedded import embedded_model_path
    from flashloop_backend.host.loader import load_model

    out = tmp_path / "tokens.json"
    assert run_ranks(2, _rank_embedded_tokens, (str(out),), "cpu") == 0
    ranks = json.loads(out.read_text())
    model = load_model(embedded_model_path(), "cpu", torch.float32)
    for name, flags in zip(COMBINATION_IDS, COMBINATIONS, strict=True):
        assert ranks[name] == _tokens(model, _config(flags)), name


def _failing_rank(tp) -> int:
    if tp.rank == 1:
        raise RuntimeError("rank 1 cannot start")
    torch.distributed.barrier()  # would wait for rank 1 forever
    return 0


def test_a_failing_rank_stops_the_others_and_is_named(capfd):
    assert run_ranks(2, _failing_rank, (), "cpu") != 0
    assert (
        "tensor parallel rank 1 failed: RuntimeError: rank 1 cannot start" in capfd.readouterr().err
    )


def _generate_json(capfd, *extra) -> dict:
    from flashloop_backend.cli.main import main

    argv = ["generate", "--prompt", "def fibonacci(n):", "--max-new-tokens", "6", "--json"]
    assert main([*argv, "--config", "configs/all_on.json", *extra]) == 0
    return json.loads(capfd.readouterr().out.strip().splitlines()[-1])


def test_generate_tp_2_gives_the_single_engines_tokens_on_the_embedded_model(capfd):
    alone = _generate_json(capfd)
    ranks = _generate_json(capfd, "--tp", "2")
    assert ranks["output_token_ids"] == alone["output_token_ids"]
    assert ranks["tensor_parallel"] == 2 and "tensor_parallel" not in alone


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (["--tp", "4"], "--tp 4: num_attention_heads=2 does not split over 4 ranks"),
        (["--tp", "2", "--snapshot", "x.snap", "--snapshot-after", "2"], "--tp with --snapshot"),
    ],
)
def test_generate_tp_refuses_what_no_rank_could_run(capsys, extra, fragment):
    from flashloop_backend.cli.main import EXIT_USAGE, main

    argv = ["generate", "--prompt", "x", "--max-new-tokens", "4", *extra]
    assert main(argv) == EXIT_USAGE
    assert fragment in capsys.readouterr().err


def test_a_feature_that_does_not_split_is_refused_when_the_engine_is_built(monkeypatch):
    from flashloop_backend.backends import flashloop_support as flashloop

    declared = dict(flashloop.TENSOR_PARALLEL_SUPPORT, sparse_decode_attention=False)
    monkeypatch.setattr(flashloop, "TENSOR_PARALLEL_SUPPORT", declared)
    model = shard_model(tiny_model(seed=1, **FOUR_KV_HEADS), TensorParallel(0, 1))
    config = _config(dict.fromkeys(declared, True))
    with pytest.raises(ValueError, match="feature 'sparse_decode_attention' does not split"):
        _tokens(model, config)
    model.tensor_parallel = None  # the whole model on one engine is not refused
    assert len(_tokens(model, config)) == len(PROMPTS)


def test_ranks_on_gpus_need_one_gpu_each(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="--tp 2 on cuda needs 2 GPUs; this machine has 1"):
        run_ranks(2, _failing_rank, (), "cuda")
