"""The flashloop backend's packed INT4 KV: the page store, what to encode when, and
per-batch reader metadata planned on the host.

A prompt is packed once it has run every loop: whole groups of ``group_size`` rows, every
depth's logical history, compact residual levels for rows that token-sparse prefill left
inactive (or that exited early). The host then frees their BF16 blocks, so no BF16
shadow remains. ``fixed_prompt`` stops there: generated tokens stay BF16. ``rolling``
keeps a BF16 tail of at least ``tail_size`` final rows and flushes one whole group each
time the tail reaches ``tail_size + group_size`` (so it holds tail_size..tail_size+G-1
rows after every step).

A request's pages are reserved when it is admitted (:meth:`PackedState.reserve`), bounded
by :meth:`PackedState.page_bound`: packing then never runs out of pages mid-flight.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..dispatch import BatchView
from ..packed_kv import PackedKVStore
from ..packed_meta import level_metadata


class PackedState:
    def __init__(
        self, store: PackedKVStore, quantize: Callable, policy: str, tail_size: int
    ) -> None:
        self.store, self.quantize = store, quantize
        self.policy, self.tail_size = policy, tail_size
        self._planned: tuple[BatchView, dict[str, torch.Tensor]] | None = None
        self._ordered: dict[str, torch.Tensor] | None = None

    @property
    def group_size(self) -> int:
        return self.store.group_size

    @staticmethod
    def packable_rows(rows: int, group_size: int, policy: str, tail_size: int) -> int:
        """Whole groups of ``rows`` final rows that go to the store: all of them
        (``fixed_prompt``), or all that leave at least ``tail_size`` rows in BF16 (``rolling``)."""
        keep = tail_size if policy == "rolling" else 0
        return max(0, rows - keep) // group_size * group_size

    @staticmethod
    def page_bound(prompt_length: int, max_new_tokens: int, depths: int, group_size: int,
                   policy: str, tail_size: int) -> int:  # fmt: skip
        """Most pages a request can ever hold. Rows are packed in whole groups, and each
        append costs a level at most rows / G pages (a compact level starts a fresh page per
        append but stores only its active rows), so every level costs at most packed rows /
        G. ``fixed_prompt`` packs the prompt only; ``rolling`` also flushes generated rows."""
        rows = prompt_length + (max_new_tokens if policy == "rolling" else 0)
        return depths * (
            PackedState.packable_rows(rows, group_size, policy, tail_size) // group_size
        )

    def pages_needed(self, prompt_length: int, max_new_tokens: int, depths: int) -> int:
        """:meth:`page_bound` under this state's group size, policy and tail."""
        return self.page_bound(prompt_length, max_new_tokens, depths, self.group_size,
                               self.policy, self.tail_size)  # fmt: skip

    def reserve(self, sequence: int, prompt_length: int, max_new_tokens: int, depths: int) -> None:
        """Hold every page the request can need (raises ``OutOfPackedPagesError`` when the
        pool's unreserved pages are short; nothing is taken then)."""
        self.store.reserve(sequence, self.pages_needed(prompt_length, max_new_tokens, depths))

    def prompt_packed(self, sequence: int) -> None:
        """``fixed_prompt`` packs nothing after the prompt: what its reservation holds beyond
        the pages taken (compact levels take fewer) goes back to the pool."""
        if self.policy != "rolling":
            self.store.unreserve(sequence)

    def packed_rows(self, sequence: int) -> int:
        entry = self.store.sequences.get(sequence)
        return 0 if entry is None else entry.rows

    def prompt_rows(self, prompt_length: int) -> int:
        """Rows of a completed prompt to pack: every whole group (``fixed_prompt``), or
        every whole group that leaves at least ``tail_size`` rows in BF16 (``rolling``)."""
        return self.packable_rows(prompt_length, self.group_size, self.policy, self.tail_size)

    def flush_due(self, sequence: int, final_rows: int) -> bool:
        """Whether the next group leaves the BF16 tail (``rolling``): ``final_rows`` rows
        have their KV final on every depth."""
        if self.policy != "rolling":
            return False
        return final_rows - self.packed_rows(sequence) >= self.tail_size + self.group_size

    def append(self, sequence: int, keys: list[torch.Tensor], values: list[torch.Tensor],
               active: list[torch.Tensor] | None) -> None:  # fmt: skip
        """keys/values per depth [T, L, Hkv, D] for the sequence's next T rows (a multiple
        of the group size); ``active`` per depth [T] bool or None."""
        self.store.append(sequence, keys, values, active, quantize=self.quantize)

    def release(self, sequence: int) -> None:
        """Return the sequence's pages and what remains of its reservation."""
        self.store.release(sequence)

    def plan(self, view: BatchView, sequences: list[int | None], depths: list[int]) -> None:
        """Reader metadata for ``view`` (host planning step). ``sequences[i]`` None: row i
        reads no packed KV (a prefill or padding row); rows of sequences not packed yet
        read BF16 only. When some rows are None the others must be exactly the view's
        ``decode_bound`` decode rows, which its stable decode-first order puts first: only
        they get metadata, so a prefill chunk's thousands of rows cost nothing here."""
        reading = [i for i, s in enumerate(sequences) if s is not None]
        if len(reading) == len(sequences):
            meta = level_metadata(self.store, sequences, depths, view.device)
            self._planned, self._ordered = (view, meta), None
            return
        if view.decode_bound != len(reading):
            raise ValueError(
                f"{len(reading)} rows read packed KV but the batch has decode_bound="
                f"{view.decode_bound} decode rows: only decode rows may read it"
            )
        meta = level_metadata(self.store, [sequences[i] for i in reading],
                              [depths[i] for i in reading], view.device)  # fmt: skip
        self._planned, self._ordered = (view, meta), meta  # already the decode-first order

    def use_plan(self, view: BatchView, meta: dict[str, torch.Tensor]) -> None:
        """Metadata the caller planned into its own buffers (a CUDA graph's fixed
        addresses, filled before each replay) for ``view``."""
        self._planned, self._ordered = (view, meta), None

    def meta_for(self, view: BatchView, order: torch.Tensor) -> dict[str, torch.Tensor]:
        """The planned metadata in the backend's gathered row order (computed once per
        batch: every layer gathers the same order)."""
        if self._planned is None or self._planned[0] is not view:
            raise RuntimeError(
                "packed KV metadata was not planned for this batch: the host calls "
                "backend.plan_packed(view, request_ids, depths) after building it"
            )
        if self._ordered is None:
            self._ordered = {name: tensor[order] for name, tensor in self._planned[1].items()}
        return self._ordered  # decode rows first: readers take the first decode_bound rows
