"""One line per backend of a ``bench e2e`` record: TPOT, its ratio to the first backend
(dense) and the CUDA-graph replay time of each graph key (one loop's traversal) with the
bytes it moves and the TB/s that makes (``tools/bench/replay_bytes.py``), so a device
call's output shows where decode time goes and how far each replay is from HBM speed.

    python3 scripts/e2e_summary.py results/.../bench_e2e_all_on_8k.json
"""

from __future__ import annotations

import json
import sys

from flashloop_backend.tools.bench.replay_bytes import record_bandwidth


def summary(record: dict, gpu: str | None = None) -> list[str]:
    """``record``'s lines, bandwidth fractions of ``gpu``'s HBM (None: the H200)."""
    lines = []
    results = record["results"]
    bandwidth = record_bandwidth(record, gpu)
    first = next(iter(results.values()))["tpot_ms"]["median"]
    for name, result in results.items():
        tpot = result["tpot_ms"]["median"]
        steady = (result.get("tpot_from_second_token_ms") or {}).get("median")
        lines.append(
            f"{record['context']} x {record['concurrency']} {name}: TPOT {tpot:.2f} ms "
            f"(dense / this {first / tpot:.2f}x), TTFT {result['ttft_s']['median']:.3f} s"
            + (f", from the second token {steady:.2f} ms" if steady else "")
        )
        for key, timing in (result.get("replay_ms_by_key") or {}).items():  # one loop each
            moved = bandwidth.get(name, {}).get(key)
            rate = (
                f", {moved['total'] / 1e6:,.0f} MB ({moved['attention'] / 1e6:,.0f} MB "
                f"attention, FlashInfer BF16 {moved['flashinfer_attention'] / 1e6:,.0f}) at "
                f"{moved['tb_s']:.2f} TB/s = {moved['fraction_of_hbm']:.2f} of HBM"
                if moved
                else ""
            )
            lines.append(
                f"    replay {key}: median {timing['median_ms']:.3f} ms, "
                f"{timing['replays']} replays{rate}"
            )
    return lines


if __name__ == "__main__":
    for path in sys.argv[1:]:
        with open(path) as handle:
            record = json.load(handle)
        gpu = record.get("environment", {}).get("gpu")
        for run in record.get("runs", [record]):  # the CLI's record holds one run a context
            print("\n".join(summary(run, gpu)))
