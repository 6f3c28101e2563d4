"""Running one engine step, as :class:`Engine` methods: the traversal of the scheduled
rows (decode rows from a CUDA graph, prompt chunks eagerly, or every row eagerly), then
advancing each request by what its rows computed: a prompt's next chunk or depth, a
token's next loop or its exit, the next tokens sampled, finished requests retired."""

from __future__ import annotations

import itertools

import torch

from flashloop_backend.backends.base import AttentionBackend
from flashloop_backend.device_copy import to_device
from flashloop_backend.dispatch import RowMode
from flashloop_backend.host.batch import Batch, RowGroup, build_batch, row_tokens
from flashloop_backend.host.features import HostRequestKV
from flashloop_backend.host.graphs import GRAPH_MODES
from flashloop_backend.host.kvcache import OutOfBlocksError, PagedKVCache
from flashloop_backend.host.requests import GenerationResult, Request
from flashloop_backend.host.sampling import choose_tokens, finish_reason


class _LayerAttention:
    """The model's attention context for one traversal: KV write, then backend attention."""

    def __init__(
        self, kv: PagedKVCache, backend: AttentionBackend, batch: Batch, kernels: bool | None
    ) -> None:
        self.kv, self.backend, self.batch, self.kernels = kv, backend, batch, kernels

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.kv.write(layer, self.batch.slots, k, v, use_triton=self.kernels)
        key_view, value_view = self.kv.layer_views(layer)
        return self.backend.forward(q, key_view, value_view, self.batch.view, layer=layer)


class StepExecution:
    """The engine's step and what follows from its rows (a mixin of :class:`Engine`)."""

    def step(self) -> list[GenerationResult]:
        """Hand the last step's completed prompts to the backend, admit what fits, run one
        traversal over the scheduled rows (two with ``GraphSettings.split_mixed_steps``:
        the decode rows from a graph, the prompt chunks eagerly), return finished ones."""
        self.hand_over_prompts()
        self._admit()
        groups = self._schedule()
        if not groups:
            waiting = [r.id for r in self._requests.values() if r.phase == "waiting"]
            if waiting:
                raise OutOfBlocksError(
                    f"requests {waiting} wait for KV blocks or packed pages but nothing runs "
                    f"to free them"
                )
            return self._collect()
        self._carry_planes(groups)
        if self.graphs is not None:
            graphed = [g for g in groups if g.mode in GRAPH_MODES]
            chunks = [g for g in groups if g.mode not in GRAPH_MODES]
            if graphed and (not chunks or self.graphs.settings.split_mixed_steps):
                hidden = torch.cat([self._input_hidden(g) for g in graphed])
                out = self.graphs.run(graphed, hidden)
                if out is not None:
                    with torch.no_grad():
                        if chunks:  # the prompt chunks in their own eager traversal
                            out = torch.cat([out, self._run_eagerly(chunks)])
                        self._advance(graphed + chunks, out)
                    self.steps += 1
                    return self._collect()
        with torch.no_grad():
            out = self._run_eagerly(groups)
            self._advance(groups, out)
        self.steps += 1
        return self._collect()

    def _run_eagerly(self, groups: list[RowGroup]) -> torch.Tensor:
        """One eager traversal of ``groups``' rows: their outputs [rows, hidden]."""
        pad_to = None
        if self.pad_to_multiple:
            rows = sum(g.count for g in groups)
            pad_to = -(-rows // self.pad_to_multiple) * self.pad_to_multiple
        batch = build_batch(groups, self.kv, self.device, pad_to)
        hidden = torch.cat([self._input_hidden(g) for g in groups])
        pad = batch.view.num_rows - batch.num_real_rows
        # host planning: which decode rows read which of the backend's own KV
        decode = [g for g in groups if g.mode != RowMode.PREFILL]
        rows = [g for g in decode for _ in range(g.count)]
        self.backend.plan(
            batch.view, [g.request_id for g in rows], [g.depth for g in rows], row_tokens(decode)
        )
        if pad:
            hidden = torch.cat([hidden, hidden.new_zeros(pad, hidden.shape[1])])
        return self._traverse(hidden, batch)[: batch.num_real_rows]

    def _traverse(self, hidden: torch.Tensor, batch: Batch) -> torch.Tensor:
        """One loop over every layer for the batch's rows: [R, hidden] -> [R, hidden]."""
        ctx = _LayerAttention(self.kv, self.backend, batch, self.model.layer_kernels)
        return self.model.recurrent(hidden, batch.view.positions, ctx)

    def _request_kv(self, r: Request) -> HostRequestKV:
        """The request's BF16 KV as the backend may read and free it."""
        return HostRequestKV(self.kv, r, self.sparsity is not None, self.cfg.total_ut_steps)

    def _input_hidden(self, group: RowGroup) -> torch.Tensor:
        r = self._requests[group.request_id]
        if group.mode == RowMode.PREFILL:
            return r.prompt_hidden[r.schedule.rows(r.chunk_start, group.count)]
        return r.hidden if group.mode == RowMode.VERIFY else r.hidden[None]

    def _advance(self, groups: list[RowGroup], out: torch.Tensor) -> None:
        loops = self.cfg.total_ut_steps
        starts = list(itertools.accumulate((g.count for g in groups), initial=0))
        # exit hazards of every decode row that may still exit early: one host read
        gated = [i for i, g in enumerate(groups) if self._may_exit_early(g)]
        lams = self.model.exit_lambda(out[[starts[i] for i in gated]]).tolist() if gated else []
        if gated:
            self._device_read()
        hazard = dict(zip(gated, lams, strict=True))
        emits: list[tuple[Request, torch.Tensor]] = []
        packing: list[tuple[Request, int]] = []  # final prompt rows packed after sampling
        for index, group in enumerate(groups):
            r = self._requests[group.request_id]
            h = out[starts[index] : starts[index] + group.count]
            if group.mode == RowMode.PREFILL:
                r.prompt_hidden[r.schedule.rows(r.chunk_start, group.count)] = h
                r.chunk_start += group.count
                if r.depth == loops - 1:  # rows before the next scheduled one are final
                    final = r.schedule.final_rows(r.chunk_start)
                    if r.chunk_start < len(r.schedule.positions):
                        packing.append((r, final))
                    else:  # the depth ends here: its rows are packed before it does
                        self.backend.prompt_rows_done(r.id, self._request_kv(r), final)
                if r.chunk_start == len(r.schedule.positions):
                    r.schedule.finish_depth(r.depth, r.prompt_hidden, self.kv, r.id)
                    r.depth, r.chunk_start = r.depth + 1, 0
                    if r.depth == loops:  # prompt done: its last token predicts the first output
                        if self.prefix_cache is not None:
                            r.published = self.prefix_cache.publish(
                                r.prompt, r.id, r.schedule.history()
                            )
                        if self.on_prompt_done is not None:
                            self.on_prompt_done(self, r)
                        self._prompts_to_hand_over.append(r)
                        r.prompt_hidden, last = None, r.prompt_hidden[-1]
                        emits.append((r, last))
                continue
            if r.block is not None:
                reads = self.speculation.device_reads
                tokens = self.speculation.advance(r, h)
                if self.speculation.device_reads != reads:
                    self._device_read()
                if tokens is not None:
                    self._emit_block(r, tokens)
                continue
            exit_now = r.depth == loops - 1
            replayed = r.replay_exits is not None and len(r.exit_depths) < len(r.replay_exits)
            if replayed:  # recomputing after a preemption: leave where the token left
                exit_now = r.depth == r.replay_exits[len(r.exit_depths)]
            elif index in hazard:
                lam = hazard[index]
                spent = 1.0 - r.remaining * (1.0 - lam)  # cumulative exit probability so far
                r.remaining *= 1.0 - lam
                exit_now = spent >= self.cfg.early_exit_threshold
            if exit_now:
                if r.depth < loops - 1:
                    self.kv.finalize_exit(r.id, r.position, r.depth)
                r.exit_depths.append(r.depth)
                self.backend.token_done(r.id, self._request_kv(r))
                emits.append((r, h[0]))
            else:
                r.depth, r.hidden = r.depth + 1, h[0]
        self._emit(emits)
        # queued after the sampling read, so that the step's tokens do not wait for the
        # conversion; the stream still runs it before any later step reads the pages
        for r, final in packing:
            self.backend.prompt_rows_done(r.id, self._request_kv(r), final)

    def _may_exit_early(self, group: RowGroup) -> bool:
        """A decode row whose token may still leave before the last loop."""
        if group.mode == RowMode.PREFILL or not self.cfg.exits_early:
            return False
        return self._requests[group.request_id].depth < self.cfg.total_ut_steps - 1

    def _emit(self, emits: list[tuple[Request, torch.Tensor]]) -> None:
        """Next tokens from final hidden states (one coda call for the step), then start
        each unfinished request's loops on its token."""
        if not emits:
            return
        requests = [r for r, _ in emits]
        tokens = choose_tokens(self.model, requests, torch.stack([h for _, h in emits]))
        self._device_read()
        going = []
        self.tokens_generated += len(requests)
        for r, token in zip(requests, tokens, strict=True):
            r.output.append(token)
            r.finish_reason = finish_reason(r, self.cfg.eos_token_id, self.detokenize)
            if r.finish_reason:
                r.phase = "done"
            else:
                going.append(r)
        if not going:
            return
        ids = to_device(torch.tensor([r.output[-1] for r in going]), self.device)
        for r, hidden in zip(going, self.model.prelude(ids), strict=True):
            r.phase, r.depth, r.remaining, r.hidden = "decode", 0, 1.0, hidden
            self._start_token(r)

    def _device_read(self) -> None:
        """The host just read from the device (the step's tokens, exit hazards, a draft or
        a block's acceptance), so the token selections queued before are on the host;
        prompts take them when scheduled."""
        for r in self._requests.values():
            if r.phase == "prefill":
                r.schedule.device_read()

    def _collect(self) -> list[GenerationResult]:
        return [self._retire(r) for r in list(self._requests.values()) if r.phase == "done"]

    def _retire(self, r: Request) -> GenerationResult:
        """A finished (or cancelled) request leaves: its KV blocks, packed pages and
        reservations, token-state slot and any pending hand-over go back."""
        self._release(r)
        del self._requests[r.id]
        return GenerationResult(
            r.id,
            r.prompt,
            r.output,
            r.finish_reason,
            r.exit_depths,
            torch.stack(r.logprobs) if r.logprobs else None,
        )
