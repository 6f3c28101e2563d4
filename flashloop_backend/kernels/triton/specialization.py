"""Which kernel arguments Triton may specialize on, and a census of the variants a run needs.

Triton compiles a kernel once per specialization key: every constexpr value, each integer
argument's class (equal to 1, divisible by 16, or neither) and each pointer's 16-byte
alignment. An eager host's batches change shape from step to step (rows finish, spans
grow), so an argument whose class follows the batch (a split count, the row stride of a
[R, H, S] buffer, a slice of per-row lengths) compiles the kernel again for a shape it has
already run. Arguments that only index per-row or per-head metadata gain nothing from
specialization and are left unspecialized here; arguments that address the K/V tiles keep
it, since their alignment lets loads vectorize.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

# pointers read one scalar per row: their alignment never widens a load
SCALAR_PER_ROW = ["lengths_ptr"]
# the paged decode kernel's verification spans, read like the lengths (and the lengths
# themselves stand in for them when there are none)
PAGED_PER_ROW = [*SCALAR_PER_ROW, "spans_ptr"]
# the split count (a mask bound, a loop trip count) and the strides of the [R, H, S] split
# state buffers, which follow it; per kernel, since argument names differ in meaning
MERGE_SPLITS_METADATA = ["num_splits", "stride_mr", "stride_mh", "stride_lr", "stride_sr"]
PAGED_SPLIT_METADATA = ["blocks_per_split", "stride_mr", "stride_mh"]
PACKED_SPLIT_METADATA = ["groups_per_split", "stride_sr", "stride_sh"]
# the strides of the packed readers' level metadata (tables [R, Lv, P], maps [R, Lv, Tp],
# kinds [R, Lv]): they follow the batch's level count and page width (1 where either is)
LEVEL_METADATA = ["stride_lr", "stride_ll", "stride_mr", "stride_ml", "stride_kr"]
# the level an append encodes and the row strides of its page and slot tables (1 where an
# append touches one page): offsets that follow the append, not the tile shapes
APPEND_METADATA = ["level", "stride_st", "stride_pl"]
# the row stride of a batch's block table [R, MB]: MB follows the longest row of an eager
# batch but is the graph capacity's width in a captured step, so its class (1, divisible
# by 16, neither) differs between steps that read the same tiles
BLOCK_TABLE_ROWS = ["stride_tr"]
# the layer a write goes to: an offset, one value per layer of a traversal
LAYER_INDEX = ["layer"]


@contextmanager
def specialization_census() -> Iterator[dict[str, dict[tuple, int]]]:
    """Inside the block, every Triton launch under the interpreter (``TRITON_INTERPRET=1``)
    also records the key the NVIDIA backend's JIT would compile it under: ``{kernel name:
    {key: launches}}``, one key per compiled variant on a GPU."""
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction, create_function_from_signature

    census: dict[str, dict[tuple, int]] = defaultdict(dict)
    binders: dict[int, object] = {}
    interpreted_run = InterpretedFunction.run

    def counting_run(self, *args, grid, warmup, **kwargs):
        if id(self) not in binders:
            jit = JITFunction(self.fn, **self.kwargs)
            binders[id(self)] = create_function_from_signature(
                jit.signature, jit.params, CUDABackend
            )
        _, specialization, _ = binders[id(self)](*args, **kwargs)
        names = list(self.arg_names)
        key = tuple((name, s[0], str(s[1])) for name, s in zip(names, specialization, strict=True))
        seen = census[self.fn.__qualname__]
        seen[key] = seen.get(key, 0) + 1
        return interpreted_run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = counting_run
    try:
        yield census
    finally:
        InterpretedFunction.run = interpreted_run


def varying_arguments(keys: list[tuple]) -> dict[str, list[str]]:
    """The arguments whose specialization differs between ``keys`` (from one kernel)."""
    if not keys:
        return {}
    out = {}
    for i, (name, _, _) in enumerate(keys[0]):
        classes = sorted({f"{k[i][1]}:{k[i][2]}" for k in keys})
        if len(classes) > 1:
            out[name] = classes
    return out
