"""Self-speculative decoding as :class:`Engine` methods: setting it up and checking what it
serves, sizing and scheduling each block, and outputting a verified block's tokens (the
block logic itself is :mod:`flashloop_backend.host.speculation`)."""

from __future__ import annotations

import torch

from flashloop_backend.device_copy import to_device
from flashloop_backend.host.batch import RowGroup
from flashloop_backend.host.requests import Request
from flashloop_backend.host.sampling import finish_reason
from flashloop_backend.host.speculation import Speculation, SpeculationSettings


class SpeculativeDecoding:
    """The engine's speculation (a mixin of :class:`Engine`: it uses the engine's model,
    backend, slots and requests)."""

    def _set_up_speculation(self, settings: SpeculationSettings | None, max_slots: int) -> None:
        """Refuse, naming why, a model that exits early or a backend whose features do not
        verify speculative rows; a speculating request holds one token-state slot per
        block row."""
        self.speculation = None
        if settings is not None:
            cfg = self.cfg
            blockers = self.backend.speculation_blockers()
            if cfg.exits_early:
                blockers.append(
                    f"the model exits early (early_exit_threshold={cfg.early_exit_threshold}); "
                    "speculation verifies every token at the last loop (threshold 1.0)"
                )
            if blockers:
                raise ValueError("speculative decoding is not supported: " + "; ".join(blockers))
            self.speculation = Speculation(settings, self.model, cfg.total_ut_steps)
        self.slots_per_request = settings.block_size if settings else 1
        if self.slots_per_request > self.max_batch_tokens:  # its block could never run
            raise ValueError(
                f"max_batch_tokens={self.max_batch_tokens} is below the speculation "
                f"block_size={self.slots_per_request}: a block's rows run in one step"
            )
        if self.slots_per_request > max_slots:
            raise ValueError(
                f"max_slots={max_slots} is below the {self.slots_per_request} token-state "
                "slots one speculating request holds (one per block row)"
            )

    def _check_speculative_request(self, forced, keep_logprobs: bool) -> None:
        if self.speculation is None:
            return
        unsupported = {"forced": forced is not None, "keep_logprobs": keep_logprobs}
        named = [name for name, given in unsupported.items() if given]
        if named:
            raise ValueError(
                f"speculative decoding outputs tokens by the block: {named} are not "
                "supported with it"
            )

    def _block_group(self, r: Request) -> RowGroup:
        """The rows of ``r``'s block that run this step, the block fitted to the backend's
        limit before its first row (after the hand-over: the packing is current)."""
        if not r.block.sized:
            final = self._request_kv(r).final_rows
            aligned = self.speculation.settings.rolling == "serial_aligned"
            limit = self.backend.speculation_rows(r.id, final) if aligned else None
            self.speculation.fit(r, limit)
        return self.speculation.group(r)

    def _emit_block(self, r: Request, tokens: list[int]) -> None:
        """Output a verified speculation block's tokens in order, stopping at the first
        that finishes the request; a request that goes on starts its next block."""
        last = self.cfg.total_ut_steps - 1
        for token in tokens:
            r.output.append(token)
            r.exit_depths.append(last)
            self.tokens_generated += 1
            self.backend.token_done(r.id, self._request_kv(r))
            r.finish_reason = finish_reason(r, self.cfg.eos_token_id, self.detokenize)
            if r.finish_reason:
                r.phase, r.block = "done", None
                return
        ids = to_device(torch.tensor([tokens[-1]]), self.device)
        r.depth, r.hidden = 0, self.model.prelude(ids)[0]
        self.speculation.start(r, self._new_incarnations)

    def _start_token(self, r: Request) -> None:
        """``r``'s next token starts its loops: a new incarnation (its reference state
        starts empty) and, when speculating and not replaying, a new block."""
        r.incarnation = self._new_incarnations(1)[0]
        if self.speculation is not None and not r.replaying:
            self.speculation.start(r, self._new_incarnations)

    def _new_incarnations(self, count: int) -> list[int]:
        """``count`` tokens never seen before (their reference state starts empty)."""
        first = self._incarnations + 1
        self._incarnations += count
        return list(range(first, first + count))
