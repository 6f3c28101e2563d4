"""The packed sparse-op benchmark case runs end to end on CPU (interpreter, tiny shapes,
a stand-in timer): a device call should not be the first run of its code."""

import pytest
import torch

from flashloop_backend.kernels.triton.dense_source import SelectTuning
from flashloop_backend.tools.bench import packed as bench_packed


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU smoke run; the GPU runs the bench")
def test_sparse_ops_case_times_every_op_and_launch(monkeypatch):
    monkeypatch.setattr(bench_packed, "HEADS", 2)
    monkeypatch.setattr(bench_packed, "HEAD_DIM", 32)
    monkeypatch.setattr(bench_packed, "GROUP", 16)
    calls = []

    def timer(fn):
        calls.append(fn())
        return 0.5

    small = SelectTuning(sample=16, candidates=16, block=16, compact_block=16, chunk_min=16)
    record = bench_packed.sparse_ops_case(64, 2, torch.Generator().manual_seed(0), lambda m: None,
                                          1.0, timer=timer, select=small, launches=[(32, 4, 512), (16, 1, 64)])  # fmt: skip
    names = [f"{levels}_{op}_{launch}" for levels in ("dense_levels", "token_sparse")
             for launch in ("block32_w4_p512", "block16_w1_p64", "v_by_channel", "v_rows")
             for op in ("source_depth2", "correction_depth3", "correction_depth4")]  # fmt: skip
    names += [f"{levels}_correction_depth{d}_streamed" for levels in ("dense_levels", "token_sparse") for d in (3, 4)]  # fmt: skip
    names += [f"{levels}_plain_read_depth2" for levels in ("dense_levels", "token_sparse")]
    assert sorted(record["ops"]) == sorted(names)
    streamed = {
        k: e.pop("max_abs_vs_gather") for k, e in record["ops"].items() if k.endswith("streamed")
    }
    assert len(streamed) == 4 and max(streamed.values()) < 1e-2  # bf16 outputs of the two designs
    assert all(entry == {"ms": 0.5, "vs_dense_decode": 0.5} for entry in record["ops"].values())
    assert record["key_bucket"] == 16 and len(calls) == len(names)
    correction = calls[1]  # the streamed correction: [R, Hq, D] in q's dtype, finite
    assert correction.shape == (2, 2, 32) and torch.isfinite(correction.float()).all()


def test_unknown_parts_are_refused_by_name_before_the_gpu():
    from flashloop_backend.config import ConfigError

    with pytest.raises(
        ConfigError, match=r"parts \['select'\] are not among \['decode', 'sparse_ops'\]"
    ):
        bench_packed.bench_packed_kv([1024], [1], parts=("sparse_ops", "select"))
