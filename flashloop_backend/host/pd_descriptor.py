"""What a prefill/decode handoff agrees on before any byte moves (docs/pd_handoff.md): the
versioned descriptor P sends (the snapshot manifest and a table of its tensors), D's
checks of it against its engine, and the record of what moved and how long each phase
took. The transport is :mod:`flashloop_backend.host.pd_handoff`'s."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from flashloop_backend.host.kvcache import OutOfBlocksError
from flashloop_backend.host.snapshot import (
    SNAPSHOT_FORMAT,
    RequestSnapshot,
    SnapshotError,
    check_matches,
)

PD_FORMAT = 1
DTYPES = {
    name: getattr(torch, name)
    for name in "float32 float16 bfloat16 int64 int32 int16 int8 uint8 bool".split()
}


class HandoffError(RuntimeError):
    """A handoff that cannot complete: a transfer in ERR state, a timeout, a cancellation,
    missing or changed ranges. Nothing is active or registered on D when it is raised."""


def tensor_digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.cpu().contiguous().view(torch.uint8).numpy()).hexdigest()


@dataclass(frozen=True)
class TensorEntry:
    """One exported range: the snapshot tensor's name, dtype, shape and bytes, P's address
    (meaningful to P's agent only: D binds by ``name``), memory kind, device and SHA-256."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    addr: int
    memory: str
    device: int
    sha256: str


@dataclass(frozen=True)
class HandoffDescriptor:
    """What D needs before any byte moves: ``format`` (PD_FORMAT), the transfer
    ``generation``, the snapshot ``manifest`` (identity, geometry, request, bytes by part),
    the tensor table, and P's agent name and metadata."""

    format: int
    generation: str
    manifest: dict
    tensors: tuple[TensorEntry, ...]
    agent: str
    agent_metadata: bytes


def check_descriptor(engine, descriptor: HandoffDescriptor, max_new_tokens: int | None) -> None:
    """Refuse a descriptor before any byte moves: another descriptor or snapshot format, a
    model, backend, config digest, KV encoding or geometry other than ``engine``'s (a
    ``SnapshotError`` naming the field and both values), a malformed tensor table, or a
    request the engine cannot hold now (``OutOfBlocksError`` naming what is short)."""
    if descriptor.format != PD_FORMAT:
        raise SnapshotError(
            f"handoff descriptor format {descriptor.format!r}; this build reads {PD_FORMAT}"
        )
    manifest = descriptor.manifest
    if manifest.get("format") != SNAPSHOT_FORMAT:
        raise SnapshotError(
            f"snapshot format {manifest.get('format')!r}; this build reads {SNAPSHOT_FORMAT}"
        )
    check_matches(RequestSnapshot(manifest, {}), *engine.snapshot_identity())
    parts = {"packed": 0, "bf16": 0, "other": 0}
    for e in descriptor.tensors:
        dtype = DTYPES.get(e.dtype)
        if dtype is None:
            raise SnapshotError(
                f"tensor {e.name!r} has dtype {e.dtype!r}; allowed: {sorted(DTYPES)}"
            )
        if e.nbytes != torch.Size(e.shape).numel() * dtype.itemsize:
            raise SnapshotError(
                f"tensor {e.name!r}: {e.nbytes} bytes do not fit {e.dtype} {list(e.shape)}"
            )
        part = e.name.split(".")[0]
        parts[part if part in parts else "other"] += e.nbytes
    if len({e.name for e in descriptor.tensors}) != len(
        descriptor.tensors
    ) or parts != manifest.get("bytes"):
        raise SnapshotError(
            f"the tensor table ({parts} bytes) does not match the manifest's {manifest.get('bytes')}"
        )
    _check_capacity(engine, manifest, max_new_tokens)


def _check_capacity(engine, manifest: dict, max_new_tokens: int | None) -> None:
    """What ``Engine.restore`` will take (BF16 blocks, token-state slots, packed pages),
    against what is free now; blocks only a prefix cache holds count as free (restore
    evicts them), packed pages a cached prefix holds do not."""
    try:
        request = manifest["request"]
        prompt, made = len(request["prompt"]), len(request["output"])
        saved_new = request["params"]["max_new_tokens"]
    except (KeyError, TypeError) as exc:
        raise SnapshotError(f"snapshot request fields are missing ({exc})") from None
    new = saved_new if max_new_tokens is None else made + max_new_tokens
    pools, short = engine.pools(), []
    blocks = engine.kv.blocks_needed(prompt + new)
    free = pools["free_blocks"] + pools.get("prefix_blocks_cache_only", 0)
    if blocks > free:
        short.append(f"{blocks} KV blocks ({free} of {pools['num_blocks']} free)")
    if pools["free_slots"] < engine.slots_per_request:
        short.append(f"{engine.slots_per_request} token-state slots ({pools['free_slots']} free)")
    pages, total = engine.backend.pages_needed(prompt, new)
    held = pools.get("packed_pages_used", 0) + pools.get("packed_pages_reserved", 0)
    if pages > total - held:
        short.append(f"{pages} packed pages ({total - held} of {total} free)")
    if short:
        raise OutOfBlocksError(
            "the decode engine cannot hold the request now: it needs " + "; ".join(short)
        )


def handoff_record(descriptor: HandoffDescriptor, export: dict, transfer: dict) -> dict:
    """Bytes moved (by part, total, per prompt token), bytes registered on each side
    (NIXL temporary storage) and latency by phase (export, check, reserve, transfer,
    verify, activate, total), from the descriptor and the two sides' timings."""
    parts = dict(descriptor.manifest["bytes"])
    total = sum(parts.values())
    prompt = len(descriptor.manifest["request"]["prompt"])
    latency = {**export, **transfer}
    latency["total_s"] = sum(latency.values())
    return {
        "transport": "nixl",
        "transferred_bytes": {**parts, "total": total},
        "bytes_per_prompt_token": total / prompt,
        "prompt_tokens": prompt,
        "registered_bytes": {"producer": total, "consumer": total},
        "handoff_latency_s": latency,
    }
