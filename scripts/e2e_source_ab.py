"""Runs a ``flashloop-backend`` command with the CUDA loop-2 source's cluster rule set by
``--cluster-pairs`` (0: the three launches at every batch), so that one machine times the
one-launch cluster source and the three launches side by side:

    python scripts/e2e_source_ab.py --cluster-pairs 0 bench e2e --contexts 8192 ...
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from flashloop_backend.cli.main import main
from flashloop_backend.kernels.cuda import packed_source


def set_cluster_pairs(pairs: int) -> None:
    """Every later call of ``packed_dense_source_cuda`` without a tuning takes ``pairs``."""
    source = packed_source.packed_dense_source_cuda
    defaults = [
        dataclasses.replace(d, cluster_pairs=pairs) if d is packed_source.DEFAULT_SOURCE else d
        for d in source.__defaults__
    ]
    source.__defaults__ = tuple(defaults)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cluster-pairs", type=int, required=True)
    args, rest = parser.parse_known_args()
    set_cluster_pairs(args.cluster_pairs)
    sys.exit(main(rest))
