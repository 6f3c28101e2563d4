"""Which prompt positions run at each depth. Dense: every position at every depth. With
token-sparse prefill (RFC §3.1): loops 1-2 dense; before loop r >= 3 the prompt is scored
from the two preceding loops' hidden states and each fixed window keeps its budget of
the previous active set. A token dropped after depth d leaves like an early exit: its
hidden state stays, and copy-on-exit gives deeper planes its depth-d K/V (the logical
LAST_EXITED history)."""

from __future__ import annotations

from bisect import bisect_left

import torch

from flashloop_backend.algorithms import token_change_scores
from flashloop_backend.algorithms.token_selection import select_in_windows
from flashloop_backend.config import DENSE_LOOPS, TokenSparsePrefillConfig
from flashloop_backend.device_copy import to_device
from flashloop_backend.host.kvcache import PagedKVCache


class PromptSchedule:
    def __init__(
        self,
        length: int,
        sparsity: TokenSparsePrefillConfig | None,
        num_loops: int,
        device,
        reused: int = 0,
        reused_active: torch.Tensor | None = None,
    ) -> None:
        """``reused``: leading positions whose KV at every depth comes from a published
        prefix (whole selection windows); they run no depth here. ``reused_active``
        [num_loops, reused] bool on the host: which of them ran each depth (token-sparse
        prefill)."""
        self.sparsity = sparsity if sparsity is not None and sparsity.enabled else None
        self.num_loops = num_loops
        self.reused, self.reused_active = reused, reused_active
        if (
            self.sparsity is not None
            and reused
            and (reused % self.sparsity.window_size or reused_active is None)
        ):
            raise ValueError(
                f"reused={reused} positions must be whole windows of "
                f"{self.sparsity.window_size} with their active rows per depth"
            )
        self.active = torch.ones(length, dtype=torch.bool, device=device)
        self.positions = list(range(reused, length))
        # the active positions on the device (None while every position is active): a
        # chunk's rows are gathered and scattered with one index, not a copy per run
        self.index: torch.Tensor | None = None
        self.prev_hidden: torch.Tensor | None = None  # hidden after the previous loop
        self.active_counts = [length]
        self.active_history = [self.active]  # rows that ran each depth so far
        # (device mask, its host copy): packing reads the masks on the host at every
        # append, and a device read there would wait for the queued steps
        self._host_copies = [(self.active, torch.ones(length, dtype=torch.bool))]
        self._pending: _PendingSelection | None = None  # a selection not yet on the host

    def _selects_before(self, depth: int) -> bool:
        return (
            self.sparsity is not None
            and DENSE_LOOPS <= depth < self.num_loops
            and self.sparsity.retention[depth] < 1.0
        )

    def finish_depth(
        self, depth: int, hidden: torch.Tensor, kv: PagedKVCache, request_id: int
    ) -> None:
        """Every scheduled row of ``depth`` ran; ``hidden`` [T, hidden] is the state after it.
        Queues the next depth's selection on the device and its copy to the host; the
        schedule takes it (and retires the dropped rows) once :meth:`ready`."""
        nxt = depth + 1
        if self._selects_before(nxt):
            scores = token_change_scores(hidden, self.prev_hidden)
            chosen = select_in_windows(
                scores, self.active, self.sparsity.retention[nxt], self.sparsity.window_size
            )
            self._pending = _PendingSelection(depth, chosen, kv, request_id)
        else:
            self._next_depth(nxt)
        if any(self._selects_before(d) for d in range(nxt + 1, self.num_loops)):
            self.prev_hidden = hidden.clone()  # two aliases could not give a change score

    def ready(self, wait: bool = False) -> bool:
        """Whether the current depth's rows are known, asked once per step (and again
        with ``wait`` where the step would run nothing else). The compact host schedules
        on the CPU, so reading the selection is its planning step: a queued selection is
        taken once the host has read from the device after queuing it
        (:meth:`device_read`: that read waited for its copy), so reading it holds the
        host behind no kernel. While requests decode, a token's loops bring such a read;
        where none comes, it is taken at the ``num_loops``-th step that asks, and at once
        with ``wait``. Which step a prompt's rows join depends only on the steps before
        it, never on timing."""
        pending = self._pending
        if pending is None:
            return True
        pending.asked += 1
        if not (wait or pending.arrived or pending.asked >= self.num_loops):
            return False
        self._pending = None
        chosen = pending.host_copy()
        dropped = self.active_on_host(pending.depth) & ~chosen
        if self.reused:  # the prefix's windows chose before (their KV is final)
            chosen[: self.reused] = self.reused_active[pending.depth + 1]
            dropped[: self.reused] = False
        pending.kv.finalize_exits(
            pending.request_id, dropped.nonzero().flatten().tolist(), pending.depth
        )
        self.active = to_device(chosen, self.active.device)
        self._host_copies.append((self.active, chosen))
        positions = chosen[self.reused :].nonzero().flatten() + self.reused
        self.index = to_device(positions, self.active.device)
        self.positions = positions.tolist()
        self._next_depth(pending.depth + 1)
        return True

    def device_read(self) -> None:
        """The host read from the device, which waited for every kernel and copy queued
        before: a selection queued before is on the host."""
        if self._pending is not None:
            self._pending.arrived = True

    def _next_depth(self, nxt: int) -> None:
        self.active_counts.append(len(self.positions))
        if nxt < self.num_loops:
            self.active_history.append(self.active)
            self.active_on_host(nxt)

    def restore_history(self, host_masks: list[torch.Tensor]) -> None:
        """The rows that ran each depth, from a snapshot's host masks [T] bool (their host
        copies kept, so packing reads none back from the device)."""
        device = self.active.device
        self.active_history = [to_device(mask, device) for mask in host_masks]
        self._host_copies = list(zip(self.active_history, host_masks, strict=True))

    def active_on_host(self, depth: int) -> torch.Tensor:
        """[T] bool on the host: the rows that ran ``depth`` (copied once per mask)."""
        mask = self.active_history[depth]
        for device_mask, host_mask in self._host_copies:
            if device_mask is mask:
                return host_mask
        host_mask = mask.cpu()
        self._host_copies.append((mask, host_mask))
        return host_mask

    def history(self) -> torch.Tensor | None:
        """[depths, T] bool on the host: the rows that ran each depth (the prefix's as
        published); None without token-sparse prefill (every row ran every depth)."""
        if self.sparsity is None:
            return None
        return torch.stack([self.active_on_host(d) for d in range(len(self.active_history))])

    def final_rows(self, done: int) -> int:
        """At the last depth, once its first ``done`` scheduled rows ran: how many leading
        prompt rows ran every depth (the rows before the next scheduled one; those between
        the scheduled ones left earlier)."""
        if done >= len(self.positions):
            return len(self.active)
        return self.positions[done]

    def chunk(self, start: int, count: int) -> tuple[int, tuple[int, ...]]:
        """(first position, positions) of scheduled rows [start, start+count); positions is
        empty when they are consecutive (the row group's start and count say it all)."""
        chunk = self.positions[start : start + count]
        if chunk[-1] - chunk[0] == count - 1:  # strictly increasing: consecutive
            return chunk[0], ()
        return chunk[0], tuple(chunk)

    def rows_within(self, start: int, count: int, span: int) -> int:
        """How many of scheduled rows [start, start+count) lie within ``span`` positions
        of the first (at least one)."""
        end = bisect_left(self.positions, self.positions[start] + span, start, start + count)
        return max(1, end - start)

    def rows(self, start: int, count: int) -> slice | torch.Tensor:
        """Where scheduled rows [start, start+count) sit in the prompt's hidden states
        [T, hidden]: a slice when they are consecutive, else an index [count] int64 on the
        device (one gather in, one scatter out)."""
        first, span = self.chunk(start, count)
        if not span:
            return slice(first, first + count)
        assert self.index is not None  # positions skip rows only after a selection
        return self.index[start : start + count]


class _PendingSelection:
    """The next depth's selection ``chosen`` [T] bool on the device, copied to pinned host
    memory behind an event: reading it waits for that copy, not for the steps queued
    after it."""

    def __init__(self, depth: int, chosen: torch.Tensor, kv: PagedKVCache, request_id: int):
        self.depth, self.kv, self.request_id = depth, kv, request_id
        self.arrived = False  # the host read from the device after queuing it
        self.asked = 0  # steps that asked for the rows since
        cuda = chosen.device.type == "cuda"
        self._host = torch.empty(chosen.shape, dtype=torch.bool, pin_memory=cuda)
        self._host.copy_(chosen, non_blocking=cuda)
        self._copied = torch.cuda.Event() if cuda else None
        if self._copied is not None:
            self._copied.record(torch.cuda.current_stream(chosen.device))

    def host_copy(self) -> torch.Tensor:
        """[T] bool on the host (waits for the copy if it has not run)."""
        if self._copied is not None:
            self._copied.synchronize()
        return self._host.clone()
