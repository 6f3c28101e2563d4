"""Decode rows in lockstep (``host/decode_depths.py``): a step runs one depth's decode
rows when the backend's decode ops differ by depth, the tokens do not change, and the
depth chosen lets a smaller group meet a larger one within a cycle of the loops."""

import pytest
import torch

from flashloop_backend import FlashLoopConfig
from flashloop_backend.dispatch import RowMode
from flashloop_backend.host import Engine, SamplingParams
from flashloop_backend.host.decode_depths import lockstep_depth
from flashloop_backend.registry import Registry

from .host_helpers import tiny_model
from .test_feature_combinations import FEATURES, REQUEST

# prompts that finish their loops at different steps, so their tokens start out of phase
PROMPTS = [[(5 * i + 1) % 61 for i in range(n)] for n in (9, 40, 23, 33)]
ALL_ON = FlashLoopConfig(**FEATURES)


def _engine(backend_name, config, **kwargs):
    backend = Registry.discover().create(backend_name, REQUEST, config)
    model = tiny_model(seed=3)
    return Engine(model, backend, num_blocks=240, block_size=4, prefill_chunk=16,
                  max_batch_tokens=20, **kwargs)  # fmt: skip


def _decode_depths_per_step(engine, prompts, params):
    """The tokens, and the set of decode-row depths of every step that had decode rows."""
    seen = []
    schedule = engine._schedule

    def recording():
        groups = schedule()
        depths = {g.depth for g in groups if g.mode != RowMode.PREFILL}
        if depths:
            seen.append(depths)
        return groups

    engine._schedule = recording
    out = engine.generate(prompts, params)
    return [r.output_token_ids for r in out], seen


def test_the_depth_with_most_rows_runs_and_a_tie_goes_to_the_deepest():
    assert lockstep_depth([], patience=4) is None
    assert lockstep_depth([(0, 1, 0), (0, 1, 0), (2, 1, 0)], patience=4) == 0
    assert lockstep_depth([(0, 1, 0), (2, 1, 0), (2, 1, 0), (1, 1, 0)], patience=4) == 2
    assert lockstep_depth([(0, 1, 0), (3, 1, 0), (1, 1, 0), (0, 1, 0), (3, 1, 0)], 4) == 3
    # rows, not requests: a verifying block of 4 rows outweighs three single rows
    assert lockstep_depth([(1, 4, 0), (0, 1, 0), (0, 1, 0), (0, 1, 0)], patience=4) == 1


def test_a_request_held_back_patience_steps_runs_next_the_longest_held_first():
    many = [(0, 1, 0)] * 5
    assert lockstep_depth([*many, (2, 1, 3)], patience=4) == 0
    assert lockstep_depth([*many, (2, 1, 4)], patience=4) == 2
    assert lockstep_depth([*many, (2, 1, 4), (1, 1, 6)], patience=4) == 1


class _EasyTokens(Engine):
    """Every request but request 0 has tokens whose gate fires at loop 1."""

    def _may_exit_early(self, group):
        return super()._may_exit_early(group) and group.request_id != 0


def test_tokens_exiting_early_do_not_starve_a_request_at_a_deeper_depth():
    """Requests 1-3 exit at loop 1 on every token, so their group cycles through depths
    0-1 and never reaches request 0's deeper depths: request 0 runs by the patience rule,
    held back at most ``loops`` steps in a row, and finishes its 4 tokens before the
    others finish their 60 (without the rule it waits for them all). Such a model does
    not align by default."""
    model = tiny_model(seed=3, early_exit_threshold=0.5)
    model.exit_lambda = lambda h: torch.ones(h.shape[0])
    backend = Registry.discover().create("flashloop", REQUEST, ALL_ON)
    engine = _EasyTokens(model, backend, num_blocks=240, block_size=4, prefill_chunk=16,
                         max_batch_tokens=64, align_decode_depths=True)  # fmt: skip
    lengths = (4, 60, 60, 60)
    ids = [engine.add_request(PROMPTS[0], SamplingParams(max_new_tokens=n, ignore_eos=True))
           for n in lengths]  # fmt: skip
    finished, most_held = {}, 0
    while engine.has_unfinished():
        for r in engine.step():
            finished[r.request_id] = engine.steps
        if ids[0] not in finished:
            most_held = max(most_held, engine._requests[ids[0]].held_back)
    loops = engine.cfg.total_ut_steps
    assert most_held <= loops
    assert finished[ids[0]] < min(finished[i] for i in ids[1:])
    default = Engine(model, Registry.discover().create("flashloop", REQUEST, ALL_ON),
                     num_blocks=240, block_size=4, prefill_chunk=16)  # fmt: skip
    assert not default.align_decode_depths


def test_a_backend_whose_ops_or_variants_differ_by_depth_aligns_by_default_and_dense_does_not():
    assert _engine("flashloop", ALL_ON).align_decode_depths
    # one op at every depth, its variant the deepest row's levels
    kv_quant = FlashLoopConfig(kv_residual_quantization=FEATURES["kv_residual_quantization"])
    assert _engine("flashloop", kv_quant).align_decode_depths
    assert not _engine("flashloop", FlashLoopConfig()).align_decode_depths
    assert not _engine("torch", FlashLoopConfig()).align_decode_depths


@pytest.mark.parametrize(
    "backend_name,config", [("flashloop", ALL_ON), ("torch", FlashLoopConfig())]
)
def test_lockstep_steps_hold_one_depth_and_give_the_same_tokens(backend_name, config):
    params = SamplingParams(max_new_tokens=7, ignore_eos=True)
    mixed, mixed_steps = _decode_depths_per_step(
        _engine(backend_name, config, align_decode_depths=False), PROMPTS, params
    )
    aligned, aligned_steps = _decode_depths_per_step(
        _engine(backend_name, config, align_decode_depths=True), PROMPTS, params
    )
    assert aligned == mixed
    assert any(len(depths) > 1 for depths in mixed_steps)  # the prompts do go out of phase
    assert all(len(depths) == 1 for depths in aligned_steps)
