"""The ``flashloop`` backend's request lifecycle, a mixin of ``FlashLoopBackend``: the
stores it reserves at start-up (the loop-2 references, the packed pages), what a request
costs, admission with shared prompt rows, a prompt's packing, release, and the tensors a
snapshot or a PD handoff carries per request."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from flashloop_backend.backends.base import EngineCapacity, RequestCost, RequestKV
from flashloop_backend.backends.packed_state import PackedState
from flashloop_backend.backends.sparse_state import ReferenceStates, key_bucket
from flashloop_backend.capabilities import Capability
from flashloop_backend.config import ConfigError, FlashLoopConfig
from flashloop_backend.dispatch import route_table
from flashloop_backend.kernels.op_inputs import SOURCE_OPS
from flashloop_backend.kernels.op_protocols import OpName
from flashloop_backend.kv.encoding import encoding_descriptor
from flashloop_backend.kv.layout import PackedLayout
from flashloop_backend.kv.store import PackedKVStore
from flashloop_backend.kv.transfer import SharedRows

if TYPE_CHECKING:
    from flashloop_backend.registry import KernelChoice


class FlashLoopRequests:
    """Start-up, request and saved-state methods of :class:`FlashLoopBackend` (they read
    its ``config`` and ``kernels`` and own its ``states`` and ``packed`` stores)."""

    config: FlashLoopConfig
    kernels: dict[OpName, KernelChoice]
    states: ReferenceStates | None
    packed: PackedState | None
    _statistics_stream: torch.cuda.Stream | None

    def reserve(self, capacity: EngineCapacity) -> None:
        """The loop-2 reference store (sparse decode) and the packed store (KV
        quantization), checked against the engine's geometry; the route table on the
        device and the statistics stream (before any graph capture needs them)."""
        c = capacity
        route_table(self.config, c.device)
        self._statistics_stream = self._statistics_stream_on(c.device)
        if self.config.enabled_features() and self.config.num_loops != c.loops:
            raise ConfigError(
                f"num_loops={self.config.num_loops} differs from the model's "
                f"total_ut_steps={c.loops}"
            )
        # the selection bucket holds what a source selects from the span its readers cover
        # (graph rows read block tables of the full width), not from max_context itself
        span = self.reader_span(c.max_context, c.block_size)
        self.reserve_state(c.max_slots, c.num_layers, c.num_heads, c.head_dim, span, c.device)
        quant = self.config.kv_residual_quantization
        if not quant.enabled:
            return
        if quant.group_size % c.block_size:
            raise ConfigError(
                f"kv_residual_quantization.group_size={quant.group_size} must be a multiple of "
                f"the KV block_size={c.block_size}: packed groups free whole BF16 blocks"
            )
        pages = c.packed_pages or PackedState.default_pages(
            c.num_blocks, c.block_size, c.loops, quant.group_size, quant.policy, quant.tail_size
        )
        self.reserve_packed(pages, c.num_layers, c.num_kv_heads, c.head_dim, c.device)

    def _statistics_stream_on(self, device: torch.device) -> torch.cuda.Stream | None:
        """The stream a loop-2 source kernel declaring ``statistics_stream`` writes its
        statistics on, beside its dense output (None: no such kernel, or not CUDA)."""
        declared = any(
            Capability.STATISTICS_STREAM in choice.impl.support.capabilities
            for op, choice in self.kernels.items()
            if op in SOURCE_OPS
        )
        if not declared or torch.device(device).type != "cuda":
            return None
        return torch.cuda.Stream(device=device)

    def reader_span(self, context: int, block_size: int = 1) -> int:
        """Positions the loop-2 source reads for a row whose block table spans ``context``
        positions: whole KV blocks of ``block_size``, and under KV quantization whole
        packed groups (``packed_span``). The source checks its ``k_bucket`` against K of
        this span (``check_bucket``: it reads no row lengths on the host), which exceeds K
        of ``context`` when the added positions add a selected key."""
        span = -(-context // block_size) * block_size
        quant = self.config.kv_residual_quantization
        if quant.enabled:
            span = -(-span // quant.group_size) * quant.group_size
        return span

    def reserve_packed(
        self,
        num_pages: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device | str,
    ) -> None:
        """Allocate the packed INT4 KV store (KV quantization only)."""
        quant = self.config.kv_residual_quantization
        if not quant.enabled:
            return
        store = PackedKVStore(
            num_pages, num_layers, num_kv_heads, head_dim, quant.group_size, device
        )
        write = self.kernels[OpName.PACKED_KV_WRITE].impl.fn
        self.packed = PackedState(
            store, write, quant.policy, quant.tail_size, self.first_compact_level()
        )

    def first_compact_level(self) -> int:
        """The first packed level this configuration can store compact: a token-sparse
        depth that keeps fewer than all rows, or (``rolling``, which packs generated rows)
        any deeper level, where a token that exited early has no residual."""
        depths = self.config.num_loops
        first = depths
        sparse = self.config.token_sparse_prefill
        if sparse.enabled:
            ratios = sparse.retention
            first = next((d for d in range(1, len(ratios)) if ratios[d] < 1), depths)
        if self.config.kv_residual_quantization.policy == "rolling":
            first = 1
        return first

    def reserve_state(
        self,
        num_slots: int,
        num_layers: int,
        num_heads: int,
        head_dim: int,
        max_context: int,
        device: torch.device | str,
    ) -> None:
        """Allocate the loop-2 reference store (sparse decode only): one slot per live token,
        its selection bucket sized for sources over ``max_context`` positions (the readers'
        span: :meth:`reader_span`)."""
        if not self.config.sparse_decode_attention.enabled:
            return
        bucket = key_bucket(self.config.sparse_decode_attention.key_retention, max_context)
        self.states = ReferenceStates(num_slots, num_layers, num_heads, head_dim, bucket, device)

    # ------------------------------------------------------------ requests
    def request_cost(
        self, capacity: EngineCapacity, prompt_length: int, max_new_tokens: int
    ) -> RequestCost:
        """Packed pages (KV quantization: the bound a reservation takes, every level a
        whole page per group) and the reference store's bytes per slot (sparse decode)."""
        c = capacity
        slot = 0
        if self.config.sparse_decode_attention.enabled:
            span = self.reader_span(c.max_context, c.block_size)
            bucket = key_bucket(self.config.sparse_decode_attention.key_retention, span)
            per_head = bucket * 4 + 4 + 2 * c.head_dim * 4  # indices, mass, output, contribution
            slot = c.num_layers * (c.num_heads * per_head + 8)  # and the incarnation
        quant = self.config.kv_residual_quantization
        if not quant.enabled:
            return RequestCost(slot_bytes=slot)
        policy, tail, group = quant.policy, quant.tail_size, quant.group_size
        pages = PackedState.page_bound(
            prompt_length, max_new_tokens, self.config.num_loops, group, policy, tail
        )
        block = PackedLayout(group, c.head_dim).block_bytes
        rows = PackedState.packable_rows(prompt_length, group, policy, tail)
        return RequestCost(pages, c.num_layers * c.num_kv_heads * block, rows, slot)

    def pages_needed(self, prompt_length: int, max_new_tokens: int) -> tuple[int, int]:
        if self.packed is None:
            return 0, 0
        loops = self.config.num_loops
        needed = self.packed.pages_needed(prompt_length, max_new_tokens, loops)
        return needed, self.packed.store.num_pages

    def admit(
        self,
        request_id: int,
        prompt_length: int,
        max_new_tokens: int,
        shared: object | None = None,
        shared_rows: int = 0,
    ) -> None:
        if self.packed is not None:
            adopted = 0
            if isinstance(shared, SharedRows):  # never more than its own prompt would pack
                rows = min(shared_rows, self.packed.prompt_rows(prompt_length))
                adopted = self.packed.store.adoptable(shared, rows)
            loops = self.config.num_loops
            self.packed.reserve(request_id, prompt_length, max_new_tokens, loops, adopted)
            if adopted:
                self.packed.store.adopt(request_id, shared, adopted)

    def share_prompt(self, request_id: int, rows: int) -> object | None:
        if self.packed is None:
            return None
        rows = self.packed.shareable_rows(request_id, rows)
        return self.packed.store.share(request_id, rows) if rows else None

    def drop_shared(self, shared: object) -> None:
        if self.packed is not None and isinstance(shared, SharedRows):
            self.packed.store.drop(shared)

    def frees_on_drop(self, shared: object) -> bool:
        if self.packed is None or not isinstance(shared, SharedRows):
            return False
        return self.packed.store.frees_on_drop(shared)

    def prompt_rows_done(self, request_id: int, kv: RequestKV, rows: int) -> None:
        if self.packed is not None:
            self.packed.pack_final_prompt_rows(request_id, kv, rows)

    def carried_prompt_rows(self, prompt_length: int) -> int:
        return 0 if self.packed is None else self.packed.prompt_rows(prompt_length)

    def store_prompt_depth(self, request_id: int, kv: RequestKV, depth: int, rows: int) -> int:
        if self.packed is None:
            return super().store_prompt_depth(request_id, kv, depth, rows)
        return self.packed.pack_prompt_level(request_id, kv, depth, rows)

    def prompt_done(self, request_id: int, kv: RequestKV) -> None:
        if self.packed is not None:
            self.packed.pack_prompt(request_id, kv)

    def token_done(self, request_id: int, kv: RequestKV) -> None:
        if self.packed is not None:
            self.packed.flush_tail(request_id, kv)

    def speculation_rows(self, request_id: int, final_rows: int) -> int | None:
        """``rolling`` packs a group once enough rows are final, and packing is lossy: a
        row reads the packed rows serial decoding would have packed by its turn. A block
        therefore ends before the next flush (serial-aligned)."""
        if self.packed is None:
            return None
        return self.packed.rows_until_repacking(request_id, final_rows)

    def retire_slot(self, slot: int) -> None:
        if self.states is not None:
            self.states.retire(slot)

    def release(self, request_id: int, slot: int) -> None:
        if self.packed is not None:
            self.packed.release(request_id)
        if self.states is not None and slot >= 0:
            self.states.retire(slot)
        self.check_vouched_references()

    def check_vouched_references(self) -> None:
        """Raise if a step whose loop-2 references the host vouched for met a row the
        device found without one (that row's attention was left out). It reads the
        device, so it runs where a request leaves, and only once a step was vouched for."""
        states = self.states
        if states is None or not self._vouched_any:
            return
        missing = int(states.vouched_missing)
        if missing:
            raise RuntimeError(
                f"{missing} loop 3-4 rows of steps the host vouched for found no loop-2 "
                "reference on the device: their attention was left out. The host's record of "
                "planned sources (ReferenceStates.host_written) disagrees with the device's."
            )

    # ------------------------------------------------------------ saved request state
    def state_identity(self) -> dict:
        quant = self.config.kv_residual_quantization
        encoding = None
        if quant.enabled:
            sparse = self.config.token_sparse_prefill.enabled
            encoding = encoding_descriptor(quant.group_size, quant.policy, quant.tail_size, sparse)
        return super().state_identity() | {"kv_encoding": encoding}

    def export_request(self, request_id: int) -> dict[str, torch.Tensor]:
        if self.packed is None:
            return {}
        stored = self.packed.store.export_sequence(request_id)
        return {f"packed.{name}": tensor for name, tensor in stored.items()}

    def import_request(self, request_id: int, tensors: dict[str, torch.Tensor]) -> None:
        if self.packed is None:
            super().import_request(request_id, tensors)
            return
        foreign = sorted(name for name in tensors if not name.startswith("packed."))
        if foreign:
            raise ValueError(
                f"flashloop keeps only packed.* tensors per request; got {foreign[:4]}"
            )
        stored = {name.removeprefix("packed."): t for name, t in tensors.items()}
        if stored:
            self.packed.store.import_sequence(request_id, stored)
        if self.packed.policy != "rolling":  # as after a prompt's packing
            self.packed.store.unreserve(request_id)
