"""Decode steps through the CUDA-graph runner's fixed buffers (``capture=False`` on CPU:
the same planning, bucket padding and fixed widths a captured graph reads) give the same
tokens as the plain eager engine, for every feature combination; unsupported steps fall
back to eager with a reason, and bad settings fail with the value and the allowed ones."""

import pytest
import torch

from flashloop_backend import FlashLoopConfig
from flashloop_backend.config import ConfigError
from flashloop_backend.host import Engine, SamplingParams
from flashloop_backend.host.graphs import GraphSettings
from flashloop_backend.registry import Registry

from .host_helpers import tiny_model
from .test_feature_combinations import (
    COMBINATION_IDS,
    COMBINATIONS,
    PROMPTS,
    REQUEST,
    _config,
    _engine,
)

EAGER_GRAPHS = GraphSettings(buckets=(1, 2, 4), max_context=128, capture=False)


@pytest.mark.parametrize(
    "flags", COMBINATIONS, ids=COMBINATION_IDS
)  # fmt: skip
def test_graph_buffers_give_the_eager_tokens(flags):
    model = tiny_model(seed=7)
    config = _config(flags)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    plain = _engine(model, config, max_batch_tokens=24).generate(PROMPTS, params)
    engine = _engine(model, config, max_batch_tokens=24, cuda_graphs=EAGER_GRAPHS)
    graphed = engine.generate(PROMPTS, params)
    assert [r.output_token_ids for r in graphed] == [r.output_token_ids for r in plain]
    stats = engine.graphs.stats()
    assert stats["eager_steps"] > 0  # decode-only steps went through the fixed buffers
    assert set(stats["fallbacks"]) <= {"the step has prefill rows"}


def test_steps_beyond_the_buckets_or_capacity_run_eagerly_with_a_reason(caplog):
    model = tiny_model(seed=7)
    config = _config({"token_sparse_prefill": False, "sparse_decode_attention": True,
                      "kv_residual_quantization": True})  # fmt: skip
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    plain = _engine(model, config).generate(PROMPTS, params)
    small = GraphSettings(buckets=(1, 2), max_context=36, capture=False)
    engine = _engine(model, config, cuda_graphs=small)
    with caplog.at_level("WARNING"):
        graphed = engine.generate(PROMPTS, params)
    assert [r.output_token_ids for r in graphed] == [r.output_token_ids for r in plain]
    reasons = " | ".join(engine.graphs.stats()["fallbacks"])
    assert "3 decode rows exceed the largest bucket 2" in reasons
    assert "exceeds the graph capacity" in reasons  # the 40-token prompt is wider than 36
    assert "runs eagerly (same backend and kernels)" in caplog.text


def test_padding_rows_leave_every_allocatable_block_as_eager():
    """A bucket of 4 for one request: tokens and every allocatable KV block equal the plain
    engine's (the three padding rows write only into the scratch block past them)."""
    model = tiny_model(seed=3)
    config = FlashLoopConfig(sparse_decode_attention={"enabled": True, "key_retention": 0.3})
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    plain = _engine(model, config)
    tokens = plain.generate(PROMPTS[:1], params)[0].output_token_ids
    engine = _engine(model, config, cuda_graphs=GraphSettings(buckets=(4,), max_context=64, capture=False))  # fmt: skip
    assert engine.generate(PROMPTS[:1], params)[0].output_token_ids == tokens
    blocks, tol = plain.kv.num_blocks, {"atol": 1e-4, "rtol": 1e-3}  # GEMMs of 4 rows vs 1
    torch.testing.assert_close(engine.kv.key_pool[:blocks], plain.kv.key_pool[:blocks], **tol)
    torch.testing.assert_close(engine.kv.value_pool[:blocks], plain.kv.value_pool[:blocks], **tol)


def test_settings_are_checked():
    with pytest.raises(
        ValueError, match=r"buckets \(4, 2\) must be positive and strictly increasing"
    ):
        GraphSettings(buckets=(4, 2))
    with pytest.raises(ValueError, match="max_context"):
        GraphSettings(max_context=0)
    with pytest.raises(ValueError, match="extra"):
        GraphSettings(bucket=(1,))


def test_capture_needs_a_graph_safe_backend_and_a_cuda_device():
    model = tiny_model()
    backend = Registry.discover().create("flashloop", REQUEST, FlashLoopConfig())
    with pytest.raises(ConfigError, match=r"cannot capture this backend: op 'dense_attention' runs on kernel provider 'torch_reference'.*cuda_graphs"):  # fmt: skip
        Engine(model, backend, num_blocks=16, block_size=4, cuda_graphs=GraphSettings())


def test_graph_blockers_name_the_ops_of_every_combination():
    """Every combination names exactly the decode ops whose CPU kernels lack cuda_graphs."""
    from flashloop_backend.dispatch import routable_ops

    for flags in COMBINATIONS:
        config = _config(flags)
        backend = Registry.discover().create("flashloop", REQUEST, config)
        named = {reason.split("'")[1] for reason in backend.graph_blockers()}
        assert named == {op.value for op in routable_ops(config, decode_only=True)}
    dense = Registry.discover().create("torch", REQUEST, FlashLoopConfig())
    assert "does not declare 'cuda_graphs'" in dense.graph_blockers()[0]


def _every_row(needed, fn, q, meta, block_tables, *per_row):
    """``torch_packed._only_rows`` without its host read of the mask (the reference picks
    rows on the host, which a capture would bake in): every row runs, unneeded rows are
    overwritten with the same fill."""
    result = fn(q, meta, block_tables, *per_row)

    def keep(t):
        mask = needed.view(-1, *[1] * (t.dim() - 1))
        return torch.where(mask, t, torch.full_like(t, -1 if t.dtype == torch.int32 else 0))

    return tuple(keep(t) for t in result) if isinstance(result, tuple) else keep(result)


def _recorded(flags, monkeypatch):
    """(plain engine's tokens of PROMPTS, an engine capturing with the CPU recorder, the
    sampling parameters) for a feature combination."""
    from flashloop_backend.kernels.torch_ref import packed as torch_packed

    from .graph_recorder import RecordingCapture

    monkeypatch.setattr(torch_packed, "_only_rows", _every_row)
    model = tiny_model(seed=7)
    config = _config(flags)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    plain = _engine(model, config, max_batch_tokens=24).generate(PROMPTS, params)
    settings = GraphSettings(buckets=(1, 2, 4), max_context=128)
    engine = _engine(model, config, max_batch_tokens=24, cuda_graphs=settings,
                     graph_capture=RecordingCapture())  # fmt: skip
    return [r.output_token_ids for r in plain], engine, params


@pytest.mark.parametrize(
    "flags", COMBINATIONS, ids=COMBINATION_IDS
)  # fmt: skip
def test_mixed_steps_split_replay_their_decode_rows_and_give_the_eager_tokens(flags, monkeypatch):
    """``split_mixed_steps``: a step with prompt chunks replays its decode rows from a
    recorded graph and runs the chunks eagerly; the tokens equal one eager traversal's,
    and more steps replay than without the split."""
    from .graph_recorder import RecordingCapture

    plain, split, params = _recorded(flags, monkeypatch)
    assert split.graphs.settings.split_mixed_steps  # the default
    assert [r.output_token_ids for r in split.generate(PROMPTS, params)] == plain
    settings = GraphSettings(buckets=(1, 2, 4), max_context=128, split_mixed_steps=False)
    whole = _engine(tiny_model(seed=7), _config(flags), max_batch_tokens=24,
                    cuda_graphs=settings, graph_capture=RecordingCapture())  # fmt: skip
    assert [r.output_token_ids for r in whole.generate(PROMPTS, params)] == plain
    assert split.graphs.stats()["replays"] > whole.graphs.stats()["replays"]


@pytest.mark.parametrize(
    "flags", COMBINATIONS, ids=COMBINATION_IDS
)  # fmt: skip
def test_recorded_replays_give_the_eager_tokens(flags, monkeypatch):
    """Capture and replay with the CPU recorder: replays run no Python, so everything the
    traversal needs must be read from the fixed buffers; the tokens equal eager's."""
    plain, engine, params = _recorded(flags, monkeypatch)
    graphed = engine.generate(PROMPTS, params)
    stats = engine.graphs.stats()
    assert stats["replays"] > 0 and len(stats["graphs"]) >= 2, stats
    assert [r.output_token_ids for r in graphed] == plain


@pytest.mark.parametrize(
    "flags", COMBINATIONS, ids=COMBINATION_IDS
)  # fmt: skip
def test_graphs_captured_on_padding_rows_at_warm_up_serve_every_later_step(flags, monkeypatch):
    """``Engine.warm_up`` captures every graph key a decode step can meet, on padding rows
    (``DecodeGraphs.prepare_every_key``): serving then captures nothing, and the replays
    of those graphs, which read the real rows from the fixed buffers, give the eager
    tokens."""
    plain, engine, params = _recorded(flags, monkeypatch)
    engine.warm_up()
    captured = set(engine.graphs.graphs)
    loops = engine.cfg.total_ut_steps
    deepest = engine.backend.graph_variants(frozenset({loops - 1}))
    assert deepest == ((1, loops) if flags["kv_residual_quantization"] else (1,))
    one_depth = engine.align_decode_depths
    assert engine.graphs.prepare_every_key(engine.max_slots, loops, one_depth) == 0  # all there
    replays = engine.graphs.replays
    graphed = engine.generate(PROMPTS, params)
    assert set(engine.graphs.graphs) == captured
    assert engine.graphs.replays > replays
    assert [r.output_token_ids for r in graphed] == plain


def test_recorded_replays_catch_a_plan_made_outside_the_capture(monkeypatch):
    """The negative control: if the capture reused the warm-up's batch view (so the
    backend's per-view plan was made before capturing), replays keep the first step's
    gather order and lengths and the tokens change."""
    from flashloop_backend.host import graphs

    from .graph_recorder import RecordingCapture

    model = tiny_model(seed=7)
    config = FlashLoopConfig()
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    plain = _engine(model, config, max_batch_tokens=24).generate(PROMPTS, params)
    made: dict[int, object] = {}
    original = graphs.DecodeGraphs._view

    def reused(self, bucket, depths):
        return made.setdefault((bucket, depths), original(self, bucket, depths))

    monkeypatch.setattr(graphs.DecodeGraphs, "_view", reused)
    engine = _engine(model, config, max_batch_tokens=24,
                     cuda_graphs=GraphSettings(buckets=(1, 2, 4), max_context=128),
                     graph_capture=RecordingCapture())  # fmt: skip
    graphed = engine.generate(PROMPTS, params)
    assert [r.output_token_ids for r in graphed] != [r.output_token_ids for r in plain]


def test_capture_on_a_cpu_cache_is_refused_by_device():
    from flashloop_backend.host.graphs import DecodeGraphs
    from flashloop_backend.host.kvcache import PagedKVCache

    class GraphSafe:  # a backend whose decode kernels all declare cuda_graphs
        def graph_blockers(self):
            return []

    kv = PagedKVCache(8, 1, 4, 2, 16, 4, torch.float32, "cpu")
    with pytest.raises(
        ConfigError, match="CUDA graph capture needs a CUDA device; the KV cache is on cpu"
    ):
        DecodeGraphs(GraphSettings(), kv, GraphSafe(), 64, 128, lambda h, b: h)


def test_batch_shapes_are_checked():
    from flashloop_backend.dispatch import BatchView, RowMode
    from flashloop_backend.host.batch import RowGroup, build_batch
    from flashloop_backend.host.kvcache import PagedKVCache

    kv = PagedKVCache(64, 1, 4, 2, 16, 4, torch.float32, "cpu")
    kv.reserve(0, 40)
    groups = [RowGroup(0, RowMode.DECODE, 0, 30, 1)]
    with pytest.raises(ValueError, match=r"table_width=3 is below the widest block table \(10\)"):
        build_batch(groups, kv, "cpu", table_width=3)
    view = build_batch(groups, kv, "cpu", pad_to=2).view
    assert view.decode_only and view.decode_bound == 1 and view.decode_depths == {0}
    fields = {name: getattr(view, name) for name in ("positions", "depths", "row_modes", "slots",
              "incarnations", "request_ids", "window_ids", "context_lengths", "block_tables")}  # fmt: skip
    with pytest.raises(ValueError, match=r"decode_bound=3 must lie in \[0, rows=2\]"):
        BatchView(**fields, decode_bound=3)
    assert view.verify_rows == 1  # no verification group
    verify = RowGroup(0, RowMode.VERIFY, 1, 31, 3, row_slots=(0, 1, 2), row_incarnations=(0,) * 3)
    assert build_batch([groups[0], verify], kv, "cpu").view.verify_rows == 3
    for bad, fragment in ((0, "verify_rows=0 must be >= 1"), (True, "verify_rows=True must be")):
        with pytest.raises(ValueError, match=fragment):
            BatchView(**fields, verify_rows=bad)
    with pytest.raises(ValueError, match=r"decode_depths=\[-1\] must be depths >= 0"):
        BatchView(**fields, decode_depths=frozenset({-1}))
    with pytest.raises(ValueError, match=r"prefill_depths=\[-2, 1\] must be depths >= 0"):
        BatchView(**fields, prefill_depths=frozenset({1, -2}))
    assert view.prefill_depths == frozenset()  # a decode batch has no prefill rows


def test_graph_metadata_reads_what_the_per_batch_plan_reads(monkeypatch):
    """The graph runner rewrites a row's page tables and maps only when its sequence or
    packing changed: at every step, everything a reader can see (kinds, packed lengths,
    and tables/maps of the levels a row reads) equals the per-batch plan's, while rows
    finish at different steps and the others move up."""
    from flashloop_backend.backends.packed_state import _GraphInputs
    from flashloop_backend.kv.levels import LevelKind, level_metadata

    model = tiny_model(seed=7)
    config = _config({"token_sparse_prefill": True, "kv_residual_quantization": True})
    engine = _engine(model, config, max_batch_tokens=24, cuda_graphs=EAGER_GRAPHS)
    original, checked, rewrites = _GraphInputs.fill, [], []
    fill_ = torch.Tensor.fill_

    def counting_fill(tensor, value):
        rewrites.append(1)
        return fill_(tensor, value)

    def compared(self, sequences, depths):
        step = original(self, sequences, depths)
        if step.reason is None:
            bucket, levels = len(sequences), step.variant
            widths = (levels, self.pages, self.packed_rows)
            plan = level_metadata(self.store, sequences, depths, "cpu", widths)
            mine = self.meta.first_levels(bucket, levels)
            assert torch.equal(mine.kinds, plan.kinds)
            assert torch.equal(mine.packed_lengths, plan.packed_lengths)
            read = plan.kinds != LevelKind.EMPTY
            for name in ("tables", "maps"):
                assert torch.equal(getattr(mine, name)[read], getattr(plan, name)[read]), name
            checked.append(sum(s is not None for s in sequences))
        return step

    monkeypatch.setattr(_GraphInputs, "fill", compared)
    monkeypatch.setattr(torch.Tensor, "fill_", counting_fill)
    lengths = [3, 6, 9]  # requests leave at different steps: rows shift
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lengths]
    engine.generate(PROMPTS, params)
    assert len(set(checked)) > 1 and len(checked) > 10
    assert len(rewrites) < len(checked)  # most steps rewrote no row's tables


def test_replays_are_timed_per_graph_key_when_asked():
    """After ``time_replays`` every replay is bracketed by the capture's events and
    ``replay_ms`` reports each key's median, mean, max, total and count."""
    import time

    from .graph_recorder import RecordingCapture

    class Event:
        def record(self):
            self.at = time.perf_counter()

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return 1e3 * (end.at - self.at)

    class TimedCapture(RecordingCapture):
        def event(self):
            return Event()

    model = tiny_model(seed=7)
    config = _config({"sparse_decode_attention": True})
    engine = _engine(model, config, max_batch_tokens=24, graph_capture=TimedCapture(),
                     cuda_graphs=GraphSettings(buckets=(1, 2, 4), max_context=128))  # fmt: skip
    engine.graphs.time_replays()
    engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, ignore_eos=True))
    timed = engine.graphs.replay_ms()
    assert sum(t["replays"] for t in timed.values()) == engine.graphs.replays > 0
    assert all(t["median_ms"] > 0 for t in timed.values())
    for t in timed.values():
        assert t["max_ms"] >= t["median_ms"] and t["max_ms"] >= t["mean_ms"] > 0
        assert t["total_ms"] == pytest.approx(t["mean_ms"] * t["replays"])
    assert any("sparse_correction" in key for key in timed)  # keys name the launched ops


def test_a_capture_collects_garbage_first_and_none_while_capturing(monkeypatch):
    """A dropped engine is a reference cycle holding graphs: collected during another
    engine's capture it would destroy them there and invalidate that capture."""
    import contextlib
    import gc

    from flashloop_backend.host.graphs import CudaCapture

    seen = []

    class Cycle:  # garbage whose collection is visible
        def __init__(self):
            self.me = self

        def __del__(self):
            seen.append(("collected", gc.isenabled()))

    @contextlib.contextmanager
    def fake_graph(graph, pool):
        seen.append(("capture", gc.isenabled()))
        yield

    monkeypatch.setattr(torch.cuda, "graph", fake_graph)
    capture = object.__new__(CudaCapture)
    capture.pool = None
    Cycle()
    with capture.capturing(object()):
        seen.append(("inside", gc.isenabled()))
    assert seen == [("collected", True), ("capture", False), ("inside", False)]
    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="boom"), capture.capturing(object()):
        raise RuntimeError("boom")
    assert gc.isenabled()
