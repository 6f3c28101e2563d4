"""Decode rows in lockstep (``host/decode_depths.py``): a step runs one depth's decode
rows when the backend's decode ops differ by depth, the tokens do not change, and the
depth chosen lets a smaller group meet a larger one within a cycle of the loops."""

import pytest

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
    assert lockstep_depth([]) is None
    assert lockstep_depth([0, 0, 2]) == 0
    assert lockstep_depth([0, 2, 2, 1]) == 2
    assert lockstep_depth([0, 3, 1, 0, 3]) == 3


@pytest.mark.parametrize("start", range(4))
def test_a_smaller_group_meets_the_larger_one_within_a_cycle(start):
    big, small, loops = 0, start, 4
    for _ in range(loops):
        if big == small:
            return
        run = lockstep_depth([big] * 3 + [small] * 2)
        big = (big + 1) % loops if run == big else big
        small = (small + 1) % loops if run == small else small
    assert big == small, f"groups at {big} and {small} after {loops} steps"


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
