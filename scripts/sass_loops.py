"""Innermost loops of a cuobjdump SASS listing and their instruction mix (no imports
beyond the standard library: tests read listings without compiling anything)."""

from __future__ import annotations

import collections
import re

LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
BRANCH_TARGET = re.compile(r"^\s*(0x[0-9a-f]+)")
# instruction classes of the mix
CLASSES = {
    "LDG": "global load",
    "LDS": "shared load",
    "STS": "shared store",
    "STL": "local (spill) store",
    "LDL": "local (spill) load",
    "LDSM": "shared load",
    "HMMA": "tensor core",
    "FFMA": "fp32 math",
    "FMUL": "fp32 math",
    "FADD": "fp32 math",
    "FMNMX": "fp32 math",
    "HFMA2": "fp16x2 math",
    "HADD2": "fp16x2 math",
    "HMUL2": "fp16x2 math",
    "LOP3": "integer logic",
    "SHF": "shift",
    "PRMT": "byte permute",
    "I2F": "int to float",
    "F2F": "float convert",
    "F2FP": "float convert",
    "IMAD": "integer math / move",
    "IADD3": "integer math / move",
    "LEA": "address",
    "MOV": "integer math / move",
    "SHFL": "shuffle",
    "MUFU": "special function",
    "ISETP": "compare",
    "FSETP": "compare",
    "SEL": "select",
    "FSEL": "select",
    "BAR": "barrier",
}


def innermost_loops(text: str) -> list[dict]:
    """Every innermost loop: its address range, size and instruction mix."""
    instructions, loops = [], []
    for raw in text.splitlines():
        found = LINE.search(raw)
        if not found:
            continue
        address, opcode = int(found.group(1), 16), found.group(3)
        instructions.append((address, opcode))
        target = BRANCH_TARGET.match(found.group(4))
        if opcode.startswith("BRA") and target and int(target.group(1), 16) < address:
            loops.append((int(target.group(1), 16), address))
    inner = [
        (start, end)
        for start, end in loops
        if not any(s >= start and e <= end and (s, e) != (start, end) for s, e in loops)
    ]
    result = []
    for start, end in inner:
        body = [op for address, op in instructions if start <= address <= end and op != "NOP"]
        mix = collections.Counter(CLASSES.get(op.split(".")[0], "other") for op in body)
        result.append(
            {
                "start": start,
                "end": end,
                "instructions": len(body),
                "mix": dict(mix.most_common()),
                "top_opcodes": dict(collections.Counter(body).most_common(16)),
            }
        )
    return sorted(result, key=lambda loop: -loop["instructions"])
