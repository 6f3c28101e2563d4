"""Prefill/decode handoff over NIXL (UCX, host memory to host memory, two agents in this
process): D receives P's snapshot tensors byte for byte and continues with the tokens one
engine makes, for every feature combination; a partial, cancelled or failed handoff and a
mismatched descriptor activate nothing and leave nothing registered or reserved."""

import dataclasses
import json
import time

import pytest
import torch

from flashloop_backend import FlashLoopConfig
from flashloop_backend.host import Engine, SamplingParams, load_model
from flashloop_backend.host.embedded import embedded_model_path
from flashloop_backend.host.kvcache import OutOfBlocksError
from flashloop_backend.host.pd_handoff import Consumer, HandoffError, Producer, nixl_agent
from flashloop_backend.host.snapshot import SnapshotError
from flashloop_backend.registry import Registry

from .host_helpers import tiny_model
from .test_feature_combinations import COMBINATION_IDS, COMBINATIONS, _config, _engine
from .test_lifecycle import ROLLING, _baseline

PROMPT = [(5 * i + 2) % 61 for i in range(37)]  # two whole selection windows and groups
ALL_ON = _config(dict.fromkeys(COMBINATIONS[-1], True))


class Counted:
    """A NIXL agent whose live registrations and posted transfers are counted."""

    def __init__(self, agent) -> None:
        self.agent, self.live, self.posted = agent, set(), 0

    def __getattr__(self, name):
        return getattr(self.agent, name)

    def register_memory(self, *args):
        registration = self.agent.register_memory(*args)
        self.live.add(id(registration))
        return registration

    def deregister_memory(self, registration) -> None:
        self.agent.deregister_memory(registration)
        self.live.remove(id(registration))

    def initialize_xfer(self, *args):
        self.posted += 1
        return self.agent.initialize_xfer(*args)


@pytest.fixture(scope="module")
def agents():
    return nixl_agent("P"), nixl_agent("D")


@pytest.fixture
def sides(agents):
    """(producer, consumer factory) over counted agents; every test ends with nothing
    registered on either side."""
    p_agent, d_agent = Counted(agents[0]), Counted(agents[1])
    producer, consumers = Producer(p_agent), []
    producer.connect(d_agent.get_agent_metadata())

    def consumer(engine):
        consumers.append(Consumer(d_agent, engine))
        return consumers[-1]

    yield producer, consumer
    for c in consumers:
        c.close()
    producer.close()
    assert not p_agent.live and not d_agent.live


def _prefilled(model, config, new=6, build=None, **kwargs):
    """P's engine (``build``, default the tiny models' ``_engine``) with the prompt
    prefilled and its first token made, at a boundary."""
    engine = (build or _engine)(model, config, **kwargs)
    rid = engine.add_request(PROMPT, SamplingParams(max_new_tokens=new, ignore_eos=True))
    while not (engine.has_first_token(rid) and engine.at_token_boundary(rid)):
        engine.step()
    return engine, rid


def _handed_over(producer):
    """All on, tiny model: P prefilled and exported, and an empty D engine beside it."""
    model = tiny_model(seed=3)
    p_engine, rid = _prefilled(model, ALL_ON)
    return p_engine, rid, producer.export(p_engine, rid), _engine(model, ALL_ON)


def _finish(engine, rid):
    results = {}
    while engine.has_unfinished():
        results.update({r.request_id: r for r in engine.step()})
    return results[rid]


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def test_payload_metadata_and_prompt_hidden_arrive_unchanged(sides):
    producer, consumer = sides
    model = tiny_model(seed=3)
    p_engine, rid = _prefilled(model, ROLLING)
    descriptor = producer.export(p_engine, rid)
    sent = producer.exports[descriptor.generation].tensors
    assert any(n.startswith("packed.") for n in sent) and "prompt_active" in sent
    assert {e.name for e in descriptor.tensors} == set(sent)
    d_engine = _engine(model, ROLLING)
    transfer = consumer(d_engine).begin(descriptor)
    transfer.start()
    transfer.wait(30)
    assert {n: _bytes(t) for n, t in transfer.tensors.items()} == {
        n: _bytes(t) for n, t in sent.items()
    }
    d_rid = transfer.activate()
    assert producer.settle(descriptor.generation) == "ack"
    again = d_engine.snapshot(d_rid)  # D's state, read back: P's manifest and tensors
    assert again.manifest == descriptor.manifest
    assert {n: _bytes(t) for n, t in again.tensors.items()} == {
        n: _bytes(t) for n, t in p_engine.snapshot(rid).tensors.items()
    }
    assert _bytes(d_engine._live(d_rid).hidden) == _bytes(p_engine._live(rid).hidden)


def _embedded_engine(model, config, **kwargs):
    request = model.support_request(4)
    backend = Registry.discover().create("flashloop", request, config)
    return Engine(model, backend, num_blocks=240, block_size=4, prefill_chunk=16, **kwargs)


@pytest.fixture(scope="module")
def embedded():
    return load_model(embedded_model_path(), "cpu", torch.float32)


@pytest.mark.parametrize("model_name", ["tiny", "embedded"])
@pytest.mark.parametrize("flags", COMBINATIONS, ids=COMBINATION_IDS)
def test_p_to_d_gives_the_tokens_of_one_engine(sides, flags, model_name, request):
    producer, consumer = sides
    if model_name == "tiny":
        model, engine = tiny_model(seed=7), _engine
    else:  # the embedded model's own shapes (2 heads of 128), as `generate --pd` runs it
        model, engine = request.getfixturevalue("embedded"), _embedded_engine
    config = _config(flags)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    whole = engine(model, config).generate([PROMPT], params)[0]
    p_engine, rid = _prefilled(model, config, build=engine)
    descriptor = producer.export(p_engine, rid)
    d_engine = engine(model, config)
    d_rid = consumer(d_engine).receive(descriptor, timeout_s=30)
    assert producer.settle(descriptor.generation) == "ack"
    p_engine.cancel(rid)
    assert _finish(d_engine, d_rid).output_token_ids == whole.output_token_ids
    assert d_engine.pools() == _baseline(d_engine)
    assert p_engine.pools() == _baseline(p_engine)


def test_a_partial_transfer_never_activates_and_leaks_nothing(sides):
    producer, consumer = sides
    _, _, descriptor, d_engine = _handed_over(producer)
    transfer = consumer(d_engine).begin(descriptor)
    transfer.start({e.name for e in descriptor.tensors} - {"hidden"})
    transfer.wait(30)
    with pytest.raises(HandoffError, match=r"ranges not received: \['hidden'\]"):
        transfer.activate()
    assert transfer.state == "cancelled" and not transfer.tensors
    assert d_engine.pools() == _baseline(d_engine)
    assert producer.settle(descriptor.generation) == "cancel"


def test_producer_steps_during_the_transfer_do_not_change_what_d_receives(sides):
    producer, consumer = sides
    model = tiny_model(seed=5)
    whole = _engine(model, ROLLING).generate(
        [PROMPT], SamplingParams(max_new_tokens=12, ignore_eos=True)
    )[0]
    p_engine, rid = _prefilled(model, ROLLING, new=12)
    descriptor = producer.export(p_engine, rid)
    sent = {n: _bytes(t) for n, t in producer.exports[descriptor.generation].tensors.items()}
    manifest = json.loads(json.dumps(descriptor.manifest))
    d_engine = _engine(model, ROLLING)
    transfer = consumer(d_engine).begin(descriptor)
    transfer.start()
    while p_engine.output_count(rid) < 8:  # P flushes its BF16 tail into packed pages
        p_engine.step()
    transfer.wait(30)
    assert {n: _bytes(t) for n, t in transfer.tensors.items()} == sent
    assert descriptor.manifest == manifest  # the tokens P made since are not in it
    d_rid = transfer.activate()
    assert _finish(d_engine, d_rid).output_token_ids == whole.output_token_ids
    assert _finish(p_engine, rid).output_token_ids == whole.output_token_ids


@pytest.mark.parametrize("side", ["consumer", "producer"])
def test_cancelling_mid_transfer_releases_everything_and_activates_nothing(sides, side):
    producer, consumer = sides
    p_engine, rid, descriptor, d_engine = _handed_over(producer)
    d_side = consumer(d_engine)
    transfer = d_side.begin(descriptor)
    transfer.start()
    if side == "consumer":
        transfer.cancel()
        assert producer.settle(descriptor.generation) == "cancel"
        with pytest.raises(HandoffError, match="is cancelled"):
            transfer.activate()
    else:
        producer.cancel(descriptor.generation)
        deadline = time.perf_counter() + 10
        while descriptor.generation not in d_side.withdrawn and time.perf_counter() < deadline:
            d_side.poll()
        with pytest.raises(HandoffError, match="the producer cancelled it"):
            transfer.wait(30)
    assert transfer.state == "cancelled" and not transfer.tensors
    assert not producer.exports
    assert d_engine.pools() == _baseline(d_engine)
    d_side.agent.send_notif("P", f"ack:{descriptor.generation}".encode())  # a late ack
    time.sleep(0.05)
    assert producer.poll() == {}
    assert p_engine.output_count(rid) == 1  # P's request still runs, unharmed
    _finish(p_engine, rid)


def test_a_failed_activation_leaks_nothing_and_activates_nothing(sides):
    producer, consumer = sides
    _, _, descriptor, d_engine = _handed_over(producer)
    transfer = consumer(d_engine).begin(descriptor)
    transfer.start()
    transfer.wait(30)
    kv = d_engine.kv  # another request takes all but 4 blocks after the check
    kv.reserve(999, (kv.free_blocks - 4) // kv.num_depths * kv.block_size)
    before = d_engine.pools()
    with pytest.raises(OutOfBlocksError, match="needs"):
        transfer.activate()
    assert d_engine.pools() == before and before["live_requests"] == 0
    assert transfer.state == "cancelled" and not transfer.tensors
    assert producer.settle(descriptor.generation) == "cancel"
    d_engine.kv.release(999)
    assert d_engine.pools() == _baseline(d_engine)


def test_a_consumer_too_small_is_refused_before_any_byte_moves(sides):
    producer, consumer = sides
    _, _, descriptor, d_engine = _handed_over(producer)
    kv = d_engine.kv  # all but 8 blocks taken
    kv.reserve(999, (kv.free_blocks - 8) // kv.num_depths * kv.block_size)
    d_side = consumer(d_engine)
    with pytest.raises(OutOfBlocksError, match=r"needs \d+ KV blocks \(\d+ of 240 free\)"):
        d_side.begin(descriptor)
    assert d_side.agent.posted == 0 and not d_side.agent.live
    producer.cancel(descriptor.generation)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ("format", "handoff descriptor format 2; this build reads 1"),
        ("config", "identity config_digest: snapshot '[0-9a-f]+', engine '[0-9a-f]+'"),
        ("model", "identity model: snapshot"),
        ("table", "does not match the manifest"),
    ],
)
def test_a_mismatched_descriptor_is_refused_by_name_before_any_byte_moves(sides, change, named):
    producer, consumer = sides
    model = tiny_model(seed=3)
    p_engine, rid = _prefilled(model, ALL_ON)
    descriptor = producer.export(p_engine, rid)
    d_model, d_config = model, ALL_ON
    if change == "format":
        descriptor = dataclasses.replace(descriptor, format=2)
    if change == "config":
        d_config = FlashLoopConfig.model_validate(
            ALL_ON.model_dump()
            | {"sparse_decode_attention": {"enabled": True, "key_retention": 0.5}}
        )
    if change == "model":
        d_model = tiny_model(seed=4)
    if change == "table":
        descriptor = dataclasses.replace(descriptor, tensors=descriptor.tensors[1:])
    d_engine = _engine(d_model, d_config)
    d_side = consumer(d_engine)
    with pytest.raises(SnapshotError, match=named):
        d_side.begin(descriptor)
    assert d_side.agent.posted == 0 and not d_side.agent.live
    assert d_engine.pools() == _baseline(d_engine)
    producer.cancel(descriptor.generation)


@pytest.mark.parametrize("config", [None, "configs/all_on.json"], ids=["dense", "all_on"])
def test_generate_pd_nixl_gives_the_single_engine_tokens(capsys, config):
    from flashloop_backend.cli.main import main

    base = ["generate", "--prompt", "def fibonacci(n):\n", "--max-new-tokens", "6", "--json"]
    base += ["--config", config] if config else []
    runs = []
    for extra in ([], ["--pd", "nixl"]):
        assert main(base + extra) == 0
        runs.append(json.loads(capsys.readouterr().out))
    alone, handed = runs
    assert handed["output_token_ids"] == alone["output_token_ids"]
    assert len(handed["output_token_ids"]) == 6
    pd = handed["pd"]
    assert pd["transport"] == "nixl"
    moved = pd["transferred_bytes"]
    assert moved["total"] == moved["packed"] + moved["bf16"] + moved["other"] > 0
    assert pd["bytes_per_prompt_token"] == moved["total"] / len(handed["prompt_token_ids"])
    assert set(pd["handoff_latency_s"]) >= {"export_s", "check_s", "transfer_s", "total_s"}


def test_generate_pd_refuses_what_it_does_not_combine_with(capsys, tmp_path):
    from flashloop_backend.cli.main import main

    code = main(["generate", "--prompt", "a", "--pd", "nixl", "--speculate", "4"])
    assert code == 2
    assert "--pd runs one --prompt through a handoff; leave out ['--speculate']" in (
        capsys.readouterr().err
    )
    code = main(["generate", "--prompt", "a", "--pd", "nixl", "--tp", "2"])
    assert code == 2
    assert "leave out ['--tp']" in capsys.readouterr().err


def test_without_nixl_generate_pd_names_the_package_and_the_install_command(capsys, monkeypatch):
    import sys

    from flashloop_backend.cli.main import main

    monkeypatch.setitem(sys.modules, "nixl._api", None)  # import of it raises ImportError
    assert main(["generate", "--prompt", "a", "--pd", "nixl"]) == 2
    err = capsys.readouterr().err
    assert "PD handoff needs the nixl package" in err
    assert 'pip install --no-deps "nixl==1.5.1" "nixl-cu13==1.5.1"' in err
