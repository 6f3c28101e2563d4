"""Where serving steps wait for the device: ``bench capacity``'s workload for one variant
(Ouro-1.4B shapes, random weights, CUDA graphs, split mixed steps), with torch's sync
debug mode set to warn during every timed step. Per kind of step (the loop depths of its
prompt chunks, or decode only) it records the steps, their host time and each place in
the package that synchronized (the innermost package frames of the call), with counts.

    python3 scripts/sync_census.py --variant config --config configs/all_on.json \
        --context 32768 --gib 16 --layers 4 --new-tokens 256 --clients 16 \
        --json sync_census.json

torch's sync debug mode sees device-to-host copies, blocking host-to-device copies from
pageable memory and stream or device synchronizations made through torch; waits inside
other libraries' own CUDA calls (FlashInfer's plan) do not show. Host times are longer
than without the census: the warnings take host time."""

import argparse
import collections
import json
import time
import traceback
import warnings
from pathlib import Path

import torch

from flashloop_backend.tools.bench import capacity
from flashloop_backend.tools.bench.workload import percentiles

PACKAGE = "flashloop_backend"


def _sites(frames: int) -> str:
    """The innermost ``frames`` package frames of the current stack, outermost first."""
    stack = [f for f in traceback.extract_stack() if PACKAGE in f.filename]
    stack = [f for f in stack if "sync_census" not in f.filename][-frames:]
    return " > ".join(f"{f.filename.split(PACKAGE + '/')[-1]}:{f.lineno} {f.name}" for f in stack)


def _kind(engine) -> str:
    depths = sorted({r.depth for r in engine._requests.values() if r.phase == "prefill"})
    return "prompt depths " + ",".join(map(str, depths)) if depths else "decode only"


def census_step(census: dict, frames: int):
    """``wrap_step`` for ``bench capacity``: each engine step under the sync debug mode's
    warnings, counted by kind of step."""

    def wrap(engine, step):
        def counted_step():
            entry = census.setdefault(
                _kind(engine), {"steps": 0, "host_ms": [], "syncs": collections.Counter()}
            )
            shown = warnings.showwarning

            def record(message, category, filename, lineno, file=None, line=None):
                entry["syncs"][_sites(frames)] += 1

            began = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = record
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    return step()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                    warnings.showwarning = shown
                    entry["steps"] += 1
                    entry["host_ms"].append(1e3 * (time.perf_counter() - began))

        return counted_step

    return wrap


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    capacity.add_workload_arguments(parser, new_tokens=256, clients=16)
    parser.add_argument("--frames", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    census: dict = {}
    record = capacity.bench_variant(args, census_step(census, args.frames))
    kinds = {}
    for kind, entry in sorted(census.items()):
        host = percentiles(entry["host_ms"])
        kinds[kind] = {
            "steps": entry["steps"],
            "host_ms_p50": host["p50"],
            "host_ms_p99": host["p99"],
            "syncs_per_step": sum(entry["syncs"].values()) / max(1, entry["steps"]),
            "sites": dict(entry["syncs"].most_common()),
        }
        print(
            f"{kind}: {entry['steps']} steps, host ms p50 / p99 "
            f"{kinds[kind]['host_ms_p50']:.2f} / {kinds[kind]['host_ms_p99']:.2f}, "
            f"{kinds[kind]['syncs_per_step']:.2f} syncs a step"
        )
        for site, count in entry["syncs"].most_common(8):
            print(f"    {count:6d}  {site}")
    if args.json:
        args.json.write_text(json.dumps({"census": kinds, "capacity": record}, indent=1))


if __name__ == "__main__":
    main()
