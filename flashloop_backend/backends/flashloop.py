"""The ``flashloop`` backend: routes each batch's rows to the kernels its config needs.

What it can do on a machine is derived from the kernel implementations usable there: a
capability is reported only when every op it concerns has a usable implementation that
declares it. With every feature off it is the dense path (DESIGN §4).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from flashloop_backend._version import __version__
from flashloop_backend.backends.base import (
    AttentionBackend,
    EngineCapacity,
    GraphStep,
    RequestCost,
    RequestKV,
)
from flashloop_backend.backends.batch_plan import BatchPlan, PlanRouting
from flashloop_backend.backends.packed_state import PackedState
from flashloop_backend.backends.sparse_state import ReferenceStates, key_bucket
from flashloop_backend.capabilities import Capability, Environment, SupportRequest
from flashloop_backend.config import ConfigError, FlashLoopConfig, UnservableError
from flashloop_backend.dispatch import (
    SPARSE_START_DEPTH,
    BatchView,
    config_capabilities,
    decode_route_ops,
    prefill_route_ops,
    required_ops,
    routable_ops,
)
from flashloop_backend.kernels.ops import (
    BASE_OUTPUT_OPS,
    CORRECTION_OPS,
    OP_INPUTS,
    PACKED_READ_OPS,
    PACKED_VERSION,
    SOURCE_OPS,
    CorrectionInputs,
    OpName,
    PackedKV,
    PagedInputs,
    SourceInputs,
    over_packed,
)
from flashloop_backend.kv.encoding import encoding_descriptor
from flashloop_backend.kv.layout import PackedLayout
from flashloop_backend.kv.store import PackedKVStore
from flashloop_backend.kv.transfer import SharedRows
from flashloop_backend.registry.spec import BackendSpec, SelectionInfo

if TYPE_CHECKING:
    from flashloop_backend.registry import KernelChoice, Registry

# Which ops must carry a capability for the backend to claim it. ``None``: every op the
# configuration routes to; ``"decode"``: every op it can route a decode row to.
CAPABILITY_OPS: dict[Capability, tuple[OpName, ...] | str | None] = {
    Capability.SOURCE_STATISTICS: (OpName.DENSE_SOURCE,),
    Capability.NONCONSECUTIVE_QUERIES: (OpName.SPARSE_PREFILL,),
    Capability.PACKED_KV_READ: (OpName.PACKED_DECODE,),
    # only decode steps are captured (DESIGN §4): sparse prefill runs eagerly, so graph
    # safety is asked of the sparse decode ops alone
    Capability.GRAPH_SAFE_SPARSE: (OpName.DENSE_SOURCE, OpName.SPARSE_CORRECTION),
    Capability.DEVICE_POSITIONS: None,
    Capability.PACKED_PREFILL: None,
    # CUDA graphs capture the decode traversal only (DESIGN §4); prefill steps run eagerly,
    # so their kernels may plan on the host
    Capability.CUDA_GRAPHS: "decode",
    Capability.ASYNC_SCHEDULING: None,
}
# Capabilities this backend does not deliver whatever its kernels declare: its packed and
# sparse reads take verification rows one at a time, so it passes no groups on.
NOT_DELIVERED = {
    Capability.GROUPED_VERIFY_ROWS: "required capability grouped_verify_rows: the flashloop "
    "backend reads verification rows one at a time (its packed and sparse kernels have no "
    "grouped form)"
}
# Whether each feature's state serves speculative verification rows (and under which KV
# quantization policies). Token-sparse prefill shapes the prompt's KV only, and
# `fixed_prompt` packs only the prompt: VERIFY rows read both as decode rows do. Sparse
# decode keeps one loop-2 reference per token-state slot and incarnation, and the host
# gives every block row its own. `rolling` packs generated groups only between blocks,
# from accepted rows, and blocks end before a flush (`speculation_rows`).
SPECULATION_SUPPORT = {
    "token_sparse_prefill": True,
    "sparse_decode_attention": True,
    "kv_residual_quantization": True,
}
SPECULATION_POLICIES = ("fixed_prompt", "rolling")
# Whether each feature's state splits with the heads under tensor parallelism: token
# selection reads the hidden state every rank holds whole, top-K keys and loop-2
# references are per head, packed pages per KV head, so no rank needs another's state.
TENSOR_PARALLEL_SUPPORT = {
    "token_sparse_prefill": True,
    "sparse_decode_attention": True,
    "kv_residual_quantization": True,
}


def feature_support() -> dict[str, dict[str, bool]]:
    """Which features serve speculative verification rows and which split over
    tensor-parallel ranks (``info`` reports it; the engine refuses the rest by name)."""
    return {
        "speculation": dict(SPECULATION_SUPPORT),
        "tensor_parallel": dict(TENSOR_PARALLEL_SUPPORT),
    }


# Every op with typed inputs (the table in ``kernels/ops.py``) and the packed write.
WIRED_OPS = frozenset(OP_INPUTS) | {OpName.PACKED_KV_WRITE}


class FlashLoopSpec(BackendSpec):
    name = "flashloop"
    version = __version__
    priority = 50
    description = "FlashLoop: token-sparse prefill, sparse decode attention, INT4 residual KV"

    def _op_needs(
        self, request: SupportRequest, config: FlashLoopConfig
    ) -> dict[OpName, tuple[str, frozenset[Capability]]]:
        """op -> (why it is needed, capabilities its kernel must declare)."""
        needs = {r.op: (r.feature, r.capabilities) for r in required_ops(config)}
        for cap in request.required - NOT_DELIVERED.keys():
            ops = CAPABILITY_OPS[cap]
            if ops == "decode":
                ops = tuple(sorted(decode_route_ops(config), key=lambda o: o.value))
            targets = tuple(needs) if ops is None else ops
            # the configuration may route the packed-KV version of a listed op instead
            targets += tuple(PACKED_VERSION[o] for o in targets if PACKED_VERSION.get(o) in needs)
            for op in targets:
                why, caps = needs.get(op, (f"required capability {cap.value}", frozenset()))
                needs[op] = (why, caps | {cap})
        return needs

    def _choose(
        self, request: SupportRequest, config: FlashLoopConfig, registry: Registry
    ) -> tuple[dict[OpName, KernelChoice], list[str]]:
        choices: dict[OpName, KernelChoice] = {}
        reasons: list[str] = []
        for op, (why, caps) in self._op_needs(request, config).items():
            if op not in WIRED_OPS:
                reasons.append(
                    f"op {op.value!r} (needed by {why}) is not wired into the flashloop "
                    f"backend {__version__} (wired: {sorted(o.value for o in WIRED_OPS)})"
                )
                continue
            op_request = replace(request, required=caps)
            try:
                override = config.kernel_overrides.get(op.value)
                choices[op] = registry.select_kernel(op, op_request, override)
            except ValueError as exc:
                reasons.append(f"op {op.value!r} (needed by {why}): {exc}")
        return choices, reasons

    def capabilities(
        self, registry: Registry, config: FlashLoopConfig, env: Environment, device: str
    ) -> frozenset[Capability]:
        base = SupportRequest.default(env)
        base = SupportRequest(device, base.dtype if device == "cuda" else torch.float32)
        delivered = set()
        for cap in set(Capability) - NOT_DELIVERED.keys():
            _, reasons = self._choose(base.with_required({cap}), config, registry)
            if not reasons:
                delivered.add(cap)
        return frozenset(delivered)

    def not_supported_reasons(
        self, request: SupportRequest, config: FlashLoopConfig, registry: Registry, env: Environment
    ) -> list[str]:
        _, reasons = self._choose(
            request.with_required(config_capabilities(config)), config, registry
        )
        return [NOT_DELIVERED[c] for c in sorted(request.required & NOT_DELIVERED.keys())] + reasons

    def kernel_choices(
        self, request: SupportRequest, config: FlashLoopConfig, registry: Registry
    ) -> dict[str, str]:
        choices, _ = self._choose(request, config, registry)
        return {op.value: choice.provider.name for op, choice in choices.items()}

    def kv_encoding(self, config: FlashLoopConfig) -> dict[str, str | int] | None:
        quant = config.kv_residual_quantization
        if not quant.enabled:
            return None
        return encoding_descriptor(
            quant.group_size, quant.policy, quant.tail_size, config.token_sparse_prefill.enabled
        )

    def create(
        self,
        request: SupportRequest,
        config: FlashLoopConfig,
        registry: Registry,
        info: SelectionInfo,
    ) -> FlashLoopBackend:
        choices, reasons = self._choose(request, config, registry)
        if reasons:
            raise UnservableError("flashloop cannot serve this request: " + "; ".join(reasons))
        caps = self.capabilities(registry, config, registry.env, request.device)
        return FlashLoopBackend(config, choices, caps, info)


class FlashLoopBackend(AttentionBackend):
    """The callable backend. ``__call__`` is vllm-rlt's dense surface; ``forward`` takes a
    :class:`~flashloop_backend.dispatch.BatchView` and dispatches segments."""

    def __init__(
        self,
        config: FlashLoopConfig,
        kernels: dict[OpName, KernelChoice],
        capabilities: frozenset[Capability],
        info: SelectionInfo,
    ) -> None:
        self.config = config
        self.kernels = kernels
        self.capabilities = capabilities
        self.info = info
        self.states: ReferenceStates | None = None
        self.packed: PackedState | None = None
        self.dense_attention = kernels[OpName.DENSE_ATTENTION].impl.fn
        self._plan: BatchPlan | None = None
        self._routing: PlanRouting | None = None
        self._prefill_ops = prefill_route_ops(config)  # the config is immutable

    def graph_blockers(self) -> list[str]:
        """Why a CUDA graph cannot capture this backend's decode traversal (none: it can).
        Every op a decode row can route to must run on a kernel that declares
        ``cuda_graphs`` (sparse ops also ``graph_safe_sparse``)."""
        sparse = SOURCE_OPS | CORRECTION_OPS
        reasons = []
        for op in sorted(routable_ops(self.config, decode_only=True), key=lambda o: o.value):
            declared = self.kernels[op].impl.support.capabilities
            needed = {Capability.CUDA_GRAPHS} | (
                {Capability.GRAPH_SAFE_SPARSE} if op in sparse else set()
            )
            missing = sorted(c.value for c in needed - declared)
            if missing:
                reasons.append(
                    f"op {op.value!r} runs on kernel provider {self.kernels[op].provider.name!r}, "
                    f"which does not declare {missing} (create the backend with required "
                    f"capability {Capability.CUDA_GRAPHS.value!r})"
                )
        return reasons

    def speculation_blockers(self) -> list[str]:
        supported = sorted(name for name, ok in SPECULATION_SUPPORT.items() if ok)
        blockers = [
            f"feature {name!r} does not verify speculative rows (features that do: {supported})"
            for name in self.config.enabled_features()
            if not SPECULATION_SUPPORT[name]
        ]
        quantization = self.config.kv_residual_quantization
        if quantization.enabled and quantization.policy not in SPECULATION_POLICIES:
            blockers.append(
                f"kv_residual_quantization policy {quantization.policy!r} does not verify "
                f"speculative rows (policies that do: {list(SPECULATION_POLICIES)})"
            )
        return blockers

    def tensor_parallel_blockers(self) -> list[str]:
        supported = sorted(name for name, ok in TENSOR_PARALLEL_SUPPORT.items() if ok)
        return [
            f"feature {name!r} does not split over tensor-parallel ranks (features that do: "
            f"{supported})"
            for name in self.config.enabled_features()
            if not TENSOR_PARALLEL_SUPPORT[name]
        ]

    def decode_ops(self, depths: frozenset[int]) -> tuple[str, ...]:
        """The ops a decode-only step with rows at ``depths`` launches (a graph key part);
        the packed read marked ``:few_rows`` where it carries that launch hint (a graph
        captured with it must not serve a step that reads real rows)."""
        ops = sorted(op.value for op in routable_ops(self.config, True, depths))
        if self._fallback_depths(depths):
            hinted = OpName.PACKED_DECODE.value
            ops = [f"{op}:few_rows" if op == hinted else op for op in ops]
        return tuple(ops)

    # ------------------------------------------------------------ start-up
    def reserve(self, capacity: EngineCapacity) -> None:
        """The loop-2 reference store (sparse decode) and the packed store (KV
        quantization), checked against the engine's geometry."""
        c = capacity
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

    # ------------------------------------------------------------ steps and graphs
    def plan(self, view: BatchView, request_ids: list[int], depths: list[int]) -> None:
        """Which decode rows read which packed levels (KV quantization; see ``PackedState``)."""
        if self.packed is not None:
            self.packed.plan(view, request_ids, depths)

    def reserve_graph_inputs(self, rows: int, max_context: int) -> None:
        states = self.states
        # graph rows read tables of ``max_context`` positions; the runner reserves its
        # inputs when it is built, before any step has written a reference
        if states is not None:
            span = self.reader_span(max_context)
            key_retention = self.config.sparse_decode_attention.key_retention
            if key_bucket(key_retention, span) > states.k_bucket:
                heads, head_dim = states.output.shape[-2:]
                device = states.indices.device
                self.reserve_state(
                    states.num_slots, states.num_layers, heads, head_dim, span, device
                )
        if self.packed is not None:
            self.packed.reserve_graph_inputs(rows, max_context, self.config.num_loops)

    def graph_variants(self, depths: frozenset[int]) -> tuple[int, ...]:
        if self.packed is None:
            return (1,)
        # the packed reader's levels: the deepest row whose sequence has packed pages, + 1
        # (1 when none has: a prompt shorter than one group packs nothing)
        return tuple(sorted({1, *(depth + 1 for depth in depths)}))

    def plan_graph_step(self, request_ids: list[int | None], depths: list[int]) -> GraphStep:
        if self.packed is None:
            return GraphStep()
        return self.packed.plan_graph_step(request_ids, depths)

    def bind_graph_step(self, view: BatchView, step: GraphStep) -> None:
        if self.packed is not None:
            self.packed.bind_graph_step(view, step)

    # ------------------------------------------------------------ accounting
    def kv_bytes_held(self) -> int:
        return 0 if self.packed is None else self.packed.store.accounting()["steady_bytes"]

    def held(self) -> dict[str, int]:
        counts = {}
        if self.packed is not None:
            store = self.packed.store
            counts["packed_sequences"] = len(store.sequences)
            counts["packed_pages_used"] = store.accounting()["pages_used"]
            counts["packed_pages_reserved"] = store.accounting()["pages_reserved"]
        if self.states is not None:
            counts["reference_slots_live"] = self.states.live_slots()
        return counts

    def memory(self) -> dict[str, int]:
        pools = {}
        if self.packed is not None:
            store = self.packed.store
            pools["packed_pool"] = sum(t.numel() * t.element_size() for t in store.pools)
        if self.states is not None:
            pools["reference_states"] = self.states.nbytes()
        return pools

    def forward(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        view: BatchView,
        layer: int = 0,
        scale: float | None = None,
    ) -> torch.Tensor:
        """Attention for every row of ``view`` at ``layer``: q [R, Hq, D] -> [R, Hq, D].

        Rows are gathered decode-first then active prefill, each segment runs the op its
        route names, and results are scattered back; inactive and padding rows get zeros.
        Sparse decode: loop-2 rows write their reference into the state store; loop 3-4
        rows with this token's reference run the correction, others run dense and are
        counted in ``states.missing_reference``. No host synchronisation.
        """
        states = self.states
        plan, routing = self._planned(view)
        gathered_q = plan.gather(q)
        out = None
        for op, choice, n in self._runs(view, plan):
            mine, inputs = self._op_inputs(op, n, layer, gathered_q, key_cache, value_cache, scale)
            result = choice.impl(inputs)
            if op in SOURCE_OPS:
                rows = routing.source_rows(states, n, mine)
                states.store(
                    layer, rows, result.indices, result.mass, result.output, result.contribution
                )
                result = result.out
            if out is None and n == view.num_rows and op in BASE_OUTPUT_OPS:
                # rows this op does not serve had length 0, which the op contract answers
                # with zeros: its output is the base
                out = result
                continue
            if out is None:
                out = torch.zeros_like(gathered_q)
            torch.where(mine[:, None, None], result, out[:n], out=out[:n])  # one launch
        return plan.restore(out if out is not None else torch.zeros_like(gathered_q))

    def _planned(self, view: BatchView) -> tuple[BatchPlan, PlanRouting]:
        """The batch's plan and routing, made at its first layer and reused by the others."""
        if self.config.sparse_decode_attention.enabled and self.states is None:
            raise RuntimeError(
                "sparse decode needs reserve(EngineCapacity) (or reserve_state) before the first forward"
            )
        if self._plan is None or self._plan.view is not view:
            self._plan = BatchPlan.of(view, self.config)
            self._routing = PlanRouting(self._plan, self.states, self.config)
        return self._plan, self._routing

    def _runs(self, view: BatchView, plan: BatchPlan) -> list[tuple[OpName, KernelChoice, int]]:
        """(op, kernel choice, rows it runs on) of every op this batch launches, the op over
        every row whose other rows read nothing first (its output is the others' base)."""
        prefill_ops = self._prefill_ops
        launched = routable_ops(
            self.config, view.decode_only, view.decode_depths, view.prefill_depths
        )
        bound = view.num_rows if view.decode_bound is None else view.decode_bound
        if plan.order is None and bound != 0:  # the view's own order: padding may sit anywhere
            bound = view.num_rows
        runs = [
            (op, choice, view.num_rows if op in prefill_ops else bound)
            for op, choice in self.kernels.items()
        ]
        runs = [(op, choice, n) for op, choice, n in runs if op in launched and n != 0]
        runs.sort(key=lambda run: not (run[0] in BASE_OUTPUT_OPS and run[2] == view.num_rows))
        return runs

    def _op_inputs(self, op, n: int, layer: int, gathered_q, key_cache, value_cache, scale):
        """(rows ``op`` serves among the first ``n`` planned rows [n] bool, its typed
        inputs) at ``layer``, from the batch's plan: the gathered queries, tables and
        lengths, the loop-2 references, the packed reader's metadata."""
        plan, routing, states = self._plan, self._routing, self.states
        prefill_ops = self._prefill_ops
        # the correction reads the reference's positions, not lengths
        mine, masked = routing.rows(
            op, n, layer, reads_lengths=op not in CORRECTION_OPS, decode=op not in prefill_ops
        )
        # the plan's own tensors where every row runs: a kernel that plans on the host
        # (FlashInfer) recognises them at every layer and plans once
        every_row = n == plan.view.num_rows
        q_n = gathered_q if every_row else gathered_q[:n]
        tables_n = plan.tables if every_row else plan.tables[:n]
        if op in CORRECTION_OPS:
            indices, mass, ref_out, contribution = routing.references(states, op, n, layer)
            inputs = CorrectionInputs(
                q_n, key_cache, value_cache, tables_n, indices, mass, ref_out, contribution, scale
            )
        elif op in SOURCE_OPS:
            retention = self.config.sparse_decode_attention.key_retention
            inputs = SourceInputs(
                q_n, key_cache, value_cache, tables_n, masked, retention, states.k_bucket, scale
            )
        else:
            inputs = PagedInputs(q_n, key_cache, value_cache, tables_n, masked, scale)
        if op in PACKED_READ_OPS:
            if self.packed is None:
                raise RuntimeError(
                    "KV quantization needs reserve(EngineCapacity) (or reserve_packed) before the first forward"
                )
            meta = self.packed.meta_for(plan.view, plan.order)
            inputs = over_packed(PackedKV(self.packed.store, layer, meta.head(n)), inputs)
            if op == OpName.PACKED_DECODE and self._fallback_only(plan.view):
                inputs = replace(inputs, few_rows=True)
        return mine, inputs

    def _fallback_only(self, view: BatchView) -> bool:
        """Whether the batch's packed read serves only rows a loop 3-4 correction could not
        (every row decodes at a sparse loop: none in a steady run), the launch hint
        ``few_rows``."""
        return view.decode_only and self._fallback_depths(view.decode_depths)

    def _fallback_depths(self, depths: frozenset[int] | None) -> bool:
        """Whether decode rows at ``depths`` (None: unknown) all run at a sparse loop."""
        return (
            self.config.sparse_decode_attention.enabled
            and bool(depths)
            and min(depths) >= SPARSE_START_DEPTH
        )


def factory() -> FlashLoopSpec:
    return FlashLoopSpec()
