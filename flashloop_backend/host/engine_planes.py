"""A prompt's rows as the backend stores them, as :class:`Engine` methods: the hand-over of
completed prompts, and the carried planes (loop d - 1's rows stored, then plane d takes
their blocks, so a prompt holds one BF16 plane of the rows the backend packs)."""

from __future__ import annotations

from flashloop_backend.dispatch import RowMode
from flashloop_backend.host.batch import RowGroup
from flashloop_backend.host.requests import Request


class PromptPlanes:
    """The engine's prompt hand-over and plane carrying (a mixin of :class:`Engine`)."""

    def hand_over_prompts(self) -> None:
        """``backend.prompt_done`` for every prompt completed in the last step whose request
        still runs (one that finished on its first token left with its KV). Each step
        starts with it; a profile of the prompt phase calls it to include the packing."""
        for r in self._prompts_to_hand_over:
            if r.id in self._requests:
                self.backend.prompt_done(r.id, self._request_kv(r))
                entry, r.published = r.published, None
                if entry is not None:  # later prompts may start from its stored rows too
                    shared = self.backend.share_prompt(r.id, len(entry.tokens))
                    if shared is not None:
                        self.prefix_cache.attach_packed(entry, shared)
        self._prompts_to_hand_over.clear()

    def _carried_rows(self, prompt_length: int) -> int:
        """Rows of a prompt of this length whose blocks pass from plane to plane."""
        return self.backend.carried_prompt_rows(prompt_length) if self.carry_planes else 0

    def _carry_planes(self, groups: list[RowGroup]) -> None:
        """Before a prompt's chunk of loop d > 0 runs: the backend stores loop d - 1 of the
        carried rows the chunk reads (the rows before its last position; in the last loop
        also those its chunk makes final, which the last level's packing reads right
        after) and plane d takes their blocks; with its last chunk, or rows past the
        carried ones, plane d takes the rest (fresh blocks holding a copy of plane d - 1's
        prompt rows past them). Stored in whole appends as the chunks reach them, a
        depth's conversion spreads over the next loop's steps for prompts longer than an
        append (``PACK_CHUNK_ROWS``)."""
        for group in groups:
            carry = self.kv.carried_rows(group.request_id) if group.mode == RowMode.PREFILL else 0
            if not carry or not group.depth:
                continue
            r = self._requests[group.request_id]
            needed = (group.span[-1] if group.span else group.start + group.count - 1) + 1
            done = r.chunk_start + group.count
            if group.depth == self.cfg.total_ut_steps - 1:  # the rows packed right after it
                needed = max(needed, r.schedule.final_rows(done))
            whole = needed > carry or done == len(r.schedule.positions)
            self._carry_plane(r, group.depth - 1, carry, carry if whole else needed, whole)

    def _carry_plane(self, r: Request, depth: int, carry: int, rows: int, whole: bool) -> None:
        """Plane ``depth + 1`` takes plane ``depth``'s blocks of the first ``rows`` of the
        request's ``carry`` carried rows once stored (and the rest with ``whole``)."""
        if self.kv.carried_through(r.id) > depth:
            return
        kv = self._request_kv(r)
        stored = self.backend.store_prompt_depth(r.id, kv, depth, min(rows, carry))
        if stored < min(rows, carry) or stored > carry:
            raise RuntimeError(
                f"request {r.id}: the backend stored {stored} rows of depth {depth}; the host "
                f"carries {min(rows, carry)} of {carry} to the next plane"
            )
        rows = stored // self.kv.block_size * self.kv.block_size
        self.kv.carry_plane(r.id, depth, rows, whole, copy_rows=len(r.prompt))
