"""What a request asks for and what it gets back, and the engine's per-request state."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from flashloop_backend.host.prompt_schedule import PromptSchedule
from flashloop_backend.host.speculation import Block


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 32
    temperature: float = 0.0  # 0: greedy
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be a finite number >= 0")


@dataclass
class GenerationResult:
    request_id: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    finish_reason: str  # "length", "eos", "stop", "forced" or "cancelled"
    exit_depths: list[int]  # zero-based exit depth of every generated token that ran loops
    logprobs: torch.Tensor | None = None  # [n, vocab] FP32 log-softmax before each output


@dataclass
class Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    prompt_hidden: torch.Tensor | None = None  # [T, hidden] latest hidden of each prompt token
    schedule: PromptSchedule | None = None  # prompt positions to run at the current depth
    phase: str = "waiting"  # waiting -> prefill -> decode -> done
    depth: int = 0
    chunk_start: int = 0
    hidden: torch.Tensor | None = None  # [hidden] the decode token's current hidden
    remaining: float = 1.0  # exit-distribution mass not yet spent
    output: list[int] = field(default_factory=list)
    exit_depths: list[int] = field(default_factory=list)
    finish_reason: str = ""
    forced: list[int] | None = None  # teacher forcing: feed these instead of sampling
    logprobs: list[torch.Tensor] | None = None
    slot: int = -1  # token-state slot of its live decode token
    incarnation: int = -1  # bumped for every new decode token
    replay: list[int] | None = None  # tokens produced before a preemption, fed back first
    replay_exits: list[int] | None = None  # and the depths at which they left
    block: Block | None = None  # the speculation block decoding now (speculating engines)
    held_back: int = 0  # decode steps in a row lockstep left it out of
    extra_slots: list[int] = field(default_factory=list)  # a block's rows after the first
    published: object | None = None  # its prefix-cache entry, until its prompt is handed over

    @property
    def position(self) -> int:  # absolute position of the current decode token
        return len(self.prompt) + len(self.output) - 1

    @property
    def replaying(self) -> bool:
        """Recomputing after a preemption: the next output is one it produced before."""
        return self.replay is not None and len(self.output) < len(self.replay)


def checked_params(
    prompt: list[int],
    params: SamplingParams | None,
    forced: list[int] | None,
    vocab_size: int,
    max_context: int,
) -> SamplingParams:
    """The sampling parameters a request runs with (teacher forcing: ``forced``'s length,
    EOS ignored), after checking the prompt's ids and the total length."""
    if forced is not None:
        if not forced:
            raise ValueError("forced continuation is empty")
        params = SamplingParams(max_new_tokens=len(forced), ignore_eos=True)
    params = params or SamplingParams()
    if not prompt:
        raise ValueError("prompt is empty; give at least one token")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]} are outside [0, {vocab_size})")
    total = len(prompt) + params.max_new_tokens
    if total > max_context:
        raise ValueError(
            f"prompt length {len(prompt)} + max_new_tokens {params.max_new_tokens} = {total} "
            f"exceeds the engine's max_context={max_context}"
        )
    return params
