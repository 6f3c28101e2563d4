"""Prefill/decode handoff over NIXL (RFC §6.5, docs/pd_handoff.md): a producer engine (P)
exports a request at a token boundary as its snapshot's tensors registered with a NIXL
agent and a versioned descriptor; a consumer engine (D) checks the descriptor against
itself, reserves and registers destination buffers, READs every range from P, and only
then restores the request. Serialization is the snapshot's (``Engine.snapshot`` /
``Engine.restore``); this module moves its tensors."""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass, field

import torch

from flashloop_backend.host.pd_descriptor import (
    DTYPES,
    PD_FORMAT,
    HandoffDescriptor,
    HandoffError,
    TensorEntry,
    check_descriptor,
    handoff_record,
    tensor_digest,
)
from flashloop_backend.host.snapshot import RequestSnapshot

__all__ = [
    "Consumer",
    "HandoffDescriptor",
    "HandoffError",
    "Producer",
    "Transfer",
    "handoff_record",
    "nixl_agent",
]

NIXL_INSTALL = 'pip install --no-deps "nixl==1.5.1" "nixl-cu13==1.5.1"'


def nixl_agent(name: str):
    """A NIXL agent with the UCX backend (progress thread on, metadata exchanged by hand);
    a missing ``nixl`` package is an ImportError naming the install command."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL logs INFO to stdout otherwise
    try:
        from nixl._api import nixl_agent as agent_class
        from nixl._api import nixl_agent_config
    except ImportError as exc:
        raise ImportError(f"PD handoff needs the nixl package ({exc}); {NIXL_INSTALL}") from None
    config = nixl_agent_config(enable_prog_thread=True, enable_listen_thread=False, backends=[])
    agent = agent_class(name, config)
    agent.create_backend("UCX", {})
    return agent


def _memory(tensor: torch.Tensor) -> tuple[str, int]:
    """NIXL memory kind and device id of a tensor: host memory or its GPU's."""
    return ("VRAM", tensor.device.index or 0) if tensor.is_cuda else ("DRAM", 0)


def _register(agent, tensors: list[torch.Tensor]) -> list:
    """One NIXL registration per memory kind over the non-empty tensors."""
    import numpy as np

    kinds: dict[str, list] = {}
    for t in tensors:
        if t.nbytes:
            kind, dev = _memory(t)
            kinds.setdefault(kind, []).append((t.data_ptr(), t.nbytes, dev))
    return [agent.register_memory(np.array(r, dtype=np.uint64), k) for k, r in kinds.items()]


@dataclass
class _Export:
    descriptor: HandoffDescriptor
    tensors: dict[str, torch.Tensor]  # P's registered host copies, alive until released
    registrations: list


class Producer:
    """P's side: exports requests and keeps each export (its registered copies) until D
    acknowledges (``ack:<generation>``) or cancels (``cancel:<generation>``), or P
    cancels. Snapshot tensors are copies, so P's later steps and tail flushes never reach
    an export in flight."""

    def __init__(self, agent) -> None:
        self.agent, self.exports, self.timings = agent, {}, {}
        self.peers: list[str] = []

    def connect(self, metadata: bytes) -> str:
        """Load a consumer's agent metadata so P can tell it of a cancellation."""
        name = self.agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else name
        self.peers.append(name)
        return name

    def export(self, engine, request_id: int) -> HandoffDescriptor:
        """Snapshot the request (at a token boundary), register every tensor, describe it."""
        start = time.perf_counter()
        snapshot = engine.snapshot(request_id)
        tensors = {n: t.contiguous() for n, t in snapshot.tensors.items()}
        registrations = _register(self.agent, list(tensors.values()))
        entries = tuple(
            TensorEntry(
                n,
                str(t.dtype).removeprefix("torch."),
                tuple(t.shape),
                t.nbytes,
                t.data_ptr(),
                *_memory(t),
                tensor_digest(t),
            )
            for n, t in tensors.items()
        )
        metadata = self.agent.get_agent_metadata()
        generation = uuid.uuid4().hex[:16]
        manifest = json.loads(json.dumps(snapshot.manifest))  # portable, P's own copy
        descriptor = HandoffDescriptor(
            PD_FORMAT, generation, manifest, entries, self.agent.name, metadata
        )
        self.exports[descriptor.generation] = _Export(descriptor, tensors, registrations)
        self.timings[descriptor.generation] = {"export_s": time.perf_counter() - start}
        return descriptor

    def poll(self) -> dict[str, str]:
        """Release every export D acknowledged or cancelled; returns {generation: 'ack' or
        'cancel'} for those seen now (late messages for released exports are ignored)."""
        seen = {}
        for messages in self.agent.get_new_notifs().values():
            for message in messages:
                kind, _, generation = message.decode(errors="replace").partition(":")
                if kind in ("ack", "cancel") and generation in self.exports:
                    self._release(generation)
                    seen[generation] = kind
        return seen

    def settle(self, generation: str, timeout_s: float = 10.0) -> str:
        """Wait until D acknowledged or cancelled the export (then released): 'ack' or
        'cancel'; a :class:`HandoffError` after ``timeout_s`` (the export stays held)."""
        deadline = time.perf_counter() + timeout_s
        while generation in self.exports:
            seen = self.poll().get(generation)
            if seen is not None:
                return seen
            if time.perf_counter() > deadline:
                raise HandoffError(f"export {generation}: no ack or cancel in {timeout_s} s")
            time.sleep(0.001)
        return "released"

    def cancel(self, generation: str) -> None:
        """Withdraw an export: tell D (which then never activates it) and release it."""
        if generation in self.exports:
            for peer in self.peers:  # the generation names the export; other Ds ignore it
                self.agent.send_notif(peer, f"cancel:{generation}".encode())
            self._release(generation)

    def _release(self, generation: str) -> None:
        # deregister only after ack or cancel: NIXL over UCX still serves a READ of
        # deregistered memory, so D's digests are what refuse a late read of reused bytes
        export = self.exports.pop(generation)
        for registration in export.registrations:
            self.agent.deregister_memory(registration)

    def close(self) -> None:
        for generation in list(self.exports):
            self._release(generation)
        for peer in self.peers:
            self.agent.remove_remote_agent(peer)
        self.peers.clear()


def _release_handle(agent, handle) -> None:
    """Release a transfer handle; a backend that keeps an in-flight handle is waited out
    first, so a destination buffer is never freed under a live write."""
    try:
        agent.release_xfer_handle(handle)
    except Exception:  # nixl raises its binding's own types here
        while agent.check_xfer_state(handle) == "PROC":
            time.sleep(0.001)
        agent.release_xfer_handle(handle)


class Consumer:
    """D's side: one NIXL agent and one engine; :meth:`receive` runs a whole handoff,
    :meth:`begin` returns its :class:`Transfer` for step-by-step use."""

    def __init__(self, agent, engine) -> None:
        self.agent, self.engine = agent, engine
        self.peers: dict[str, tuple[str, bytes]] = {}  # P's name: (agent name, metadata)
        self.withdrawn: set[str] = set()
        self.timings: dict[str, dict[str, float]] = {}

    def begin(self, descriptor: HandoffDescriptor, max_new_tokens: int | None = None) -> Transfer:
        """Check the descriptor, then reserve and register a destination for every range."""
        start = time.perf_counter()
        check_descriptor(self.engine, descriptor, max_new_tokens)
        return Transfer(self, descriptor, max_new_tokens, time.perf_counter() - start)

    def receive(
        self,
        descriptor: HandoffDescriptor,
        max_new_tokens: int | None = None,
        timeout_s: float = 60.0,
    ) -> int:
        """Check, reserve, READ every range, wait (``timeout_s``), activate; the restored
        request's id. Any failure leaves nothing registered, reserved or active."""
        transfer = self.begin(descriptor, max_new_tokens)
        transfer.start()
        transfer.wait(timeout_s)
        return transfer.activate()

    def peer(self, descriptor: HandoffDescriptor) -> str:
        """P's agent name, its metadata (re)loaded: each export registers new memory, so
        the metadata of an earlier descriptor does not describe this one's ranges."""
        if self.peers.get(descriptor.agent, (None, b""))[1] != descriptor.agent_metadata:
            name = self.agent.add_remote_agent(descriptor.agent_metadata)
            name = name.decode() if isinstance(name, bytes) else name
            self.peers[descriptor.agent] = (name, descriptor.agent_metadata)
        return self.peers[descriptor.agent][0]

    def poll(self) -> None:
        """Note P's cancellations (``cancel:<generation>``)."""
        for messages in self.agent.get_new_notifs().values():
            for message in messages:
                kind, _, generation = message.decode(errors="replace").partition(":")
                if kind == "cancel":
                    self.withdrawn.add(generation)

    def close(self) -> None:
        for name, _ in self.peers.values():
            self.agent.remove_remote_agent(name)
        self.peers.clear()


@dataclass
class Transfer:
    """One handoff on D: destination tensors ([shape] of each table entry, host memory:
    ``Engine.restore`` takes host tensors) registered with D's agent, READ handles, the
    ranges received, timings. States: reserved, reading, received, active, cancelled."""

    consumer: Consumer
    descriptor: HandoffDescriptor
    max_new_tokens: int | None
    check_s: float
    state: str = "reserved"
    received: set[str] = field(default_factory=set)
    timings: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        start = time.perf_counter()
        self.timings["check_s"] = self.check_s
        self.consumer.timings[self.descriptor.generation] = self.timings
        self.tensors = {
            e.name: torch.empty(e.shape, dtype=DTYPES[e.dtype]) for e in self.descriptor.tensors
        }
        self.received = {e.name for e in self.descriptor.tensors if not e.nbytes}
        self.registrations = _register(self.consumer.agent, list(self.tensors.values()))
        self.handles: list[tuple[object, list[str]]] = []
        self.timings["reserve_s"] = time.perf_counter() - start

    def start(self, names: set[str] | None = None) -> None:
        """Post READs of every range (or of ``names`` only), one per pair of memory kinds."""
        self._started = time.perf_counter()
        agent, generation = self.consumer.agent, self.descriptor.generation
        try:
            peer = self.consumer.peer(self.descriptor)
            groups: dict[tuple[str, str], list] = {}
            for e in self.descriptor.tensors:
                if e.nbytes and (names is None or e.name in names):
                    dst = self.tensors[e.name]
                    local = (dst.data_ptr(), e.nbytes, _memory(dst)[1])
                    groups.setdefault((_memory(dst)[0], e.memory), []).append(
                        (e.name, local, (e.addr, e.nbytes, e.device))
                    )
            for (local_kind, remote_kind), rows in groups.items():
                handle = agent.initialize_xfer(
                    "READ",
                    agent.get_xfer_descs([r[1] for r in rows], local_kind),
                    agent.get_xfer_descs([r[2] for r in rows], remote_kind),
                    peer,
                    f"read:{generation}".encode(),
                )
                self.handles.append((handle, [r[0] for r in rows]))
                if agent.transfer(handle) == "ERR":
                    raise HandoffError(f"transfer {generation}: posting a READ failed")
            self.state = "reading"
        except BaseException:
            self.cancel()
            raise

    def wait(self, timeout_s: float) -> None:
        """Poll until every posted READ is DONE; ERR, a timeout or P's cancellation
        cancels the transfer and raises :class:`HandoffError`."""
        agent, generation = self.consumer.agent, self.descriptor.generation
        deadline = time.perf_counter() + timeout_s
        try:
            while True:
                pending = []
                for handle, names in self.handles:
                    state = agent.check_xfer_state(handle)
                    if state == "ERR":
                        raise HandoffError(f"transfer {generation}: a READ of {names} failed")
                    if state == "DONE":
                        self.received.update(names)
                    else:
                        pending.append(names)
                self.consumer.poll()
                if generation in self.consumer.withdrawn:
                    raise HandoffError(f"transfer {generation}: the producer cancelled it")
                if not pending:
                    break
                if time.perf_counter() > deadline:
                    raise HandoffError(
                        f"transfer {generation}: {pending} not done in {timeout_s} s"
                    )
                time.sleep(0.0005)
            self.timings["transfer_s"] = time.perf_counter() - self._started
            self.state = "received"
        except BaseException:
            self.cancel()
            raise

    def activate(self) -> int:
        """Restore the request once every range has arrived and matches its digest, tell P
        (``ack:<generation>``) and release the transfer; the new request id."""
        generation = self.descriptor.generation
        try:
            missing = sorted({e.name for e in self.descriptor.tensors} - self.received)
            if self.state != "received" or missing:
                raise HandoffError(
                    f"transfer {generation} is {self.state}; ranges not received: {missing}"
                )
            self.consumer.poll()
            if generation in self.consumer.withdrawn:
                raise HandoffError(f"transfer {generation}: the producer cancelled it")
            start = time.perf_counter()
            for e in self.descriptor.tensors:  # a READ of released or reused memory shows here
                if tensor_digest(self.tensors[e.name]) != e.sha256:
                    raise HandoffError(f"transfer {generation}: tensor {e.name!r} arrived changed")
            self.timings["verify_s"] = time.perf_counter() - start
            start = time.perf_counter()
            snapshot = RequestSnapshot(self.descriptor.manifest, dict(self.tensors))
            request_id = self.consumer.engine.restore(snapshot, self.max_new_tokens)
            self.timings["activate_s"] = time.perf_counter() - start
        except BaseException:
            self.cancel()
            raise
        self.consumer.agent.send_notif(
            self.consumer.peer(self.descriptor), f"ack:{generation}".encode()
        )
        self._release()
        self.state = "active"
        return request_id

    def cancel(self) -> None:
        """Stop reading, release handles and registrations, tell P (``cancel:<generation>``).
        Idempotent; an active request stays (the handoff is over)."""
        if self.state in ("active", "cancelled"):
            return
        self._release()
        self.state = "cancelled"
        peer = self.consumer.peers.get(self.descriptor.agent)
        if peer is not None:
            self.consumer.agent.send_notif(peer[0], f"cancel:{self.descriptor.generation}".encode())

    def _release(self) -> None:
        for handle, _ in self.handles:
            _release_handle(self.consumer.agent, handle)
        for registration in self.registrations:
            self.consumer.agent.deregister_memory(registration)
        self.handles, self.registrations, self.tensors = [], [], {}
