"""Where one sequence's packed levels live (pages per level, compact maps, the marks and
spans of level-by-level appends), and the error of a pool that cannot give the pages a
sequence asks for."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class OutOfPackedPagesError(MemoryError):
    """The packed pool cannot give a sequence the pages it asks for; nothing was taken."""


@dataclass
class SequenceLevels:
    """Where one sequence's levels live: pages per level and compact maps."""

    rows: int  # packed logical rows (a multiple of the group size)
    pages: list[list[int]] = field(default_factory=list)  # [level] -> page ids
    maps: list[torch.Tensor | None] = field(default_factory=list)  # [level] -> [rows] int32
    # the same maps on the host: per-batch reader metadata is planned there every step
    host_maps: list[torch.Tensor | None] = field(default_factory=list)
    version: int = 0  # the store's append count at this entry's last append (unique)
    # rows after each append -> every level's page count then (where a prefix may be shared)
    marks: dict[int, list[int]] = field(default_factory=dict)
    # a level appended on its own: its rows past ``rows`` (level -> rows ahead)
    ahead: dict[int, int] = field(default_factory=dict)
    # (level, first row) -> (rows, pages, compact rows) of a level's append that a later
    # level's append of the same rows reads its residuals against; gone once every level
    # holds those rows
    spans: dict[tuple[int, int], tuple[int, list[int], torch.Tensor | None]] = field(
        default_factory=dict
    )
    # level -> {its rows after an append of it -> its page count then}
    level_marks: dict[int, dict[int, int]] = field(default_factory=dict)

    def level_rows(self, level: int) -> int:
        """Logical rows stored at ``level`` (``rows`` plus those appended to it alone)."""
        return self.rows + self.ahead.get(level, 0)
