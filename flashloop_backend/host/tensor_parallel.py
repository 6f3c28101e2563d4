"""Tensor parallelism over heads (RFC §7.4): each rank holds a slice of every layer's
heads and of its MLP, and one all-reduce joins the partial outputs of each attention and
MLP block.

Column-parallel: q/k/v (by head) and gate/up (by intermediate channel); row-parallel:
o_proj and down_proj, whose partial products the all-reduce sums. Embedding, norms, the
exit gate and the LM head stay whole on every rank, so every rank sees the same hidden
state and logits and samples the same tokens. Every FlashLoop state is per head (top-K
keys, packed pages per KV head, loop-2 references), so a rank's backend serves its heads
alone with no extra communication.

Ranks run as spawned processes joined by ``torch.distributed`` (gloo on CPU, NCCL on
GPUs, one GPU per rank).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch

from flashloop_backend.host.config import OuroConfig
from flashloop_backend.host.model import OuroModel

COLUMN_PARALLEL = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
COLUMN_PARALLEL_MLP = ("mlp.gate_proj", "mlp.up_proj")
ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")
# a collective that waits longer than this names the stuck rank instead of hanging
COLLECTIVE_TIMEOUT = timedelta(seconds=300)


@dataclass(frozen=True)
class TensorParallel:
    """This process's place among the ranks that share a model's heads."""

    rank: int
    world_size: int

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside [0, {self.world_size})")

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks in place (every rank gets the same bits)."""
        torch.distributed.all_reduce(tensor)
        return tensor


def shard_reasons(cfg: OuroConfig, world_size: int) -> list[str]:
    """Why ``cfg``'s model cannot split over ``world_size`` ranks (none: it can); each
    reason names the value and the rank counts that would work."""
    if world_size < 1:
        return [f"tensor parallel size {world_size} must be at least 1"]
    reasons = []
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(cfg, name)
        if value % world_size:
            fits = [r for r in range(1, value + 1) if value % r == 0 and r <= 16]
            reasons.append(
                f"{name}={value} does not split over {world_size} ranks "
                f"(rank counts that divide it: {fits})"
            )
    return reasons


def shard_config(cfg: OuroConfig, world_size: int) -> OuroConfig:
    """The config of one rank's slice: its heads and MLP channels."""
    reasons = shard_reasons(cfg, world_size)
    if reasons:
        raise ValueError("; ".join(reasons))
    return dataclasses.replace(
        cfg,
        num_attention_heads=cfg.num_attention_heads // world_size,
        num_key_value_heads=cfg.num_key_value_heads // world_size,
        intermediate_size=cfg.intermediate_size // world_size,
    )


def shard_state(
    cfg: OuroConfig, state: dict[str, torch.Tensor], tp: TensorParallel
) -> dict[str, torch.Tensor]:
    """Rank ``tp.rank``'s slice of a whole checkpoint ``state`` (names as
    :func:`~flashloop_backend.host.loader.expected_shapes`): column-parallel weights keep
    the rank's output rows, row-parallel ones its input columns; the rest is shared."""
    shard_config(cfg, tp.world_size)  # refuses a model that does not split
    out = {}
    for name, tensor in state.items():
        module = name.removesuffix(".weight").split(".", 3)[-1]
        if module in COLUMN_PARALLEL or module in COLUMN_PARALLEL_MLP:
            out[name] = tensor.chunk(tp.world_size, dim=0)[tp.rank].contiguous()
        elif module in ROW_PARALLEL:
            out[name] = tensor.chunk(tp.world_size, dim=1)[tp.rank].contiguous()
        else:
            out[name] = tensor
    return out


def shard_model(model: OuroModel, tp: TensorParallel) -> OuroModel:
    """Rank ``tp.rank``'s slice of a whole in-memory ``model`` (unfused), on its device
    and dtype, joined to the other ranks through ``tp``'s all-reduce."""
    if model.fused:
        raise ValueError("shard the model before fuse_projections (its weights are views)")
    param = next(model.parameters())
    state = shard_state(model.config, dict(model.state_dict()), tp)
    with torch.device("meta"):
        shard = OuroModel(shard_config(model.config, tp.world_size))
    shard.load_state_dict(state, assign=True)
    shard = shard.to(device=param.device, dtype=param.dtype).eval()
    shard.tensor_parallel = tp
    return shard


# ------------------------------------------------------------------ ranks as processes
def _rank_entry(rank, world_size, init_method, backend, target, args, errors) -> None:
    tp = TensorParallel(rank, world_size)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    else:  # ranks share the CPU: more threads than cores make every rank wait on spinning
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    torch.distributed.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    try:
        code = target(tp, *args)
    except BaseException as exc:  # the parent reports it and stops the other ranks
        errors.put((rank, f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        torch.distributed.destroy_process_group()
    # leave without the interpreter's teardown: the process group's transport threads may
    # still be alive there, and destroying them aborts a rank that has already succeeded
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def run_ranks(world_size: int, target: Callable[..., int], args: tuple, device: str) -> int:
    """Run ``target(tp, *args)`` in ``world_size`` spawned processes joined by gloo (CPU) or
    NCCL (``device == "cuda"``, GPU i for rank i); returns the first non-zero exit code
    (0 if every rank succeeded). A rank that fails stops the others at once, its error
    printed with its rank, rather than leaving them waiting in a collective."""
    backend = "nccl" if device == "cuda" else "gloo"
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(
            f"--tp {world_size} on cuda needs {world_size} GPUs; this machine has "
            f"{torch.cuda.device_count()}"
        )
    context = multiprocessing.get_context("spawn")
    errors = context.SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="flashloop-tp-") as scratch:
        init_method = Path(scratch, "rendezvous").as_uri()
        processes = [
            context.Process(
                target=_rank_entry,
                args=(rank, world_size, init_method, backend, target, args, errors),
                daemon=False,
            )
            for rank in range(world_size)
        ]
        for process in processes:
            process.start()
        code = _wait(processes)
    while not errors.empty():
        rank, message = errors.get()
        print(f"tensor parallel rank {rank} failed: {message}", file=sys.stderr)
    return code


def _wait(processes: list) -> int:
    while True:
        codes = [p.exitcode for p in processes]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            for process in processes:
                if process.exitcode is None:
                    process.terminate()
            for process in processes:
                process.join()
            return failed[0]
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.05)
