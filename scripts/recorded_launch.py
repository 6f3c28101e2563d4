"""A Triton kernel launch as a wrapper really makes it, recorded on the CPU and compiled
for sm_90a offline: the wrapper runs on CPU tensors of Ouro-1.4B's shapes with every
kernel of the given modules replaced by a recorder, and the recorded launch is compiled
with the specialization Triton's JIT gives it at run time (ints of value 1 as constants,
divisibility-by-16 hints on ints and tensor addresses; without them loads do not
vectorize and instruction and register counts are not the ones the GPU runs)."""

from __future__ import annotations

import os

os.environ.pop("TRITON_INTERPRET", None)

import torch
import triton
from compile_sm90 import TARGET
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend
from triton.compiler import ASTSource


def compile_launch(fn, args: tuple, kwargs: dict):
    """``fn`` compiled for sm_90a as the JIT specializes it for ``args`` / ``kwargs``."""
    kwargs = dict(kwargs)
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "maxnreg") if k in kwargs}
    signature, constexprs, attrs = {}, dict(kwargs), {}
    for index, (name, value) in enumerate(zip(fn.arg_names, args, strict=False)):
        kind, spec = native_specialize_impl(BaseBackend, value, False, True, True)
        if kind == "constexpr":
            constexprs[name] = spec
        elif spec == "D":
            attrs[(index,)] = [["tt.divisibility", 16]]
        signature[name] = kind
    for name in kwargs:
        signature[name] = "constexpr"
    source = ASTSource(fn, signature, constexprs, attrs)
    return triton.compile(source, target=TARGET, options=options)


class Launches:
    """Stands in for every Triton kernel of ``modules`` while a wrapper runs: records each
    launch's (kernel, args, kwargs) instead of running it (no GPU here)."""

    def __init__(self, *modules) -> None:
        self.modules, self.calls, self._saved = modules, [], []

    def __enter__(self) -> Launches:
        for module in self.modules:
            for name in dir(module):
                kernel = getattr(module, name)
                if isinstance(kernel, triton.runtime.jit.JITFunction):
                    self._saved.append((module, name, kernel))
                    setattr(module, name, _Recorder(kernel, self.calls))
        return self

    def __exit__(self, *exc) -> None:
        for module, name, kernel in self._saved:
            setattr(module, name, kernel)

    def first(self, kernel) -> tuple[tuple, dict]:
        """The first recorded launch of ``kernel``: (args, kwargs)."""
        return next((a, k) for fn, a, k in self.calls if fn is kernel)


class _Recorder:
    def __init__(self, kernel, calls: list) -> None:
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((self.kernel, args, dict(kwargs)))


def ouro_caches(context: int, rows: int):
    """q [rows, 16, 128] and Ouro-1.4B's BF16 cache views of layer 1 (24 layers, 16 heads x
    128, blocks of 16), block tables and lengths for ``rows`` rows of ``context`` tokens."""
    blocks = context // 16
    pool = torch.zeros(2 * rows * blocks + 1, 24, 16, 16, 128, dtype=torch.bfloat16)
    tables = torch.arange(rows * blocks, dtype=torch.int32).reshape(rows, blocks)
    lengths = torch.full((rows,), context, dtype=torch.int32)
    q = torch.zeros(rows, 16, 128, dtype=torch.bfloat16)
    return q, pool[:, 1], pool[:, 1], tables, lengths


def packed_launch(levels: int, context: int = 8192, half_products: bool = True):
    """(kernel, args, kwargs) of the packed reader's launch for one row whose whole
    ``context`` is packed at ``levels`` dense levels, metadata at a graph step's widths,
    with its PTX paths as on a GPU."""
    import flashloop_backend.kernels.triton.packed_decode_jit as jit
    import flashloop_backend.kernels.triton.paged_decode_jit as paged_jit
    from flashloop_backend.kernels.triton.packed_decode import PackedTuning, packed_decode_triton
    from flashloop_backend.kv.levels import LevelKind, LevelMetadata
    from flashloop_backend.kv.store import PackedKVStore

    store = PackedKVStore(4, 24, 16, 128, 64)
    q, key_cache, value_cache, tables, lengths = ouro_caches(context, 1)
    pages = context // 64
    meta = LevelMetadata(
        torch.arange(levels * pages, dtype=torch.int32).reshape(1, levels, pages) % 4,
        torch.full((1, levels, context), -1, dtype=torch.int32),
        torch.full((1, levels), int(LevelKind.DENSE), dtype=torch.int32),
        torch.full((1,), context, dtype=torch.int32),
        levels,  # every level dense: no compact path
    )
    tuning = PackedTuning(half_products=half_products)
    with Launches(jit, paged_jit) as launches:
        packed_decode_triton(
            q, store, 1, meta, key_cache, value_cache, tables, lengths, tuning=tuning
        )
    args, kwargs = launches.first(jit.packed_decode_split_kernel)
    return jit.packed_decode_split_kernel, args, {**kwargs, "ASM": True}
