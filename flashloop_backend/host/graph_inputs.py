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
        """Write decode ``groups`` (one row each) and padding rows up to ``bucket``, then
        start their copy to the device (queued on the current stream, so work launched
        after this reads them)."""
        if self._copied is not None:  # the last step's copy may still read the host buffer
            self._copied.synchronize()  # (an event never recorded returns at once)
        host = self._host
        for row, group in enumerate(groups):
            if group.depth >= kv.num_depths:
                raise ValueError(f"row depth {group.depth} >= the cache's {kv.num_depths} planes")
            host["positions"][row] = group.start
            host["depths"][row] = group.depth
            host["slots"][row] = group.slot
            host["incarnations"][row] = group.incarnation
            host["request_ids"][row] = group.request_id
            host["window_ids"][row] = -1
            host["kv_slots"][row] = kv.slots(group.request_id, group.depth, [group.start])[0]
            host["context_lengths"][row] = group.start + 1
            host["row_modes"][row] = int(group.mode)
            table = kv.table_tensor(group.request_id).numpy()
            if table.shape[1] > self.width:
                raise ValueError(
                    f"a block table of {table.shape[1]} blocks exceeds the width {self.width}"
                )
            host["tables"][:, row, : table.shape[1]] = table
            host["tables"][:, row, table.shape[1] :] = -1
        pad = slice(len(groups), bucket)
        for name in INT64_FIELDS:
            host[name][pad] = PAD_VALUES.get(name, -1)
        host["context_lengths"][pad] = 0
        host["row_modes"][pad] = int(RowMode.PAD)
        host["tables"][:, pad] = -1
        self._device_bytes.copy_(self._host_bytes, non_blocking=self._copied is not None)
        if self._copied is not None:
            self._copied.record()
