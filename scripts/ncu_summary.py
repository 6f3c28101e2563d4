"""The lines of an Nsight Compute details page (``scripts/device_packed_counters.sh``)
that say where a kernel's time goes: per kernel launch its duration, DRAM and SM
throughput, occupancy, registers, launch shape, issue rate, and the warp stall reasons of
at least half a cycle per issued instruction.

    python3 scripts/ncu_summary.py ncu_8192x1.txt
"""

import re
import sys

KEEP = (
    "Duration",
    "DRAM Throughput",
    "Compute (SM) Throughput",
    "Achieved Occupancy",
    "Theoretical Occupancy",
    "Registers Per Thread",
    "Dynamic Shared Memory Per Block",
    "Warp Cycles Per Issued Instruction",
    "No Eligible",
)
KERNEL = re.compile(r"\s{2}(\S+)\s.*\(\d+, \d+, \d+\)x\(\d+, \d+, \d+\)")
STALL = "smsp__average_warps_issue_stalled_"


def main(path: str) -> int:
    for line in open(path):
        text = line.strip()
        if KERNEL.match(line):
            print("==", text[:100])
        elif text.startswith(KEEP):
            print("  ", " ".join(text.split())[:100])
        elif text.startswith(STALL):
            name, *_, value = text.split()
            try:
                cycles = float(value.replace(",", ""))
            except ValueError:
                continue
            if cycles >= 0.5:
                name = name.removeprefix(STALL).removesuffix("_per_issue_active.ratio")
                print(f"   stall {name} {cycles}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
