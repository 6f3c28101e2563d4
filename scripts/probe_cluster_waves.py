"""Whether the cluster source's 8-CTA clusters all fit the GPU at once: the driver's
maximum active clusters at each launch shape, and the source timed at 8 and 16 heads
(a second wave shows as 16 heads taking twice 8's time), with 8 and 4 warps per CTA."""

from __future__ import annotations

import ctypes
import json
import sys

import torch

from flashloop_backend.kernels.cuda import loader
from flashloop_backend.kernels.cuda import packed_source_cluster as cluster
from flashloop_backend.kernels.cuda.packed_source import SourceTuning, packed_dense_source_cuda
from tests.test_cuda_kernels import _packed_rows


class _LaunchConfig(ctypes.Structure):
    _fields_ = [
        *((n, ctypes.c_uint) for n in "gx gy gz bx by bz shared".split()),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.c_void_p),
        ("num_attrs", ctypes.c_uint),
    ]


def max_active_clusters(kernel, heads: int, shared: int) -> int:
    config = _LaunchConfig(8 * heads, 1, 1, cluster.WARPS * 32, 1, 1, shared, None, None, 0)
    count = ctypes.c_int()
    result = loader._driver().cuOccupancyMaxActiveClusters(
        ctypes.byref(count), kernel.function, ctypes.byref(config)
    )
    return count.value if result == 0 else -result


def time_us(fn, repeats: int = 50) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / repeats


def main(context: int) -> dict:
    args, lengths = _packed_rows(2, sparse=False, context=context, batch=1, tail=40)
    bucket = -(-(context + 64) // 10) + 64
    out = {"context": context, "gpu": torch.cuda.get_device_name()}
    for warps in (8, 4):
        cluster.WARPS = warps
        for heads in (16,):
            sub = (args[0][:, :heads].contiguous(), *args[1:])
            for pairs, name in ((1 << 30, "cluster"), (0, "three_launches")):
                tuning = SourceTuning(cluster_pairs=pairs)

                def run(sub=sub, tuning=tuning):
                    return packed_dense_source_cuda(*sub, lengths, 0.1, bucket, tuning=tuning)

                key = f"{name}_warps{warps}_heads{heads}" if pairs else f"{name}_heads{heads}"
                out[key] = round(time_us(run), 1)
            kernels = [
                k
                for m in loader._MODULES.values()
                for n, k in m.items()
                if n == "packed_source_cluster"
            ]
            span = -(-(context + 64) // 64) * 64
            shared = cluster.dynamic_shared(2, 64, 128, -(-span // 512))
            out[f"max_active_clusters_warps{warps}_heads{heads}"] = max_active_clusters(
                kernels[-1], heads, shared
            )
            print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":  # probe_cluster_waves.py OUT.json CONTEXT...
    results = [main(int(c)) for c in sys.argv[2:]]
    with open(sys.argv[1], "w") as f:
        json.dump(results, f, indent=1)
