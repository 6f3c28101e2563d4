"""Which loop depth a decode step runs when decode rows go in lockstep.

A generated token advances one loop per step, so requests whose prompts finished at
different steps decode at different depths. For a dense backend a step with rows at
every depth costs what a step at one depth costs: one kernel reads every row. A backend
whose decode ops differ by depth (FlashLoop's loop-1 read, loop-2 source and loop 3-4
corrections) launches every depth's ops for a few rows each in such a step, so a token
then pays each op's fixed cost four times; one whose kernel variant follows the deepest
row (the packed reader's levels) reads shallow rows with the deepest row's launch. In lockstep, a step runs the decode rows of
one depth and the others wait: a request that joins (its first decode token, or a token
after an early exit) waits at most ``loops - 1`` steps for the others to reach its depth.
Tokens are the same either way; only the steps they take differ.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from flashloop_backend.backends.base import AttentionBackend


def depth_dependent_decode(backend: AttentionBackend, loops: int) -> bool:
    """Whether ``backend`` launches different ops, or different kernel variants, for decode
    rows at different depths (the default of ``Engine(align_decode_depths=None)``): a
    step mixing depths then runs every depth's ops, or its deepest row's variant for every
    row (the packed reader's launch for four levels reading one)."""
    plans = {
        (backend.decode_ops(frozenset({d})), backend.graph_variants(frozenset({d})))
        for d in range(loops)
    }
    return len(plans) > 1


def lockstep_depth(row_depths: Iterable[int]) -> int | None:
    """The depth whose decode rows run this step: the one holding most rows, the deepest
    of a tie (it finishes its tokens first, after which its requests rejoin at depth 0).
    A smaller group meets the larger one within a cycle of the loops. None: no rows."""
    counts = Counter(row_depths)
    if not counts:
        return None
    return max(counts, key=lambda depth: (counts[depth], depth))
