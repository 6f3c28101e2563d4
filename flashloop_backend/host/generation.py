"""Generation with a progress display: the loop behind ``demo``, ``generate`` and the
main job's table, showing prompt rows while prompts prefill, then tokens and tokens/s."""

from __future__ import annotations

from collections.abc import Callable

from flashloop_backend.host.engine import Engine, GenerationResult, SamplingParams
from flashloop_backend.host.progress import ProgressBar


def generate_with_progress(
    engine: Engine,
    prompts: list[list[int]],
    params: SamplingParams,
    label: str,
    after_step: Callable[[Engine], None] | None = None,
) -> list[GenerationResult]:
    """Run ``prompts`` to completion (results in prompt order) with two bars on stderr:
    prompt rows x loops while any prompt is waiting or prefilling, then tokens generated.
    ``after_step(engine)`` runs after every step (e.g. to sample the KV held)."""
    ids = [engine.add_request(p, params) for p in prompts]
    rows = sum(map(len, prompts)) * engine.cfg.total_ut_steps
    new_tokens = len(prompts) * params.max_new_tokens
    return run_with_progress(engine, ids, rows, new_tokens, label, after_step)


def run_with_progress(
    engine: Engine,
    ids: list[int],
    prompt_rows: int,
    new_tokens: int,
    label: str,
    after_step: Callable[[Engine], None] | None = None,
) -> list[GenerationResult]:
    """Run the submitted requests ``ids`` to completion (results in their order) with the
    bars of :func:`generate_with_progress`: ``prompt_rows`` prompt rows x loops to prefill
    (0 for restored requests), ``new_tokens`` tokens to make."""
    start = engine.counters()
    prefill = ProgressBar(f"{label}: prefill", prompt_rows, "prompt rows x loops")
    tokens = ProgressBar(f"{label}: generate", new_tokens, "tokens", rate_unit="tokens")
    results: dict[int, GenerationResult] = {}
    try:
        while engine.has_unfinished():
            for result in engine.step():
                results[result.request_id] = result
            if after_step is not None:
                after_step(engine)
            now = engine.counters()
            rows = now["prefill_rows"] - start["prefill_rows"]
            if now["prompts_running"]:
                prefill.update(rows)
            else:  # token-sparse loops skip rows: the bar ends when no prompt is left
                prefill.finish(rows)
            made = now["tokens_generated"] - start["tokens_generated"]
            if made or not now["prompts_running"]:  # no empty token bar beside the prefill one
                tokens.update(made, rate_count=made)
        made = engine.counters()["tokens_generated"] - start["tokens_generated"]
        tokens.finish(made, rate_count=made)
    finally:
        prefill.close()
        tokens.close()
    return [results[i] for i in ids]
