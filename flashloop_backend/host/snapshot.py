"""Snapshot and restore of one request between tokens (docs/snapshot.md): its BF16 blocks,
the backend's own state (packed pages and compact maps), the prompt's token-sparse
schedule, the current token's hidden state and the sampler's RNG, in one safetensors file
whose header carries a versioned JSON manifest."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

SNAPSHOT_FORMAT = 1
MANIFEST_KEY = "flashloop_snapshot"
MANIFEST_DIGEST_KEY = "flashloop_snapshot.sha256"


class SnapshotError(ValueError):
    """A snapshot that cannot be restored here: damaged, truncated, of another format,
    model, configuration or geometry. The message names what does not match."""


@dataclass(frozen=True)
class RequestSnapshot:
    """``manifest``: JSON-ready identity, geometry and request fields; ``tensors``: CPU
    tensors by name (``bf16.keys`` / ``bf16.values`` [depths, blocks, L, BS, Hkv, D],
    ``hidden`` [hidden], optional ``rng``, ``prompt_active`` [depths, T] bool,
    ``logprobs`` [n, vocab], and the backend's ``packed.*``)."""

    manifest: dict
    tensors: dict[str, torch.Tensor]


def model_fingerprint(model) -> str:
    """16 hex digits over the model's config and every parameter's name, shape, dtype and
    rounded sums: another checkpoint (or the same one in another dtype) differs."""
    cfg = dataclasses.asdict(model.config)
    params = list(model.named_parameters())
    with torch.no_grad():
        sums = torch.stack(
            [torch.stack([p.double().sum(), p.double().abs().sum()]) for _, p in params]
        ).tolist()
    text = json.dumps(cfg, sort_keys=True) + "".join(
        f"|{name}:{list(p.shape)}:{p.dtype}:{s:.6e}:{a:.6e}"
        for (name, p), (s, a) in zip(params, sums, strict=True)
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _checksum(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def save_snapshot(snapshot: RequestSnapshot, path: str | Path) -> None:
    """Write the snapshot, every tensor's SHA-256 in the manifest (a damaged byte is named
    on load). Written to a temporary name and renamed: no half-written file at ``path``."""
    from safetensors.torch import save_file

    tensors = {name: t.contiguous() for name, t in snapshot.tensors.items()}
    manifest = snapshot.manifest | {"checksums": {n: _checksum(t) for n, t in tensors.items()}}
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    text = json.dumps(manifest)
    digest = hashlib.sha256(text.encode()).hexdigest()
    save_file(tensors, str(partial), metadata={MANIFEST_KEY: text, MANIFEST_DIGEST_KEY: digest})
    partial.replace(path)


def load_snapshot(path: str | Path) -> RequestSnapshot:
    """Read and verify a snapshot file: a missing, damaged or truncated file, a file
    without a FlashLoop manifest, another format version or a tensor whose bytes changed
    is a :class:`SnapshotError` that says which."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise SnapshotError(f"no snapshot file at {str(path)!r}")
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        size = path.stat().st_size
        raise SnapshotError(f"{path} is damaged or truncated ({size} bytes): {exc}") from None
    if MANIFEST_KEY not in metadata:
        raise SnapshotError(f"{path} is a safetensors file without a FlashLoop snapshot manifest")
    text = metadata[MANIFEST_KEY]
    if hashlib.sha256(text.encode()).hexdigest() != metadata.get(MANIFEST_DIGEST_KEY):
        raise SnapshotError(f"{path}: the manifest does not match its checksum (damaged)")
    try:
        manifest = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SnapshotError(f"{path}: the snapshot manifest is not JSON ({exc})") from None
    version = manifest.get("format") if isinstance(manifest, dict) else None
    if version != SNAPSHOT_FORMAT:
        raise SnapshotError(
            f"{path} has snapshot format {version!r}; this build reads format {SNAPSHOT_FORMAT}"
        )
    checksums = manifest.get("checksums", {})
    if set(checksums) != set(tensors):
        raise SnapshotError(
            f"{path}: tensors {sorted(set(tensors) ^ set(checksums))} are in the file or "
            "the manifest but not both"
        )
    for name, tensor in tensors.items():
        if _checksum(tensor) != checksums[name]:
            raise SnapshotError(f"{path}: tensor {name!r} does not match its checksum (damaged)")
    return RequestSnapshot(manifest, tensors)


def check_matches(snapshot: RequestSnapshot, identity: dict, geometry: dict) -> None:
    """Refuse a snapshot of another model, backend, configuration, encoding or KV
    geometry than the engine's, naming each field that differs and both values."""
    saved = snapshot.manifest
    wrong = [
        f"{kind} {key}: snapshot {saved.get(kind, {}).get(key)!r}, engine {value!r}"
        for kind, expected in (("identity", identity), ("geometry", geometry))
        for key, value in expected.items()
        if saved.get(kind, {}).get(key) != value
    ]
    if wrong:
        raise SnapshotError("snapshot does not match this engine: " + "; ".join(wrong))


def _ints(value, low: int, high: int) -> bool:
    return isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) and low <= v < high for v in value
    )


def check_request(snapshot: RequestSnapshot, hidden_size: int, loops: int, vocab: int) -> None:
    """Refuse a snapshot whose request fields or tensors do not fit together or this
    model (a :class:`SnapshotError` naming the field), before a restore takes anything."""
    saved = snapshot.manifest.get("request")
    tensors = snapshot.tensors

    def need(ok: bool, what: str) -> None:
        if not ok:
            raise SnapshotError(f"snapshot request {what}")

    need(isinstance(saved, dict), "fields are missing")
    prompt, output = saved.get("prompt"), saved.get("output")
    need(_ints(prompt, 0, vocab) and len(prompt) > 0, f"prompt must be token ids in [0, {vocab})")
    need(_ints(output, 0, vocab) and len(output) > 0, f"output must be token ids in [0, {vocab})")
    exits = saved.get("exit_depths")
    need(
        _ints(exits, 0, loops) and len(exits) == len(output) - 1,
        f"exit_depths must give a depth in [0, {loops}) for each output token but the last",
    )
    need(isinstance(saved.get("params"), dict), "params are missing")
    need(saved.get("forced") is None or _ints(saved["forced"], 0, vocab), "forced is malformed")
    need(isinstance(saved.get("keep_logprobs"), bool), "keep_logprobs must be true or false")
    for name, bound in (("replay", vocab), ("replay_exits", loops)):
        need(saved.get(name) is None or _ints(saved[name], 0, bound), f"{name} is malformed")
    hidden = tensors.get("hidden")
    need(
        hidden is not None and hidden.shape == (hidden_size,) and hidden.is_floating_point(),
        f"tensor 'hidden' must be a float [{hidden_size}]",
    )
    active = tensors.get("prompt_active")
    need(
        active is None or (active.dtype == torch.bool and active.shape == (loops, len(prompt))),
        f"tensor 'prompt_active' must be bool [{loops}, {len(prompt)}]",
    )
    if saved["keep_logprobs"] and "logprobs" in tensors:
        need(tensors["logprobs"].shape == (len(output), vocab), "tensor 'logprobs' is misshaped")
