"""KV residual quantization end to end in the host (fixed_prompt): the packed store and
its reader give what the reconstruction written into BF16 planes gives, the prompt's BF16
blocks are freed, and every page comes back."""

import pytest
import torch

from flashloop_backend import ConfigError, FlashLoopConfig
from flashloop_backend.capabilities import SupportRequest
from flashloop_backend.host import Engine, SamplingParams
from flashloop_backend.registry import Registry

from .host_helpers import tiny_model
from .quant_oracle import fake_quantize_prompt

REQUEST = SupportRequest(head_dim=16, block_size=4, num_q_heads=4, num_kv_heads=2)
PROMPT = [1, 5, 9, 3, 22, 7, 8, 2, 40, 11, 12, 4, 4, 17, 30, 2, 2, 9, 50, 1, 19, 6, 13, 27] * 2
QUANT = {"enabled": True, "group_size": 16}
SPARSE = {"enabled": True, "window_size": 16, "retention": [1, 1, 0.5, 0.25]}


def _engine(model, config, block_size=4, prefill_chunk=32, **kwargs):
    backend = Registry.discover().create("flashloop", REQUEST, config)
    return Engine(
        model, backend, num_blocks=200, block_size=block_size, prefill_chunk=prefill_chunk, **kwargs
    )


def _logprobs(engine, prompt, forced):
    return engine.generate([prompt], forced=[forced], keep_logprobs=True)[0].logprobs


SPARSE_DECODE = {"enabled": True, "key_retention": 0.3}


def test_a_chunk_packs_its_final_rows_after_the_step_samples(monkeypatch):
    """In a step that decodes one request and runs a last-loop chunk of another's prompt
    (not the prompt's last chunk), the sampling read comes before the chunk's packing, so
    the decoded token does not wait for the conversion; the depth's last chunk packs
    before its depth ends."""
    from flashloop_backend.backends import packed_state
    from flashloop_backend.host import engine_steps

    monkeypatch.setattr(packed_state, "PACK_CHUNK_ROWS", 16)
    model = tiny_model(seed=2)
    engine = _engine(model, FlashLoopConfig(kv_residual_quantization=QUANT), prefill_chunk=16)
    events = []
    choose, pack = engine_steps.choose_tokens, type(engine.backend).prompt_rows_done

    def sampled(*args, **kwargs):
        events.append("sample")
        return choose(*args, **kwargs)

    def packed(self, request_id, kv, rows):
        events.append(("pack", request_id, rows))
        return pack(self, request_id, kv, rows)

    monkeypatch.setattr(engine_steps, "choose_tokens", sampled)
    monkeypatch.setattr(type(engine.backend), "prompt_rows_done", packed)
    first = engine.add_request(PROMPT[:16], SamplingParams(max_new_tokens=40))
    while not engine.has_first_token(first):
        engine.step()
    second = engine.add_request(PROMPT + PROMPT[:20], SamplingParams(max_new_tokens=2))
    seen = []  # (rows final, packed after the sampling read)
    while not engine.has_first_token(second):
        events.clear()
        engine.step()
        mine = [e for e in events if e != "sample" and e[1] == second]
        if mine and "sample" in events:
            seen.append((mine[0][2], events.index("sample") < events.index(mine[0])))
    total = len(PROMPT) + 20
    assert any(rows < total for rows, _ in seen) and seen[-1] == (total, False), seen
    assert all(after for rows, after in seen if rows < total), seen
    assert engine.backend.packed.packed_rows(second) == 64


@pytest.mark.parametrize(
    "extra",
    [{}, {"token_sparse_prefill": SPARSE}, {"sparse_decode_attention": SPARSE_DECODE},
     {"token_sparse_prefill": SPARSE, "sparse_decode_attention": SPARSE_DECODE}],
    ids=["dense_levels", "token_sparse", "sparse_decode", "all_three"],
)  # fmt: skip
def test_packed_path_equals_the_reconstruction_in_bf16_planes(extra):
    """Every read of packed KV (decode, loop-2 source, sparse correction) sees what the
    reference reconstruction written into BF16 planes gives."""
    model = tiny_model(seed=2)
    forced = [3, 9, 27, 1, 4, 8]
    packed = _logprobs(_engine(model, FlashLoopConfig(kv_residual_quantization=QUANT, **extra)),
                       PROMPT, forced)  # fmt: skip
    simulated_engine = _engine(model, FlashLoopConfig(**extra))
    quant = FlashLoopConfig(kv_residual_quantization=QUANT).kv_residual_quantization
    simulated_engine.on_prompt_done = lambda eng, req: fake_quantize_prompt(eng, req, quant)
    simulated = _logprobs(simulated_engine, PROMPT, forced)
    dense = _logprobs(_engine(model, FlashLoopConfig(**extra)), PROMPT, forced)
    torch.testing.assert_close(packed, simulated, atol=1e-4, rtol=1e-4)
    assert (packed - dense).abs().max() > 1e-3  # the quantization is really in the path


def test_prompt_blocks_are_freed_and_pages_come_back():
    model = tiny_model(seed=2)
    engine = _engine(model, FlashLoopConfig(kv_residual_quantization=QUANT))
    rid = engine.add_request(PROMPT + PROMPT[:5], SamplingParams(max_new_tokens=3))  # 53 tokens
    engine.step()
    # 56 rows in 14 blocks of 4: the first plane now, 2 blocks past the 48 packed rows
    # promised to each later plane, which takes the 12 blocks of those rows from the one before
    assert (engine.kv.free_blocks, engine.kv.promised_blocks) == (200 - 14 - 3 * 2, 3 * 2)
    while engine._requests[rid].phase != "decode":
        engine.step()
    store = engine.backend.packed.store
    # the prompt's last prefill step packs it; its BF16 blocks go when the next step starts
    assert engine.has_first_token(rid)
    assert store.accounting()["pages_used"] == 4 * 3  # 48 of 53 rows: 3 groups x 4 levels
    assert (engine.kv.free_blocks, engine.kv.promised_blocks) == (200 - 14 - 3 * 2, 0)
    engine.step()
    for depth in range(4):
        table = engine.kv.block_table(rid, depth)
        assert table[:12] == [-1] * 12 and min(table[12:]) >= 0  # rows 48.. stay BF16
    assert engine.kv.free_blocks == 200 - 4 * 2
    while engine.has_unfinished():
        engine.step()
    assert store.accounting()["pages_used"] == 0 and engine.kv.free_blocks == 200


def test_a_request_that_ends_on_its_first_token_is_never_packed():
    """Its prompt would be handed over when the next step starts, but it has left by then:
    its reserved pages come back without an encoding."""
    model = tiny_model(seed=2)
    engine = _engine(model, FlashLoopConfig(kv_residual_quantization=QUANT))
    engine.generate([PROMPT], SamplingParams(max_new_tokens=1))
    store = engine.backend.packed.store
    assert store.sequences == {} and store.accounting()["pages_used"] == 0
    assert store.unreserved_pages() == store.num_pages and engine.kv.free_blocks == 200


def test_short_prompts_and_mixed_batches_run():
    model = tiny_model(seed=5)
    prompts = [PROMPT[:10], PROMPT, PROMPT[3:40]]
    config = FlashLoopConfig(kv_residual_quantization=QUANT)
    together = [
        r.output_token_ids
        for r in _engine(model, config, pad_to_multiple=8).generate(prompts, SamplingParams(max_new_tokens=4))
    ]  # fmt: skip
    alone = [
        _engine(model, config).generate([p], SamplingParams(max_new_tokens=4))[0].output_token_ids
        for p in prompts
    ]
    assert together == alone


def test_group_size_must_cover_whole_blocks():
    with pytest.raises(
        ConfigError, match="group_size=16 must be a multiple of the KV block_size=32"
    ):
        _engine(tiny_model(), FlashLoopConfig(kv_residual_quantization=QUANT), block_size=32)


def test_effective_config_carries_the_encoding_descriptor():
    from flashloop_backend.registry import resolve

    plain = resolve(FlashLoopConfig(), "flashloop", REQUEST)
    packed = resolve(FlashLoopConfig(kv_residual_quantization=QUANT), "flashloop", REQUEST)
    both = resolve(
        FlashLoopConfig(kv_residual_quantization=QUANT, token_sparse_prefill=SPARSE), "flashloop", REQUEST
    )  # fmt: skip
    assert plain.kv_encoding is None
    assert (
        packed.kv_encoding["version"] == 3 and packed.kv_encoding["window_policy"] == "fixed_prompt"
    )
    assert "16 token rows" in packed.kv_encoding["k_groups"]
    assert both.kv_encoding["token_sparse_depths"].startswith("compact")
    assert '"kv_encoding":{"bits":4' in packed.canonical_json()  # part of the digest


ROLLING = {"enabled": True, "group_size": 16, "policy": "rolling", "tail_size": 16}


def test_rolling_keeps_a_bounded_bf16_tail_and_flushes_whole_groups():
    model = tiny_model(seed=2)
    engine = _engine(model, FlashLoopConfig(kv_residual_quantization=ROLLING))
    prompt = PROMPT[:40]
    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=30, ignore_eos=True))
    packed = engine.backend.packed
    tails, flushes = [], 0
    while engine.has_unfinished():
        before = packed.packed_rows(rid)
        engine.step()
        if rid not in engine._requests or engine._requests[rid].phase != "decode":
            continue
        r = engine._requests[rid]
        final_rows = len(r.prompt) + len(r.exit_depths)
        rows = packed.packed_rows(rid)
        flushes += rows > before and before > 0
        tails.append(final_rows - rows)
        blocks = engine.kv.block_table(rid, 3)
        freed = len(tails) > 1  # the packed rows' blocks go when the next step starts
        assert (blocks[: rows // 4] == [-1] * (rows // 4)) == freed and min(
            blocks[rows // 4 :]
        ) >= 0
    # the prompt's last prefill step packs 16 of its 40 rows (24 stay in BF16); afterwards
    # the tail is 16..31 rows: 31 final rows + one more token -> 32 -> one group flushed -> 16
    assert tails[:2] == [24, 24] and all(16 <= t <= 31 for t in tails)
    assert 31 in tails and flushes == 2
    assert packed.store.accounting()["pages_used"] == 0  # finished: every page came back


def test_rolling_with_a_tail_longer_than_the_request_is_dense():
    model = tiny_model(seed=2)
    huge = dict(ROLLING, tail_size=128)
    forced = [3, 9, 27, 1]
    rolling = _logprobs(
        _engine(model, FlashLoopConfig(kv_residual_quantization=huge)), PROMPT, forced
    )
    dense = _logprobs(_engine(model, FlashLoopConfig()), PROMPT, forced)
    # nothing is packed: only the reader (another summation order) differs
    torch.testing.assert_close(rolling, dense, atol=2e-4, rtol=2e-4)


def test_rolling_mixed_batches_equal_one_by_one():
    model = tiny_model(seed=5)
    prompts = [PROMPT[:10], PROMPT, PROMPT[3:40]]
    config = FlashLoopConfig(kv_residual_quantization=ROLLING, token_sparse_prefill=SPARSE)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    together = [
        r.output_token_ids
        for r in _engine(model, config, pad_to_multiple=8).generate(prompts, params)
    ]
    alone = [_engine(model, config).generate([p], params)[0].output_token_ids for p in prompts]
    assert together == alone


def test_prompt_packs_in_bounded_chunks_like_one_shot(monkeypatch):
    """Chunked conversion appends at most ``chunk`` rows at a time; with dense levels the
    pages hold the same groups, so the log-probs are those of packing the prompt at once."""
    from flashloop_backend.backends import packed_state
    from flashloop_backend.host import engine as engine_module

    model = tiny_model(seed=2)
    forced = [3, 9, 27, 1, 4, 8]
    config = FlashLoopConfig(kv_residual_quantization=QUANT)
    whole = _logprobs(_engine(model, config), PROMPT, forced)
    gathered = []
    gather = engine_module.PagedKVCache.plane_rows

    def spy(self, request_id, start, end, depths=None):
        gathered.append((end - start, depths))
        return gather(self, request_id, start, end, depths)

    monkeypatch.setattr(engine_module.PagedKVCache, "plane_rows", spy)
    monkeypatch.setattr(packed_state, "PACK_CHUNK_ROWS", 16)
    chunked = _logprobs(_engine(model, config), PROMPT, forced)
    # 48 prompt rows, groups of 16, one level at a time
    assert sorted(gathered, key=lambda g: g[1].start) == [
        (16, range(d, d + 1)) for d in range(4) for _ in range(3)
    ]
    torch.testing.assert_close(chunked, whole, atol=0, rtol=0)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="chunk=24 must be a multiple of group_size=16"):
        _engine(model, config).backend.packed.pack_prompt(0, None, chunk=24)


@pytest.mark.parametrize("extra", [{}, {"token_sparse_prefill": SPARSE}], ids=["dense", "sparse"])
def test_the_last_loop_packs_chunk_by_chunk_as_at_hand_over(monkeypatch, extra):
    """Each prefill chunk of the prompt's last loop packs the appends its final rows
    complete, in that step; the pages (compact levels and maps included) are those a
    packing of the whole prompt at hand-over writes, and so are the log-probs."""
    from flashloop_backend.backends import packed_state

    monkeypatch.setattr(packed_state, "PACK_CHUNK_ROWS", 16)
    model = tiny_model(seed=2)
    config = FlashLoopConfig(kv_residual_quantization=QUANT, **extra)
    prompt, forced = PROMPT + PROMPT[:20], [3, 9, 27, 1]  # 68 rows: 64 packed

    def run(engine):
        rid = engine.add_request(prompt, SamplingParams(max_new_tokens=len(forced)))
        packed_in_prefill = []
        while not engine.has_first_token(rid):
            engine.step()
            r = engine._requests[rid]
            packed_in_prefill.append((r.depth, engine.backend.packed.packed_rows(rid)))
        engine.step()  # hand-over: the BF16 blocks of the packed rows go
        return engine.backend.export_request(rid), packed_in_prefill

    early, steps = run(_engine(model, config, prefill_chunk=16))
    # prefill_chunk 16: rows are packed after a chunk of the last loop that is not its last
    assert any(depth == 3 and rows > 0 for depth, rows in steps) and steps[-1][1] == 64
    monkeypatch.setattr(
        type(_engine(model, config).backend), "prompt_rows_done", lambda *args: None
    )
    late, late_steps = run(_engine(model, config, prefill_chunk=16))
    assert all(rows == 0 for _, rows in late_steps)  # packed when the next step starts
    assert sorted(early) == sorted(late)
    for name, tensor in early.items():
        assert torch.equal(tensor, late[name]), name


@pytest.mark.parametrize(
    "extra",
    [{}, {"token_sparse_prefill": SPARSE}, {"sparse_decode_attention": SPARSE_DECODE},
     {"token_sparse_prefill": SPARSE, "sparse_decode_attention": SPARSE_DECODE},
     {"policy": "rolling"}],
    ids=["dense_levels", "token_sparse", "sparse_decode", "all_three", "rolling"],
)  # fmt: skip
def test_planes_carried_from_loop_to_loop_give_the_pages_and_logprobs_of_kept_planes(extra):
    """A prompt packed one depth at a time as its loops end, each plane's packed rows
    passed on to the next loop's plane (inactive rows read there as inherited), stores the
    bytes, maps and marks of a prompt that keeps a plane per loop and packs once every loop
    ran, and gives the same log-probs; a prompt ending mid-group and a chunked prefill."""
    model = tiny_model(seed=2)
    quant = QUANT | ({"policy": "rolling", "tail_size": 16} if "policy" in extra else {})
    extra = {k: v for k, v in extra.items() if k != "policy"}
    config = FlashLoopConfig(kv_residual_quantization=quant, **extra)
    prompt, forced = PROMPT + PROMPT[:21], [3, 9, 27, 1, 4, 8]  # 69 rows

    def run(carry):
        engine = _engine(model, config, prefill_chunk=32)
        engine.carry_planes = carry
        rid = engine.add_request(prompt, forced=forced, keep_logprobs=True)
        carried, results = [], []
        while not engine.has_first_token(rid):
            results += engine.step()
            carried.append(engine.kv.promised_blocks)
        results += engine.step()
        stored = engine.backend.export_request(rid)
        while engine.has_unfinished():
            results += engine.step()
        return results[0].logprobs, stored, carried

    (kept, kept_pages, none), (carried, carried_pages, promised) = run(False), run(True)
    assert set(none) == {0} and promised[0] > 0 and promised[-1] == 0
    assert sorted(kept_pages) == sorted(carried_pages)
    for name, tensor in kept_pages.items():
        assert torch.equal(tensor, carried_pages[name]), name
    torch.testing.assert_close(carried, kept, atol=0, rtol=0)


def _kept_and_carried(model, config, prompt, prefill_chunk, **generate):
    """The results of one prompt with every plane kept and with planes carried."""
    out = []
    for carry in (False, True):
        engine = _engine(model, config, prefill_chunk=prefill_chunk)
        engine.carry_planes = carry
        out.append(engine.generate([prompt], **generate)[0])
    return out


def test_a_chunk_ending_on_an_append_boundary_carries_the_rows_it_reads(monkeypatch):
    """Chunks of 17 rows against appends of 16: a chunk's last row starts a new append,
    which the chunk reads, so it is stored and carried before the chunk runs."""
    from flashloop_backend.backends import packed_state

    monkeypatch.setattr(packed_state, "PACK_CHUNK_ROWS", 16)
    prompt = [(7 * i + 3) % 59 + 1 for i in range(69)]
    kept, carried = _kept_and_carried(
        tiny_model(seed=2), FlashLoopConfig(kv_residual_quantization=QUANT), prompt, 17,
        forced=[[3, 9, 27]], keep_logprobs=True,
    )  # fmt: skip
    torch.testing.assert_close(carried.logprobs, kept.logprobs, atol=0, rtol=0)


def test_a_last_loop_chunk_carries_the_rows_its_packing_makes_final(monkeypatch):
    """Token-sparse last loop: after a chunk, the rows up to the next active one are final
    and the last level packs them at once; the level below must hold them by then, even
    where they reach past the chunk's own rows (here rows 48-63, final once row 47 ran,
    the next active row being 64)."""
    from flashloop_backend.algorithms.token_selection import window_budgets
    from flashloop_backend.backends import packed_state
    from flashloop_backend.host import prompt_schedule

    monkeypatch.setattr(packed_state, "PACK_CHUNK_ROWS", 16)
    select = prompt_schedule.select_in_windows

    def rows_16_to_47_and_64_to_66(scores, eligible, ratio, window):
        if ratio != 0.5:
            return select(scores, eligible, ratio, window)
        at = torch.arange(len(eligible))
        chosen = eligible & (((at >= 16) & (at < 48)) | ((at >= 64) & (at < 67)))
        per_window = torch.zeros_like(at[: -(-len(at) // window)])
        per_window.scatter_add_(0, at // window, chosen.long())
        assert torch.equal(per_window, window_budgets(eligible, ratio, window))  # a real budget
        return chosen

    monkeypatch.setattr(prompt_schedule, "select_in_windows", rows_16_to_47_and_64_to_66)
    sparse = {"enabled": True, "window_size": 32, "retention": [1, 1, 1, 0.5]}
    config = FlashLoopConfig(kv_residual_quantization=QUANT, token_sparse_prefill=sparse)
    prompt = [(7 * i + 3) % 59 + 1 for i in range(69)]
    kept, carried = _kept_and_carried(
        tiny_model(seed=2), config, prompt, 32, forced=[[3, 9]], keep_logprobs=True
    )
    torch.testing.assert_close(carried.logprobs, kept.logprobs, atol=0, rtol=0)


def test_a_depth_is_stored_chunk_by_chunk_as_the_next_loop_reads_it(monkeypatch):
    """Each chunk of loop d > 0 stores loop d - 1 of the rows it reads first (whole
    appends), so a depth's conversion spreads over the next loop's steps; the rows past
    the packed ones reach the next plane with the depth's last chunk."""
    from flashloop_backend.backends import packed_state

    monkeypatch.setattr(packed_state, "PACK_CHUNK_ROWS", 16)
    engine = _engine(tiny_model(seed=2), FlashLoopConfig(kv_residual_quantization=QUANT),
                     prefill_chunk=16)  # fmt: skip
    rid = engine.add_request(PROMPT + PROMPT[:21], SamplingParams(max_new_tokens=2))  # 69 rows
    seen = []
    while not engine.has_first_token(rid):
        engine.step()
        r = engine._requests[rid]
        table = engine.kv.block_table(rid, 1)
        seen.append((r.depth, engine.backend.packed.level_rows(rid, 0), sum(b >= 0 for b in table)))
    # (loop, rows of depth 0 stored, blocks plane 1 holds) after each step: the step that
    # ends loop 0 stores none of it; then chunks [0, 16), [16, 32), ... of loop 1 (blocks
    # of 4 rows; 64 of the 69 rows pack, 71 positions reserved in 18 blocks)
    after_loop_0 = [entry for entry in seen if entry[0] > 0]
    assert after_loop_0[:5] == [(1, 0, 0), (1, 16, 4), (1, 32, 8), (1, 48, 12), (1, 64, 16)]
    # loop 1's last chunk takes the rest; loop 2 then takes plane 1's carried blocks
    assert [entry[2] for entry in after_loop_0[5:10]] == [18, 14, 10, 6, 2]


def test_reference_reads_per_batch_and_per_layer_agree(monkeypatch):
    """A batch reads every layer's loop-2 reference at once while its indices fit in
    REFERENCE_READ_BYTES, else each layer's as it runs: the log-probs are the same."""
    from flashloop_backend.backends import batch_plan

    model = tiny_model(seed=2)
    config = FlashLoopConfig(
        kv_residual_quantization=QUANT,
        sparse_decode_attention=SPARSE_DECODE,
        token_sparse_prefill=SPARSE,
    )
    forced = [3, 9, 27, 1, 4, 8]
    at_once = _logprobs(_engine(model, config), PROMPT, forced)
    monkeypatch.setattr(batch_plan, "REFERENCE_READ_BYTES", 0)
    per_layer = _logprobs(_engine(model, config), PROMPT, forced)
    torch.testing.assert_close(per_layer, at_once, atol=0, rtol=0)


@pytest.mark.parametrize("stop", ["preempt", "cancel"])
def test_a_request_stopped_mid_last_loop_returns_its_packed_pages(monkeypatch, stop):
    """Packing starts inside the prompt's last loop: a request preempted or cancelled
    there, with some rows packed and its BF16 rows still held, returns every page and
    block; preempted, it recomputes to the log-probs of an undisturbed run."""
    from flashloop_backend.backends import packed_state

    monkeypatch.setattr(packed_state, "PACK_CHUNK_ROWS", 16)
    model = tiny_model(seed=2)
    config = FlashLoopConfig(kv_residual_quantization=QUANT)
    prompt, forced = PROMPT + PROMPT[:20], [3, 9, 27, 1]
    expected = _logprobs(_engine(model, config, prefill_chunk=16), prompt, forced)
    engine = _engine(model, config, prefill_chunk=16)
    rid = engine.add_request(
        prompt, SamplingParams(max_new_tokens=len(forced)), forced=forced, keep_logprobs=True
    )
    packed = engine.backend.packed
    while not (engine._requests[rid].depth == 3 and packed.packed_rows(rid) > 0):
        engine.step()
    assert engine._requests[rid].phase == "prefill"
    getattr(engine, stop)(rid)
    store = packed.store
    if stop == "cancel":
        assert store.sequences == {} and store.accounting()["pages_used"] == 0
        assert store.unreserved_pages() == store.num_pages and engine.kv.free_blocks == 200
        return
    finished = []
    while engine.has_unfinished():
        finished += engine.step()
    (result,) = [f for f in finished if f.request_id == rid]
    torch.testing.assert_close(result.logprobs, expected, atol=0, rtol=0)
    assert store.accounting()["pages_used"] == 0 and engine.kv.free_blocks == 200
