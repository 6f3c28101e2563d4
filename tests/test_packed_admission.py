"""Packed pages are reserved at admission: more concurrent requests than the packed pool
holds wait for pages (and give what they give alone), a request that can never fit is
refused by name, and a pool nobody can free still stops the loop."""

import pytest

from flashloop_backend import FlashLoopConfig
from flashloop_backend.capabilities import SupportRequest
from flashloop_backend.host import Engine, GenerationResult, OutOfBlocksError, SamplingParams
from flashloop_backend.registry import Registry

from .host_helpers import tiny_model

REQUEST = SupportRequest(head_dim=16, block_size=4, num_q_heads=4, num_kv_heads=2)


def _prompts(*lengths: int) -> list[list[int]]:
    return [[(5 * i + 3 * n) % 61 for i in range(n)] for n in lengths]


SHORT, LONG = _prompts(45, 40, 36, 33), _prompts(48, 52, 40, 56, 49)
FIXED = {"enabled": True, "group_size": 16}
ROLLING = {"enabled": True, "group_size": 16, "policy": "rolling", "tail_size": 16}
SPARSE = {"enabled": True, "window_size": 16, "retention": [1, 1, 0.5, 0.25]}

# (quantization, token-sparse prefill, prompts, BF16 blocks, packed pages (None: default),
# new tokens). Every case's BF16 pool admits requests whose packed pages overrun the packed
# pool: all at once (explicit pools), or as packing frees the prompts' blocks (the default
# pool). Under rolling, 10 new tokens flush a generated group of the 45- and 40-row prompts.
CASES = {
    "fixed_prompt": (FIXED, None, SHORT, 240, 20, 4),
    "rolling": (ROLLING, None, SHORT, 240, 12, 10),
    "fixed_prompt+token_sparse": (FIXED, SPARSE, SHORT, 240, 20, 4),
    "rolling+token_sparse": (ROLLING, SPARSE, SHORT, 240, 12, 10),
    "fixed_prompt_default_pool": (FIXED, None, LONG, 128, None, 8),
}


def _engine(model, config, num_blocks=240, packed_pages=None):
    backend = Registry.discover().create("flashloop", REQUEST, config)
    return Engine(model, backend, num_blocks=num_blocks, block_size=4, prefill_chunk=32,
                  packed_pages=packed_pages)  # fmt: skip


def run_watching_admission(engine: Engine) -> tuple[dict[int, GenerationResult], bool, bool]:
    """Step ``engine`` until every request is done: its results, whether a waiting request
    stayed waiting with its BF16 blocks free (held back by packed pages), and whether a
    generated group was flushed; reserved and used pages never exceed the pool."""
    results, held_back, flushed = {}, False, False
    packed = engine.backend.packed
    while engine.has_unfinished():
        head = next((r for r in engine._requests.values() if r.phase == "waiting"), None)
        tokens = len(head.prompt) + head.params.max_new_tokens if head is not None else 0
        carry = engine.backend.carried_prompt_rows(len(head.prompt)) if head is not None else 0
        fits = head is not None and engine.kv.blocks_needed(tokens, carry) <= engine.kv.free_blocks
        results.update((r.request_id, r) for r in engine.step())
        held_back |= fits and head.phase == "waiting"
        flushed |= any(packed.packed_rows(i) > packed.prompt_rows(len(r.prompt))
                       for i, r in engine._requests.items())  # fmt: skip
        report = packed.store.accounting()
        assert report["pages_used"] + report["pages_reserved"] <= report["pages_total"]
    return results, held_back, flushed


def _config(quant, sparse):
    extra = {"token_sparse_prefill": sparse} if sparse else {}
    return FlashLoopConfig(kv_residual_quantization=quant, **extra)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_more_requests_than_the_packed_pool_holds_wait_and_give_their_alone_tokens(case):
    quant, sparse, prompts, num_blocks, packed_pages, new = case
    model = tiny_model(seed=3)
    config = _config(quant, sparse)
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    engine = _engine(model, config, num_blocks, packed_pages)
    packed = engine.backend.packed
    needed = sum(packed.pages_needed(len(p), new, 4) for p in prompts)
    assert needed > packed.store.num_pages  # together they overrun the packed pool
    ids = [engine.add_request(p, params) for p in prompts]
    results, held_back, flushed = run_watching_admission(engine)
    assert held_back and flushed == (quant is ROLLING)
    report = packed.store.accounting()
    assert report["pages_used"] == report["pages_reserved"] == 0
    assert engine.kv.free_blocks == num_blocks
    alone = [_engine(model, config).generate([p], params)[0].output_token_ids for p in prompts]
    assert [results[i].output_token_ids for i in ids] == alone
    assert all(len(tokens) == new for tokens in alone)


def test_default_pool_fits_any_request_the_bf16_pool_takes():
    model = tiny_model(seed=3)
    for quant in (FIXED, ROLLING):
        engine = _engine(model, _config(quant, None), num_blocks=130)
        packed = engine.backend.packed
        longest = 130 // 4 * 4  # tokens per depth plane
        assert packed.store.num_pages == packed.pages_needed(longest, 0, 4)
        assert packed.pages_needed(longest - 8, 8, 4) <= packed.store.num_pages
        engine.add_request([1] * (longest - 8), SamplingParams(max_new_tokens=8))


def test_fixed_prompt_returns_its_unused_reservation_once_the_prompt_is_packed():
    engine = _engine(tiny_model(seed=3), _config(FIXED, SPARSE), packed_pages=20)
    rid = engine.add_request(SHORT[0], SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert engine.backend.packed.pages_needed(len(SHORT[0]), 4, 4) == 8  # 2 groups, 4 depths
    engine.step()
    assert engine.backend.packed.store.accounting()["pages_reserved"] == 8
    while engine._requests[rid].phase != "decode":
        engine.step()
    engine.step()  # the step after the first token starts by packing the prompt
    report = engine.backend.packed.store.accounting()
    assert report["pages_reserved"] == 0 and report["pages_used"] < 8  # compact deep levels


def test_a_request_that_can_never_get_its_pages_is_refused_and_others_run():
    model = tiny_model(seed=3)
    config = _config(FIXED, None)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    engine = _engine(model, config, packed_pages=10)
    short = [LONG[0][:20], LONG[1][:33]]  # 4 and 8 pages: they take turns
    first = engine.add_request(short[0], params)
    with pytest.raises(
        OutOfBlocksError,
        match="48 prompt \\+ 4 new tokens needs 12 packed KV pages but the whole packed pool has 10",
    ):
        engine.add_request(LONG[0], params)
    second = engine.add_request(short[1], params)
    results = {}
    while engine.has_unfinished():
        results.update((r.request_id, r.output_token_ids) for r in engine.step())
    alone = [_engine(model, config).generate([p], params)[0].output_token_ids for p in short]
    assert [results[first], results[second]] == alone


def test_requests_waiting_for_pages_nobody_frees_stop_the_loop():
    model = tiny_model(seed=3)
    engine = _engine(model, _config(FIXED, None), packed_pages=16)
    engine.backend.packed.store.reserve(99, 8)  # held outside the engine: never released
    engine.add_request(LONG[0], SamplingParams(max_new_tokens=2))  # 12 pages
    with pytest.raises(
        OutOfBlocksError, match=r"requests \[0\] wait for KV blocks or packed pages"
    ):
        engine.step()
