"""Prefix reuse in the host: a prompt that starts with a published prefix shares its BF16
blocks (every depth plane) and runs only the rest, and makes the tokens it makes alone, for
every feature combination; only whole units (block size and selection window) are reused,
a partially shared window is recomputed; the last prompt token always runs; cached
prefixes are evicted when the pool runs short; cancelling a sharing request leaves the
prefix to the cache, and clearing the cache returns every block."""

import pytest

from flashloop_backend.host import SamplingParams

from .host_helpers import tiny_model
from .test_lifecycle import COMBINATIONS, IDS
from .test_lifecycle import _engine as lifecycle_engine

SHARED = [4, 8, 15, 16, 23, 42, 9, 1] * 8  # 64 tokens: four units of 16
PARAMS = SamplingParams(max_new_tokens=6)


def _engine(model, config, prefix_cache=True, num_blocks=200):
    return lifecycle_engine(model, config, prefix_cache, num_blocks)


def _rows(engine, prompt):
    """(tokens, prompt rows computed, every loop counted) of one prompt run to the end."""
    before = engine.counters()["prefill_rows"]
    tokens = engine.generate([prompt], PARAMS)[0].output_token_ids
    return tokens, engine.counters()["prefill_rows"] - before


@pytest.mark.parametrize(("features", "config"), COMBINATIONS, ids=IDS)
def test_a_shared_prefix_runs_once_and_changes_no_token(features, config):
    model = tiny_model(seed=3)
    first, second = [*SHARED, 5, 6, 7], SHARED + [11, 12, 13, 14, 2, 3] * 3
    alone, rows_alone = _rows(_engine(model, config, prefix_cache=False), second)
    engine = _engine(model, config)
    _rows(engine, first)
    tokens, rows = _rows(engine, second)
    assert tokens == alone
    assert engine.prefix_counters() == {
        "prefix_lookups": 2,
        "prefix_hits": 1,
        "prefix_reused_tokens": 64,
    }
    if not config.token_sparse_prefill.enabled:  # every row of the 18-token suffix, 4 loops
        assert (rows_alone, rows) == (82 * 4, 18 * 4)
    else:
        assert rows < rows_alone - 2 * 64  # loops 1-2 alone skip 128 prefix rows
    engine.prefix_cache.clear()
    assert engine.pools()["free_blocks"] == engine.pools()["num_blocks"]


def test_only_whole_units_are_reused_and_the_last_token_always_runs():
    model, config = tiny_model(seed=4), COMBINATIONS[-2][1]  # all on
    engine = _engine(model, config)
    _rows(engine, [*SHARED, 5, 6, 7])
    # 70 shared tokens: the window [64, 80) is shared only in part, so it is recomputed
    partial = [*SHARED, 5, 6, 7, 1, 2, 3, 50, 51]
    tokens, _ = _rows(engine, partial)
    assert engine.prefix_counters()["prefix_reused_tokens"] == 64
    assert tokens == _rows(_engine(model, config, prefix_cache=False), partial)[0]
    # a prompt equal to a published unit prefix: its last unit runs (its last token
    # predicts the first output)
    tokens, _ = _rows(engine, SHARED)
    assert engine.prefix_counters()["prefix_reused_tokens"] == 64 + 48
    assert tokens == _rows(_engine(model, config, prefix_cache=False), SHARED)[0]


def test_cached_prefixes_are_evicted_when_the_pool_runs_short():
    model, config = tiny_model(seed=5), COMBINATIONS[0][1]  # dense
    engine = _engine(model, config, num_blocks=96)  # 24 positions x 4 planes = 96 blocks
    _rows(engine, [*SHARED, 5, 6, 7])
    assert engine.pools()["prefix_blocks"] == 64
    other = [3, 1, 4, 1, 5, 9, 2, 6] * 9  # no shared prefix: needs 80 of the 96 blocks
    tokens, _ = _rows(engine, other)
    assert tokens == _rows(_engine(model, config, prefix_cache=False), other)[0]
    assert engine.prefix_counters()["prefix_hits"] == 0
    assert engine.pools()["prefix_entries"] == 1  # the new prompt's, the old one evicted


def test_a_cancelled_sharing_request_leaves_the_prefix_to_the_cache():
    model, config = tiny_model(seed=6), COMBINATIONS[-2][1]
    engine = _engine(model, config)
    _rows(engine, [*SHARED, 5, 6, 7])
    held = engine.pools()["prefix_blocks"]
    rid = engine.add_request([*SHARED, 9, 9, 9, 9, 9], PARAMS)
    while not engine.has_first_token(rid):
        engine.step()
    engine.cancel(rid)
    pools = engine.pools()
    assert pools["prefix_blocks"] == held and pools["free_blocks"] == 200 - held
    assert (
        _rows(engine, [*SHARED, 5, 6, 7, 8])[0]
        == _rows(_engine(model, config, prefix_cache=False), [*SHARED, 5, 6, 7, 8])[0]
    )
    engine.prefix_cache.clear()
    assert engine.pools()["free_blocks"] == 200


def test_the_cache_is_off_by_default():
    engine = _engine(tiny_model(seed=1), COMBINATIONS[0][1], prefix_cache=False)
    _rows(engine, [*SHARED, 1])
    _, rows = _rows(engine, [*SHARED, 2])
    assert rows == 65 * 4 and "prefix_hits" not in engine.counters()


def test_prompts_arriving_together_wait_for_a_shared_prefix_in_flight():
    """Three prompts with the same 64-token start submitted at once: the first prefills
    it, the others wait until it is published and then compute only their own rows; an
    unrelated prompt is not held back. Each makes the tokens it makes alone."""
    model, config = tiny_model(seed=8), COMBINATIONS[0][1]
    prompts = [[*SHARED, *tail] for tail in ([5, 6, 7], [8, 9], [10, 11, 12, 13])]
    prompts.append([3, 1, 4, 1, 5, 9, 2, 6] * 3)
    engine = _engine(model, config)
    results = engine.generate(prompts, PARAMS)
    assert engine.counters()["prefill_rows"] == (67 + 2 + 4 + 24) * 4
    assert engine.prefix_counters()["prefix_hits"] == 2
    lone = _engine(model, config, prefix_cache=False)
    assert [r.output_token_ids for r in results] == [
        lone.generate([p], PARAMS)[0].output_token_ids for p in prompts
    ]


PACKED = [(f, c) for f, c in COMBINATIONS if c.kv_residual_quantization.enabled]


@pytest.mark.parametrize(("features", "config"), PACKED, ids=["+".join(f) for f, _ in PACKED])
def test_a_prompt_repeating_a_packed_prefix_starts_from_its_pages(features, config):
    """Once a published prompt is packed, a later prompt that repeats it holds the same
    packed pages (compact levels included, in whole packing chunks) instead of packing
    its own copy, and makes the tokens it makes alone. Under ``fixed_prompt`` it needs no
    page for them: it runs while the rest of the pool is taken."""
    model = tiny_model(seed=9)
    engine = lifecycle_engine(model, config, True, 200)
    # appends of 16 rows: a compact level's whole chunks (shareable) fit these prompts
    engine.backend.packed.chunk_rows = 16
    _rows(engine, [*SHARED, 5, 6, 7])
    store = engine.backend.packed.store
    assert engine.pools()["prefix_entries_packed"] == 1
    used = store.accounting()["pages_used"]
    assert used > 0  # the cache holds the packed prefix: no request runs
    published = engine.prefix_cache.lookup([*SHARED, 1])[1].packed.pages
    fixed = config.kv_residual_quantization.policy == "fixed_prompt"
    if fixed:
        store.reserve(-1, store.unreserved_pages())  # another sequence takes the rest
    repeat = engine.add_request([*SHARED, 9, 9], PARAMS)
    while not engine.has_first_token(repeat):
        engine.step()
    engine.step()  # the hand-over: its prompt is packed by now
    assert engine.prefix_counters()["prefix_hits"] == 1  # nothing was evicted for it
    held = store.sequences[repeat].pages
    assert all(
        tuple(level[: len(shared)]) == shared for level, shared in zip(held, published, strict=True)
    )
    if fixed:
        assert store.accounting()["pages_used"] == used  # the same pages, none new
    done = {}
    while engine.has_unfinished():
        done.update({r.request_id: r for r in engine.step()})
    store.unreserve(-1)
    lone = lifecycle_engine(model, config, False, 200)
    lone.backend.packed.chunk_rows = 16
    assert (
        done[repeat].output_token_ids
        == lone.generate([[*SHARED, 9, 9]], PARAMS)[0].output_token_ids
    )
    engine.prefix_cache.clear()
    assert store.accounting()["pages_used"] == 0  # every hold given back


def test_a_compact_prefix_shares_only_whole_packing_chunks():
    """Token-sparse prefill leaves compact levels, whose pages follow the packing's
    appends: with appends of 4096 rows a 64-row prefix shares no packed page (its BF16
    blocks only), and with appends of 16 rows it shares them all."""
    config = COMBINATIONS[-2][1]  # all on
    for chunk, packed in ((4096, 0), (16, 1)):
        engine = lifecycle_engine(tiny_model(seed=9), config, True, 200)
        engine.backend.packed.chunk_rows = chunk
        _rows(engine, [*SHARED, 5, 6, 7])
        assert engine.pools()["prefix_entries_packed"] == packed


def test_a_packed_shortage_evicts_no_entry_whose_pages_a_request_still_holds():
    """Evicting for packed pages drops only entries whose pages nothing else holds: while
    the prompt that packed them runs, its entry stays (dropping it would free nothing),
    and once that prompt has finished the entry gives way."""
    model, config = tiny_model(seed=9), COMBINATIONS[3][1]  # KV quantization alone
    engine = lifecycle_engine(model, config, True, 200)
    store = engine.backend.packed.store
    first = engine.add_request([*SHARED, 5, 6, 7], SamplingParams(max_new_tokens=12))
    while not engine.has_first_token(first):
        engine.step()
    engine.step()  # handed over: the entry holds its packed rows
    assert engine.pools()["prefix_entries_packed"] == 1
    store.reserve(-1, store.unreserved_pages())
    other = [3, 1, 4, 1, 5, 9, 2, 6] * 9
    waiting = engine.add_request(other, PARAMS)
    engine.step()
    assert engine.output_count(waiting) == 0 and engine.pools()["prefix_entries_packed"] == 1
    done = {}
    while engine.has_unfinished():
        done.update({r.request_id: r for r in engine.step()})
    assert engine.prefix_cache.lookup([*SHARED, 1])[1] is None  # evicted once it freed pages
    lone = lifecycle_engine(model, config, False, 200)
    assert done[waiting].output_token_ids == lone.generate([other], PARAMS)[0].output_token_ids


def test_a_restored_request_short_of_packed_pages_evicts_cached_prefixes():
    """A request that adopted a cached prefix's pages, saved and cancelled, is restored
    onto pages of its own: with the rest of the pool taken, the cached prefix gives way."""
    model, config = tiny_model(seed=9), COMBINATIONS[3][1]
    engine = lifecycle_engine(model, config, True, 200)
    _rows(engine, [*SHARED, 5, 6, 7])
    store = engine.backend.packed.store
    store.reserve(-1, store.unreserved_pages())
    repeat = engine.add_request([*SHARED, 9, 9], PARAMS)
    while engine.output_count(repeat) < 2:
        engine.step()
    snapshot = engine.snapshot(repeat)
    engine.cancel(repeat)
    restored = engine.restore(snapshot)
    assert engine.pools()["prefix_entries_packed"] == 0  # it gave its pages way
    done = {}
    while engine.has_unfinished():
        done.update({r.request_id: r for r in engine.step()})
    lone = lifecycle_engine(model, config, False, 200)
    assert (
        done[restored].output_token_ids
        == lone.generate([[*SHARED, 9, 9]], PARAMS)[0].output_token_ids
    )


def test_a_request_short_of_packed_pages_evicts_cached_packed_prefixes():
    """A prompt that shares nothing and finds the packed pool short evicts cached prefixes
    that hold packed pages (least recently used first) and runs on the pages they free."""
    model, config = tiny_model(seed=9), COMBINATIONS[3][1]
    engine = lifecycle_engine(model, config, True, 200)
    _rows(engine, [*SHARED, 5, 6, 7])
    store = engine.backend.packed.store
    store.reserve(-1, store.unreserved_pages())
    other = [3, 1, 4, 1, 5, 9, 2, 6] * 9
    tokens, _ = _rows(engine, other)
    assert engine.prefix_counters()["prefix_hits"] == 0
    lone = lifecycle_engine(model, config, False, 200)
    assert tokens == lone.generate([other], PARAMS)[0].output_token_ids
    assert engine.pools()["prefix_entries"] == 1  # the new prompt's own entry; SHARED's is gone
    assert engine.prefix_cache.lookup([*SHARED, 1])[1] is None


def test_blocks_two_entries_share_count_as_held_by_the_cache_alone():
    """Two published prompts with a common start hold its blocks together: once no
    request runs, every cached block is the cache's alone (``kv_held`` leaves them out)."""
    engine = _engine(tiny_model(seed=2), COMBINATIONS[0][1])
    _rows(engine, [*SHARED, *[5] * 20])
    _rows(engine, [*SHARED, *[9] * 20])
    pools = engine.pools()
    assert pools["prefix_entries"] == 2 and pools["live_requests"] == 0
    assert pools["prefix_blocks_cache_only"] == pools["prefix_blocks"]
    assert pools["free_blocks"] + pools["prefix_blocks"] == pools["num_blocks"]
    assert engine.kv_held() == (0, 0)
