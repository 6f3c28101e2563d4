"""Join eval --grid records that parallel processes wrote over parts of one grid.

    python scripts/merge_eval_records.py OUT.json PART.json [PART.json ...]

Every part must come from the same model, text, dtype, config and settings; each point is
kept once, in the grid's order (flashloop_backend.tools.grid.merge_records)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from flashloop_backend.tools.grid import merge_records


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    out, parts = Path(argv[0]), [Path(p) for p in argv[1:]]
    missing = [str(p) for p in parts if not p.is_file()]
    if missing:
        print(f"error: no such record {missing}", file=sys.stderr)
        return 2
    try:
        merged = merge_records([json.loads(p.read_text()) for p in parts])
    except (ValueError, json.JSONDecodeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    out.write_text(json.dumps(merged, indent=2) + "\n")
    print(f"{out}: {len(merged['combinations'])} points from {len(parts)} records")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
