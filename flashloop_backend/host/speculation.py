"""Self-speculative decoding with a shallow draft (RFC §6.2-6.4; issue 25).

A looped model drafts for itself. A block starts at the request's last output token x0
(position p) and holds ``rows`` positions p .. p+rows-1:

1. Drafting: each row's token runs the first ``draft_depth`` loops (1 or 2) as an
   ordinary decode row, and the coda of that state drafts the next token (d1 .. d_rows),
   which becomes the next row's token. Those rows write their loops' KV like any decode
   token. With ``draft_confidence`` c > 0, a draft whose probability under the draft
   distribution is below c is the block's last: the block ends at the row that drafted it.
2. Verification: all rows run the remaining loops together as VERIFY rows (decode
   queries, each with its own causal length), from their draft states. The coda of each
   row's final state is the model's own next token y1 .. y_rows.
3. Acceptance: greedy, the drafts equal to y, in order, are accepted (a of them), and the
   block outputs d1 .. da, then y_{a+1} when a draft was rejected. Sampling (a seeded
   temperature) uses the standard rejection rule instead (:func:`accept_sampled`).

Rows past the last accepted one hold rejected tokens. Their KV lies beyond every later
row's causal length until the next block overwrites those positions, so it is never read.
With greedy decoding the output equals the non-speculative output; with sampling every
token follows the model's distribution, from a different random stream.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from flashloop_backend.dispatch import RowMode
from flashloop_backend.host.batch import RowGroup

DRAFT_DEPTHS = (1, 2)  # loops a draft token runs before its coda


class SpeculationSettings(BaseModel):
    """Block speculation: at most ``block_size`` rows per block (k), drafted at
    ``draft_depth`` loops and verified at the rest; drafting stops at a draft less
    probable than ``draft_confidence`` (0: every block drafts its k rows)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    block_size: int = Field(default=4, ge=2)
    draft_depth: int = 2
    # a draft this unlikely is probably rejected, and every row drafted after it with it:
    # verifying at once spends no more draft steps on them
    draft_confidence: float = Field(default=0.0, ge=0.0, lt=1.0)
    # KV quantization `rolling`: `serial_aligned` ends a block before the next flush, so
    # every row reads the packed rows serial decoding shows it (the same tokens);
    # `block_boundary` lets blocks run across it and packs between blocks (execution-
    # dependent: rows may read BF16 where serial decoding reads packed values)
    rolling: Literal["serial_aligned", "block_boundary"] = "serial_aligned"

    @field_validator("draft_depth")
    @classmethod
    def _built(cls, depth: int) -> int:
        if depth not in DRAFT_DEPTHS:
            raise ValueError(f"draft_depth={depth} is not built (supported: {list(DRAFT_DEPTHS)})")
        return depth


@dataclass
class Block:
    """One speculation block of a request: its first position, its rows, the rows'
    tokens (x0 first), each drafted row's loop-``draft_depth`` state, and the last draft
    (drafted from the last row, compared with the last verified token)."""

    start: int
    rows: int
    tokens: list[int]
    slots: tuple[int, ...]  # each row's token-state slot (its loop-2 reference lives there)
    incarnations: tuple[int, ...]  # each row's token, new for every block
    sized: bool = False  # its rows were fitted to the backend's limit (at its first step)
    drafted: list[torch.Tensor] = field(default_factory=list)
    last_draft: int | None = None
    draft_probs: list[torch.Tensor] = field(default_factory=list)  # under sampling: q per draft

    @property
    def verifying(self) -> bool:
        return self.last_draft is not None


class Speculation:
    """The speculating host's side of a request's decode: which rows run next, and what
    a block outputs once verified. Counters: blocks verified, tokens drafted, drafts
    accepted, rows run (drafting and verification), blocks whose drafting stopped at an
    unsure draft before ``block_size`` rows."""

    def __init__(self, settings: SpeculationSettings, model, loops: int) -> None:
        if loops <= settings.draft_depth:
            raise ValueError(
                f"draft_depth={settings.draft_depth} leaves no loop to verify in a "
                f"{loops}-loop model"
            )
        self.settings, self.model, self.loops = settings, model, loops
        self.blocks = self.drafted = self.accepted = self.rows_run = self.stopped = 0
        self.device_reads = 0  # advances that read a draft or an acceptance on the host

    def counters(self) -> dict[str, int | float]:
        rate = self.accepted / self.drafted if self.drafted else 0.0
        return {
            "speculation_blocks": self.blocks,
            "speculation_drafted": self.drafted,
            "speculation_accepted": self.accepted,
            "speculation_rows": self.rows_run,
            "speculation_stopped": self.stopped,
            "acceptance_rate": rate,
        }

    def start(self, r, incarnations: Callable[[int], list[int]]) -> None:
        """A new block at ``r``'s last output token (its hidden is that token's embedding);
        never more rows than tokens the request may still output. Row i takes the
        request's i-th token-state slot and a new incarnation (``incarnations(n)``), so a
        reference a rejected row wrote is never read as another's."""
        rows = max(1, min(self.settings.block_size, r.params.max_new_tokens - len(r.output)))
        slots = (r.slot, *r.extra_slots)[:rows]
        new = tuple(incarnations(rows))
        r.block = Block(r.position, rows, [r.output[-1]], slots, new)
        r.incarnation = new[0]

    def fit(self, r, limit: int | None) -> None:
        """Before the block's first row runs: at most ``limit`` rows (the backend's
        :meth:`speculation_rows`; None or less than one: as started)."""
        block = r.block
        if limit is not None and 1 <= limit < block.rows:
            block.rows = limit
            block.slots, block.incarnations = block.slots[:limit], block.incarnations[:limit]
        block.sized = True

    def group(self, r) -> RowGroup:
        """The rows ``r`` runs this step: its drafting row, or every row of the block at the
        verifying depth."""
        block = r.block
        if block.verifying:
            return RowGroup(
                r.id,
                RowMode.VERIFY,
                r.depth,
                block.start,
                block.rows,
                row_slots=block.slots,
                row_incarnations=block.incarnations,
            )
        row = len(block.tokens) - 1
        slot, incarnation = block.slots[row], block.incarnations[row]
        return RowGroup(r.id, RowMode.DECODE, r.depth, block.start + row, 1, slot, incarnation)

    def advance(self, r, out: torch.Tensor) -> list[int] | None:
        """Take this step's output [rows, hidden] for ``r``; at the end of verification the
        tokens the block outputs (None before)."""
        block = r.block
        self.rows_run += out.shape[0]
        if r.depth + 1 < self.settings.draft_depth or (
            block.verifying and r.depth + 1 < self.loops
        ):
            r.depth, r.hidden = r.depth + 1, out if block.verifying else out[0]
            return None
        self.device_reads += 1  # the draft or the acceptance below is read on the host
        if not block.verifying:  # the row's draft state guesses the next token
            block.drafted.append(out[0])
            draft, probability = self._draft(r, self.model.coda(out[:1])[0])
            if len(block.tokens) < block.rows and probability < self.settings.draft_confidence:
                self._stop_drafting(block)
            if len(block.tokens) < block.rows:
                block.tokens.append(draft)
                r.depth = 0
                r.hidden = self.model.prelude(torch.tensor([draft], device=out.device))[0]
            else:
                block.last_draft = draft
                r.depth, r.hidden = self.settings.draft_depth, torch.stack(block.drafted)
            return None
        logits = self.model.coda(out)
        drafts = [*block.tokens[1:], block.last_draft]
        if r.params.temperature > 0:
            target = torch.softmax(logits / r.params.temperature, dim=-1)
            tokens = accept_sampled(drafts, torch.stack(block.draft_probs), target, r.generator)
        else:
            tokens = accept_greedy(drafts, torch.argmax(logits, dim=-1).tolist())
        accepted = len(tokens) if tokens == drafts else len(tokens) - 1
        self.blocks += 1
        self.drafted += block.rows
        self.accepted += accepted
        return tokens

    def _stop_drafting(self, block: Block) -> None:
        """End ``block`` at the rows drafted so far (their slots and incarnations stay)."""
        block.rows = len(block.tokens)
        block.slots, block.incarnations = (
            block.slots[: block.rows],
            block.incarnations[: block.rows],
        )
        self.stopped += 1

    def _draft(self, r, logits: torch.Tensor) -> tuple[int, float]:
        """The next draft from a row's draft-state logits [vocab] and its probability under
        the draft distribution: the argmax (probability at temperature 1), or under
        sampling a draw from the tempered distribution (kept for the acceptance test).
        The probability is computed only when ``draft_confidence`` asks for it (else 1)."""
        wanted = self.settings.draft_confidence > 0
        if r.params.temperature <= 0:
            if not wanted:
                return int(torch.argmax(logits).item()), 1.0
            probability, draft = torch.softmax(logits.float(), dim=-1).max(dim=-1)
            # one host read for both (a vocabulary index is exact in FP32)
            probability, draft = torch.stack((probability, draft.float())).tolist()
            return int(draft), probability
        probs = torch.softmax(logits / r.params.temperature, dim=-1)
        r.block.draft_probs.append(probs)
        draft = int(torch.multinomial(probs, 1, generator=r.generator).item())
        return draft, float(probs[draft].item()) if wanted else 1.0


def accept_greedy(drafts: list[int], verified: list[int]) -> list[int]:
    """The drafts equal to the verifier's tokens, in order, then the verifier's token at
    the first that differs (all drafts when none does)."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == verified[accepted]:
        accepted += 1
    return drafts if accepted == len(drafts) else [*drafts[:accepted], verified[accepted]]


def accept_sampled(
    drafts: list[int], draft_probs: torch.Tensor, target: torch.Tensor, generator
) -> list[int]:
    """The standard rejection rule (speculative sampling): draft i, drawn from
    ``draft_probs[i]`` [vocab], is accepted with probability min(1, p/q) under
    ``target[i]`` [vocab]; at the first rejection a token is drawn from the normalised
    excess max(0, p - q) instead, and the block ends. Every output token is then
    distributed as the target says, whatever the drafts."""
    out = []
    for i, draft in enumerate(drafts):
        p, q = target[i], draft_probs[i]
        ratio = float(p[draft] / q[draft]) if q[draft] > 0 else 0.0
        u = float(torch.rand((), generator=generator, device=p.device))
        if u < ratio:
            out.append(draft)
            continue
        excess = torch.clamp(p - q, min=0)
        excess = excess if float(excess.sum()) > 0 else p
        out.append(int(torch.multinomial(excess / excess.sum(), 1, generator=generator).item()))
        return out
    return out
