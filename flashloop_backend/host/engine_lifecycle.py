"""Stopping requests between steps, as :class:`Engine` methods: preemption with recompute,
cancellation and giving back what a request holds."""

from __future__ import annotations

from flashloop_backend.host.requests import GenerationResult, Request


class RequestLifecycle:
    """The engine's preempt and cancel (a mixin of :class:`Engine`)."""

    def preempt(self, request_id: int) -> None:
        """Free a running request's KV, pages and slot now, between steps, and queue it
        again ahead of every later arrival. Readmitted, it recomputes its prompt and feeds
        the tokens it had produced back through the decode path, each leaving at the depth
        it left before (its output count drops until they are back), then goes on. The
        replay draws no random numbers, so greedy, teacher-forced and seeded requests
        continue as without the preemption, bit for bit where the kernels give a row the
        same result in any batch (the CPU reference); on a GPU, kernels planned for
        another batch shape may change last bits."""
        r = self._live(request_id)
        if r.phase == "waiting":
            raise ValueError(f"request {request_id} is waiting: it holds nothing to preempt")
        self._release(r)
        if r.replay is None or len(r.output) >= len(r.replay):
            r.replay, r.replay_exits = list(r.output), list(r.exit_depths)
        r.output, r.exit_depths = [], []
        r.logprobs = [] if r.logprobs is not None else None
        r.phase, r.depth, r.chunk_start, r.slot, r.block = "waiting", 0, 0, -1, None
        r.prompt_hidden = r.schedule = r.hidden = None
        r.remaining, r.finish_reason = 1.0, ""

    def _release(self, r: Request) -> None:
        """Give back everything ``r`` holds: KV blocks, the backend's pages, reservation and
        reference slot, its token-state slot, a pending hand-over."""
        # a request that ended on its first token is not handed over: it leaves now
        self._prompts_to_hand_over = [p for p in self._prompts_to_hand_over if p is not r]
        self.kv.release(r.id)
        self.backend.release(r.id, r.slot)
        if r.slot >= 0:
            self._free_slots.append(r.slot)
        for slot in r.extra_slots:
            self.backend.retire_slot(slot)
            self._free_slots.append(slot)
        r.extra_slots = []

    def cancel(self, request_id: int) -> GenerationResult:
        """Stop a waiting or running request between steps: everything it holds goes back
        at once (as when it finishes); returns what it produced, finish reason
        ``cancelled``."""
        request = self._live(request_id)
        request.phase, request.finish_reason = "done", "cancelled"
        return self._retire(request)

    def _live(self, request_id: int) -> Request:
        request = self._requests.get(request_id)
        if request is None:
            raise KeyError(
                f"request {request_id} is not waiting or running (live: {sorted(self._requests)})"
            )
        return request
