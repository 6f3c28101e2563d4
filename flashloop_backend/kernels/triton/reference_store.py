"""Wrapper of the reference-store write (``reference_store_jit.py``): a step's loop-2
references into their slots in one launch, where indexing writes take one per field."""

from __future__ import annotations

import torch

from flashloop_backend.kernels.triton.paged_decode import next_pow2

BLOCK_K_MAX = 1024


def store_reference_triton(
    state: tuple[torch.Tensor, ...],
    layer: int,
    slot: torch.Tensor,
    incarnation: torch.Tensor,
    indices: torch.Tensor,
    mass: torch.Tensor,
    output: torch.Tensor,
    contribution: torch.Tensor,
) -> None:
    """Write row r's references at ``layer`` into slot ``slot[r]`` of ``state`` = (indices
    [L, S+1, H, Kb] int32, mass [L, S+1, H] FP32, output and contribution [L, S+1, H, D]
    FP32, incarnation [S+1, L] int64; unit stride on their last axis): ``indices`` [N, H,
    W] int32 (W <= Kb; -1 fills the rest), ``mass`` [N, H] FP32, ``output`` and
    ``contribution`` [N, H, D] FP32, ``incarnation`` [N] int64 recorded at [slot, layer].
    ``slot`` [N] int64. Rows sharing a slot (the scratch slot) leave one of theirs."""
    from flashloop_backend.kernels.triton.reference_store_jit import store_reference_kernel

    state_indices, state_mass, state_output, state_contribution, state_incarnation = state
    rows, heads, width = indices.shape
    bucket, head_dim = state_indices.shape[-1], state_output.shape[-1]
    if width > bucket:
        raise ValueError(f"{width} selected keys exceed the state's bucket of {bucket}")
    if indices.dtype != torch.int32:
        raise ValueError(f"indices dtype {indices.dtype}: expected torch.int32")
    fields = {"mass": mass, "output": output, "contribution": contribution}
    for name, tensor in fields.items():
        if tensor.dtype != torch.float32:
            raise ValueError(f"{name} dtype {tensor.dtype}: expected torch.float32")
    expected = {"mass": (rows, heads), "output": (rows, heads, head_dim)}
    expected["contribution"] = expected["output"]
    for name, shape in expected.items():
        if tuple(fields[name].shape) != shape:
            raise ValueError(f"{name} shape {tuple(fields[name].shape)}: expected {shape}")
    tensors = (indices, mass, output, contribution, *state)
    if any(t.stride(-1) != 1 for t in tensors):
        raise ValueError("references and state need unit stride on their last axis")
    if rows == 0:
        return
    store_reference_kernel[(rows, heads)](
        slot,
        incarnation,
        indices,
        mass,
        output,
        contribution,
        state_indices,
        state_mass,
        state_output,
        state_contribution,
        state_incarnation,
        layer,
        width,
        bucket,
        indices.stride(0),
        indices.stride(1),
        mass.stride(0),
        output.stride(0),
        output.stride(1),
        contribution.stride(0),
        contribution.stride(1),
        state_indices.stride(0),
        state_indices.stride(1),
        state_indices.stride(2),
        state_mass.stride(0),
        state_mass.stride(1),
        state_output.stride(0),
        state_output.stride(1),
        state_output.stride(2),
        state_incarnation.stride(0),
        head_dim,
        BLOCK_K=min(BLOCK_K_MAX, max(16, next_pow2(bucket))),
        HEAD_PAD=max(16, next_pow2(head_dim)),
    )
