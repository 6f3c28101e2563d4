"""Where a prompt's wall time goes on the host: each prefill step's host time (until
``Engine.step`` returns) beside the time then spent waiting for the device, and the
Python functions that take the host time (cProfile over one more pass).

    python3 scripts/profile_host.py --backend flashloop --config configs/all_on.json \
        --context 8192 --layers 24 --json host_all_on_8k.json

On a GPU the model has Ouro-1.4B shapes with random weights; ``--tiny`` (any device) a
small model of the same depth, so the host's own work shows beside small kernels. A
step whose wait is near zero is host-bound: the device idled while the host planned.

``--decode N`` profiles decode instead: N-token decodes of ``--concurrency`` requests
(one by default) from CUDA graphs (``--graphs``) or eager, each step's wall time beside the GPU time of its graph replays,
and cProfile over one more decode (the host's share of a token)."""

import argparse
import cProfile
import io
import json
import pstats
import time

import torch

from flashloop_backend import FlashLoopConfig
from flashloop_backend.host.config import OuroConfig
from flashloop_backend.host.engine import Engine, SamplingParams
from flashloop_backend.host.model import OuroModel
from flashloop_backend.registry import Registry
from flashloop_backend.tools.bench.bench_models import random_ouro


def _model(args):
    if not args.tiny:
        return random_ouro(args.layers, 16)
    cfg = OuroConfig(
        hidden_size=128,
        num_hidden_layers=args.layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=256,
        vocab_size=512,
        total_ut_steps=4,
        max_position_embeddings=65536,
    )
    torch.manual_seed(0)
    model = OuroModel(cfg).eval()
    return model, model.support_request(16)


def _pass(engine, prompts, new_tokens):
    """[(host s, wait s, prefill rows)] per step until every first token is out."""
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else lambda: None
    ids = [
        engine.add_request(p, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
        for p in prompts
    ]
    steps = []
    while not all(engine.has_first_token(i) for i in ids):
        rows = engine.prefill_rows_run
        start = time.perf_counter()
        engine.step()
        issued = time.perf_counter()
        sync()
        steps.append((issued - start, time.perf_counter() - issued, engine.prefill_rows_run - rows))
    while engine.has_unfinished():
        engine.step()
    sync()
    return steps


def _decode(engine, prompts, new_tokens, profiler=None):
    """Wall ms of every decode step once every request of ``prompts`` has its first token."""
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else lambda: None
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    while not all(engine.has_first_token(i) for i in ids):
        engine.step()
    sync()
    walls = []
    if profiler is not None:
        profiler.enable()
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        walls.append(1e3 * (time.perf_counter() - start))
    sync()
    if profiler is not None:
        profiler.disable()
    return walls


def _profile_decode(engine, prompts, args) -> dict:
    """The decode record: step walls, replay GPU ms by graph key and the top functions."""
    _decode(engine, prompts, args.decode)  # compiles and captures every decode graph
    if engine.graphs is not None:
        engine.graphs.time_replays()
    walls = _decode(engine, prompts, args.decode)
    replays = engine.graphs.replay_ms() if engine.graphs is not None else {}
    profiler = cProfile.Profile()
    profiled = _decode(engine, prompts, args.decode, profiler)
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(args.rows)
    stats.sort_stats("cumulative").print_stats(args.rows)
    print(text.getvalue())
    median = sorted(walls)[len(walls) // 2]
    replay_sum = sum(r["median_ms"] for r in replays.values())
    for key, r in replays.items():
        print(f"replay {key}: median {r['median_ms']:.3f} ms over {r['replays']}")
    print(
        f"decode step wall median {median:.3f} ms (profiled {sorted(profiled)[len(profiled) // 2]:.3f}),"
        f" replay medians sum {replay_sum:.3f} ms: {median - replay_sum:.3f} ms outside the replays"
    )
    return {"step_wall_ms": walls, "replay_ms_by_key": replays, "top_functions": text.getvalue()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", default="flashloop")
    parser.add_argument("--config")
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--prefill-chunk", type=int, default=2048)
    parser.add_argument("--tiny", action="store_true", help="a small model (CPU or GPU)")
    parser.add_argument("--rows", type=int, default=30, help="functions listed")
    parser.add_argument("--json", help="write the record here")
    parser.add_argument("--decode", type=int, help="profile decode steps of this many tokens")
    parser.add_argument("--graphs", action="store_true", help="decode from CUDA graphs")
    parser.add_argument(
        "--concurrency", type=int, default=1, help="requests decoding together (decode only)"
    )
    args = parser.parse_args()
    model, request = _model(args)
    rows = args.concurrency if args.decode else 1
    config = FlashLoopConfig()
    if args.config:
        config = FlashLoopConfig.from_dict(json.load(open(args.config)))
    graphs = None
    if args.graphs:
        from flashloop_backend.capabilities import Capability
        from flashloop_backend.host.graphs import GraphSettings

        request = request.with_required({Capability.CUDA_GRAPHS})
        buckets = tuple(sorted({1, args.concurrency}))
        graphs = GraphSettings(buckets=buckets, max_context=args.context + 64 + (args.decode or 2))
    backend = Registry.discover().create(args.backend, request, config)
    engine = Engine(
        model,
        backend,
        num_blocks=rows * (-(-(args.context + 64) // 16)) * model.config.total_ut_steps + 8,
        block_size=16,
        prefill_chunk=args.prefill_chunk,
        max_batch_tokens=args.prefill_chunk,
        max_context=args.context + 64 + (args.decode or 2),
        max_slots=rows,
        cuda_graphs=graphs,
    )
    prompt = torch.randint(0, model.config.vocab_size, (args.context,)).tolist()
    if args.decode:
        _pass(engine, [prompt[: args.prefill_chunk]], 2)  # compiles every prefill kernel
        prompts = [prompt[i:] + prompt[:i] for i in range(rows)]  # distinct prompts
        record = _profile_decode(engine, prompts, args)
        record.update(backend=args.backend, config=args.config, context=args.context)
        record.update(concurrency=rows)
        record.update(layers=args.layers, graphs=args.graphs, device=str(engine.device))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(record, f, indent=1)
        return 0
    _pass(engine, [prompt[: args.prefill_chunk]], 2)  # compiles every kernel
    _pass(engine, [prompt], 2)  # the timed length's shapes
    steps = _pass(engine, [prompt], 2)
    profiler = cProfile.Profile()
    profiler.enable()
    _pass(engine, [prompt], 2)
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text).sort_stats("tottime")
    stats.print_stats(args.rows)
    print(text.getvalue())
    host, wait = sum(s[0] for s in steps), sum(s[1] for s in steps)
    for i, (h, w, rows) in enumerate(steps):
        print(f"step {i:2d}: {rows:6d} rows, host {1e3 * h:7.2f} ms, wait {1e3 * w:7.2f} ms")
    print(f"TTFT {host + wait:.3f} s: host {host:.3f} s, waiting for the device {wait:.3f} s")
    record = {
        "backend": args.backend,
        "config": args.config,
        "context": args.context,
        "layers": args.layers,
        "tiny": args.tiny,
        "device": str(engine.device),
        "steps": [{"host_s": h, "wait_s": w, "prefill_rows": r} for h, w, r in steps],
        "host_s": host,
        "wait_s": wait,
        "top_functions": text.getvalue(),
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
