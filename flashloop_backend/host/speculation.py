"""Self-speculative decoding with a shallow draft (RFC §6.2-6.4; issue 25).

A looped model drafts for itself. A block starts at the request's last output token x0
(position p) and holds ``rows`` positions p .. p+rows-1:

1. Drafting: each row's token runs the first ``draft_depth`` loops (1 or 2) as an
   ordinary decode row, and the coda of that state drafts the next token (d1 .. d_rows),
   which becomes the next row's token. Those rows write their loops' KV like any decode
   token.
2. Verification: all rows run the remaining loops together as VERIFY rows (decode
   queries, each with its own causal length), from their draft states. The coda of each
   row's final state is the model's own next token y1 .. y_rows.
3. Greedy acceptance: the drafts equal to y, in order, are accepted (a of them). The
   block outputs d1 .. da, then y_{a+1} when a draft was rejected.

Rows past the last accepted one hold rejected tokens. Their KV lies beyond every later
row's causal length until the next block overwrites those positions, so it is never read.
With greedy decoding the output equals the non-speculative output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from flashloop_backend.dispatch import RowMode
from flashloop_backend.host.batch import RowGroup

DRAFT_DEPTHS = (1, 2)  # loops a draft token runs before its coda


class SpeculationSettings(BaseModel):
    """Block speculation: ``block_size`` rows per block (k), drafted at ``draft_depth``
    loops and verified at the rest."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    block_size: int = Field(default=4, ge=2)
    draft_depth: int = 2

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
    drafted: list[torch.Tensor] = field(default_factory=list)
    last_draft: int | None = None

    @property
    def verifying(self) -> bool:
        return self.last_draft is not None


class Speculation:
    """The speculating host's side of a request's decode: which rows run next, and what
    a block outputs once verified. Counters: blocks verified, tokens drafted, drafts
    accepted, rows run (drafting and verification)."""

    def __init__(self, settings: SpeculationSettings, model, loops: int) -> None:
        if loops <= settings.draft_depth:
            raise ValueError(
                f"draft_depth={settings.draft_depth} leaves no loop to verify in a "
                f"{loops}-loop model"
            )
        self.settings, self.model, self.loops = settings, model, loops
        self.blocks = self.drafted = self.accepted = self.rows_run = 0

    def counters(self) -> dict[str, int | float]:
        rate = self.accepted / self.drafted if self.drafted else 0.0
        return {
            "speculation_blocks": self.blocks,
            "speculation_drafted": self.drafted,
            "speculation_accepted": self.accepted,
            "speculation_rows": self.rows_run,
            "acceptance_rate": rate,
        }

    def start(self, r) -> None:
        """A new block at ``r``'s last output token (its hidden is that token's embedding);
        never more rows than tokens the request may still output."""
        rows = min(self.settings.block_size, r.params.max_new_tokens - len(r.output))
        r.block = Block(start=r.position, rows=max(1, rows), tokens=[r.output[-1]])

    def group(self, r) -> RowGroup:
        """The rows ``r`` runs this step: its drafting row, or every row of the block at the
        verifying depth."""
        block = r.block
        if block.verifying:
            return RowGroup(
                r.id, RowMode.VERIFY, r.depth, block.start, block.rows, r.slot, r.incarnation
            )
        row = len(block.tokens) - 1
        return RowGroup(r.id, RowMode.DECODE, r.depth, block.start + row, 1, r.slot, r.incarnation)

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
        if not block.verifying:  # the row's loop-2 state drafts the next token
            block.drafted.append(out[0])
            draft = int(torch.argmax(self.model.coda(out[:1]), dim=-1).item())
            if len(block.tokens) < block.rows:
                block.tokens.append(draft)
                r.depth = 0
                r.hidden = self.model.prelude(torch.tensor([draft], device=out.device))[0]
            else:
                block.last_draft = draft
                r.depth, r.hidden = self.settings.draft_depth, torch.stack(block.drafted)
            return None
        verified = torch.argmax(self.model.coda(out), dim=-1).tolist()
        drafts = [*block.tokens[1:], block.last_draft]
        accepted = 0
        while accepted < block.rows and drafts[accepted] == verified[accepted]:
            accepted += 1
        self.blocks += 1
        self.drafted += block.rows
        self.accepted += accepted
        if accepted == block.rows:
            return drafts
        return [*drafts[:accepted], verified[accepted]]
