"""Which loop depth a decode step runs when decode rows go in lockstep.

A generated token advances one loop per step, so requests whose prompts finished at
different steps decode at different depths. For a dense backend a step with rows at
every depth costs what a step at one depth costs: one kernel reads every row. A backend
whose decode ops differ by depth (FlashLoop's loop-1 read, loop-2 source and loop 3-4
corrections) launches every depth's ops for a few rows each in such a step, so a token
then pays each op's fixed cost four times; one whose kernel variant follows the deepest
row (the packed reader's levels) reads shallow rows with the deepest row's launch.

In lockstep, a step runs the decode rows of one depth and the others wait: a request
that joins (its first decode token, or a token after an early exit) usually waits fewer
than ``loops`` steps for the others to reach its depth. Tokens that exit early can keep
a group cycling through shallow depths, so a request held back ``loops`` steps in a row
has its depth run next (the longest held first); such a request still runs only one
step in about ``loops``, so an engine whose model exits early does not align by
default. Tokens are the same either way; only the steps they take differ.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from flashloop_backend.backends.base import AttentionBackend


def depth_dependent_decode(backend: AttentionBackend, loops: int) -> bool:
    """Whether ``backend`` launches different ops, or different kernel variants, for decode
    rows at different depths (what ``Engine(align_decode_depths=None)`` asks): a
    step mixing depths then runs every depth's ops, or its deepest row's variant for every
    row (the packed reader's launch for four levels reading one)."""
    plans = {
        (backend.decode_ops(frozenset({d})), backend.graph_variants(frozenset({d})))
        for d in range(loops)
    }
    return len(plans) > 1


def lockstep_depth(rows: Iterable[tuple[int, int, int]], patience: int) -> int | None:
    """The depth whose decode rows run this step, from each decode request's (depth, rows,
    steps held back in a row): the depth of the longest held request once one has waited
    ``patience`` steps (the deepest of a tie), else the depth holding most rows (the
    deepest of a tie: it finishes its tokens first, after which its requests rejoin at
    depth 0). None: no rows."""
    counts: Counter[int] = Counter()
    held = []
    for depth, count, waited in rows:
        counts[depth] += count
        if waited >= patience:
            held.append((waited, depth))
    if held:
        return max(held)[1]
    if not counts:
        return None
    return max(counts, key=lambda depth: (counts[depth], depth))
