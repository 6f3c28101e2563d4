"""The flashloop backend's packed INT4 KV: the page store, what to encode when, and
per-batch reader metadata planned on the host.

A prompt is packed once it has run every loop: whole groups of ``group_size`` rows, every
depth's logical history, compact residual levels for rows that token-sparse prefill left
inactive (or that exited early). The host then frees their BF16 blocks, so no BF16
shadow remains. ``fixed_prompt`` stops there: generated tokens stay BF16. ``rolling``
keeps a BF16 tail of at least ``tail_size`` final rows and flushes one whole group each
time the tail reaches ``tail_size + group_size`` (so it holds tail_size..tail_size+G-1
rows after every step).
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

    def packed_rows(self, sequence: int) -> int:
        entry = self.store.sequences.get(sequence)
        return 0 if entry is None else entry.rows

    def prompt_rows(self, prompt_length: int) -> int:
        """Rows of a completed prompt to pack: every whole group (``fixed_prompt``), or
        every whole group that leaves at least ``tail_size`` rows in BF16 (``rolling``)."""
        keep = self.tail_size if self.policy == "rolling" else 0
        return max(0, prompt_length - keep) // self.group_size * self.group_size

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
        if sequence in self.store.sequences:
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
