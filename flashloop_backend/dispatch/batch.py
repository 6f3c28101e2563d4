"""The batch view: device tensors the runner owns and the backend borrows per submission."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch

from flashloop_backend.kernels.sequence_plan import SequencePlan, plan_host_sequences
from flashloop_backend.kernels.span_plan import SpanPlan, plan_host_spans


class RowMode(IntEnum):
    """What an execution row does in this traversal."""

    DECODE = 0  # one generated token
    VERIFY = 1  # speculative verification row; treated as a decode query
    PREFILL = 2  # active prefill row (recomputed this loop)
    INACTIVE = 3  # prefill row skipped this loop: keeps its previous hidden state and KV
    PAD = 4  # padding row (graph buckets); context length zero


@dataclass(frozen=True)
class HostRows:
    """The host's own copy of a view's rows, from which a backend plans kernels that plan
    on the host without reading the device. R rows, P depth planes, O tables per plane;
    every tensor on the host.

    context_lengths:  [R] int32  as the view's
    depths:           [R] int64  as the view's
    row_modes:        [R] int8   as the view's
    table_owners:     [R] int64  row r reads owner_tables[depths[r], table_owners[r]]
    owner_tables:     [P, O, MB] int32  one block table per (plane, owner)
    """

    context_lengths: torch.Tensor
    depths: torch.Tensor
    row_modes: torch.Tensor
    table_owners: torch.Tensor
    owner_tables: torch.Tensor

    def __post_init__(self) -> None:
        rows = self.row_modes.shape[0]
        for name in ("context_lengths", "depths", "row_modes", "table_owners"):
            if getattr(self, name).shape != (rows,):
                shape = tuple(getattr(self, name).shape)
                raise ValueError(f"host rows' {name} must be [rows={rows}]; got {shape}")
        if self.owner_tables.dim() != 3:
            raise ValueError(
                f"host rows' owner_tables must be [depth_planes, owners, max_blocks]; "
                f"got {tuple(self.owner_tables.shape)}"
            )
        tensors = (self.context_lengths, self.depths, self.row_modes)
        devices = {t.device.type for t in (*tensors, self.table_owners, self.owner_tables)}
        if devices != {"cpu"}:
            raise ValueError(f"host rows must be on the host; got devices {sorted(devices)}")

    def sequences(
        self, lengths: torch.Tensor, block_size: int, device: torch.device
    ) -> SequencePlan:
        """The :class:`SequencePlan` of these rows read at ``lengths`` [R] int32 (on the
        host: the context lengths with rows a kernel does not serve at 0), in pages of
        ``block_size`` keys, for a kernel on ``device`` (pinned for a GPU, so copying it
        there does not wait)."""
        keys, tables = self._table_keys()
        return plan_host_sequences(keys, lengths, tables, block_size, device.type == "cuda")

    def spans(self, lengths: torch.Tensor, block_size: int, device: torch.device) -> SpanPlan:
        """The :class:`SpanPlan` of these rows read at ``lengths`` [R] int32, as
        :meth:`sequences`."""
        keys, tables = self._table_keys()
        return plan_host_spans(keys, lengths, tables, block_size, device.type == "cuda")

    def _table_keys(self) -> tuple[torch.Tensor, torch.Tensor]:
        """([R] each row's table key, [P * O, MB] the tables by key)."""
        planes, owners, _ = self.owner_tables.shape
        # one key per (plane, owner) table; depth clamped for padding, as the view's tables
        keys = self.depths.clamp(0, planes - 1) * owners + self.table_owners
        return keys, self.owner_tables.flatten(0, 1)


@dataclass(frozen=True)
class BatchView:
    """One submission's rows. Every tensor is on one device; R rows, P depth planes.

    positions:        [R] int64  absolute token position (RoPE and causal mask use it)
    depths:           [R] int64  zero-based loop depth the row executes
    row_modes:        [R] int8   :class:`RowMode` values
    slots:            [R] int64  token-state slot (persistent per live token), -1 if none
    incarnations:     [R] int64  generation number of the token occupying the slot
    request_ids:      [R] int64  runner's request index, -1 for padding
    window_ids:       [R] int64  prefill selection window (absolute), -1 for decode/padding
    context_lengths:  [R] int32  position + 1; 0 for padding rows
    block_tables:     [P, R, MB] int32  one block table per depth plane (LAST_EXITED)

    decode_only (host-known, static): every row is DECODE, VERIFY or PAD, so the backend
    launches only the ops decode rows can route to (a CUDA graph's execution mode).
    decode_bound (host-known): at most this many rows are DECODE/VERIFY, so ops only decode
    rows route to run on that many rows of the decode-first order (None: on every row).
    decode_depths (host-known): the loop depths of the DECODE/VERIFY rows, so ops no row at
    those depths can route to are not launched (None: any depth).
    prefill_depths (host-known): the loop depths of the PREFILL rows, likewise for the
    prefill ops (None: any depth).
    verify_rows (host-known): no VERIFY group (consecutive VERIFY rows of one request and
    depth) has more rows, so a kernel may compute a group's rows together (1: none does).
    host_rows (host-known): the host's copy of the rows' lengths, depths, modes and
    tables (:class:`HostRows`), or None where the host keeps none. A view made from
    another with changed rows must not keep the other's host rows.

    A backend plans a view once and reuses the plan for every layer (keyed by identity):
    build a new view for every submission, and for every CUDA-graph capture.
    """

    positions: torch.Tensor
    depths: torch.Tensor
    row_modes: torch.Tensor
    slots: torch.Tensor
    incarnations: torch.Tensor
    request_ids: torch.Tensor
    window_ids: torch.Tensor
    context_lengths: torch.Tensor
    block_tables: torch.Tensor
    decode_only: bool = False
    decode_bound: int | None = None
    decode_depths: frozenset[int] | None = None
    prefill_depths: frozenset[int] | None = None
    verify_rows: int = 1
    host_rows: HostRows | None = None

    def __post_init__(self) -> None:
        rows = self.row_modes.shape[0]
        host = self.host_rows
        if host is not None:
            planes, _, width = host.owner_tables.shape
            seen = (host.row_modes.shape[0], planes, width)
            want = (rows, self.block_tables.shape[0], self.block_tables.shape[2])
            if seen != want:
                raise ValueError(
                    f"host_rows hold {seen[0]} rows, {planes} planes, tables {width} wide; "
                    f"the view {want[0]}, {want[1]} and {want[2]}"
                )
        per_row = {
            "positions": self.positions,
            "depths": self.depths,
            "row_modes": self.row_modes,
            "slots": self.slots,
            "incarnations": self.incarnations,
            "request_ids": self.request_ids,
            "window_ids": self.window_ids,
            "context_lengths": self.context_lengths,
        }
        for name, tensor in per_row.items():
            if tensor.shape != (rows,):
                raise ValueError(f"{name} must be [rows={rows}]; got {tuple(tensor.shape)}")
        if self.block_tables.dim() != 3 or self.block_tables.shape[1] != rows:
            raise ValueError(
                f"block_tables must be [depth_planes, rows={rows}, max_blocks]; "
                f"got {tuple(self.block_tables.shape)}"
            )
        if isinstance(self.verify_rows, bool) or not isinstance(self.verify_rows, int):
            raise ValueError(f"verify_rows={self.verify_rows!r} must be an integer >= 1")
        if self.verify_rows < 1:
            raise ValueError(f"verify_rows={self.verify_rows} must be >= 1")
        if self.decode_bound is not None and not 0 <= self.decode_bound <= rows:
            raise ValueError(f"decode_bound={self.decode_bound} must lie in [0, rows={rows}]")
        for name, depths in (("decode", self.decode_depths), ("prefill", self.prefill_depths)):
            if depths is not None and any(
                isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in depths
            ):
                raise ValueError(f"{name}_depths={sorted(depths, key=str)} must be depths >= 0")
        devices = {t.device for t in (*per_row.values(), self.block_tables)}
        if len(devices) != 1:
            raise ValueError(f"batch view tensors span devices {sorted(map(str, devices))}")

    @property
    def num_rows(self) -> int:
        return self.row_modes.shape[0]

    @property
    def device(self) -> torch.device:
        return self.row_modes.device

    def row_block_tables(self) -> torch.Tensor:
        """[R, MB] each row's table for its own depth plane (depth clamped for padding)."""
        planes = self.block_tables.shape[0]
        depth = self.depths.clamp(0, planes - 1)
        rows = torch.arange(self.num_rows, device=self.device)
        return self.block_tables[depth, rows]
