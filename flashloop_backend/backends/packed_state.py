"""The flashloop backend's packed INT4 KV (``fixed_prompt``): the page store, the encoding
of a completed prompt, and per-batch reader metadata planned on the host.

A prompt is packed once it has run every loop: whole groups of ``group_size`` rows, every
depth's logical history, compact residual levels for rows that token-sparse prefill left
inactive. Its BF16 pages for those rows are then released by the host, so no BF16 shadow
remains; later rows (the partial last group and generated tokens) stay BF16.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..dispatch import BatchView
from ..kernels.triton.packed_decode import level_metadata
from ..packed_kv import PackedKVStore


class PackedState:
    def __init__(self, store: PackedKVStore, quantize: Callable) -> None:
        self.store, self.quantize = store, quantize
        self._planned: tuple[BatchView, dict[str, torch.Tensor]] | None = None

    @property
    def group_size(self) -> int:
        return self.store.group_size

    def packable_rows(self, prompt_length: int) -> int:
        return prompt_length // self.group_size * self.group_size

    def pack_prompt(self, sequence: int, keys: list[torch.Tensor], values: list[torch.Tensor],
                    active: list[torch.Tensor] | None) -> None:  # fmt: skip
        """keys/values per depth [T, L, Hkv, D] (T = ``packable_rows``); ``active`` per
        depth [T] bool or None."""
        self.store.encode(sequence, keys, values, active, quantize=self.quantize)

    def release(self, sequence: int) -> None:
        if sequence in self.store.sequences:
            self.store.release(sequence)

    def plan(self, view: BatchView, sequences: list[int], depths: list[int]) -> None:
        """Reader metadata for every row of ``view`` (host planning step; padding rows and
        sequences not packed yet read BF16 only)."""
        known = [s if s in self.store.sequences else None for s in sequences]
        packed_rows = [i for i, s in enumerate(known) if s is not None]
        meta = level_metadata(
            self.store,
            [known[i] for i in packed_rows],
            [depths[i] for i in packed_rows],
            view.device,
        )
        rows = view.num_rows
        full = {
            "level_tables": torch.full((rows, *meta["level_tables"].shape[1:]), -1, dtype=torch.int32),
            "level_maps": torch.full((rows, *meta["level_maps"].shape[1:]), -1, dtype=torch.int32),
            "level_kinds": torch.full((rows, meta["level_kinds"].shape[1]), 2, dtype=torch.int32),
            "packed_lengths": torch.zeros(rows, dtype=torch.int32),
        }  # fmt: skip
        index = torch.tensor(packed_rows, dtype=torch.long)
        for name, tensor in full.items():
            if packed_rows:
                tensor[index] = meta[name].cpu()
            full[name] = tensor.to(view.device)
        self._planned = (view, full)

    def meta_for(self, view: BatchView, order: torch.Tensor) -> dict[str, torch.Tensor]:
        if self._planned is None or self._planned[0] is not view:
            raise RuntimeError(
                "packed KV metadata was not planned for this batch: the host calls "
                "backend.plan_packed(view, request_ids, depths) after building it"
            )
        return {name: tensor[order] for name, tensor in self._planned[1].items()}
