"""Packing a prompt never waits for the device (on the GPU): every call that stores a
prompt's rows in the packed store (a level carried from loop to loop, the last loop's
final rows; two compact levels, several appends each) runs under torch's sync debug mode
set to error, so a device read or a blocking copy from host memory there fails the
test. Such a wait would hold the host until
the steps already queued ran, so it could not plan the next step meanwhile."""

import json
from pathlib import Path

import pytest
import torch

from flashloop_backend import FlashLoopConfig, embedded_model_path
from flashloop_backend.capabilities import SupportRequest
from flashloop_backend.host import Engine, SamplingParams, load_model

pytestmark = pytest.mark.gpu
ALL_ON = Path(__file__).resolve().parents[1] / "configs" / "all_on.json"


def _without_syncs(method, calls: list[str]):
    def checked(*args, **kwargs):
        calls.append(method.__name__)
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return method(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(previous)

    return checked


def test_a_prompts_packing_runs_without_waiting_for_the_device():
    from flashloop_backend.registry import Registry

    settings = json.loads(ALL_ON.read_text())
    settings["token_sparse_prefill"]["retention"] = [1, 1, 0.75, 0.5]  # two compact levels
    config = FlashLoopConfig.from_dict(settings)
    model = load_model(embedded_model_path(), "cuda", torch.bfloat16)
    request = SupportRequest("cuda", torch.bfloat16, 128, 16, 2, 2)
    backend = Registry.discover().create("flashloop", request, config)
    engine = Engine(model, backend, num_blocks=2048, prefill_chunk=128, max_context=1024)
    engine.generate([[1, 2, 3] * 40], SamplingParams(max_new_tokens=2, ignore_eos=True))
    calls: list[str] = []
    packed = backend.packed
    packed.chunk_rows = 128  # several appends a level: compact spans read back, maps grown
    for name in ("pack_prompt_level", "pack_final_prompt_rows"):
        setattr(packed, name, _without_syncs(getattr(packed, name), calls))
    prompts = [[(7 * i + 3) % 200 for i in range(n)] for n in (700, 450)]
    out = engine.generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True))
    torch.cuda.synchronize()
    assert all(len(r.output_token_ids) == 4 for r in out)
    assert {"pack_prompt_level", "pack_final_prompt_rows"} <= set(calls)


def test_an_eager_decode_steps_packed_metadata_reaches_the_device_without_a_wait():
    """An eager (ungraphed) decode step plans its rows' packed-reader metadata (page
    tables, row maps: megabytes at long contexts) on the host; the upload must not wait
    for the steps already queued."""
    config = FlashLoopConfig.from_dict(json.loads(ALL_ON.read_text()))
    model = load_model(embedded_model_path(), "cuda", torch.bfloat16)
    from flashloop_backend.registry import Registry

    request = SupportRequest("cuda", torch.bfloat16, 128, 16, 2, 2)
    backend = Registry.discover().create("flashloop", request, config)
    engine = Engine(model, backend, num_blocks=2048, prefill_chunk=256, max_context=1024)
    calls: list[str] = []
    packed = backend.packed
    checked = _without_syncs(packed.plan, calls)
    decode_rows: list[int] = []

    def plan(view, sequences, depths):
        decode_rows.append(sum(s in packed.store.sequences for s in sequences))
        return checked(view, sequences, depths)

    packed.plan = plan
    prompts = [[(5 * i + 1) % 200 for i in range(n)] for n in (600, 300)]
    out = engine.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True))
    torch.cuda.synchronize()
    assert all(len(r.output_token_ids) == 6 for r in out)
    assert max(decode_rows) == 2  # steps planned both prompts' packed rows


def test_graph_steps_and_a_depths_selection_are_planned_without_waiting_for_the_device(
    monkeypatch,
):
    """A graphed decode step writes a row's packed page tables and maps into the graph's
    buffers when the row's sequence changed (requests joining and leaving), and a prompt's
    last row of a depth queues the next depth's token selection; neither may wait for
    the steps already queued (the selection reaches the host by an asynchronous copy).
    A selection taken after a read of the device finds its copy already run."""
    from flashloop_backend.host import prompt_schedule
    from flashloop_backend.host.graphs import GraphSettings
    from flashloop_backend.registry import Registry

    config = FlashLoopConfig.from_dict(json.loads(ALL_ON.read_text()))
    model = load_model(embedded_model_path(), "cuda", torch.bfloat16)
    request = SupportRequest("cuda", torch.bfloat16, 128, 16, 2, 2)
    backend = Registry.discover().create("flashloop", request, config)
    graphs = GraphSettings(buckets=(1, 2, 4), max_context=1024)
    engine = Engine(
        model, backend, num_blocks=2048, prefill_chunk=256, max_context=1024, cuda_graphs=graphs
    )
    calls: list[str] = []
    packed = backend.packed
    packed.plan_graph_step = _without_syncs(packed.plan_graph_step, calls)
    schedule = prompt_schedule.PromptSchedule
    checked_finish = _without_syncs(schedule.finish_depth, calls)
    monkeypatch.setattr(schedule, "finish_depth", lambda self, *a: checked_finish(self, *a))
    pending = prompt_schedule._PendingSelection
    made, already_copied = [], []
    real_init, real_copy = pending.__init__, pending.host_copy

    def init(self, *args):
        real_init(self, *args)
        made.append(self)

    def host_copy(self):
        if self.arrived:  # taken after a device read: its event has fired
            already_copied.append(self._copied.query())
        return real_copy(self)

    monkeypatch.setattr(pending, "__init__", init)
    monkeypatch.setattr(pending, "host_copy", host_copy)
    prompts = [[(3 * i + 2) % 200 for i in range(n)] for n in (700, 260, 500)]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    out = engine.generate(prompts, params)
    torch.cuda.synchronize()
    assert all(len(r.output_token_ids) == 8 for r in out)
    assert {"plan_graph_step", "finish_depth"} <= set(calls)
    assert len(made) == len(prompts)  # all on selects before loop 4 only
    assert all(already_copied), already_copied
    assert engine.graphs is not None and engine.graphs.replays > 0
