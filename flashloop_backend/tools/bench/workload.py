"""Serving workloads through the host: a fixed-arrival mixed workload (requests arrive at a
fixed rate with mixed prompt and output lengths) and a closed loop (a fixed number of
requests in flight). Per request: TTFT, TPOT, inter-token latencies, end-to-end latency;
per run: throughput, percentiles, failed requests and the most KV held.

The functions take any engine, so the same code runs the embedded model on CPU (tests)
and Ouro-1.4B shapes on the GPU (``flashloop-backend bench serving``)."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


def step_wait(sync_every_step: bool) -> Callable[[], None]:
    """What a timed loop calls after every step: the device wait with ``sync_every_step``,
    else nothing."""
    if not sync_every_step:
        return lambda: None
    import torch

    return torch.cuda.synchronize


def step_timing(sync_every_step: bool) -> str:
    """How a timed loop took token times, as a record's ``method`` says it."""
    if sync_every_step:
        return "the device synchronized after every step"
    return (
        "no device wait after a step: a token's time is taken when the step that sampled "
        "it returns (its host read of the token waited for the device)"
    )


@dataclass(frozen=True)
class Arrival:
    at_s: float  # seconds after the run starts
    prompt_len: int
    output_len: int


def fixed_arrival_schedule(
    requests: int, rate_per_s: float, prompt_lens: list[int], output_lens: list[int], seed: int = 0
) -> list[Arrival]:
    """``requests`` arrivals 1/rate apart, lengths drawn (seeded) from the given lists."""
    if requests <= 0 or rate_per_s <= 0:
        raise ValueError(f"requests={requests} and rate_per_s={rate_per_s} must be positive")
    if not prompt_lens or not output_lens or min(prompt_lens + output_lens) <= 0:
        raise ValueError(
            f"prompt_lens={prompt_lens} and output_lens={output_lens} need positive lengths"
        )
    rng = random.Random(seed)
    return [
        Arrival(i / rate_per_s, rng.choice(prompt_lens), rng.choice(output_lens))
        for i in range(requests)
    ]


@dataclass
class RequestTimes:
    arrival_s: float
    prompt_len: int
    token_s: list[float] = field(default_factory=list)  # time of each output token
    finished_s: float | None = None
    error: str | None = None


def percentiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"p50": statistics.median(ordered), "p99": at(0.99), "mean": statistics.fmean(ordered)}


def summarize(times: list[RequestTimes], wall_s: float) -> dict:
    """Latency percentiles (seconds; TPOT and ITL in ms), throughput and failures."""
    ok = [t for t in times if t.error is None and t.finished_s is not None]
    ttft = [t.token_s[0] - t.arrival_s for t in ok if t.token_s]
    tpot = [
        1e3 * (t.token_s[-1] - t.token_s[0]) / (len(t.token_s) - 1)
        for t in ok
        if len(t.token_s) > 1
    ]
    itl = [1e3 * (b - a) for t in ok for a, b in zip(t.token_s, t.token_s[1:], strict=False)]
    tokens = sum(len(t.token_s) for t in ok)
    return {
        "requests": len(times),
        "completed": len(ok),
        "failed_requests": len(times) - len(ok),
        "errors": sorted({t.error for t in times if t.error}),
        "ttft_s": percentiles(ttft),
        "tpot_ms": percentiles(tpot),
        "itl_ms": percentiles(itl),
        "latency_s": percentiles([t.finished_s - t.arrival_s for t in ok]),
        "output_tokens": tokens,
        "throughput_tokens_s": tokens / wall_s if wall_s > 0 else 0.0,
        "wall_s": wall_s,
    }


def step_kinds(before: dict[str, int], after: dict[str, int]) -> tuple[str, ...]:
    """The kinds a step counts under, from the engine's counters before and after it:
    ``decode_only``, or ``with_prompt_rows`` and ``prompt_loopN`` of the deepest loop N
    whose prompt rows it computed."""
    if after["prefill_rows"] == before["prefill_rows"]:
        return ("decode_only",)
    loops = [loop for loop, rows in enumerate(rows_by_loop(before, after), 1) if rows]
    return ("with_prompt_rows", *([f"prompt_loop{max(loops)}"] if loops else []))


def rows_by_loop(before: dict[str, int], after: dict[str, int]) -> list[int]:
    """Prompt rows a step computed at each loop, in loop order, from the engine's counters
    (``prefill_rows_loopN``) before and after it."""
    loops = sorted(
        (int(key.removeprefix("prefill_rows_loop")), rows - before.get(key, 0))
        for key, rows in after.items()
        if key.startswith("prefill_rows_loop")
    )
    return [rows for _, rows in loops]


# One row of ``run_workload``'s ``prompt_steps`` per step that computed prompt rows: the
# workload's step index, host and device ms (None untimed), prompt rows per loop, decode
# rows' tokens made, requests held after it.
PROMPT_STEP_COLUMNS = ("step", "host_ms", "device_ms", "rows_by_loop", "tokens", "held")


def _prompt_step(index: int, host_ms: float, before: dict, after: dict) -> list:
    """A ``prompt_steps`` row from the engine's counters before and after the step."""
    return [
        index,
        round(host_ms, 3),
        None,
        rows_by_loop(before, after),
        after["tokens_generated"] - before["tokens_generated"],
        after["requests_held"],
    ]


def step_percentiles(step_ms: dict[str, list[float]]) -> dict[str, dict]:
    """Steps and percentiles per kind: the other kinds as given, then ``prompt_loopN`` by N."""

    def order(kind: str) -> tuple[bool, int]:
        loop = kind.startswith("prompt_loop")
        return loop, int(kind.removeprefix("prompt_loop")) if loop else 0

    return {
        kind: {"steps": len(step_ms[kind]), **(percentiles(step_ms[kind]) or {})}
        for kind in sorted(step_ms, key=order)
    }


def first_and_later_ttft(times: list[RequestTimes]) -> dict:
    """With a shared prefix: the first request's TTFT (it computes the prefix), the later
    requests' TTFT percentiles (they reuse it), and the ratio of the later mean to the
    first (None where a side has no request that made a token)."""
    ok = [t for t in times if t.error is None and t.token_s]
    first = ok[0].token_s[0] - ok[0].arrival_s if ok else None
    later = percentiles([t.token_s[0] - t.arrival_s for t in ok[1:]])
    return {
        "first_s": first,
        "later_s": later,
        "later_mean_over_first": later["mean"] / first if first and later else None,
    }


def run_workload(
    engine,
    arrivals: list[Arrival],
    vocab_size: int,
    concurrency: int | None = None,
    sync: Callable[[], None] = lambda: None,
    seed: int = 0,
    clock: Callable[[], float] = time.perf_counter,
    shared_prefix: int = 0,
    device_marker: Callable[[], Any] | None = None,
) -> dict:
    """Drive ``engine`` with ``arrivals``. ``concurrency`` None: open loop (each request
    enters at its arrival time); an int: closed loop (arrival times ignored, at most that
    many in flight, the next one entering when one finishes). A request the engine
    refuses counts as failed with its reason; the run goes on. ``kv_held``: the most KV
    bytes the live requests held after any step (``Engine.kv_held``: BF16 blocks in use
    plus the packed store's steady bytes), with their tokens, and ``most_requests_held``
    the most requests admitted at once; the probe's host time is kept off the latency
    clock. ``shared_prefix``: every prompt starts with the same that
    many tokens (the rest random). ``prompt_rows`` counts the prompt rows computed (every
    loop) and, with the engine's prefix cache on, ``prefix`` its lookups, hits, misses and
    reused positions over the workload. ``step_ms``: the host's time per step (to its return,
    which for a step that samples waits for the device), apart for steps that computed
    prompt rows and steps that only decoded, and the prompt steps again by the deepest loop
    whose rows they computed (``prompt_loop1``...). ``device_marker``: records a marker on
    the device's stream and returns it (``torch.cuda.Event(enable_timing=True)`` recorded);
    given, ``step_device_ms`` has the same kinds, each step's span on the device from the
    marker before it to the one after it, read once the run is over so no step waits.
    ``prompt_steps``: each step that computed prompt rows as a row of
    ``PROMPT_STEP_COLUMNS`` (its device ms where markers timed it), so a record says which
    prompt steps were slow and at which loops."""
    from flashloop_backend.host.engine import SamplingParams

    rng = random.Random(seed)
    times: list[RequestTimes] = []
    live: dict[int, RequestTimes] = {}
    pending = list(arrivals)
    held = (0, 0)  # (tokens, bytes) at the largest bytes seen
    most_held = 0  # the most requests admitted and not done after any step
    prefix = [rng.randrange(vocab_size) for _ in range(shared_prefix)]
    counted = engine.counters()
    step_ms: dict[str, list[float]] = {"with_prompt_rows": [], "decode_only": []}
    marks: list[tuple[tuple[str, ...], Any, Any]] = []  # (kinds, before, after) per step
    # each step with prompt rows: its PROMPT_STEP_COLUMNS row and its device markers
    prompt_steps: list[tuple[list, Any, Any]] = []
    steps_run = 0
    counted_before = counted  # the engine's counters before the next step
    start = clock()
    while pending or engine.has_unfinished():
        now = clock() - start
        while pending and (
            len(live) < concurrency if concurrency is not None else pending[0].at_s <= now
        ):
            arrival = pending.pop(0)
            entry = RequestTimes(
                now if concurrency is not None else arrival.at_s, arrival.prompt_len
            )
            times.append(entry)
            own = max(0, arrival.prompt_len - len(prefix))
            prompt = (prefix + [rng.randrange(vocab_size) for _ in range(own)])[
                : arrival.prompt_len
            ]
            try:
                params = SamplingParams(max_new_tokens=arrival.output_len, ignore_eos=True)
                live[engine.add_request(prompt, params)] = entry
            except (ValueError, MemoryError) as exc:
                entry.error = f"{type(exc).__name__}: {exc}"
        if not engine.has_unfinished():
            if pending and concurrency is None:  # idle until the next arrival
                time.sleep(max(0.0, pending[0].at_s - (clock() - start)))
            continue
        before = device_marker() if device_marker is not None else None
        began = clock()
        finished = engine.step()
        sync()
        now = clock() - start
        probe = clock()
        after = device_marker() if device_marker is not None else None
        seen = engine.counters()
        kinds = step_kinds(counted_before, seen)
        for kind in kinds:
            step_ms.setdefault(kind, []).append(1e3 * (probe - began))
        if kinds[0] == "with_prompt_rows":
            row = _prompt_step(steps_run, 1e3 * (probe - began), counted_before, seen)
            prompt_steps.append((row, before, after))
        if before is not None:
            marks.append((kinds, before, after))
        steps_run += 1
        counted_before = seen
        tokens, held_bytes = engine.kv_held()
        held = max(held, (tokens, held_bytes), key=lambda h: h[1])
        most_held = max(most_held, seen["requests_held"])
        start += clock() - probe
        for rid, entry in live.items():
            produced = engine.output_count(rid)
            if produced is not None and produced > len(entry.token_s):
                entry.token_s.extend([now] * (produced - len(entry.token_s)))
        for result in finished:
            entry = live.pop(result.request_id, None)
            if entry is not None:
                missing = len(result.output_token_ids) - len(entry.token_s)
                entry.token_s.extend([now] * missing)
                entry.finished_s = now
    summary = summarize(times, clock() - start)
    if shared_prefix:
        summary["ttft_first_and_later"] = first_and_later_ttft(times)
    summary["kv_held"] = {
        "peak_bytes": held[1],
        "tokens_at_peak": held[0],
        "bytes_per_token_at_peak": held[1] / held[0] if held[0] else None,
    }
    now = engine.counters()
    summary["prompt_rows"] = now["prefill_rows"] - counted["prefill_rows"]
    summary["most_requests_held"] = most_held
    summary["step_ms"] = step_percentiles(step_ms)
    if marks:
        marks[-1][2].synchronize()
        device_ms: dict[str, list[float]] = {"with_prompt_rows": [], "decode_only": []}
        for kinds, before, after in marks:
            for kind in kinds:
                device_ms.setdefault(kind, []).append(before.elapsed_time(after))
        summary["step_device_ms"] = step_percentiles(device_ms)
        for row, before, after in prompt_steps:
            row[2] = round(before.elapsed_time(after), 3)
    summary["prompt_steps"] = {
        "columns": list(PROMPT_STEP_COLUMNS),
        "rows": [row for row, _, _ in prompt_steps],
    }
    if "prefix_lookups" in now:
        seen = {k: now[k] - counted[k] for k in ("prefix_lookups", "prefix_hits")}
        summary["prefix"] = {
            "lookups": seen["prefix_lookups"],
            "hits": seen["prefix_hits"],
            "misses": seen["prefix_lookups"] - seen["prefix_hits"],
            "reused_tokens": now["prefix_reused_tokens"] - counted["prefix_reused_tokens"],
        }
    return summary
