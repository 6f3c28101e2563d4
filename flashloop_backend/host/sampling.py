"""Next tokens from final hidden states, many requests at a time: one coda call, one host
read for every greedy row of a step and one for every row keeping log-probs (a read per
row would be a host sync per row)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from flashloop_backend.host.model import OuroModel
from flashloop_backend.host.requests import Request


def choose_tokens(
    model: OuroModel, requests: list[Request], final_hidden: torch.Tensor
) -> list[int]:
    """The next token of each request from its final hidden state [N, hidden]: the token it
    produced before a preemption (while it recomputes), the forced token (teacher forcing),
    a seeded sample (temperature > 0) or the argmax. Requests that
    keep log-probs get the FP32 log-softmax appended."""
    logits = model.coda(final_hidden)  # [N, vocab] FP32
    greedy = torch.argmax(logits, dim=-1).tolist()  # one host read for the whole step
    keeping = [row for row, r in enumerate(requests) if r.logprobs is not None]
    if keeping:  # one log-softmax and one host read for every row that keeps them
        rows = torch.tensor(keeping, device=logits.device)
        kept = torch.log_softmax(logits.index_select(0, rows), dim=-1).cpu()
        for index, row in enumerate(keeping):
            requests[row].logprobs.append(kept[index])
    tokens = []
    for row, r in enumerate(requests):
        if r.replaying:
            tokens.append(r.replay[len(r.output)])  # recomputing after a preemption
        elif r.forced is not None:
            tokens.append(r.forced[len(r.output)])
        elif r.params.temperature > 0:
            probs = torch.softmax(logits[row] / r.params.temperature, dim=-1)
            tokens.append(int(torch.multinomial(probs, 1, generator=r.generator)))
        else:
            tokens.append(greedy[row])
    return tokens


def finish_reason(
    r: Request, eos_token_id: int | None, detokenize: Callable[[list[int]], str] | None
) -> str:
    """Why ``r`` stops after its latest output token ("" if it goes on)."""
    token = r.output[-1]
    if r.forced is not None:
        return "forced" if len(r.output) == len(r.forced) else ""
    if token == eos_token_id and not r.params.ignore_eos:
        return "eos"
    if r.params.stop and detokenize and any(s in detokenize(r.output) for s in r.params.stop):
        return "stop"
    if len(r.output) >= r.params.max_new_tokens:
        return "length"
    return ""
