"""Loop-2 reference state of live decode tokens (RFC §5), in fixed-address device tensors.

One slot per live token (not per request), per layer and query head: selected key
positions, their mass, the full reference output and the selected contribution. Each
(slot, layer) records the incarnation of the token that wrote it, so a new token in a
reused slot (or at a position reused after speculative rejection) never reads its
predecessor's state: a mismatch means "no reference" and the row runs dense, counted in
``missing_reference``. Writes and readiness checks never synchronise with the host; the
host keeps its own record of the tokens whose sources it planned (:meth:`host_ready`), so
a step whose rows all hold their reference can leave out the dense read for rows without
(a row the device then finds without one is counted in ``vouched_missing``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from flashloop_backend.algorithms import selected_count

EMPTY = -1


def key_bucket(key_retention: float, max_context: int) -> int:
    """Selected-key capacity (``k_bucket``) for contexts up to ``max_context`` at
    ``key_retention``, rounded up to 16."""
    return 16 * math.ceil(selected_count(key_retention, max_context) / 16)


def store_by_indexing(
    state: tuple[torch.Tensor, ...],
    layer: int,
    slot: torch.Tensor,
    incarnation: torch.Tensor,
    indices: torch.Tensor,
    mass: torch.Tensor,
    output: torch.Tensor,
    contribution: torch.Tensor,
) -> None:
    """The reference store's write by tensor indexing (the Triton store's oracle): row r's
    ``indices`` [N, H, W] int32 (-1 up to the bucket), ``mass`` [N, H], ``output`` and
    ``contribution`` [N, H, D] into slot ``slot[r]`` of ``state`` at ``layer``, and its
    ``incarnation`` at [slot, layer]."""
    state_indices, state_mass, state_output, state_contribution, state_incarnation = state
    width, bucket = indices.shape[-1], state_indices.shape[-1]
    if width < bucket:  # one tensor write (a Python scalar would be copied from the host:
        # not capturable)
        indices = torch.nn.functional.pad(indices, (0, bucket - width), value=-1)
    state_indices[layer, slot] = indices
    state_mass[layer, slot] = mass
    state_output[layer, slot] = output
    state_contribution[layer, slot] = contribution
    state_incarnation[slot, layer] = incarnation


class ReferenceStates:
    """indices [L, S+1, H, K] int32 (-1 = unused), mass [L, S+1, H] FP32, output and
    contribution [L, S+1, H, D] FP32, incarnation [S+1, L] int64. Slot S is scratch: rows
    that must not write are pointed at it. Layer-major, so one gather reads a batch's rows
    at every layer with each layer's part contiguous (:meth:`read_layers`)."""

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_heads: int,
        head_dim: int,
        k_bucket: int,
        device: torch.device | str,
    ) -> None:
        shape = (num_layers, num_slots + 1, num_heads)
        self.num_slots, self.num_layers, self.k_bucket = num_slots, num_layers, k_bucket
        self.indices = torch.full((*shape, k_bucket), -1, dtype=torch.int32, device=device)
        self.mass = torch.zeros(shape, dtype=torch.float32, device=device)
        self.output = torch.zeros((*shape, head_dim), dtype=torch.float32, device=device)
        self.contribution = torch.zeros_like(self.output)
        self.incarnation = torch.full(
            (num_slots + 1, num_layers), EMPTY, dtype=torch.int64, device=device
        )
        self.missing_reference = torch.zeros((), dtype=torch.int64, device=device)
        self.sources_written = torch.zeros((), dtype=torch.int64, device=device)
        self.vouched_missing = torch.zeros((), dtype=torch.int64, device=device)
        # slot -> incarnation of the token whose source a planned step writes there: the
        # host's copy of ``incarnation`` for the writes it planned (a write it did not plan
        # is missing here, so a row it cannot vouch for keeps its dense read)
        self.host_written: dict[int, int] = {}

    def target(self, slots: torch.Tensor) -> torch.Tensor:
        """[N] (``slots``' dtype): each row's slot, or the scratch slot S for rows without a
        usable one. A batch computes it once; every layer's read, write and readiness
        check reuse it."""
        # two launches: the clamp sends every negative slot to -1 and every slot at or past
        # S to S, and modulo S + 1 takes -1 to S
        return slots.clamp(-1, self.num_slots).remainder(self.num_slots + 1)

    def write_rows(
        self, target: torch.Tensor, incarnations: torch.Tensor, keep: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot [N], incarnation [N]) each row's :meth:`store` writes: its :meth:`target`
        and incarnation where ``keep`` ([N] bool) holds, else the scratch slot and EMPTY.
        A batch computes them once for all its layers."""
        slot = torch.where(keep, target, self.num_slots)
        return slot, torch.where(keep, incarnations, EMPTY)

    def store(
        self,
        layer: int,
        rows: tuple[torch.Tensor, torch.Tensor],
        indices: torch.Tensor,
        mass: torch.Tensor,
        output: torch.Tensor,
        contribution: torch.Tensor,
    ) -> None:
        """Write ``layer``'s state of the rows planned by :meth:`write_rows`."""
        slot, incarnation = rows
        width = indices.shape[-1]
        if width > self.k_bucket:
            raise ValueError(f"{width} selected keys exceed the state's bucket of {self.k_bucket}")
        indices = indices.to(torch.int32)
        if self.indices.is_cuda:  # one launch for every field (indexing takes one each)
            from flashloop_backend.kernels.triton.reference_store import store_reference_triton

            fields = (f.float().contiguous() for f in (mass, output, contribution))
            store_reference_triton(
                self.tensors(), layer, slot, incarnation, indices.contiguous(), *fields
            )
            return
        store_by_indexing(
            self.tensors(), layer, slot, incarnation, indices, mass, output, contribution
        )

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """(indices, mass, output, contribution, incarnation): the store's own tensors."""
        return self.indices, self.mass, self.output, self.contribution, self.incarnation

    def write_at(
        self,
        layer: int,
        target: torch.Tensor,
        incarnations: torch.Tensor,
        keep: torch.Tensor,
        indices: torch.Tensor,
        mass: torch.Tensor,
        output: torch.Tensor,
        contribution: torch.Tensor,
    ) -> None:
        """Store the rows where ``keep`` ([N] bool) holds at their :meth:`target` slots;
        other rows land in scratch. Counted in ``sources_written``."""
        rows = self.write_rows(target, incarnations, keep)
        self.store(layer, rows, indices, mass, output, contribution)
        self.sources_written += keep.sum()

    def write(self, layer: int, slots: torch.Tensor, incarnations: torch.Tensor, *args) -> None:
        """:meth:`write_at` from the rows' slots [N]."""
        self.write_at(layer, self.target(slots), incarnations, *args)

    def ready_layers(self, target: torch.Tensor, incarnations: torch.Tensor) -> torch.Tensor:
        """[N, L] bool: the row's :meth:`target` slot holds this very token's reference for
        each layer (one gather for every layer of a step: a step never writes the slot of
        a row that reads its reference)."""
        stored = self.incarnation[target]  # [N, L]
        usable = (target < self.num_slots) & (incarnations != EMPTY)
        return usable[:, None] & (stored == incarnations[:, None])

    def ready(self, layer: int, slots: torch.Tensor, incarnations: torch.Tensor) -> torch.Tensor:
        """[N] bool: the slot holds this very token's reference for ``layer``."""
        return self.ready_layers(self.target(slots), incarnations)[:, layer]

    def read_at(self, layer: int, target: torch.Tensor):
        """(indices, mass, output, contribution) of each row's :meth:`target` slot for
        ``layer``."""
        return (
            self.indices[layer, target],
            self.mass[layer, target],
            self.output[layer, target],
            self.contribution[layer, target],
        )

    def read_layers(self, target: torch.Tensor, indices: bool = True):
        """(indices [L, N, H, K] (None without ``indices``), mass [L, N, H], output and
        contribution [L, N, H, D]) of each row's :meth:`target` slot at every layer: one
        gather per field for a whole step (a step never writes the slot of a row that
        reads its reference)."""
        return (
            self.indices[:, target] if indices else None,
            self.mass[:, target],
            self.output[:, target],
            self.contribution[:, target],
        )

    def read(self, layer: int, slots: torch.Tensor):
        """(indices, mass, output, contribution) of each row's slot for ``layer``."""
        return self.read_at(layer, self.target(slots))

    def retire(self, slot: int) -> None:
        """The token in ``slot`` is gone: its state can never be read again."""
        self.incarnation[slot] = EMPTY
        self.host_written.pop(slot, None)

    def host_ready(self, tokens: Iterable[tuple[int, int]]) -> bool:
        """Whether every (slot, incarnation) of ``tokens`` holds its own reference by the
        host's record of planned sources: what :meth:`ready_layers` would find at every
        layer, known without reading the device."""
        written = self.host_written
        return all(
            0 <= slot < self.num_slots and incarnation != EMPTY and written.get(slot) == incarnation
            for slot, incarnation in tokens
        )

    def host_sources(self, tokens: Iterable[tuple[int, int]]) -> None:
        """Record that a planned step writes the source of each (slot, incarnation) of
        ``tokens`` at every layer (a row without a usable slot writes the scratch slot)."""
        for slot, incarnation in tokens:
            if 0 <= slot < self.num_slots:
                self.host_written[slot] = incarnation

    def live_slots(self) -> int:
        """Slots (scratch excluded) whose state some token wrote and that was not retired
        since (reads the device)."""
        return int((self.incarnation[:-1] != EMPTY).any(dim=1).sum())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())
