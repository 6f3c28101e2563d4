"""CUDA C++ kernels built on first use: NVRTC compiles a source for the device's
architecture, the driver loads the cubin, and kernels launch on torch's current stream
(so CUDA graphs capture them). Only ctypes and the libraries a CUDA build of torch
already loads (the driver and NVRTC) are needed: no compiler on the host, no extension
build. ``unavailable()`` says why a machine cannot build them."""

from __future__ import annotations

import ctypes
import functools
import glob
import hashlib
import os
import re
import time
from importlib import resources

import torch

NVRTC_SUCCESS = 0
CUDA_SUCCESS = 0
# cuFuncSetAttribute: CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
MAX_DYNAMIC_SHARED = 8


class CudaBuildError(RuntimeError):
    """NVRTC refused a source (the message holds its log) or the driver refused a cubin."""


@functools.cache
def _nvrtc() -> ctypes.CDLL:
    try:  # the library torch itself loads
        from torch.cuda._utils import _get_gpu_rtc_library

        return _get_gpu_rtc_library()
    except Exception:  # any failure: search the usual places
        pass
    roots = [os.path.dirname(torch.__file__), *__import__("site").getsitepackages()]
    for root in roots:
        for found in sorted(glob.glob(os.path.join(root, "**", "libnvrtc.so*"), recursive=True)):
            if "builtins" not in found:
                return ctypes.CDLL(found)
    return ctypes.CDLL("libnvrtc.so")


@functools.cache
def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def unavailable() -> str | None:
    """Why CUDA C++ kernels cannot be built and run here (None: they can)."""
    if not torch.cuda.is_available() or torch.version.cuda is None:
        return "no CUDA device (the CUDA C++ kernels build with NVRTC for a CUDA GPU)"
    try:
        _nvrtc()
        _driver()
    except OSError as exc:
        return f"NVRTC or the CUDA driver library cannot be loaded: {exc}"
    major, _ = torch.cuda.get_device_capability()
    if major < 8:
        return f"compute capability {major}.x: the CUDA C++ kernels need 8.0 or newer"
    return None


def _check_driver(result: int, what: str) -> None:
    if result != CUDA_SUCCESS:
        name = ctypes.c_char_p()
        _driver().cuGetErrorString(result, ctypes.byref(name))
        raise CudaBuildError(f"{what}: CUDA error {result} ({(name.value or b'?').decode()})")


def compile_cubin(source: str, name: str, arch: str, options: tuple[str, ...] = ()) -> bytes:
    """The cubin NVRTC builds from ``source`` for ``arch`` (e.g. ``sm_90a``)."""
    lib = _nvrtc()
    program = ctypes.c_void_p()
    code = lib.nvrtcCreateProgram(
        ctypes.byref(program), source.encode(), f"{name}.cu".encode(), 0, None, None
    )
    if code != NVRTC_SUCCESS:
        raise CudaBuildError(f"nvrtcCreateProgram failed with {code}")
    flags = [f"--gpu-architecture={arch}", "--std=c++17", "-default-device", *options]
    array = (ctypes.c_char_p * len(flags))(*(f.encode() for f in flags))
    try:
        result = lib.nvrtcCompileProgram(program, len(flags), array)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(program, log)
        if result != NVRTC_SUCCESS:
            raise CudaBuildError(f"NVRTC could not build {name} for {arch}:\n{log.value.decode()}")
        lib.nvrtcGetCUBINSize(program, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        if lib.nvrtcGetCUBIN(program, cubin) != NVRTC_SUCCESS:
            raise CudaBuildError(f"NVRTC built {name} but gave no cubin for {arch}")
        return cubin.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(program))


class CudaKernel:
    """One ``extern "C"`` kernel of a loaded module. Call it with ctypes values in the
    kernel's parameter order (``ctypes.c_void_p(tensor.data_ptr())``, ``c_int``,
    ``c_int64``, ``c_float``)."""

    def __init__(self, function: ctypes.c_void_p, name: str) -> None:
        self.function, self.name = function, name
        self.dynamic_shared = 0
        self.resident: dict[tuple[int, int], int] = {}  # (threads, shared) -> CTAs per SM

    def allow_shared(self, nbytes: int) -> None:
        """Let launches use ``nbytes`` of dynamic shared memory (above 48 KB needs it)."""
        if nbytes > self.dynamic_shared:
            result = _driver().cuFuncSetAttribute(self.function, MAX_DYNAMIC_SHARED, nbytes)
            _check_driver(result, f"{self.name}: {nbytes} B of shared memory")
            self.dynamic_shared = nbytes

    def resident_ctas(self, threads: int, shared: int) -> int:
        """CTAs of ``threads`` threads and ``shared`` dynamic bytes one SM holds at once
        (the driver's occupancy calculator: registers, shared memory, thread slots)."""
        key = (threads, shared)
        if key not in self.resident:
            count = ctypes.c_int(0)
            result = _driver().cuOccupancyMaxActiveBlocksPerMultiprocessor(
                ctypes.byref(count), self.function, threads, ctypes.c_size_t(shared)
            )
            _check_driver(result, f"occupancy of {self.name}")
            self.resident[key] = count.value
        return self.resident[key]

    def __call__(self, grid, block, args: list, shared: int = 0) -> None:
        pointers = (ctypes.c_void_p * len(args))(
            *(ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args)
        )
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        result = _driver().cuLaunchKernel(
            self.function, *grid, *block, shared, stream, pointers, None
        )
        _check_driver(result, f"launch of {self.name}")


_MODULES: dict[tuple[str, str, int], dict[str, CudaKernel]] = {}
BUILD_SECONDS: dict[str, float] = {}  # source name -> seconds its build took (diagnostics)


def build(source: str, name: str, kernels: tuple[str, ...]) -> dict[str, CudaKernel]:
    """The named ``extern "C"`` kernels of ``source``, built for the current device once
    per process and device (a module loads into one device's context; cached by the
    source's hash)."""
    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}{'a' if major == 9 else ''}"
    key = (hashlib.sha256(source.encode()).hexdigest(), arch, torch.cuda.current_device())
    if key not in _MODULES:
        start = time.perf_counter()
        cubin = compile_cubin(source, name, arch)
        torch.cuda.init()
        torch.cuda.current_stream()  # the primary context is current on this thread
        module = ctypes.c_void_p()
        _check_driver(_driver().cuModuleLoadData(ctypes.byref(module), cubin), f"load {name}")
        loaded = {}
        for kernel in kernels:
            function = ctypes.c_void_p()
            result = _driver().cuModuleGetFunction(ctypes.byref(function), module, kernel.encode())
            _check_driver(result, f"{name}: kernel {kernel}")
            loaded[kernel] = CudaKernel(function, kernel)
        _MODULES[key] = loaded
        BUILD_SECONDS[name] = time.perf_counter() - start
    return _MODULES[key]


def build_file(
    name: str, defines: dict[str, int], shared: int = 0, kernel: str | None = None
) -> CudaKernel:
    """Kernel ``kernel`` (default ``name``) of this folder's ``name``.cu with ``defines``
    prepended (its ``#include "*.cuh"`` lines inlined once each: NVRTC then needs no
    include path), allowed ``shared`` bytes of dynamic shared memory; built once per
    process, device and variant."""
    return _build_file(
        name, kernel or name, tuple(sorted(defines.items())), shared, torch.cuda.current_device()
    )


_INCLUDE = re.compile(r'^#include "([\w.]+)"[ \t]*$', re.MULTILINE)


def inline_includes(name: str, seen: set[str]) -> str:
    """This folder's file ``name`` with its ``#include "x.cuh"`` lines replaced by those
    files' text, each file once (``seen``: the files already inlined)."""
    seen.add(name)
    text = resources.files("flashloop_backend.kernels.cuda").joinpath(name).read_text()

    def include(match: re.Match) -> str:
        found = match.group(1)
        return "" if found in seen else inline_includes(found, seen)

    return _INCLUDE.sub(include, text)


@functools.cache
def _build_file(
    name: str, kernel: str, defines: tuple[tuple[str, int], ...], shared: int, device: int
) -> CudaKernel:
    # ``device`` only keys the cache: ``build`` loads into the current device's context
    defines = dict(defines)
    header = "".join(f"#define {key} {value}\n" for key, value in defines.items())
    body = inline_includes(f"{name}.cu", set())
    label = name if kernel == name else f"{name}.{kernel}"
    built = build(header + body, label, (kernel,))[kernel]
    if shared:
        built.allow_shared(shared)
    return built
