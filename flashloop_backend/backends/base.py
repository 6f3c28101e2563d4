"""The typed interface the host calls: :class:`AttentionBackend`.

A host (this package's engine, or a runtime's adapter) reaches a backend only through
these methods. The backend owns everything its kernels read: the loop-2 reference states,
the packed KV store and its per-batch and per-graph metadata. The host owns the BF16
paged cache and the requests, and lends the backend a :class:`RequestKV` view of one
request's cache when the backend needs its rows (to pack them).

Every step a dense backend has nothing to do for defaults to nothing, so the host calls
each one unconditionally.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol

import torch

from flashloop_backend.capabilities import Capability
from flashloop_backend.config import FlashLoopConfig
from flashloop_backend.dispatch import BatchView
from flashloop_backend.kernels.op_protocols import PagedAttention
from flashloop_backend.kv.rows import KVRows
from flashloop_backend.kv.sequence_levels import OutOfPackedPagesError
from flashloop_backend.registry.spec import SelectionInfo

__all__ = [
    "AttentionBackend",
    "EngineCapacity",
    "GraphStep",
    "OutOfPackedPagesError",
    "RequestCost",
    "RequestKV",
]


@dataclass(frozen=True)
class EngineCapacity:
    """What an engine holds, for the backend to size its own state at start-up.

    ``max_slots`` live decode tokens, ``max_context`` positions per request, the model's
    ``num_layers``, ``num_heads`` query heads, ``num_kv_heads`` and ``head_dim``, ``loops``
    depth planes, and the BF16 pool: ``num_blocks`` blocks of ``block_size`` tokens spread
    over every depth plane. ``packed_pages``: the packed pool (None: the backend's default
    for that BF16 pool)."""

    max_slots: int
    max_context: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    loops: int
    num_blocks: int
    block_size: int
    device: torch.device
    packed_pages: int | None = None


@dataclass(frozen=True)
class RequestCost:
    """What one request holds of a backend's own pools, from the format alone (no pool
    need exist): ``packed_pages`` pages of ``page_bytes`` reserved at admission;
    ``packed_rows`` of its prompt rows that leave the host's BF16 cache once the prompt ran
    every loop and was packed; ``slot_bytes`` of backend state per token-state slot."""

    packed_pages: int = 0
    page_bytes: int = 0
    packed_rows: int = 0
    slot_bytes: int = 0


class RequestKV(Protocol):
    """One request's BF16 KV as the host lends it to the backend.

    ``prompt_length`` prompt rows; ``final_rows``: rows whose KV is final at every depth
    (the prompt once it ran every loop, plus the generated tokens that exited)."""

    prompt_length: int
    num_depths: int

    @property
    def final_rows(self) -> int: ...

    def planes(self, start: int, end: int, depths: range | None = None) -> list[KVRows | None]:
        """Per depth K and V of rows [start, end), in place where the host keeps them
        (``KVRows``: end - start rows of [L, Hkv, D]), None for a depth outside ``depths``
        (None: every depth); valid until :meth:`drop`."""
        ...

    def active(self, start: int, end: int) -> list[torch.Tensor] | None:
        """Per depth [end - start] bool on the host: the rows that computed that depth
        (None: all)."""
        ...

    def drop(self, end: int) -> None:
        """Free the BF16 blocks of rows [0, end) on every plane: nothing reads them again."""
        ...


@dataclass(frozen=True)
class GraphStep:
    """A decode step's plan into a backend's graph buffers: ``variant`` is the part of the
    graph key the backend's kernels add (e.g. the packed reader's level count), ``reason``
    why these rows cannot run from a graph (None: they can), ``references_ready`` whether
    the host knows every row that reads a loop-2 reference holds its own (the step's ops:
    :meth:`AttentionBackend.decode_ops`)."""

    variant: int = 1
    reason: str | None = None
    references_ready: bool = False


class AttentionBackend(ABC):
    """What the host calls. ``__call__`` is vllm-rlt's dense call surface; ``forward``
    attends every row of a :class:`~flashloop_backend.dispatch.BatchView`."""

    config: FlashLoopConfig
    capabilities: frozenset[Capability]
    info: SelectionInfo
    dense_attention: PagedAttention

    def __call__(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lengths: torch.Tensor,
        scale: float | None = None,
    ) -> torch.Tensor:
        """q [R, Hq, D], caches [NB, BS, Hkv, D], block_tables [R, MB], context_lengths [R]."""
        return self.dense_attention(q, key_cache, value_cache, block_tables, context_lengths, scale)

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        view: BatchView,
        layer: int = 0,
        scale: float | None = None,
    ) -> torch.Tensor:
        """Attention for every row of ``view`` at ``layer``: q [R, Hq, D] -> [R, Hq, D];
        inactive and padding rows get zeros. The output is valid until the next call (a
        backend may write every layer's into one tensor)."""
        return None

    # ------------------------------------------------------------ start-up
    def reserve(self, capacity: EngineCapacity) -> None:
        """Allocate the backend's own state for an engine of ``capacity``; a geometry the
        backend cannot serve raises ``ConfigError`` naming it."""
        return None

    # ------------------------------------------------------------ requests
    def request_cost(
        self, capacity: EngineCapacity, prompt_length: int, max_new_tokens: int
    ) -> RequestCost:
        """:class:`RequestCost` of a request under an engine shaped like ``capacity`` (its
        pool sizes are not read): nothing for a backend that keeps no pool of its own."""
        return RequestCost()

    def pages_needed(self, prompt_length: int, max_new_tokens: int) -> tuple[int, int]:
        """(packed pages a request can ever hold, pages of the whole pool); (0, 0) when the
        backend stores no packed KV."""
        return 0, 0

    def admit(
        self,
        request_id: int,
        prompt_length: int,
        max_new_tokens: int,
        shared: object | None = None,
        shared_rows: int = 0,
    ) -> None:
        """Reserve what the request will need (raises ``OutOfPackedPagesError`` when short;
        nothing is held then). ``shared``: a :meth:`share_prompt` hold of an earlier
        prompt whose first ``shared_rows`` rows this prompt repeats (its prefix reuse): the
        backend may start the request's stored KV from them instead of storing its own."""
        return None

    def share_prompt(self, request_id: int, rows: int) -> object | None:
        """After :meth:`prompt_done`: hold the first ``rows`` rows of the request's stored
        prompt for later requests to start from (None: nothing to share). The holder gives
        it back with :meth:`drop_shared`."""
        return None

    def drop_shared(self, shared: object) -> None:
        """Give back a hold of :meth:`share_prompt`."""
        return None

    def frees_on_drop(self, shared: object) -> bool:
        """Whether giving back this hold would return storage to the pool (something only
        it holds)."""
        return False

    def prompt_rows_done(self, request_id: int, kv: RequestKV, rows: int) -> None:
        """During the prompt's last loop: its first ``rows`` rows ran every loop, so their
        KV is final at every depth. The host calls it after each prefill chunk of that
        loop, in the same step, so the backend may encode those rows there instead of in a
        later decode step. The BF16 rows stay readable (the prompt's later chunks read
        them) until :meth:`prompt_done`."""
        return None

    def prefill_chunks_by_positions(self) -> bool:
        """Whether the host bounds a token-sparse prompt chunk by the positions its rows
        span (``prefill_chunk`` positions) rather than by its rows: True where the kernel
        serving those rows computes every position of their span."""
        return False

    def carried_prompt_rows(self, prompt_length: int) -> int:
        """Leading rows of a prompt of this length that the backend stores itself one
        depth at a time (:meth:`store_prompt_depth`) once a loop but the last ran over the
        whole prompt: the host then passes their blocks on to the next loop's plane instead
        of keeping a plane per loop. 0: the backend stores no prompt rows that way."""
        return 0

    def store_prompt_depth(self, request_id: int, kv: RequestKV, depth: int, rows: int) -> int:
        """Loop ``depth`` (not the last) ran over the whole prompt: store that depth of at
        least its first ``rows`` carried rows (before the next loop's chunk that reads them;
        the host then hands their blocks of plane ``depth`` on to that loop). Returns the
        rows of that depth stored so far. The last depth follows :meth:`prompt_rows_done`."""
        raise NotImplementedError(
            f"{type(self).__name__} carries no prompt rows (carried_prompt_rows is 0)"
        )

    def prompt_done(self, request_id: int, kv: RequestKV) -> None:
        """The request's prompt ran every loop and its first token is out: its rows are
        final. The host calls it when the next step starts, before any of the request's
        decode rows run (never for a request that finished on its first token)."""
        return None

    def token_done(self, request_id: int, kv: RequestKV) -> None:
        """A generated token of the request exited: one more final row."""
        return None

    def speculation_rows(self, request_id: int, final_rows: int) -> int | None:
        """The most rows a speculation block of the request may hold, starting when
        ``final_rows`` of its rows are final: every row must read the KV that serial
        decoding would show it (None: no limit)."""
        return None

    def retire_slot(self, slot: int) -> None:
        """A token-state slot the request held besides its own (a speculation block's
        later rows) goes back: whatever state it holds is never read again."""
        return None

    def release(self, request_id: int, slot: int) -> None:
        """The request finished: return what it held (``slot``: its token-state slot, -1
        if it had none)."""
        return None

    # ------------------------------------------------------------ steps
    def plan(
        self,
        view: BatchView,
        request_ids: list[int],
        depths: list[int],
        tokens: list[tuple[int, int]] | None = None,
    ) -> None:
        """Host planning step of a batch after it is built: ``request_ids[i]``,
        ``depths[i]`` and ``tokens[i]`` (its token-state slot and incarnation; None: not
        known) of its i-th decode row, in batch order (the view's ``decode_bound`` rows;
        prefill and padding rows are not listed)."""
        return None

    def speculation_blockers(self) -> list[str]:
        """Why this backend cannot serve speculative verification rows (VERIFY: several
        decode queries of one request in a step, each with its own causal length) and
        drafted tokens whose KV a rejection leaves unread (none: it can)."""
        return []

    def tensor_parallel_blockers(self) -> list[str]:
        """Why this backend cannot serve one rank's share of the heads under tensor
        parallelism, its state split with its heads and nothing exchanged between ranks
        (none: it can)."""
        return []

    # ------------------------------------------------------------ CUDA graphs
    def graph_blockers(self) -> list[str]:
        """Why a CUDA graph cannot capture this backend's decode traversal (none: it can)."""
        return []

    def decode_ops(self, depths: frozenset[int], references_ready: bool = False) -> tuple[str, ...]:
        """The ops a decode-only step with rows at ``depths`` launches (a graph key part),
        when ``references_ready`` (:class:`GraphStep`) or not."""
        return ("dense_attention",)

    def graph_variants(self, depths: frozenset[int]) -> tuple[int, ...]:
        """Every ``GraphStep.variant`` a decode step with rows at ``depths`` can plan (the
        keys a warm-up captures ahead of serving)."""
        return (1,)

    def reference_variants(self, depths: frozenset[int]) -> tuple[bool, ...]:
        """Every ``GraphStep.references_ready`` a decode step with rows at ``depths`` can
        plan that changes its ops (the keys a warm-up captures ahead of serving)."""
        return (False,)

    def reserve_graph_inputs(self, rows: int, max_context: int) -> None:
        """Allocate fixed-address inputs for graphs of up to ``rows`` rows whose histories
        reach ``max_context`` positions."""
        return None

    def plan_graph_step(
        self,
        request_ids: list[int | None],
        depths: list[int],
        tokens: list[tuple[int, int]] | None = None,
    ) -> GraphStep:
        """Plan a decode step's rows (``request_ids`` padded with None to the bucket, and
        their ``tokens`` as :meth:`plan`'s, padded with (-1, -1)) into the fixed inputs."""
        return GraphStep()

    def bind_graph_step(self, view: BatchView, step: GraphStep) -> None:
        """The next forwards over ``view`` read the fixed inputs ``step`` planned."""
        return None

    # ------------------------------------------------------------ accounting
    def kv_bytes_held(self) -> int:
        """Bytes of KV the backend stores itself (the packed store's steady bytes)."""
        return 0

    def memory(self) -> dict[str, int]:
        """Bytes of every pool the backend allocated, by name."""
        return {}

    def held(self) -> dict[str, int]:
        """What live requests hold of the backend's own pools, by name (for accounting:
        every count is 0 once every request has been released). Reads the device: not for
        the step path."""
        return {}

    # ------------------------------------------------------------ saved request state
    def state_identity(self) -> dict:
        """What a saved request state depends on: the backend, its configuration's digest
        (algorithms and encoding) and the packed KV encoding (None without one)."""
        digest = hashlib.sha256(self.config.canonical_json().encode()).hexdigest()[:16]
        return {"backend": self.info.selected_backend, "config_digest": digest, "kv_encoding": None}

    def export_request(self, request_id: int) -> dict[str, torch.Tensor]:
        """The request's state in the backend's own pools as CPU tensors, between tokens
        (no loop-2 reference is live then); :meth:`import_request` takes it back."""
        return {}

    def import_request(self, request_id: int, tensors: dict[str, torch.Tensor]) -> None:
        """Take an admitted request's state from :meth:`export_request`'s tensors; a
        refusal (``ValueError`` naming the tensor) takes nothing."""
        if tensors:
            raise ValueError(
                f"backend {self.info.selected_backend!r} keeps no per-request state; got "
                f"tensors {sorted(tensors)[:4]}"
            )
