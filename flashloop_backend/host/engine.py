"""A compact continuous-batching generation loop driving the attention backend.

Each step runs one recurrent traversal (one loop) over a mixed batch: prefill chunks of
several requests at their current depth and decode tokens at their own depths and
positions. A request's prompt runs loop by loop (every chunk of depth d before depth d+1);
a generated token advances one loop per step and exits by Ouro's gate rule or at the last
loop. KV for prompt + max_new_tokens is reserved at admission (BF16 blocks, and under KV
quantization the packed pages its rows can ever take), so a running request never runs out
of either; a request that does not fit waits, one that can never fit is refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from flashloop_backend.backends.base import AttentionBackend
from flashloop_backend.host.capacity import footprint, plan_pools, planning_capacity
from flashloop_backend.host.decode_depths import depth_dependent_decode
from flashloop_backend.host.engine_lifecycle import RequestLifecycle
from flashloop_backend.host.engine_planes import PromptPlanes
from flashloop_backend.host.engine_scheduling import StepScheduling
from flashloop_backend.host.engine_snapshots import RequestSnapshots
from flashloop_backend.host.engine_speculation import SpeculativeDecoding
from flashloop_backend.host.engine_steps import StepExecution
from flashloop_backend.host.engine_warm_up import WarmUp
from flashloop_backend.host.features import token_sparsity
from flashloop_backend.host.graphs import DecodeGraphs, GraphSettings
from flashloop_backend.host.kvcache import OutOfBlocksError, PagedKVCache
from flashloop_backend.host.model import OuroModel
from flashloop_backend.host.prefix_cache import PrefixCache
from flashloop_backend.host.requests import (
    GenerationResult,
    Request,
    SamplingParams,
    checked_params,
)
from flashloop_backend.host.speculation import SpeculationSettings


class Engine(
    StepExecution,
    StepScheduling,
    PromptPlanes,
    RequestLifecycle,
    RequestSnapshots,
    SpeculativeDecoding,
    WarmUp,
):
    def __init__(
        self,
        model: OuroModel,
        backend: AttentionBackend,
        *,
        num_blocks: int | None = None,
        block_size: int = 16,
        max_batch_tokens: int = 512,
        prefill_chunk: int = 256,
        pad_to_multiple: int | None = None,
        detokenize: Callable[[list[int]], str] | None = None,
        max_slots: int | None = None,
        packed_pages: int | None = None,
        cuda_graphs: GraphSettings | None = None,
        max_context: int | None = None,
        graph_capture=None,
        prefix_cache: bool = False,
        speculation: SpeculationSettings | None = None,
        kv_memory_bytes: int | None = None,
        planned_request: tuple[int, int] | None = None,
        prefill_requests: int = 1,
        align_decode_depths: bool | None = None,
    ) -> None:
        """``max_context``: the longest prompt + output a request may have (vLLM's
        max_model_len); sizes the loop-2 selection buckets and the graph capacity. Default
        and upper bound: the model's ``max_position_embeddings``. ``graph_capture``: how
        graphs are made (default CUDA graphs; tests pass a CPU recorder). ``packed_pages``
        (KV quantization): the packed pool; default enough pages to pack the most tokens the
        BF16 pool holds at every depth (a prompt that carries its planes may be longer: it
        is refused by name at ``add_request`` when its pages exceed the pool; size both
        pools with ``kv_memory_bytes`` or give ``packed_pages``).
        ``prefix_cache``: completed prompts publish their whole units and later prompts
        with the same leading tokens share them (:mod:`~flashloop_backend.host.prefix_cache`).
        ``speculation``: block speculation with a loop-1 or loop-2 draft
        (:mod:`~flashloop_backend.host.speculation`); refused, naming why, for a model that
        exits early or a backend whose features do not verify speculative rows.
        ``kv_memory_bytes``: size the BF16 pool, the packed pool and the token-state slots
        from this budget instead of ``num_blocks`` / ``packed_pages`` / ``max_slots`` (give
        none of those then): as many requests of ``planned_request`` (prompt, new tokens;
        default ``max_context`` tokens of which ``min(256, max_context // 2)`` new) as fit
        with ``prefill_requests`` of them prefilling at once (:mod:`~flashloop_backend.host.capacity`;
        the plan is ``capacity_plan``). Without a budget: 256 blocks and slots.
        ``align_decode_depths``: run each step's decode rows at one loop depth, the others
        waiting (:mod:`~flashloop_backend.host.decode_depths`); default when the backend's
        decode ops or kernel variants differ by depth and the model's tokens do not exit
        early."""
        cfg = model.config
        limit = cfg.max_position_embeddings
        self.max_context = max_context or limit
        if not 1 <= self.max_context <= limit:
            raise ValueError(
                f"max_context={max_context} must lie in [1, max_position_embeddings={limit}]"
            )
        if getattr(model, "tensor_parallel", None) is not None:
            blockers = backend.tensor_parallel_blockers()
            if blockers:
                raise ValueError("; ".join(blockers))
        param = next(model.parameters())
        self.model, self.backend, self.cfg = model, backend, cfg
        self.device, self.dtype = param.device, param.dtype
        # a prompt's rows the backend stores depth by depth pass their blocks from plane to
        # plane, so a prompt holds one plane of them, not one per loop; a prefix cache
        # publishes every plane of a prompt, so it keeps them all
        self.carry_planes = not prefix_cache
        self.capacity_plan = None
        if kv_memory_bytes is not None:
            given = {"num_blocks": num_blocks, "packed_pages": packed_pages, "max_slots": max_slots}
            clash = [name for name, value in given.items() if value is not None]
            if clash:
                raise ValueError(
                    f"kv_memory_bytes sizes the pools: give it or {', '.join(clash)}, not both"
                )
            slots = speculation.block_size if speculation is not None else 1
            self.capacity_plan = self._plan_pools(
                kv_memory_bytes, block_size, planned_request, prefill_requests, slots
            )
            plan = self.capacity_plan
            num_blocks, packed_pages, max_slots = plan.num_blocks, plan.packed_pages, plan.max_slots
            packed_pages = max(1, packed_pages)  # a backend that packs nothing ignores it
        num_blocks = 256 if num_blocks is None else num_blocks
        max_slots = 256 if max_slots is None else max_slots
        self.kv = PagedKVCache(
            num_blocks,
            num_layers=cfg.num_hidden_layers,
            block_size=block_size,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            num_depths=cfg.total_ut_steps,
            dtype=self.dtype,
            device=self.device,
        )
        if prefill_chunk < 1 or max_batch_tokens < 1:
            raise ValueError(
                f"prefill_chunk={prefill_chunk}, max_batch_tokens={max_batch_tokens} must be >= 1"
            )
        self.max_batch_tokens, self.prefill_chunk = max_batch_tokens, prefill_chunk
        self.pad_to_multiple, self.detokenize = pad_to_multiple, detokenize
        self._requests: dict[int, Request] = {}
        self._next_id = 0
        self.steps = 0
        self.prefill_rows_run = 0  # prompt rows computed, every loop counted
        self.prefill_rows_by_loop = [0] * cfg.total_ut_steps
        self.tokens_generated = 0
        # One token-state slot per live decode token (one per running request here).
        self.max_slots = max_slots
        self._free_slots = list(range(max_slots - 1, -1, -1))
        self._incarnations = 0
        self.sparsity = token_sparsity(backend, prefill_chunk)
        self.chunks_by_positions = (
            self.sparsity is not None and backend.prefill_chunks_by_positions()
        )
        self.prefix_cache = None
        if prefix_cache:
            window = self.sparsity.window_size if self.sparsity is not None else None
            self.prefix_cache = PrefixCache(
                self.kv, window, backend.drop_shared, backend.frees_on_drop
            )
        # Called once per request when its whole prompt has run every loop (evaluation hooks).
        self.on_prompt_done: Callable[[Engine, Request], None] | None = None
        # Prompts whose first token is out, handed to the backend (KV quantization packs
        # what its prefill steps have not) when the next step starts, off the first
        # token's path.
        self._prompts_to_hand_over: list[Request] = []
        self._fingerprint: str | None = None  # the model's, computed on first use
        shape = planning_capacity(cfg, self.max_context, block_size, self.device)
        pools = {"max_slots": max_slots, "num_blocks": num_blocks, "packed_pages": packed_pages}
        backend.reserve(dataclasses.replace(shape, **pools))
        self._set_up_speculation(speculation, max_slots)
        if align_decode_depths is None:  # after reserve: the backend's variants need its pools
            # tokens that exit early fall out of phase at every token
            depth_dependent = depth_dependent_decode(backend, cfg.total_ut_steps)
            align_decode_depths = depth_dependent and not cfg.exits_early
        self.align_decode_depths = align_decode_depths
        # Decode-only steps replay captured traversals (None: every step runs eagerly).
        self.graphs = None
        if cuda_graphs is not None:
            self.graphs = DecodeGraphs(
                cuda_graphs,
                self.kv,
                backend,
                cfg.hidden_size,
                self.max_context,
                self._traverse,
                graph_capture,
                verify_rows=speculation.block_size if self.speculation is not None else 1,
            )

    def _plan_pools(
        self,
        budget: int,
        block_size: int,
        planned: tuple[int, int] | None,
        prefill_requests: int,
        slots_per_request: int,
    ):
        """The :class:`~flashloop_backend.host.capacity.PoolPlan` of ``budget`` bytes for
        requests of ``planned`` (prompt, new tokens), each holding ``slots_per_request``
        token-state slots (a speculating request one per block row), their prompts'
        planes carried as the engine carries them."""
        if planned is None:
            new = min(256, self.max_context // 2)
            planned = (self.max_context - new, new)
        prompt, new = planned
        if prompt < 1 or new < 1 or prompt + new > self.max_context:
            raise ValueError(
                f"planned_request={planned} needs a prompt and new tokens >= 1 within "
                f"max_context={self.max_context}"
            )
        shape = planning_capacity(self.cfg, self.max_context, block_size, self.device)
        itemsize = self.dtype.itemsize
        request = footprint(self.backend, shape, prompt, new, itemsize, self.carry_planes)
        return plan_pools(budget, request, prefill_requests, slots_per_request)

    # ------------------------------------------------------------ requests
    def add_request(
        self,
        prompt: list[int],
        params: SamplingParams | None = None,
        forced: list[int] | None = None,
        keep_logprobs: bool = False,
    ) -> int:
        """Queue a request. ``forced`` teacher-forces the continuation through the decode
        path (``max_new_tokens`` becomes its length); ``keep_logprobs`` records the FP32
        log-softmax before every output token."""
        params = checked_params(prompt, params, forced, self.cfg.vocab_size, self.max_context)
        self._check_speculative_request(forced, keep_logprobs)
        total = len(prompt) + params.max_new_tokens
        blocks, pages, pool = self._footprint(len(prompt), params.max_new_tokens)
        if blocks > self.kv.num_blocks:
            raise OutOfBlocksError(
                f"a request of {total} tokens needs {blocks} KV blocks but the whole pool has "
                f"{self.kv.num_blocks}; raise num_blocks or shorten the request"
            )
        if pages > pool:
            raise OutOfBlocksError(
                f"a request of {len(prompt)} prompt + {params.max_new_tokens} new tokens needs "
                f"{pages} packed KV pages but the whole packed pool has {pool}; raise "
                f"packed_pages or shorten the request"
            )
        generator = None
        if params.temperature > 0:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed if params.seed is not None else self._next_id)
        request = Request(self._next_id, list(prompt), params, generator)
        request.forced = list(forced) if forced is not None else None
        request.logprobs = [] if keep_logprobs else None
        self._requests[request.id] = request
        self._next_id += 1
        return request.id

    def _footprint(self, prompt_rows: int, new_tokens: int) -> tuple[int, int, int]:
        """(BF16 blocks, packed pages, the packed pool's pages) a request of ``prompt_rows``
        + ``new_tokens`` needs at most: what admission compares with the whole pools."""
        total = prompt_rows + new_tokens
        blocks = self.kv.blocks_needed(total, self._carried_rows(prompt_rows))
        return (blocks, *self.backend.pages_needed(prompt_rows, new_tokens))

    def has_unfinished(self) -> bool:
        return any(r.phase != "done" for r in self._requests.values())

    def output_count(self, request_id: int) -> int | None:
        """Tokens the request has output so far; None once it finished and left the engine
        (its :class:`GenerationResult` holds them all)."""
        request = self._requests.get(request_id)
        return None if request is None else len(request.output)

    def has_first_token(self, request_id: int) -> bool:
        """Whether the request has output a token (a finished request has)."""
        return self.output_count(request_id) != 0

    def pools(self) -> dict[str, int]:
        """What the engine's pools hold now (accounting; reads the device): free and total
        BF16 blocks (free ones promised to prompts whose planes carry forward apart) and
        token-state slots, live requests, prompts awaiting hand-over, and
        what live requests hold of the backend's own pools (``AttentionBackend.held``)."""
        return {
            "free_blocks": self.kv.free_blocks,
            "promised_blocks": self.kv.promised_blocks,
            "num_blocks": self.kv.num_blocks,
            "free_slots": len(self._free_slots),
            "max_slots": self.max_slots,
            "live_requests": len(self._requests),
            "pending_hand_over": len(self._prompts_to_hand_over),
            **(self.prefix_cache.held() if self.prefix_cache else {}),
            **self.backend.held(),
        }

    def counters(self) -> dict[str, int]:
        """Work so far, for progress displays: prompt rows computed (every loop counted, and
        per loop as ``prefill_rows_loop1``...), requests admitted and not done (holding KV),
        tokens generated, and requests whose prompt is still waiting or prefilling."""
        prompts = sum(r.phase in ("waiting", "prefill") for r in self._requests.values())
        held = sum(r.phase in ("prefill", "decode") for r in self._requests.values())
        return {
            "prefill_rows": self.prefill_rows_run,
            **{f"prefill_rows_loop{d + 1}": n for d, n in enumerate(self.prefill_rows_by_loop)},
            "requests_held": held,
            "tokens_generated": self.tokens_generated,
            "prompts_running": prompts,
            "steps": self.steps,
            **(self.prefix_counters() if self.prefix_cache else {}),
            **(self.speculation.counters() if self.speculation else {}),
        }

    def prefix_counters(self) -> dict[str, int]:
        """Prefix cache: admitted prompts looked up, hits, prompt positions reused (each
        skips every loop of its row)."""
        cache = self.prefix_cache
        return {
            "prefix_lookups": cache.lookups,
            "prefix_hits": cache.hits,
            "prefix_reused_tokens": cache.reused_tokens,
        }

    def kv_held(self) -> tuple[int, int]:
        """(tokens of live requests, KV bytes they hold now): BF16 blocks in use on every
        plane (blocks only the prefix cache holds left out) plus the packed store's steady
        bytes (KV quantization frees packed blocks)."""
        per_block = self.kv.bytes_per_token() // self.cfg.total_ut_steps * self.kv.block_size
        blocks = self.kv.num_blocks - self.kv.free_blocks - self.kv.promised_blocks
        if self.prefix_cache is not None:  # blocks only the cache holds are no request's
            blocks -= self.prefix_cache.held()["prefix_blocks_cache_only"]
        held = blocks * per_block
        held += self.backend.kv_bytes_held()
        tokens = sum(len(r.prompt) + len(r.output) for r in self._requests.values())
        return tokens, held

    # ------------------------------------------------------------ convenience
    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        progress: Callable[[int, int], None] | None = None,
        forced: list[list[int]] | None = None,
        keep_logprobs: bool = False,
    ) -> list[GenerationResult]:
        """Run prompts to completion; results in prompt order. ``progress(done, total)``
        after every step: requests finished so far of the call's (``counters()`` has the
        finer work counts)."""
        per = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        teacher = forced if forced is not None else [None] * len(prompts)
        ids = [
            self.add_request(p, s, f, keep_logprobs)
            for p, s, f in zip(prompts, per, teacher, strict=True)
        ]
        results: dict[int, GenerationResult] = {}
        while self.has_unfinished():
            for result in self.step():
                results[result.request_id] = result
            if progress:
                progress(len(results), len(ids))
        return [results[i] for i in ids]
