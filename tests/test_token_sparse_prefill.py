"""Token-sparse prefill: reference selection, device windows, and the host against the
naive model running the RFC algorithm."""

import pytest
import torch

from flashloop_backend import ConfigError, FlashLoopConfig
from flashloop_backend.algorithms import retention_budget, select_tokens, token_change_scores
from flashloop_backend.algorithms.token_selection import select_in_windows
from flashloop_backend.capabilities import SupportRequest
from flashloop_backend.host import Engine, SamplingParams
from flashloop_backend.host.kvcache import PagedKVCache
from flashloop_backend.host.naive import NaiveOuro
from flashloop_backend.host.prompt_schedule import PromptSchedule
from flashloop_backend.registry import Registry

from .host_helpers import tiny_model

REQUEST = SupportRequest(head_dim=16, block_size=4, num_q_heads=4, num_kv_heads=2)
PROMPT = [1, 5, 9, 3, 22, 7, 8, 2, 40, 11, 12, 4, 4, 17, 30, 2, 2, 9, 50, 1, 19] * 2


def test_rfc_eight_token_example():
    """Window of 8, budgets 4 then 2: loop 3 runs t2 t4 t6 t8, loop 4 runs t4 t8."""
    scores3 = torch.tensor([0.1, 0.9, 0.2, 0.8, 0.3, 0.7, 0.1, 0.6])
    everyone = torch.ones(8, dtype=torch.bool)
    loop3 = select_tokens(scores3, everyone, retention_budget(0.5, 8, 8))
    assert loop3.nonzero().flatten().tolist() == [1, 3, 5, 7]
    scores4 = torch.tensor(
        [0.9, 0.2, 0.9, 0.8, 0.9, 0.1, 0.9, 0.5]
    )  # inactive tokens may score high
    loop4 = select_tokens(scores4, loop3, retention_budget(0.25, 8, 4))
    assert loop4.nonzero().flatten().tolist() == [3, 7]
    for scores, eligible, ratio, expected in (
        (scores3, everyone, 0.5, loop3),
        (scores4, loop3, 0.25, loop4),
    ):
        assert torch.equal(select_in_windows(scores, eligible, ratio, 8), expected)


def test_budget_rounding_nesting_and_ties():
    assert retention_budget(0.1, 21, 21) == 3  # ceil(2.1)
    assert retention_budget(0.1, 30, 30) == 3  # 0.1 * 30 is not 3.0000000000000004 here
    assert retention_budget(0.25, 8, 1) == 1  # never more than the previous active set
    assert retention_budget(0.01, 8, 8) == 1  # at least one token
    tied = select_tokens(torch.zeros(6), torch.ones(6, dtype=torch.bool), 2)
    assert tied.nonzero().flatten().tolist() == [0, 1]  # the earlier position wins
    last_low = torch.tensor([0.5, 0.4, 0.3, 0.0])
    assert not select_tokens(last_low, torch.ones(4, dtype=torch.bool), 2)[
        -1
    ]  # no reserved last slot
    with pytest.raises(ValueError, match="ratio=0"):
        retention_budget(0.0, 8, 8)


def test_device_windows_match_the_reference_window_by_window():
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        length = int(torch.randint(1, 50, (1,), generator=gen))
        window = int(torch.randint(1, 16, (1,), generator=gen))
        scores = torch.randint(0, 4, (length,), generator=gen).float()  # many ties
        eligible = torch.rand(length, generator=gen) < 0.7
        ratio = float(torch.rand(1, generator=gen)) * 0.9 + 0.05
        expected = torch.zeros(length, dtype=torch.bool)
        for start in range(0, length, window):
            part = eligible[start : start + window]
            if part.any():
                budget = retention_budget(ratio, part.numel(), int(part.sum()))
                expected[start : start + window] = select_tokens(
                    scores[start : start + window], part, budget
                )
        chosen = select_in_windows(scores, eligible, ratio, window)
        assert torch.equal(chosen, expected)
        assert not (chosen & ~eligible).any()  # nested


def test_scores():
    h1 = torch.tensor([[3.0, 4.0], [0.0, 0.0]])
    h0 = torch.tensor([[0.0, 0.0], [1.0, 0.0]])
    assert token_change_scores(h1, h0).tolist() == pytest.approx([1.0, 1e6])


def test_schedule_drops_tokens_like_early_exits():
    kv = PagedKVCache(16, 1, 4, 1, 2, num_depths=4, dtype=torch.float32, device="cpu")
    kv.reserve(0, 8)
    for depth in range(4):
        kv.write(
            0,
            torch.tensor(kv.slots(0, depth, list(range(8)))),
            torch.full((8, 1, 2), float(depth)),
            torch.zeros(8, 1, 2),
        )
    sparsity = FlashLoopConfig(
        token_sparse_prefill={"enabled": True, "window_size": 16, "retention": [1, 1, 0.5, 0.25]}
    ).token_sparse_prefill
    schedule = PromptSchedule(8, sparsity, 4, "cpu")
    h0, h1 = torch.ones(8, 2), torch.ones(8, 2)
    schedule.finish_depth(0, h0, kv, 0)
    h1[:, 0] = torch.tensor([1.0, 9, 1, 9, 1, 9, 1, 9])  # odd positions change, even do not
    schedule.finish_depth(1, h1, kv, 0)  # selection before loop 3, queued
    block, offset = divmod(kv.slots(0, 3, [0])[0], 4)
    assert kv.key_pool[block, 0, offset].tolist() == [[3.0, 3.0]]  # nothing retired yet
    assert len(schedule.active_history) == 2 and schedule.active_counts == [8, 8]
    assert not schedule.ready()  # the host has not read from the device since
    assert len(schedule.active_history) == 2
    schedule.device_read()  # a step's tokens read: the selection's copy has run
    assert schedule.ready()
    assert schedule.active_counts == [8, 8, 4] and len(schedule.active_history) == 3
    assert schedule.positions == [1, 3, 5, 7]
    assert schedule.chunk(0, 4) == (1, (1, 3, 5, 7))
    assert schedule.chunk(1, 1) == (3, ())
    assert schedule.rows(1, 2).tolist() == [3, 5]
    assert kv.key_pool[block, 0, offset].tolist() == [[1.0, 1.0]]  # depth-1 K inherited by plane 3


def _engine(model, config, **kwargs):
    backend = Registry.discover().create("flashloop", REQUEST, config)
    kwargs.setdefault("prefill_chunk", 64)
    return Engine(model, backend, num_blocks=160, block_size=4, **kwargs)


def _sparse(window, **extra):
    return FlashLoopConfig(
        token_sparse_prefill={
            "enabled": True,
            "window_size": window,
            "retention": [1, 1, 0.5, 0.25],
        },
        **extra,
    )


@pytest.mark.parametrize("window", [16, 64])
def test_host_matches_naive_algorithm(window):
    model = tiny_model(seed=1)
    config = _sparse(window)
    naive = NaiveOuro(
        model.config, dict(model.state_dict()), token_sparsity=config.token_sparse_prefill
    )
    result = _engine(model, config).generate([PROMPT], SamplingParams(max_new_tokens=8))[0]
    assert result.output_token_ids == naive.generate(PROMPT, 8)[0]
    dense = _engine(model, FlashLoopConfig()).generate([PROMPT], SamplingParams(max_new_tokens=8))[
        0
    ]
    assert result.output_token_ids != dense.output_token_ids  # the approximation is active


def test_windows_split_over_submissions_equal_atomic_and_batching_is_invisible():
    model = tiny_model(seed=3)
    prompts = [PROMPT, PROMPT[5:30], PROMPT[::-1]]
    atomic = [
        r.output_token_ids
        for r in _engine(model, _sparse(16), prefill_chunk=64).generate(
            prompts, SamplingParams(max_new_tokens=5)
        )
    ]
    split = _engine(model, _sparse(16), prefill_chunk=16, max_batch_tokens=20, pad_to_multiple=8)
    assert [
        r.output_token_ids for r in split.generate(prompts, SamplingParams(max_new_tokens=5))
    ] == atomic
    alone = [
        _engine(model, _sparse(16))
        .generate([p], SamplingParams(max_new_tokens=5))[0]
        .output_token_ids
        for p in prompts
    ]
    assert alone == atomic


def test_a_queued_selection_is_taken_after_a_device_read_or_a_tokens_loops(monkeypatch):
    """A depth's selection is taken at the first schedule after the host read the step's
    tokens (which waited for its copy); without such a read, at the fourth step that asks
    (a token's loops), and at once when nothing else would run. Its prompt sits out the
    steps before while the other rows run, and the tokens are those of each prompt
    alone."""
    from flashloop_backend.host import prompt_schedule

    model = tiny_model(seed=3)
    prompts = [PROMPT[5:30], PROMPT, PROMPT[::-1]]
    params = SamplingParams(max_new_tokens=6)
    real_ready = prompt_schedule.PromptSchedule.ready
    asked: list[tuple[object, bool, bool, bool]] = []  # (selection, arrived, wait, taken)

    def ready(self, wait=False):
        pending = self._pending
        arrived = pending is not None and pending.arrived
        taken = real_ready(self, wait)
        if pending is not None:
            asked.append((pending, arrived, wait, taken))
        return taken

    monkeypatch.setattr(prompt_schedule.PromptSchedule, "ready", ready)

    def looks() -> list[list[tuple[bool, bool, bool]]]:
        selections = list(dict.fromkeys(entry[0] for entry in asked))
        return [[entry[1:] for entry in asked if entry[0] is s] for s in selections]

    not_yet = (False, False, False)
    engine = _engine(model, _sparse(16), prefill_chunk=16, max_batch_tokens=20)
    together = [r.output_token_ids for r in engine.generate(prompts, params)]
    assert len(looks()) == 2 * len(prompts)  # before loops 3 and 4 of each prompt
    for seen in looks():
        assert len(seen) <= 4 and all(look == not_yet for look in seen[:-1])
        assert seen[-1][2]  # taken
    ends = {seen[-1] for seen in looks()}
    assert (True, False, True) in ends  # after the tokens' read (other prompts decoding)
    assert [not_yet] * 3 + [(False, False, True)] in looks()  # no read: the fourth ask
    asked.clear()
    alone = [
        _engine(model, _sparse(16), prefill_chunk=16, max_batch_tokens=20)
        .generate([p], params)[0]
        .output_token_ids
        for p in prompts
    ]
    for seen in looks():  # nothing else to run: the engine waits for it
        assert seen == [not_yet, (False, True, True)]
    assert together == alone


@pytest.mark.parametrize("speculate", [False, True])
def test_a_selection_is_taken_after_the_reads_of_requests_decoding_meanwhile(
    monkeypatch, speculate
):
    """A prompt that arrives while another request decodes (plainly, or drafting and
    verifying blocks) takes each of its selections after a host read of that request's
    tokens, drafts or acceptances, never at the fallback ask."""
    from flashloop_backend.host import prompt_schedule
    from flashloop_backend.host.speculation import SpeculationSettings

    model = tiny_model(seed=3)
    taken: list[bool] = []  # per selection: whether a device read came before it
    real_ready = prompt_schedule.PromptSchedule.ready

    def ready(self, wait=False):
        pending = self._pending
        done = real_ready(self, wait)
        if pending is not None and done:
            taken.append(pending.arrived)
        return done

    monkeypatch.setattr(prompt_schedule.PromptSchedule, "ready", ready)
    extra = {"speculation": SpeculationSettings(block_size=2)} if speculate else {}
    engine = _engine(model, _sparse(16), prefill_chunk=16, max_batch_tokens=24, **extra)
    engine.add_request(PROMPT[:16], SamplingParams(max_new_tokens=60, ignore_eos=True))
    for _ in range(12):  # the first request is decoding before the second arrives
        engine.step()
    engine.add_request(PROMPT, SamplingParams(max_new_tokens=2, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    # the first prompt's two alone (nothing to read from: waited for), then the second's
    assert taken == [False, False, True, True]


def test_full_retention_is_dense():
    model = tiny_model(seed=4)
    keep_all = FlashLoopConfig(
        token_sparse_prefill={"enabled": True, "window_size": 16, "retention": [1, 1, 1, 1]}
    )
    a = (
        _engine(model, keep_all)
        .generate([PROMPT], SamplingParams(max_new_tokens=6))[0]
        .output_token_ids
    )
    b = (
        _engine(model, FlashLoopConfig())
        .generate([PROMPT], SamplingParams(max_new_tokens=6))[0]
        .output_token_ids
    )
    assert a == b


def test_with_sparse_decode_matches_naive():
    model = tiny_model(seed=1)
    config = _sparse(16, sparse_decode_attention={"enabled": True, "key_retention": 0.2})
    naive = NaiveOuro(
        model.config,
        dict(model.state_dict()),
        key_retention=0.2,
        token_sparsity=config.token_sparse_prefill,
    )
    result = _engine(model, config).generate([PROMPT], SamplingParams(max_new_tokens=6))[0]
    assert result.output_token_ids == naive.generate(PROMPT, 6)[0]


def test_incompatible_geometry_names_both_settings():
    with pytest.raises(
        ConfigError, match=r"prefill_chunk=24 .* token_sparse_prefill.window_size=16"
    ):
        _engine(tiny_model(), _sparse(16), prefill_chunk=24)
    with pytest.raises(ConfigError, match="num_loops=3 differs from the model's total_ut_steps=4"):
        config = FlashLoopConfig(
            num_loops=3,
            token_sparse_prefill={"enabled": True, "window_size": 16, "retention": [1, 1, 0.5]},
        )
        _engine(tiny_model(), config)


def test_a_sparse_chunk_is_one_row_group_with_its_positions():
    from flashloop_backend.dispatch import RowMode
    from flashloop_backend.host.batch import RowGroup, build_batch

    kv = PagedKVCache(32, 1, 4, 1, 2, 4, torch.float32, "cpu")
    kv.reserve(0, 16)
    group = RowGroup(0, RowMode.PREFILL, 2, 1, 3, span=(1, 6, 7))
    view = build_batch([group], kv, "cpu").view
    assert view.positions.tolist() == [1, 6, 7]
    assert view.context_lengths.tolist() == [2, 7, 8]
    assert RowGroup(0, RowMode.PREFILL, 0, 4, 2).positions() == [4, 5]
    for start, count in ((2, 3), (1, 2)):
        with pytest.raises(ValueError, match=f"span of 3 positions from 1 .*start={start}"):
            RowGroup(0, RowMode.PREFILL, 2, start, count, span=(1, 6, 7))


def test_a_schedule_keeps_host_copies_of_its_masks_restored_or_selected():
    """Packing reads the masks on the host: a restored history keeps the snapshot's host
    masks, and a mask is copied from the device once, whatever asks for it again."""
    from flashloop_backend.config import TokenSparsePrefillConfig
    from flashloop_backend.host.prompt_schedule import PromptSchedule

    sparsity = TokenSparsePrefillConfig(enabled=True, window_size=16, retention=[1, 1, 0.5, 0.25])
    schedule = PromptSchedule(32, sparsity, 4, "cpu")
    masks = [torch.rand(32) > 0.5 for _ in range(3)]
    schedule.restore_history(masks)
    assert all(schedule.active_on_host(d) is masks[d] for d in range(3))
    assert all(torch.equal(schedule.active_history[d], masks[d]) for d in range(3))
    fresh = PromptSchedule(32, sparsity, 4, "cpu")
    fresh.active_history.append(masks[0].clone())
    first = fresh.active_on_host(1)
    assert fresh.active_on_host(1) is first and torch.equal(first, masks[0])
