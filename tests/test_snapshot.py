"""Snapshot and restore of a request between tokens: a restored request in a fresh engine
continues with the tokens, exit depths and log-probs of an uninterrupted run, for every
feature combination (with and without the packed store, both packing policies), greedy and
seeded; a damaged, truncated or mismatched snapshot is refused by name and leaves the
engine's pools as they were."""

import hashlib
import json

import pytest
import torch

from flashloop_backend import FlashLoopConfig
from flashloop_backend.host import Engine, SamplingParams
from flashloop_backend.host.snapshot import (
    MANIFEST_DIGEST_KEY,
    MANIFEST_KEY,
    SnapshotError,
    load_snapshot,
    save_snapshot,
)
from flashloop_backend.registry import Registry

from .host_helpers import tiny_model
from .test_lifecycle import COMBINATIONS, IDS, REQUEST, _baseline, _engine


def _snapshot_after(engine: Engine, rid: int, tokens: int):
    while engine.output_count(rid) < tokens or not engine.at_token_boundary(rid):
        engine.step()
    return engine.snapshot(rid)


def _finish(engine: Engine) -> dict:
    results = {}
    while engine.has_unfinished():
        results.update({r.request_id: r for r in engine.step()})
    return results


@pytest.mark.parametrize(("features", "config"), COMBINATIONS, ids=IDS)
@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "seeded"])
def test_a_restored_request_continues_as_if_never_stopped(features, config, temperature, tmp_path):
    """Saved after 5 tokens (prompt packed, generated rows in the BF16 tail or flushed),
    written to a file, restored into a fresh engine: the same tokens, exit depths and
    log-probs as the uninterrupted run; the first engine's copy runs on unchanged."""
    model = tiny_model(seed=3, early_exit_threshold=0.5)
    prompt = [4, 8, 15, 16, 23, 42] * 7
    params = SamplingParams(max_new_tokens=24, temperature=temperature, seed=11)
    whole = _engine(model, config).generate([prompt], params, keep_logprobs=True)[0]
    engine = _engine(model, config)
    rid = engine.add_request(prompt, params, keep_logprobs=True)
    snapshot = _snapshot_after(engine, rid, 5)
    save_snapshot(snapshot, tmp_path / "r.safetensors")
    assert snapshot.manifest["live_references"] == 0
    packed = [name for name in snapshot.tensors if name.startswith("packed.")]
    assert bool(packed) == config.kv_residual_quantization.enabled
    sizes = {n: t.numel() * t.element_size() for n, t in snapshot.tensors.items()}
    assert snapshot.manifest["bytes"]["packed"] == sum(sizes[n] for n in packed)
    assert sum(snapshot.manifest["bytes"].values()) == sum(sizes.values())
    fresh = _engine(model, config)
    restored = fresh.restore(load_snapshot(tmp_path / "r.safetensors"))
    for run, request in ((fresh, restored), (engine, rid)):
        done = _finish(run)[request]
        assert done.output_token_ids == whole.output_token_ids
        assert done.exit_depths == whole.exit_depths
        torch.testing.assert_close(done.logprobs, whole.logprobs, rtol=0, atol=0)
        assert run.pools() == _baseline(run)


def test_max_new_tokens_on_restore_counts_from_where_it_stopped():
    model = tiny_model(seed=2)
    prompt, params = [1, 2, 3, 5, 8] * 8, SamplingParams(max_new_tokens=12)
    whole = _engine(model, FlashLoopConfig()).generate([prompt], params)[0]
    engine = _engine(model, FlashLoopConfig())
    snapshot = _snapshot_after(engine, engine.add_request(prompt, params), 4)
    fresh = _engine(model, FlashLoopConfig())
    rid = fresh.restore(snapshot, max_new_tokens=3)
    done = _finish(fresh)[rid]
    assert done.output_token_ids == whole.output_token_ids[:7]


def test_a_snapshot_is_taken_between_tokens_only():
    engine = _engine(tiny_model(seed=1), FlashLoopConfig())
    rid = engine.add_request([3, 1, 4, 1, 5] * 4, SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match=f"request {rid} is in phase 'waiting' at loop 0"):
        engine.snapshot(rid)
    while not engine.has_first_token(rid):
        engine.step()
    engine.step()  # the token runs its first loop
    with pytest.raises(ValueError, match=f"request {rid} is in phase 'decode' at loop 1"):
        engine.snapshot(rid)


ALL_ON = COMBINATIONS[-2][1]  # every feature on, the fixed_prompt policy


@pytest.fixture
def saved(tmp_path):
    model = tiny_model(seed=6)
    engine = _engine(model, ALL_ON)
    rid = engine.add_request([2, 7, 1, 8, 2, 8] * 6, SamplingParams(max_new_tokens=8))
    path = tmp_path / "r.safetensors"
    save_snapshot(_snapshot_after(engine, rid, 3), path)
    return model, path


def test_a_truncated_or_damaged_file_is_refused_by_name(saved, tmp_path):
    _, path = saved
    data = path.read_bytes()
    (tmp_path / "cut").write_bytes(data[: len(data) // 2])
    with pytest.raises(SnapshotError, match="damaged or truncated"):
        load_snapshot(tmp_path / "cut")
    flipped = bytearray(data)
    flipped[-3] ^= 0xFF  # a byte of the last tensor's data
    (tmp_path / "flip").write_bytes(bytes(flipped))
    with pytest.raises(SnapshotError, match=r"tensor '.+' does not match its checksum"):
        load_snapshot(tmp_path / "flip")
    with pytest.raises(SnapshotError, match="no snapshot file at"):
        load_snapshot(tmp_path / "absent")


def test_another_format_version_or_a_plain_safetensors_file_is_refused(saved, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    _, path = saved
    with safe_open(str(path), framework="pt") as f:
        manifest = json.loads(f.metadata()[MANIFEST_KEY])
    tensors = load_file(str(path))
    manifest["format"] = 99
    text = json.dumps(manifest)  # a well-formed file of another format version
    digest = hashlib.sha256(text.encode()).hexdigest()
    metadata = {MANIFEST_KEY: text, MANIFEST_DIGEST_KEY: digest}
    save_file(tensors, str(tmp_path / "v99"), metadata=metadata)
    with pytest.raises(SnapshotError, match="snapshot format 99; this build reads format 1"):
        load_snapshot(tmp_path / "v99")
    save_file(tensors, str(tmp_path / "plain"))
    with pytest.raises(SnapshotError, match="without a FlashLoop snapshot manifest"):
        load_snapshot(tmp_path / "plain")


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ("model", "identity model"),
        ("config", "identity config_digest"),
        ("backend", "identity backend"),
        ("block_size", "geometry block_size"),
    ],
)
def test_a_mismatched_snapshot_is_refused_by_name_and_takes_nothing(saved, change, named):
    model, path = saved
    snapshot = load_snapshot(path)
    config, block_size = ALL_ON, 4
    if change == "model":
        model = tiny_model(seed=7)
    if change == "config":
        changed = ALL_ON.model_dump() | {
            "sparse_decode_attention": {"enabled": True, "key_retention": 0.5}
        }
        config = FlashLoopConfig.model_validate(changed)
    if change == "block_size":
        block_size = 8
    if change == "backend":
        backend = Registry.discover().create("torch", REQUEST, FlashLoopConfig())
    else:
        backend = Registry.discover().create("flashloop", REQUEST, config)
    engine = Engine(model, backend, num_blocks=160, block_size=block_size, prefill_chunk=16)
    before = engine.pools()
    with pytest.raises(SnapshotError, match=f"does not match this engine: .*{named}: snapshot"):
        engine.restore(snapshot)
    assert engine.pools() == before


def test_a_request_the_pools_cannot_hold_is_refused_and_takes_nothing(saved):
    from flashloop_backend.host.kvcache import OutOfBlocksError

    model, path = saved
    backend = Registry.discover().create("flashloop", REQUEST, ALL_ON)
    engine = Engine(model, backend, num_blocks=40, block_size=4, prefill_chunk=16)
    before = engine.pools()
    with pytest.raises(OutOfBlocksError, match="needs"):
        engine.restore(load_snapshot(path))
    assert engine.pools() == before


def test_a_damaged_packed_tensor_is_refused_and_gives_back_what_was_taken(saved):
    model, path = saved
    snapshot = load_snapshot(path)
    snapshot.tensors["packed.level1.blocks"] = snapshot.tensors["packed.level1.blocks"][:, :1]
    engine = _engine(model, ALL_ON)
    before = engine.pools()
    with pytest.raises(ValueError, match=r"packed tensor 'level1\.blocks' must be torch\.uint8"):
        engine.restore(snapshot)
    assert engine.pools() == before


ROLLING = COMBINATIONS[-1][1]


@pytest.fixture
def seeded(tmp_path):
    """A sampled all-on rolling-policy request saved after 5 tokens."""
    model = tiny_model(seed=6)
    engine = _engine(model, ROLLING)
    params = SamplingParams(max_new_tokens=12, temperature=0.8, seed=3)
    rid = engine.add_request([2, 7, 1, 8, 2, 8] * 6, params)
    return model, _snapshot_after(engine, rid, 5)


@pytest.mark.parametrize(
    ("damage", "named"),
    [
        ("no rng", "tensor 'rng' is not a cpu generator state"),
        ("short rng", "tensor 'rng' is not a cpu generator state"),
        ("no hidden", r"tensor 'hidden' must be a float \[64\]"),
        ("bad prompt_active", r"tensor 'prompt_active' must be bool \[4, 36\]"),
        ("no bf16", "bf16.keys / bf16.values must be"),
        ("exit depths", "exit_depths must give a depth in"),
        ("params", "snapshot request params"),
        ("replay exits", "replay_exits is malformed"),
    ],
)
def test_a_request_whose_fields_do_not_fit_is_refused_before_anything_is_taken(
    seeded, damage, named
):
    model, snapshot = seeded
    tensors, request = dict(snapshot.tensors), dict(snapshot.manifest["request"])
    if damage == "no rng":
        del tensors["rng"]
    if damage == "short rng":
        tensors["rng"] = tensors["rng"][:3]
    if damage == "no hidden":
        del tensors["hidden"]
    if damage == "bad prompt_active":
        tensors["prompt_active"] = tensors["prompt_active"][:, :5]
    if damage == "no bf16":
        del tensors["bf16.keys"]
    if damage == "exit depths":
        request["exit_depths"] = request["exit_depths"] + [0]
    if damage == "replay exits":  # a depth past the model's 4 loops
        request["replay"], request["replay_exits"] = request["output"], [0, 9, 1, 2]
    if damage == "params":
        request["params"] = request["params"] | {"beam": 4}
    manifest = snapshot.manifest | {"request": request}
    engine = _engine(model, ROLLING)
    before = engine.pools()
    with pytest.raises(SnapshotError, match=named):
        engine.restore(type(snapshot)(manifest, tensors))
    assert engine.pools() == before


@pytest.mark.parametrize("more", [0, -2])
def test_max_new_tokens_below_one_is_refused_by_value(seeded, more):
    model, snapshot = seeded
    with pytest.raises(ValueError, match=f"max_new_tokens={more} must be >= 1"):
        _engine(model, ROLLING).restore(snapshot, max_new_tokens=more)


def test_a_changed_manifest_is_refused_on_load(saved, tmp_path):
    _, path = saved
    data = bytearray(path.read_bytes())
    key = b'\\"output\\": ['  # the manifest is a JSON string inside the JSON header
    at = data.index(key) + len(key)
    data[at] = ord("9") if data[at] != ord("9") else ord("8")  # one digit of a token id
    (tmp_path / "edited").write_bytes(bytes(data))
    with pytest.raises(SnapshotError, match="the manifest does not match its checksum"):
        load_snapshot(tmp_path / "edited")


@pytest.mark.parametrize("features", [(), ("all",)], ids=["dense", "all_on"])
def test_a_request_restored_beside_graph_replays_makes_the_lone_tokens(features, monkeypatch):
    """Restored into an engine replaying decode steps from recorded graphs (the CPU
    recorder), beside a request already decoding there, into a slot another request used
    before: both make the tokens of eager lone runs."""
    from flashloop_backend.host.graphs import GraphSettings
    from flashloop_backend.kernels.torch_ref import packed as torch_packed

    from .graph_recorder import RecordingCapture
    from .test_decode_graphs import _every_row

    monkeypatch.setattr(torch_packed, "_only_rows", _every_row)
    model = tiny_model(seed=7)
    config = ALL_ON if features else FlashLoopConfig()

    def graphed():
        backend = Registry.discover().create("flashloop", REQUEST, config)
        return Engine(
            model,
            backend,
            num_blocks=160,
            block_size=4,
            prefill_chunk=16,
            max_slots=8,
            cuda_graphs=GraphSettings(buckets=(1, 2, 4), max_context=128),
            graph_capture=RecordingCapture(),
        )

    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    prompts = [[(7 * i + 3) % 61 for i in range(n)] for n in (40, 21, 9)]
    source = graphed()
    snapshot = _snapshot_after(source, source.add_request(prompts[0], params), 3)
    target = graphed()
    first = target.generate([prompts[2]], params)[0]  # its slot goes back to the pool
    other = target.add_request(prompts[1], params)
    while target.output_count(other) < 2:
        target.step()
    restored = target.restore(snapshot)
    done = _finish(target)
    assert target.graphs.stats()["replays"] > 0
    for rid, prompt in ((restored, prompts[0]), (other, prompts[1])):
        alone = _engine(model, config).generate([prompt], params)[0]
        assert done[rid].output_token_ids == alone.output_token_ids, rid
    assert (
        first.output_token_ids
        == _engine(model, config).generate([prompts[2]], params)[0].output_token_ids
    )
