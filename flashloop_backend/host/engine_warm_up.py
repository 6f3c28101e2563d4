"""Compiling before serving, as an :class:`Engine` method: synthetic requests through every
path a real request can take, then every graph key."""

from __future__ import annotations

import time

from flashloop_backend.host.requests import SamplingParams

# Rows of the warm-up's short and long prompts: one under a 64-row group, and two groups and
# part of a third (a compact level where token-sparse prefill keeps one).
WARM_PROMPTS = (7, 2 * 64 + 21)
# Rows of its last prompt at most: its chunks' keys span enough pages that a kernel
# serving few query tiles splits their keys over programs (a long prompt's chunk alone in
# a step), which short prompts never do.
LONG_WARM_PROMPT = 1024
WARM_NEW_TOKENS = 3


class WarmUp:
    """The engine's warm-up (a mixin of :class:`Engine`)."""

    def warm_up(self, sizes: list[int] | None = None) -> float:
        """Run synthetic requests through the paths serving takes, so that kernels compile
        and graphs are captured before any real request: for each batch size in ``sizes``
        (default: every graph bucket up to ``max_slots``, else 1, 2 and 3), that many
        requests at once, prompts alternately short and long (``WARM_PROMPTS``), then one
        request alone of the longest prompt up to ``LONG_WARM_PROMPT`` rows the context
        and the pools admit, each generating 3 tokens through every loop; then, with
        graphs, every graph key a decode step of up to ``max_slots`` requests can meet
        (``DecodeGraphs.prepare_every_key``). Needs an idle engine; returns the seconds it
        took."""
        if self.has_unfinished():
            raise RuntimeError("warm_up needs an idle engine: requests are still running")
        if sizes is None:
            buckets = self.graphs.settings.buckets if self.graphs is not None else (1, 2, 3)
            sizes = [b for b in buckets if b <= self.max_slots] or [1]
        started = time.perf_counter()
        params = SamplingParams(max_new_tokens=WARM_NEW_TOKENS, ignore_eos=True)
        longest = max(2, self.max_context - WARM_NEW_TOKENS)
        lengths = tuple(min(rows, longest) for rows in WARM_PROMPTS)
        for size in sizes:
            prompts = [self._warm_prompt(i, lengths[i % 2]) for i in range(size)]
            self.generate(prompts, params)
        long_prompt = self._longest_admitted(min(LONG_WARM_PROMPT, longest), lengths[1])
        if long_prompt > lengths[1]:
            self.generate([self._warm_prompt(0, long_prompt)], params)
        if self.graphs is not None:
            rows = self.max_slots * self.graphs.verify_rows
            loops = self.cfg.total_ut_steps
            self.graphs.prepare_every_key(rows, loops, self.align_decode_depths)
        return time.perf_counter() - started

    def _warm_prompt(self, index: int, rows: int) -> list[int]:
        return [(13 * index + 5 * t) % self.cfg.vocab_size for t in range(rows)]

    def _longest_admitted(self, rows: int, floor: int) -> int:
        """``rows``, halved until a prompt of that many rows (and the warm-up's new tokens)
        fits the BF16 pool and the packed pool; ``floor`` if none above it does."""
        while rows > floor:
            blocks, pages, pool = self._footprint(rows, WARM_NEW_TOKENS)
            if blocks <= self.kv.num_blocks and pages <= pool:
                return rows
            rows //= 2
        return floor
