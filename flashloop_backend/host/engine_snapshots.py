"""Snapshot and restore of one request between tokens, as :class:`Engine` methods
(docs/snapshot.md; the file format is :mod:`flashloop_backend.host.snapshot`)."""

from __future__ import annotations

import torch

from flashloop_backend.backends.base import OutOfPackedPagesError
from flashloop_backend.host.kvcache import OutOfBlocksError
from flashloop_backend.host.prompt_schedule import PromptSchedule
from flashloop_backend.host.requests import Request, SamplingParams, checked_params
from flashloop_backend.host.snapshot import (
    SNAPSHOT_FORMAT,
    RequestSnapshot,
    SnapshotError,
    check_matches,
    check_request,
    model_fingerprint,
)


class RequestSnapshots:
    """The engine's snapshot and restore (a mixin of :class:`Engine`: it uses the
    engine's pools, requests and slots)."""

    def at_token_boundary(self, request_id: int) -> bool:
        """Whether the request decodes and its current token has run no loop yet: the
        point where :meth:`snapshot` may save it (no loop-2 reference is live)."""
        r = self._live(request_id)
        at_block_start = r.block is None or (len(r.block.tokens) == 1 and not r.block.verifying)
        return r.phase == "decode" and r.depth == 0 and at_block_start

    def snapshot_identity(self) -> tuple[dict, dict]:
        """(identity, geometry) a snapshot must carry to be restored here: the manifest
        fields :func:`~flashloop_backend.host.snapshot.check_matches` compares."""
        return self._identity()

    def _identity(self) -> tuple[dict, dict]:
        if self._fingerprint is None:
            self._fingerprint = model_fingerprint(self.model)
        identity = {"model": self._fingerprint, **self.backend.state_identity()}
        geometry = {
            "block_size": self.kv.block_size,
            "num_layers": self.cfg.num_hidden_layers,
            "kv_heads": self.cfg.num_key_value_heads,
            "head_dim": self.cfg.head_dim,
            "depths": self.cfg.total_ut_steps,
            "dtype": str(self.dtype).removeprefix("torch."),
        }
        return identity, geometry

    def snapshot(self, request_id: int) -> RequestSnapshot:
        """The request's whole state between tokens, on the host (reads the device): its
        BF16 blocks on every plane, the backend's pages, its token-sparse prompt schedule,
        the current token's hidden state and the sampler's RNG. The request keeps running."""
        r = self._live(request_id)
        if not self.at_token_boundary(request_id):
            raise ValueError(
                f"request {request_id} is in phase {r.phase!r} at loop {r.depth}: a snapshot "
                "is taken between tokens (phase 'decode', loop 0; step until at_token_boundary)"
            )
        self.hand_over_prompts()  # a prompt done in the last step is packed first
        identity, geometry = self._identity()
        bs, written = self.kv.block_size, r.position  # the current token's KV is not written
        planes = [self.kv.block_table(r.id, d) for d in range(self.cfg.total_ut_steps)]
        first = next((i for i, b in enumerate(planes[0]) if b >= 0), len(planes[0]))
        last = max(first, -(-written // bs))
        index = torch.tensor([p[first:last] for p in planes], dtype=torch.long).to(self.device)
        tensors = {
            "bf16.keys": self.kv.key_pool[index].cpu(),
            "bf16.values": self.kv.value_pool[index].cpu(),
            "hidden": r.hidden.cpu(),
            **self.backend.export_request(r.id),
        }
        if r.generator is not None:
            tensors["rng"] = r.generator.get_state()
        if r.schedule is not None and r.schedule.sparsity is not None:
            tensors["prompt_active"] = r.schedule.history()
        if r.logprobs:
            tensors["logprobs"] = torch.stack(r.logprobs).cpu()
        request = {  # copies: the running request's later tokens must not reach the manifest
            "prompt": list(r.prompt),
            "output": list(r.output),
            "exit_depths": list(r.exit_depths),
            "params": {**vars(r.params), "stop": list(r.params.stop)},
            "forced": _copied(r.forced),
            "keep_logprobs": r.logprobs is not None,
            "replay": _copied(r.replay),
            "replay_exits": _copied(r.replay_exits),
        }
        manifest = {
            "format": SNAPSHOT_FORMAT,
            "identity": identity,
            "geometry": geometry,
            "request": request,
            "bf16_first_block": first,
            "live_references": 0,
            "bytes": _bytes_by_part(tensors),
        }
        return RequestSnapshot(manifest, tensors)

    def restore(self, snapshot: RequestSnapshot, max_new_tokens: int | None = None) -> int:
        """Admit a request saved by :meth:`snapshot` (in any engine of the same model,
        backend configuration and KV geometry) where it stopped; ``max_new_tokens`` (>= 1):
        how many more tokens it may make (default: what it had left). Returns its new id.
        Unlike a new request it does not wait: a snapshot that does not match or does not
        fit together is a :class:`SnapshotError`, a request the pools cannot hold now an
        ``OutOfBlocksError`` (or ``OutOfPackedPagesError``), and either leaves the pools
        as they were."""
        if max_new_tokens is not None and max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
        check_matches(snapshot, *self._identity())
        loops = self.cfg.total_ut_steps
        check_request(snapshot, self.cfg.hidden_size, loops, self.cfg.vocab_size)
        saved, tensors = snapshot.manifest["request"], snapshot.tensors
        wanted = dict(saved["params"])
        if max_new_tokens is not None:
            wanted["max_new_tokens"] = len(saved["output"]) + max_new_tokens
        try:
            params = SamplingParams(**wanted | {"stop": tuple(wanted.get("stop", ()))})
        except (TypeError, ValueError) as exc:
            raise SnapshotError(f"snapshot request params {saved['params']}: {exc}") from None
        forced = saved["forced"]
        params = checked_params(
            saved["prompt"], params, None, self.cfg.vocab_size, self.max_context
        )
        if forced is not None and len(forced) < params.max_new_tokens:
            raise ValueError(
                f"a teacher-forced request has {len(forced)} tokens to feed; "
                f"max_new_tokens {params.max_new_tokens} needs more"
            )
        r = Request(self._next_id, list(saved["prompt"]), params, None, phase="decode")
        r.hidden = tensors["hidden"].to(self.device, self.dtype)
        if params.temperature > 0:
            r.generator = torch.Generator(device=self.device)
            try:
                r.generator.set_state(tensors.get("rng", torch.empty(0, dtype=torch.uint8)))
            except (RuntimeError, TypeError) as exc:
                raise SnapshotError(
                    f"tensor 'rng' is not a {self.device.type} generator state: {exc}"
                ) from None
        if (self.sparsity is not None) != ("prompt_active" in tensors):
            raise SnapshotError("tensor 'prompt_active' goes with token-sparse prefill only")
        total = len(r.prompt) + params.max_new_tokens
        blocks = self._checked_blocks(snapshot, -(-total // self.kv.block_size))
        if len(self._free_slots) < self.slots_per_request:
            raise OutOfBlocksError(
                f"{self.slots_per_request} token-state slots are needed and "
                f"{len(self._free_slots)} are free (max_slots={self.max_slots})"
            )
        stored = {k: t for k, t in tensors.items() if "." in k and not k.startswith("bf16.")}
        while True:
            try:
                self._reserve_restored(r, total, params.max_new_tokens, stored)
                break
            except (OutOfBlocksError, OutOfPackedPagesError) as exc:
                if not self._evict_for(exc):  # cached prefixes give way, as on admission
                    raise
        self._write_blocks(r.id, snapshot.manifest["bf16_first_block"], *blocks)
        r.output, r.exit_depths = list(saved["output"]), list(saved["exit_depths"])
        r.forced = None if forced is None else list(forced)
        r.replay, r.replay_exits = saved["replay"], saved["replay_exits"]
        if saved["keep_logprobs"]:
            r.logprobs = list(tensors["logprobs"]) if "logprobs" in tensors else []
        if self.sparsity is not None:
            r.schedule = PromptSchedule(len(r.prompt), self.sparsity, loops, self.device)
            r.schedule.restore_history(list(tensors["prompt_active"]))
        self._take_slots(r)
        self._start_token(r)  # saved at a token boundary (a block's start)
        self._requests[r.id] = r
        self._next_id += 1
        return r.id

    def _reserve_restored(self, r: Request, total: int, new: int, stored: dict) -> None:
        """Blocks and pages for a restored request, its stored KV imported; atomic:
        nothing held when it raises."""
        self.kv.reserve(r.id, total)
        try:
            self.backend.admit(r.id, len(r.prompt), new)
            self.backend.import_request(r.id, stored)
        except BaseException:
            self.kv.release(r.id)
            self.backend.release(r.id, -1)
            raise

    def _checked_blocks(self, snapshot: RequestSnapshot, per_plane: int):
        """The snapshot's BF16 blocks (keys, values), checked against the pools and the
        ``per_plane`` blocks the restored request reserves."""
        keys, values = snapshot.tensors.get("bf16.keys"), snapshot.tensors.get("bf16.values")
        first = snapshot.manifest.get("bf16_first_block")
        count = keys.shape[1] if keys is not None and keys.dim() == 6 else -1
        shape = (self.cfg.total_ut_steps, count, *self.kv.key_pool.shape[1:])
        if keys is None or values is None or keys.shape != shape or values.shape != shape:
            found = [None if t is None else list(t.shape) for t in (keys, values)]
            raise SnapshotError(
                f"bf16.keys / bf16.values must be [{', '.join(map(str, shape))}]; found {found}"
            )
        if not isinstance(first, int) or first < 0 or first + count > per_plane:
            raise SnapshotError(
                f"the snapshot's BF16 blocks from {first!r} ({count} of them) lie outside the "
                f"{per_plane} a plane reserves"
            )
        return keys, values

    def _write_blocks(self, request_id: int, first: int, keys, values) -> None:
        """Put checked BF16 blocks (from block ``first`` of every plane) into the
        request's reserved blocks, freeing the ones before ``first`` (packed)."""
        depths, count = keys.shape[:2]
        planes = [self.kv.block_table(request_id, d) for d in range(depths)]
        self.kv.drop_prefix(request_id, first * self.kv.block_size)
        index = torch.tensor([p[first : first + count] for p in planes], dtype=torch.long)
        index = index.to(self.device)
        self.kv.key_pool[index] = keys.to(self.device, self.kv.key_pool.dtype)
        self.kv.value_pool[index] = values.to(self.device, self.kv.value_pool.dtype)


def _copied(tokens: list[int] | None) -> list[int] | None:
    return None if tokens is None else list(tokens)


def _bytes_by_part(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    """Tensor bytes of a snapshot: packed pages and maps, BF16 blocks, the rest."""
    parts = {"packed": 0, "bf16": 0, "other": 0}
    for name, tensor in tensors.items():
        part = name.split(".")[0] if name.split(".")[0] in parts else "other"
        parts[part] += tensor.numel() * tensor.element_size()
    return parts
