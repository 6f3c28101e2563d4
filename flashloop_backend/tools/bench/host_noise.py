"""How late a separate, idle process wakes up while a benchmark runs: a witness of stalls
that come from the machine (other tenants, CPU frequency, the OS), not from the serving
process (its GIL, its garbage collector, its driver calls), which do not delay another
process. A latency tail in a record with a quiet witness came from the process; one
whose witness stalled as long may be the machine's."""

from __future__ import annotations

import json
import subprocess
import sys

# The witness: says it is ready, then sleeps PERIOD ms at a time until a line comes on its
# stdin, then prints how late each wake-up came (ms) as percentiles, the count over STALL
# ms and the five latest-waking with their time since it started (s) and that start's
# wall clock. It imports nothing of this package and keeps two floats a wake-up.
_WITNESS = r"""
import array, heapq, json, sys, threading, time
period, stall = float(sys.argv[1]) / 1e3, float(sys.argv[2])
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
began, wall = time.perf_counter(), time.time()
late, when = array.array("d"), array.array("d")
print("ready", flush=True)
while not stop.is_set():
    start = time.perf_counter()
    time.sleep(period)
    late.append((time.perf_counter() - start - period) * 1e3)
    when.append(start - began)
ms = sorted(late)
at = lambda q: ms[min(len(ms) - 1, int(q * len(ms)))] if ms else None
worst = heapq.nlargest(5, range(len(late)), key=late.__getitem__)
json.dump({"wakeups": len(ms), "late_ms": {"p50": at(0.5), "p99": at(0.99),
           "max": ms[-1] if ms else None}, "stalls_over_ms": stall,
           "stalls": sum(x > stall for x in ms), "started_unix_s": wall,
           "worst": [{"late_ms": late[i], "at_s": when[i]} for i in worst]}, sys.stdout)
"""


class HostNoise:
    """A context manager around a benchmark's timed run; ``summary`` holds the witness's
    record once it exits (None if the witness failed; a failure never stops the
    benchmark): ``wakeups``, ``late_ms`` (p50 / p99 / max), ``stalls`` (wake-ups more than
    ``stall_ms`` late), ``started_unix_s`` and the ``worst`` five with their time since the
    start. ``period_ms``: how long the witness sleeps at a time. It sees
    only CPU scheduling stalls of the machine, not the GPU's or the bus's, and on a
    machine whose cores the benchmark saturates the benchmark itself can delay it."""

    def __init__(self, period_ms: float = 2.0, stall_ms: float = 5.0) -> None:
        if period_ms <= 0 or stall_ms <= 0:
            raise ValueError(f"period_ms={period_ms} and stall_ms={stall_ms} must both be positive")
        self.period_ms, self.stall_ms = period_ms, stall_ms
        self.summary: dict | None = None
        self._process: subprocess.Popen | None = None

    def __enter__(self) -> HostNoise:
        args = [sys.executable, "-c", _WITNESS, str(self.period_ms), str(self.stall_ms)]
        self._process = subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self._process.stdout.readline()  # "ready": the run starts watched
        return self

    def __exit__(self, *exc) -> None:
        process = self._process
        try:
            out, _ = process.communicate(input="stop\n", timeout=30)
            self.summary = json.loads(out) if process.returncode == 0 else None
        except (subprocess.TimeoutExpired, ValueError):
            process.kill()
            process.communicate()
            self.summary = None
