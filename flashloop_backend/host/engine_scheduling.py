"""What runs in each step, as :class:`Engine` methods: admitting waiting requests (slots,
blocks and pages reserved, prefix-cache sharing and eviction) and choosing the step's rows
(prompt chunks, decode rows, in lockstep by depth where the backend asks for it)."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch

from flashloop_backend.backends.base import OutOfPackedPagesError
from flashloop_backend.device_copy import to_device
from flashloop_backend.dispatch import RowMode
from flashloop_backend.host.batch import RowGroup
from flashloop_backend.host.decode_depths import lockstep_depth
from flashloop_backend.host.kvcache import OutOfBlocksError
from flashloop_backend.host.prompt_schedule import PromptSchedule
from flashloop_backend.host.requests import Request


def token_tensor(tokens: Sequence[int]) -> torch.Tensor:
    """[T] int64 on the host from token ids: through a typed buffer, several times faster
    than ``torch.tensor`` over a long Python list (admission runs inside a step)."""
    if not tokens:  # frombuffer refuses an empty buffer
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(array("q", tokens), dtype=torch.int64)


class StepScheduling:
    """The engine's admission and step scheduling (a mixin of :class:`Engine`: it uses the
    engine's requests, pools, backend and prefix cache)."""

    def _admit(self) -> None:
        for request in self._requests.values():
            if request.phase != "waiting":
                continue
            if len(self._free_slots) < self.slots_per_request:
                break  # every token-state slot is taken: wait
            found = self.prefix_cache.lookup(request.prompt) if self.prefix_cache else (0, None)
            if self.prefix_cache is not None and self._prefix_in_flight(request, found[0]):
                continue  # its prefix is being computed: share it once published
            schedule = self._reserve(request, found)
            if schedule is None:
                break  # first-come first-served: later requests wait behind it
            self._take_slots(request)
            ids = to_device(token_tensor(request.prompt), self.device)
            with torch.no_grad():
                request.prompt_hidden = self.model.prelude(ids)
            request.schedule = schedule
            request.phase = "prefill"

    def _take_slots(self, r: Request) -> None:
        """The request's token-state slot and, speculating, one more per block row."""
        r.slot = self._free_slots.pop()
        r.extra_slots = [self._free_slots.pop() for _ in range(self.slots_per_request - 1)]

    def _evict_for(self, short: OutOfBlocksError | OutOfPackedPagesError) -> bool:
        """Drop a cached prefix that frees what ``short`` says is missing (cached prefixes
        hold BF16 blocks, and packed rows once their prompt packed); False when none would."""
        pages = isinstance(short, OutOfPackedPagesError)
        return self.prefix_cache is not None and self.prefix_cache.evict_one(packed=pages)

    def _prefix_in_flight(self, request: Request, cached: int) -> bool:
        """Whether a prompt still prefilling shares more whole units with ``request``'s
        than the ``cached`` positions the cache holds for it: computing them twice side by
        side would waste a prefill."""
        cache = self.prefix_cache
        for other in self._requests.values():
            if other.phase == "prefill":
                shared = cache.common_units(other.prompt, request.prompt)
                if shared > cached:
                    return True
        return False

    def _reserve(self, request: Request, found: tuple) -> PromptSchedule | None:
        """Reserve a waiting request's blocks and pages, sharing ``found`` (the cache's
        lookup of its prompt: positions, entry), evicting cached prefixes while the pool is
        short (and looking up again after each); its prompt schedule, or None when it must
        wait (nothing held)."""
        new, loops = request.params.max_new_tokens, self.cfg.total_ut_steps
        reused, entry = found
        while True:
            shared = self.prefix_cache.shared_blocks(entry, reused) if entry else None
            packed = entry.packed if entry else None
            carry = 0 if shared is not None else self._carried_rows(len(request.prompt))
            try:
                self.kv.reserve(request.id, len(request.prompt) + new, shared, carry)
                self.backend.admit(request.id, len(request.prompt), new, packed, reused)
                break
            except (OutOfBlocksError, OutOfPackedPagesError) as exc:
                self.kv.release(request.id)
                if not self._evict_for(exc):
                    return None
                reused, entry = self.prefix_cache.lookup(request.prompt)  # it may have gone
        active = None
        if entry is not None:
            self.prefix_cache.record(reused, entry)
            active = None if entry.active is None else entry.active[:, :reused]
        elif self.prefix_cache:
            self.prefix_cache.record(0, None)
        return PromptSchedule(
            len(request.prompt), self.sparsity, loops, self.device, reused, active
        )

    def _schedule(self) -> list[RowGroup]:
        budget, groups = self.max_batch_tokens, []
        prompts = [r for r in self._requests.values() if r.phase == "prefill"]
        unknown = {r.id for r in prompts if not r.schedule.ready()}
        if unknown and len(unknown) == len(prompts) and not self._decoding():
            for r in prompts:  # nothing else would run: wait for the selections
                r.schedule.ready(wait=True)
            unknown = set()
        lockstep = None
        if self.align_decode_depths:
            decoding = [r for r in self._requests.values() if r.phase == "decode"]
            rows = [(r.depth, self._decode_rows(r), r.held_back) for r in decoding]
            lockstep = lockstep_depth(rows, patience=self.cfg.total_ut_steps)
            for r in decoding:
                r.held_back = 0 if r.depth == lockstep else r.held_back + 1
        for r in self._requests.values():
            if budget == 0:
                break
            if r.phase == "decode":
                if lockstep is not None and r.depth != lockstep:
                    continue  # waits for the step that runs its depth
                group = (
                    self._block_group(r)
                    if r.block is not None
                    else RowGroup(
                        r.id, RowMode.DECODE, r.depth, r.position, 1, r.slot, r.incarnation
                    )
                )
                if group.count > budget:
                    break
                groups.append(group)
                budget -= group.count
            elif r.phase == "prefill" and r.id not in unknown:  # its rows known
                count = min(self.prefill_chunk, len(r.schedule.positions) - r.chunk_start, budget)
                if self.chunks_by_positions:
                    count = r.schedule.rows_within(r.chunk_start, count, self.prefill_chunk)
                first, span = r.schedule.chunk(r.chunk_start, count)
                groups.append(RowGroup(r.id, RowMode.PREFILL, r.depth, first, count, span=span))
                budget -= count
                self.prefill_rows_run += count
                self.prefill_rows_by_loop[r.depth] += count
        return groups

    def _decoding(self) -> bool:
        return any(r.phase == "decode" for r in self._requests.values())

    def _decode_rows(self, r: Request) -> int:
        """Rows a decode request runs in its next step: its token, or its speculation
        block's verification rows (a block not yet fitted counts its drafting row)."""
        if r.block is None or not r.block.sized:
            return 1
        return self.speculation.group(r).count
