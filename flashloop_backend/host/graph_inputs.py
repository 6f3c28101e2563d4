"""The fixed-address inputs of captured decode traversals, filled with one copy per step.

Every per-row field of the batch view, the block tables of every depth plane and the KV
write slots live in one device byte buffer, each field a typed view of it at a fixed
offset; a pinned host buffer of the same layout is written field by field on the host and
copied over with one asynchronous host-to-device copy (a copy per field from pageable
memory would wait for the device each time).
"""

from __future__ import annotations

import torch

from flashloop_backend.dispatch import RowMode
from flashloop_backend.host.batch import RowGroup
from flashloop_backend.host.kvcache import PagedKVCache

INT64_FIELDS = (
    "positions",
    "depths",
    "slots",
    "incarnations",
    "request_ids",
    "window_ids",
    "kv_slots",
)
# the value a padding row holds in each int64 field
PAD_VALUES = {"positions": 0, "depths": 0, "window_ids": -1}


class GraphInputs:
    """Per-row fields ([rows] each: the ``INT64_FIELDS`` int64, ``context_lengths`` int32,
    ``row_modes`` int8) and ``tables`` [depths, rows, width] int32, on ``device`` in
    :attr:`device_fields` at addresses that never change."""

    def __init__(self, rows: int, depths: int, width: int, device: torch.device) -> None:
        self.rows, self.depths, self.width = rows, depths, width
        self._int64_bytes = len(INT64_FIELDS) * rows * 8
        self._tables_bytes = depths * rows * width * 4
        total = self._int64_bytes + rows * 4 + self._tables_bytes + rows
        self._device_bytes = torch.zeros(total, dtype=torch.uint8, device=device)
        pinned = device.type == "cuda"
        self._host_bytes = torch.zeros(total, dtype=torch.uint8, pin_memory=pinned)
        self.device_fields = self._views(self._device_bytes)
        self._host = {name: t.numpy() for name, t in self._views(self._host_bytes).items()}
        self._host["tables"][:] = -1
        self._copied = torch.cuda.Event() if pinned else None

    def _views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed views of ``buffer`` (every offset aligned to its element size)."""
        rows = self.rows
        ints = buffer[: self._int64_bytes].view(torch.int64).view(len(INT64_FIELDS), rows)
        views = {name: ints[index] for index, name in enumerate(INT64_FIELDS)}
        start = self._int64_bytes
        views["context_lengths"] = buffer[start : start + rows * 4].view(torch.int32)
        start += rows * 4
        tables = buffer[start : start + self._tables_bytes].view(torch.int32)
        views["tables"] = tables.view(self.depths, rows, self.width)
        start += self._tables_bytes
        views["row_modes"] = buffer[start : start + rows].view(torch.int8)
        return views

    def fill(self, groups: list[RowGroup], kv: PagedKVCache, bucket: int) -> None:
        """Write the rows of decode and verification ``groups`` (each row one position with
        its own causal length, token-state slot and incarnation) and padding rows up to
        ``bucket``, then start their copy to the device (queued on the current stream, so
        work launched after this reads them)."""
        if self._copied is not None:  # the last step's copy may still read the host buffer
            self._copied.synchronize()  # (an event never recorded returns at once)
        host = self._host
        row = 0
        for group in groups:
            if group.depth >= kv.num_depths:
                raise ValueError(f"row depth {group.depth} >= the cache's {kv.num_depths} planes")
            table = kv.table_tensor(group.request_id).numpy()
            if table.shape[1] > self.width:
                raise ValueError(
                    f"a block table of {table.shape[1]} blocks exceeds the width {self.width}"
                )
            positions = group.positions()
            rows = slice(row, row + group.count)
            host["positions"][rows] = positions
            host["depths"][rows] = group.depth
            host["slots"][rows] = group.token_slots()
            host["incarnations"][rows] = group.token_incarnations()
            host["request_ids"][rows] = group.request_id
            host["window_ids"][rows] = -1
            host["kv_slots"][rows] = kv.slots(group.request_id, group.depth, positions)
            host["context_lengths"][rows] = [p + 1 for p in positions]
            host["row_modes"][rows] = int(group.mode)
            host["tables"][:, rows, : table.shape[1]] = table[:, None, :]
            host["tables"][:, rows, table.shape[1] :] = -1
            row += group.count
        pad = slice(row, bucket)
        for name in INT64_FIELDS:
            host[name][pad] = PAD_VALUES.get(name, -1)
        host["context_lengths"][pad] = 0
        host["row_modes"][pad] = int(RowMode.PAD)
        host["tables"][:, pad] = -1
        self._device_bytes.copy_(self._host_bytes, non_blocking=self._copied is not None)
        if self._copied is not None:
            self._copied.record()
