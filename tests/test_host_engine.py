"""The host against the independent naive model, and its batching invariances."""

import pytest
import torch

from flashloop_backend.capabilities import SupportRequest
from flashloop_backend.host import Engine, OutOfBlocksError, SamplingParams
from flashloop_backend.host.naive import NaiveOuro
from flashloop_backend.registry import Registry

from .host_helpers import tiny_model

REQUEST = SupportRequest(head_dim=16, block_size=4, num_q_heads=4, num_kv_heads=2)
PROMPTS = [[1, 5, 9, 3, 22, 7, 8, 2, 40, 11, 12], [4, 4, 17], [30, 2, 2, 9, 50, 1, 19]]


def engine(model, backend="torch", **kwargs):
    kwargs.setdefault("num_blocks", 96)
    kwargs.setdefault("block_size", 4)
    return Engine(model, Registry.discover().create(backend, REQUEST), **kwargs)


def early_exit_model():
    model = tiny_model(seed=3, early_exit_threshold=0.5)
    with torch.no_grad():
        model.model.early_exit_gate.bias.fill_(0.0)
    return model


@pytest.mark.parametrize("backend", ["torch", "flashloop"])
@pytest.mark.parametrize("exits", [False, True], ids=["fixed_depth", "early_exit"])
def test_matches_naive_token_for_token(backend, exits):
    model = early_exit_model() if exits else tiny_model(seed=1)
    naive = NaiveOuro(model.config, dict(model.state_dict()))
    results = engine(model, backend, prefill_chunk=5).generate(
        PROMPTS, SamplingParams(max_new_tokens=9)
    )
    for prompt, result in zip(PROMPTS, results, strict=True):
        tokens, exit_depths = naive.generate(prompt, 9)
        assert result.output_token_ids == tokens
        assert result.exit_depths == exit_depths
    if exits:  # the case must really exercise early exits at several depths
        depths = {d for r in results for d in r.exit_depths}
        assert len(depths) >= 2 and min(depths) < 3


def test_chunked_prefill_equals_unchunked():
    model = early_exit_model()
    outputs = []
    for chunk in (1, 3, 64):
        e = engine(model, prefill_chunk=chunk)
        outputs.append(
            [r.output_token_ids for r in e.generate(PROMPTS, SamplingParams(max_new_tokens=6))]
        )
    assert outputs[0] == outputs[1] == outputs[2]


def test_prompt_kv_is_identical_across_chunkings():
    model = tiny_model(seed=2)
    caches = []
    for chunk in (2, 64):
        e = engine(model, prefill_chunk=chunk)
        rid = e.add_request(PROMPTS[0], SamplingParams(max_new_tokens=2))
        while e._requests[rid].phase in ("waiting", "prefill"):
            e.step()
        per_depth = []
        for depth in range(4):
            slots = torch.tensor(e.kv.slots(rid, depth, list(range(len(PROMPTS[0])))))
            blocks, offsets = slots // 4, slots % 4
            per_depth.append(e.kv.key_pool[blocks, :, offsets])  # [T, layers, Hkv, D]
        caches.append(torch.stack(per_depth))
    # fp32 GEMMs of different row counts round differently; 4 loops x 2 layers of random
    # weights amplify that to ~1e-4 absolute on K of magnitude ~10.
    torch.testing.assert_close(caches[0], caches[1], atol=5e-4, rtol=1e-3)


def test_mixed_batch_equals_one_by_one():
    model = early_exit_model()
    params = [SamplingParams(max_new_tokens=n) for n in (7, 4, 6)]
    together = engine(model, prefill_chunk=3, max_batch_tokens=6).generate(PROMPTS, params)
    alone = [engine(model).generate([p], s)[0] for p, s in zip(PROMPTS, params, strict=True)]
    assert [r.output_token_ids for r in together] == [r.output_token_ids for r in alone]
    assert [r.exit_depths for r in together] == [r.exit_depths for r in alone]


def test_padding_rows_do_not_change_results():
    model = tiny_model(seed=4)
    plain = engine(model, prefill_chunk=4).generate(PROMPTS, SamplingParams(max_new_tokens=5))
    padded = engine(model, prefill_chunk=4, pad_to_multiple=8).generate(
        PROMPTS, SamplingParams(max_new_tokens=5)
    )
    assert [r.output_token_ids for r in plain] == [r.output_token_ids for r in padded]


def test_seeded_sampling_is_reproducible():
    model = tiny_model(seed=5)
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=7)
    a = engine(model).generate([PROMPTS[0]], params)[0].output_token_ids
    b = engine(model).generate([PROMPTS[0]], params)[0].output_token_ids
    c = engine(model).generate(
        [PROMPTS[0]], SamplingParams(max_new_tokens=8, temperature=1.0, seed=8)
    )[0]
    assert a == b
    assert a != c.output_token_ids


def test_eos_and_stop_strings():
    model = tiny_model(seed=1)
    first = (
        engine(model).generate([PROMPTS[0]], SamplingParams(max_new_tokens=5))[0].output_token_ids
    )
    eos_model = tiny_model(seed=1, eos_token_id=first[1])
    result = engine(eos_model).generate([PROMPTS[0]], SamplingParams(max_new_tokens=5))[0]
    assert result.output_token_ids == first[:2] and result.finish_reason == "eos"
    ignore = engine(eos_model).generate(
        [PROMPTS[0]], SamplingParams(max_new_tokens=5, ignore_eos=True)
    )[0]
    assert ignore.output_token_ids == first
    stop = engine(model, detokenize=lambda ids: " ".join(map(str, ids))).generate(
        [PROMPTS[0]], SamplingParams(max_new_tokens=5, stop=(str(first[2]),))
    )[0]
    assert stop.finish_reason == "stop"
    assert stop.output_token_ids == first[: first.index(first[2]) + 1]


def test_bad_requests():
    model = tiny_model()
    e = engine(model)
    with pytest.raises(ValueError, match="exceeds the engine's max_context=256"):
        e.add_request(list(range(1, 60)) * 4, SamplingParams(max_new_tokens=30))
    with pytest.raises(ValueError, match="empty"):
        e.add_request([])
    with pytest.raises(ValueError, match="outside"):
        e.add_request([1, 999])
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)


def test_out_of_blocks_waits_then_runs_and_never_fitting_fails():
    model = tiny_model(seed=1)
    # 3 blocks per request per plane (11 prompt + 1 new = 12 tokens / 4) x 4 planes = 12
    small = engine(model, num_blocks=12)
    with pytest.raises(OutOfBlocksError, match="needs 16 KV blocks but the whole pool has 12"):
        small.add_request(PROMPTS[0], SamplingParams(max_new_tokens=5))
    expected = [
        engine(model).generate([p], SamplingParams(max_new_tokens=1))[0].output_token_ids
        for p in PROMPTS
    ]
    results = small.generate(PROMPTS, SamplingParams(max_new_tokens=1))  # one at a time
    assert [r.output_token_ids for r in results] == expected
    assert small.kv.free_blocks == 12


def test_finalize_exit_copies_to_deeper_planes():
    from flashloop_backend.host import PagedKVCache

    kv = PagedKVCache(8, 2, 4, 1, 2, num_depths=3, dtype=torch.float32, device="cpu")
    kv.reserve(0, 4)
    for depth in range(3):
        slot = torch.tensor(kv.slots(0, depth, [2]))
        kv.write(1, slot, torch.full((1, 1, 2), float(depth)), torch.full((1, 1, 2), 10.0 + depth))
    kv.finalize_exit(0, 2, 0)
    for depth in range(3):
        block, offset = divmod(kv.slots(0, depth, [2])[0], 4)
        assert kv.key_pool[block, 1, offset].tolist() == [[0.0, 0.0]]
        assert kv.value_pool[block, 1, offset].tolist() == [[10.0, 10.0]]
    with pytest.raises(IndexError, match="outside request 0's reserved 4 tokens"):
        kv.slots(0, 0, [4])


def test_max_context_bounds_requests_and_sizes_the_selection_bucket():
    from flashloop_backend import FlashLoopConfig
    from flashloop_backend.backends.sparse_state import key_bucket
    from flashloop_backend.capabilities import SupportRequest
    from flashloop_backend.registry import Registry

    model = tiny_model()
    config = FlashLoopConfig(sparse_decode_attention={"enabled": True, "key_retention": 0.25})
    request = SupportRequest(head_dim=16, block_size=4, num_q_heads=4, num_kv_heads=2)
    backend = Registry.discover().create("flashloop", request, config)
    e = Engine(model, backend, num_blocks=64, block_size=4, max_context=100)
    assert e.backend.states.k_bucket == key_bucket(0.25, 100) < key_bucket(0.25, 256)
    with pytest.raises(ValueError, match="exceeds the engine's max_context=100"):
        e.add_request(list(range(1, 60)) + list(range(1, 40)), SamplingParams(max_new_tokens=5))
    with pytest.raises(
        ValueError, match=r"max_context=300 must lie in \[1, max_position_embeddings=256\]"
    ):
        Engine(model, backend, num_blocks=64, block_size=4, max_context=300)


def test_table_tensor_follows_reserve_and_drop_prefix():
    """The cached host tensor of a request's tables is rebuilt whenever they change."""
    from flashloop_backend.host import PagedKVCache

    kv = PagedKVCache(16, 1, 4, 1, 2, num_depths=2, dtype=torch.float32, device="cpu")
    kv.reserve(0, 4)
    first = kv.table_tensor(0)
    assert first.tolist() == [kv.block_table(0, d) for d in range(2)]
    assert kv.table_tensor(0) is first  # unchanged tables: the same tensor, no rebuild
    kv.reserve(0, 12)
    grown = kv.table_tensor(0)
    assert grown.shape == (2, 3) and grown.tolist() == [kv.block_table(0, d) for d in range(2)]
    kv.drop_prefix(0, 4)
    assert kv.table_tensor(0)[:, 0].tolist() == [-1, -1]
    assert kv.table_blocks(0) == 3


def test_kv_held_counts_packed_bytes_and_freed_blocks():
    """With KV quantization the packed prompt's BF16 blocks go back to the pool: the held
    bytes per token drop below dense's, counted from the pool and the store's tensors."""
    import json
    from pathlib import Path

    from flashloop_backend import FlashLoopConfig, embedded_model_path
    from flashloop_backend.capabilities import SupportRequest
    from flashloop_backend.host import Engine, SamplingParams, load_model
    from flashloop_backend.registry import Registry

    model = load_model(embedded_model_path(), "cpu", torch.float32)
    c = model.config
    request = SupportRequest("cpu", torch.float32, c.head_dim, 16, c.num_attention_heads,
                             c.num_key_value_heads)  # fmt: skip
    quant = json.loads((Path(__file__).parents[1] / "configs" / "all_on.json").read_text())
    held = {}
    for name, config in (("dense", FlashLoopConfig()), ("quant", FlashLoopConfig.from_dict(quant))):
        backend = Registry.discover().create("flashloop", request, config)
        engine = Engine(model, backend, num_blocks=256, prefill_chunk=128)
        engine.add_request(list(range(1, 257)), SamplingParams(max_new_tokens=2, ignore_eos=True))
        while not engine._requests[0].output:
            engine.step()
        engine.step()  # the step after the first token starts by packing the prompt
        tokens, nbytes = engine.kv_held()
        assert tokens == 257
        held[name] = nbytes / tokens
    per_token_bf16 = engine.kv.bytes_per_token()
    assert held["dense"] >= per_token_bf16  # whole blocks on every plane
    assert held["quant"] < held["dense"] / 3, held


def test_token_ids_reach_a_tensor_as_torch_tensor_makes_them():
    from flashloop_backend.host.engine_scheduling import token_tensor

    for tokens in ([5, 0, 2**40, 61], (3, 1), [7], []):
        got, want = token_tensor(tokens), torch.tensor(tokens, dtype=torch.int64)
        assert got.dtype == torch.int64 and torch.equal(got, want)
