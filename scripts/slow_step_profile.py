"""What the slowest prompt steps of a serving run do: ``bench capacity``'s workload for one
variant (Ouro-1.4B shapes, random weights, CUDA graphs, split mixed steps), where every
step that runs prompt rows at one of ``--depths`` (zero-based loop depths) starts on an
idle device and runs under torch.profiler. Per such step it records the host time, the
GPU kernels' summed time, each kernel's and each host op's share, and the pauses no torch
op shows (garbage collector passes, Triton compiles or cache loads, the caching
allocator's retries and device mallocs and frees); it prints the slowest steps by host
time and by kernel time with their prompt chunks.

    python3 scripts/slow_step_profile.py --variant config --config configs/all_on.json \
        --context 32768 --gib 16 --layers 4 --new-tokens 1024 --clients 24 --depths 3 \
        --json slow_steps.json

A profiled step's host time runs to the step's return (a step that samples waits for
the device there) and includes the profiler's own overhead; the wait before the step
removes the device's lag behind the host. Compare profiled steps with each other, not
with a capacity record's step times."""

import argparse
import gc
import json
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from flashloop_backend.tools.bench import capacity


def _chunks(engine, depths: set[int]) -> list[dict]:
    """The prompts at ``depths`` before a step: request, depth, next chunk start, length."""
    return [
        {"request": r.id, "depth": r.depth, "chunk_start": r.chunk_start, "prompt": len(r.prompt)}
        for r in engine._requests.values()
        if r.phase == "prefill" and r.depth in depths
    ]


def _top(events, key: str, rows: int) -> list[tuple[str, float, int]]:
    """(name, ms, calls) of the ``rows`` events with the most ``key`` time."""
    ranked = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:rows]
    return [(e.key[:90], getattr(e, key) / 1e3, e.count) for e in ranked if getattr(e, key) > 0]


class _Pauses:
    """While entered: the garbage collector's passes (count and host ms) and Triton's
    in-memory cache misses (a compile or a load from its disk cache, by kernel name), the
    pauses no torch op shows."""

    def __init__(self) -> None:
        self.gc_ms, self.collections, self.triton_loads = 0.0, 0, []
        self._started: float | None = None

    def _collected(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.gc_ms += 1e3 * (time.perf_counter() - self._started)
            self.collections += 1
            self._started = None

    def _loaded(self, **hook) -> bool:
        self.triton_loads.append(hook["fn"].name)
        return False  # compile as usual

    def __enter__(self) -> "_Pauses":
        from triton import knobs

        gc.callbacks.append(self._collected)
        self._saved_hook = knobs.runtime.jit_cache_hook
        knobs.runtime.jit_cache_hook = self._loaded
        return self

    def __exit__(self, *exc) -> None:
        from triton import knobs

        gc.callbacks.remove(self._collected)
        knobs.runtime.jit_cache_hook = self._saved_hook


class Enough(Exception):
    """Raised after a step once the profile holds the steps asked for."""


def profiled_step(
    steps: list[dict],
    depths: set[int],
    rows: int,
    slow_ms: float,
    together: bool = False,
    starts: set[int] | None = None,
    stop_after: int | None = None,
    shapes: set[str] | None = None,
):
    """``wrap_step`` for ``bench capacity``: each step at ``depths`` (with ``together``,
    only a step with prompt rows at every one of them) profiled from an idle device; a
    step over ``slow_ms`` of host or kernel time is reported at once. ``starts``: only
    steps where such a chunk starts at one of these prompt rows (None: any); ``stop_after``:
    the workload ends (:class:`Enough`) once that many steps are profiled. ``shapes``: torch
    op names whose every call keeps its input shapes and self host ms (which tensors a slow
    op touched). Each step also keeps the CUDA caching allocator's counters over it (its
    retries free cached blocks and synchronise the device, inside whichever op allocates)."""

    def wrap(engine, step):
        def profiled():
            chunks = _chunks(engine, depths)
            if not chunks or (together and {c["depth"] for c in chunks} != depths):
                return step()
            if starts is not None and not any(c["chunk_start"] in starts for c in chunks):
                return step()
            torch.cuda.synchronize()
            with (
                profile(
                    activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                    record_shapes=bool(shapes),
                ) as prof,
                _Pauses() as pauses,
            ):
                before = _allocator_counts()
                began = time.perf_counter()
                out = step()
                host_ms = 1e3 * (time.perf_counter() - began)
                torch.cuda.synchronize()  # the step's kernels all end inside the profile
                after = _allocator_counts()
            events = prof.key_averages()
            kernels = [
                e for e in events if e.device_time_total > 0 and e.device_type.name == "CUDA"
            ]
            kernel_ms = sum(e.self_device_time_total for e in kernels) / 1e3
            if host_ms > slow_ms or kernel_ms > slow_ms:  # shown as it happens
                print(
                    f"step {engine.steps}: host {host_ms:.2f} ms, kernels {kernel_ms:.2f} ms, "
                    f"gc {pauses.collections} passes {pauses.gc_ms:.2f} ms, "
                    f"Triton loads {pauses.triton_loads}"
                )
            steps.append(
                {
                    "index": engine.steps,
                    "chunks": chunks,
                    "host_ms": host_ms,
                    "kernel_ms": kernel_ms,
                    "kernels": _top(kernels, "self_device_time_total", rows),
                    "host_ops": _top(events, "self_cpu_time_total", rows),
                    "gc_passes": pauses.collections,
                    "gc_ms": pauses.gc_ms,
                    "triton_loads": pauses.triton_loads,
                    "allocator": {k: after[k] - before[k] for k in after},
                    **({"shapes": _op_shapes(prof, shapes)} if shapes else {}),
                }
            )
            if stop_after is not None and len(steps) >= stop_after:
                raise Enough
            return out

        return profiled

    return wrap


def _allocator_counts() -> dict[str, int]:
    """The caching allocator's retry, device malloc and device free counts so far."""
    stats = torch.cuda.memory_stats()
    return {
        k: stats.get(k, 0) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free")
    }


def _op_shapes(prof, names: set[str]) -> list[tuple[str, float, str]]:
    """(op, self host ms, input shapes) of every call of the ops ``names``, slowest first."""
    calls = [
        (e.name, e.self_cpu_time_total / 1e3, str(e.input_shapes)[:160])
        for e in prof.events()
        if e.name in names
    ]
    return sorted(calls, key=lambda call: call[1], reverse=True)


def _show(title: str, steps: list[dict], key: str, count: int) -> None:
    print(title)
    for s in sorted(steps, key=lambda s: s[key], reverse=True)[:count]:
        print(
            f"  step {s['index']}: host {s['host_ms']:.2f} ms, kernels {s['kernel_ms']:.2f} ms, "
            f"gc {s['gc_ms']:.2f} ms, Triton loads {s['triton_loads']}, chunks {s['chunks']}"
        )
        for name, ms, calls in s["kernels"]:
            print(f"      gpu  {ms:8.3f} ms {calls:5d}x  {name}")
        for name, ms, calls in s["host_ops"]:
            print(f"      host {ms:8.3f} ms {calls:5d}x  {name}")
        print(f"      allocator {s['allocator']}")
        for name, ms, shapes in s.get("shapes", [])[:12]:  # the slowest calls
            print(f"      call {ms:8.3f} ms  {name} {shapes}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    capacity.add_workload_arguments(parser, new_tokens=1024, clients=24)
    parser.add_argument("--depths", default="3", help="zero-based loop depths, comma-separated")
    parser.add_argument("--show", type=int, default=5, help="slowest steps printed per ranking")
    parser.add_argument("--rows", type=int, default=8, help="kernels and host ops per step")
    parser.add_argument("--slow-ms", type=float, default=25.0, help="steps reported at once")
    parser.add_argument(
        "--together", action="store_true", help="only steps with prompt rows at every depth"
    )
    parser.add_argument(
        "--starts", help="only steps with a chunk starting at one of these rows, comma-separated"
    )
    parser.add_argument(
        "--shapes", help="torch ops whose calls keep their input shapes, comma-separated"
    )
    parser.add_argument("--stop-after", type=int, help="end the run after this many profiled steps")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    starts = {int(r) for r in args.starts.split(",")} if args.starts else None
    depths = {int(d) for d in args.depths.split(",")}
    steps: list[dict] = []
    wrap = profiled_step(
        steps,
        depths,
        args.rows,
        args.slow_ms,
        args.together,
        starts,
        args.stop_after,
        set(args.shapes.split(",")) if args.shapes else None,
    )
    try:
        capacity.bench_variant(args, wrap)
    except Enough:
        print(f"stopped after {len(steps)} profiled steps")
    host = sorted(s["host_ms"] for s in steps)
    gpu = sorted(s["kernel_ms"] for s in steps)
    if steps:
        print(
            f"{len(steps)} profiled steps: host ms median {host[len(host) // 2]:.2f}, max "
            f"{host[-1]:.2f}; kernel ms median {gpu[len(gpu) // 2]:.2f}, max {gpu[-1]:.2f}"
        )
    _show("slowest by host time:", steps, "host_ms", args.show)
    _show("slowest by kernel time:", steps, "kernel_ms", args.show)
    if args.json:
        args.json.write_text(json.dumps({"depths": sorted(depths), "steps": steps}, indent=1))


if __name__ == "__main__":
    main()
