"""Build the dispatcher's batch view from scheduled row groups.

A row group is a set of positions of one request at one depth: a prefill chunk (under
token-sparse prefill its scheduled positions, which may skip), or one decode token. Padding rows (mode PAD, slot -1, context length 0) fill a
batch up to a bucket size; the backend returns zeros for them and the KV write of a
padding row lands in the cache's scratch block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashloop_backend.device_copy import to_device
from flashloop_backend.dispatch import BatchView, HostRows, RowMode
from flashloop_backend.host.kvcache import PagedKVCache

ROW_MODES = frozenset(RowMode)


@dataclass(frozen=True)
class RowGroup:
    request_id: int
    mode: RowMode  # DECODE, VERIFY or PREFILL
    depth: int
    start: int  # first absolute position
    count: int  # positions
    slot: int = -1  # token-state slot of a decode token (-1: none)
    incarnation: int = -1  # which token occupies that slot
    span: tuple[int, ...] = ()  # the positions when they are not start, start+1, ...
    # VERIFY rows: each row's own token-state slot and incarnation (else slot, incarnation)
    row_slots: tuple[int, ...] = ()
    row_incarnations: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.mode not in ROW_MODES:  # routes are looked up by mode
            allowed = ", ".join(f"{m.name}={m.value}" for m in RowMode)
            raise ValueError(f"row group mode {self.mode!r} is not a RowMode ({allowed})")
        object.__setattr__(self, "mode", RowMode(self.mode))
        if self.span and (len(self.span) != self.count or self.span[0] != self.start):
            raise ValueError(
                f"row group span of {len(self.span)} positions from {self.span[0]} disagrees "
                f"with start={self.start}, count={self.count}"
            )
        per_row = (len(self.row_slots), len(self.row_incarnations))
        if per_row != (0, 0) and per_row != (self.count, self.count):
            raise ValueError(
                f"row group of {self.count} rows has {per_row[0]} row slots and {per_row[1]} "
                "row incarnations: give one of each per row, or none"
            )

    def token_slots(self) -> list[int]:
        return list(self.row_slots) if self.row_slots else [self.slot] * self.count

    def token_incarnations(self) -> list[int]:
        return (
            list(self.row_incarnations)
            if self.row_incarnations
            else [self.incarnation] * self.count
        )

    def positions(self) -> list[int]:
        return list(self.span) if self.span else list(range(self.start, self.start + self.count))


def row_tokens(groups: list[RowGroup]) -> list[tuple[int, int]]:
    """(token-state slot, incarnation) of every row of ``groups``, in row order."""
    return [
        token
        for group in groups
        for token in zip(group.token_slots(), group.token_incarnations(), strict=True)
    ]


@dataclass(frozen=True)
class Batch:
    view: BatchView
    slots: torch.Tensor  # [R] int64 flat KV slot on the row's depth plane, -1 for padding
    groups: tuple[RowGroup, ...]
    num_real_rows: int


def build_batch(
    groups: list[RowGroup],
    kv: PagedKVCache,
    device: torch.device | str,
    pad_to: int | None = None,
    table_width: int | None = None,
) -> Batch:
    """The batch of ``groups`` (padded with PAD rows up to ``pad_to``) with every block
    table ``table_width`` entries wide (default: the widest request's), on ``device``."""
    positions: list[int] = []
    depths: list[int] = []
    modes: list[int] = []
    requests: list[int] = []
    token_slots: list[int] = []
    incarnations: list[int] = []
    slots: list[int] = []
    for group in groups:
        if group.depth >= kv.num_depths:
            raise ValueError(f"row depth {group.depth} >= the cache's {kv.num_depths} planes")
        span = group.positions()
        positions += span
        depths += [group.depth] * group.count
        modes += [int(group.mode)] * group.count
        requests += [group.request_id] * group.count
        token_slots += group.token_slots()
        incarnations += group.token_incarnations()
        slots += kv.slots(group.request_id, group.depth, span)
    real = len(positions)
    pad = max(0, (pad_to or 0) - real)
    positions += [0] * pad
    depths += [0] * pad
    modes += [int(RowMode.PAD)] * pad
    requests += [-1] * pad
    token_slots += [-1] * pad
    incarnations += [-1] * pad
    slots += [-1] * pad

    # One table per (request, depth) travels to the device; rows gather theirs there (a
    # prefill chunk would otherwise copy rows x depths x pages entries from the host).
    owners = list(dict.fromkeys(g.request_id for g in groups))
    widest = max([kv.table_blocks(r) for r in owners] or [1])
    if table_width is not None and table_width < widest:
        raise ValueError(f"table_width={table_width} is below the widest block table ({widest})")
    width = table_width or widest
    per_request = torch.full((kv.num_depths, len(owners) + 1, width), -1, dtype=torch.int32)
    for index, request_id in enumerate(owners):
        table = kv.table_tensor(request_id)
        per_request[:, index, : table.shape[1]] = table
    owner_of = {request_id: index for index, request_id in enumerate(owners)}
    row_owner = [owner_of[g.request_id] for g in groups for _ in range(g.count)]
    row_owner += [len(owners)] * pad  # padding rows read the all -1 table
    per_row = [positions, depths, modes, token_slots, incarnations, requests, slots, row_owner]
    host_fields = torch.tensor(per_row, dtype=torch.int64)
    fields = to_device(host_fields, device)
    position_t, depth_t, mode_t, token_slot_t, incarnation_t, request_t, slot_t, owner_t = fields
    planes = to_device(per_request, device)[:, owner_t]
    lengths = torch.where(mode_t == RowMode.PAD, 0, position_t + 1).to(torch.int32)
    host_modes = host_fields[2]
    host_rows = HostRows(
        context_lengths=torch.where(host_modes == RowMode.PAD, 0, host_fields[0] + 1).int(),
        depths=host_fields[1],
        row_modes=host_modes.to(torch.int8),
        table_owners=host_fields[7],
        owner_tables=per_request,
    )
    view = BatchView(
        positions=position_t,
        depths=depth_t,
        row_modes=mode_t.to(torch.int8),
        slots=token_slot_t,
        incarnations=incarnation_t,
        request_ids=request_t,
        window_ids=torch.full((len(positions),), -1, dtype=torch.int64, device=device),
        context_lengths=lengths,
        block_tables=planes,
        decode_only=all(g.mode in (RowMode.DECODE, RowMode.VERIFY) for g in groups),
        decode_bound=sum(g.count for g in groups if g.mode in (RowMode.DECODE, RowMode.VERIFY)),
        decode_depths=frozenset(
            g.depth for g in groups if g.mode in (RowMode.DECODE, RowMode.VERIFY)
        ),
        prefill_depths=frozenset(g.depth for g in groups if g.mode == RowMode.PREFILL),
        verify_rows=max([g.count for g in groups if g.mode == RowMode.VERIFY] or [1]),
        host_rows=host_rows,
    )
    return Batch(view, slot_t, tuple(groups), real)
