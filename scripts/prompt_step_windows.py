"""Where a capacity record's slow prompt steps fall: per variant, from the first step
after which tokens flowed and the pools held what the workload could fill (the plan's
requests, or every client where fewer), each loop's prompt steps split into a prompt's
first step at that loop (the loop absent from the step before; steps at two loops are
left out of the split) and its others (mean and median host ms), and the slowest runs of
four consecutive prompt steps (a decoding token's four loops while a prompt prefills),
no two sharing a step, with the loops each step computed and its host ms. Reads
``prompt_steps`` of ``bench capacity`` records.

    python3 scripts/prompt_step_windows.py results/decode_v3/bench_capacity_...json [--top 8]
"""

import argparse
import json
import statistics


def loops_of(rows_by_loop: list[int]) -> str:
    """The loops a step computed prompt rows at, as digits ("14": loops 1 and 4)."""
    return "".join(str(i + 1) for i, rows in enumerate(rows_by_loop) if rows)


def first_and_others(steps: list[dict]) -> dict[str, tuple[list[float], list[float]]]:
    """Per loop (steps at one loop only): host ms of the steps whose loop the step before
    did not compute (a prompt's first chunk there), and of the others."""
    split: dict[str, tuple[list[float], list[float]]] = {}
    previous = ""
    for step in steps:
        loops = loops_of(step["rows_by_loop"])
        if len(loops) == 1:
            first, others = split.setdefault(loops, ([], []))
            (others if loops in previous else first).append(step["host_ms"])
        previous = loops
    return split


def windows(steps: list[dict], size: int = 4) -> list[tuple[float, list[str], list[float]]]:
    """Runs of ``size`` consecutive prompt steps, slowest first, no two sharing a step:
    (host ms summed, loops, host ms each)."""
    by_index = {s["step"]: s for s in steps}
    runs = []
    for step in steps:
        run = [by_index.get(step["step"] + k) for k in range(size)]
        if all(run):
            runs.append(run)
    runs.sort(key=lambda run: -sum(s["host_ms"] for s in run))
    taken: set[int] = set()
    out = []
    for run in runs:
        indices = {s["step"] for s in run}
        if indices & taken:
            continue
        taken |= indices
        times = [s["host_ms"] for s in run]
        out.append((sum(times), [loops_of(s["rows_by_loop"]) for s in run], times))
    return out


def steady(steps: list[dict], fill: int) -> list[dict]:
    """The steps after the first one after which tokens had flowed and ``fill`` requests
    were held."""
    flowed = False
    for index, step in enumerate(steps):
        flowed = flowed or step["tokens"] > 0
        if flowed and step["held"] >= fill:
            return steps[index + 1 :]
    return []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("record")
    parser.add_argument("--top", type=int, default=8, help="slowest windows shown per variant")
    args = parser.parse_args()
    record = json.load(open(args.record))
    for run in record["runs"]:
        for variant in run["records"]:
            if "prompt_steps" not in variant:
                print(f"{variant['variant']}: no prompt_steps (a record before they were kept)")
                continue
            table = variant["prompt_steps"]
            steps = [dict(zip(table["columns"], row, strict=True)) for row in table["rows"]]
            fill = min(variant["plan"]["requests"], run["clients"])
            kept = steady(steps, fill)
            itl = variant["itl_ms"]
            print(
                f"{variant['variant']}: {len(steps)} prompt steps, {len(kept)} after tokens "
                f"flowed with {fill} requests held; ITL p50 / p99 {itl['p50']:.2f} / "
                f"{itl['p99']:.2f} ms"
            )
            for loops, (first, others) in sorted(first_and_others(kept).items()):
                if first and others:
                    print(
                        f"  loop {loops}: first step mean {statistics.fmean(first):.1f} ms "
                        f"({len(first)}), others mean {statistics.fmean(others):.1f} / median "
                        f"{statistics.median(others):.1f} ms ({len(others)})"
                    )
            for total, loops, times in windows(kept)[: args.top]:
                shown = ", ".join(f"{t:.1f}" for t in times)
                print(f"  four steps {total:6.1f} ms: loops {' '.join(loops)} ({shown})")


if __name__ == "__main__":
    main()
