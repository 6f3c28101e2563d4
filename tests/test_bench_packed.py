"""The packed sparse-op benchmark case runs end to end on CPU (interpreter, tiny shapes,
a stand-in timer): a device call should not be the first run of its code."""

import pytest
import torch

from flashloop_backend.kernels.triton.dense_source import SelectTuning
from flashloop_backend.tools.bench import packed as bench_packed
from flashloop_backend.tools.bench import packed_rows, packed_sparse


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU smoke run; the GPU runs the bench")
def test_sparse_ops_case_times_every_op_and_launch(monkeypatch):
    for module in (packed_rows, packed_sparse):
        monkeypatch.setattr(module, "HEADS", 2)
        monkeypatch.setattr(module, "GROUP", 16)
    monkeypatch.setattr(packed_rows, "HEAD_DIM", 32)
    calls = []

    def timer(fn):
        calls.append(fn())
        return 0.5

    small = SelectTuning(sample=16, candidates=16, block=16, compact_block=16, chunk_min=16)
    dense = {"ms": 1.0, "tb_s": 1.0}
    record = packed_sparse.sparse_ops_case(64, 2, torch.Generator().manual_seed(0), lambda m: None,
                                          dense, timer=timer, select=small)  # fmt: skip
    names = [f"{levels}_{op}" for levels in ("dense_levels", "token_sparse")
             for op in ("plain_read_depth2", "source_depth2", "correction_depth3",
                        "correction_depth4")]  # fmt: skip
    assert sorted(record["ops"]) == sorted(names)
    for entry in record["ops"].values():
        assert entry["ms"] == 0.5 and entry["vs_dense_decode"] == 0.5 and entry["bytes"] > 0
        assert entry["tb_s"] == entry["bytes"] / 0.5e-3 / 1e12
    ops = record["ops"]
    # the correction reads fewer bytes than the whole two-level read; a deeper level more
    assert (
        ops["dense_levels_correction_depth3"]["bytes"]
        < ops["dense_levels_plain_read_depth2"]["bytes"]
    )
    assert (
        ops["dense_levels_correction_depth4"]["bytes"]
        > ops["dense_levels_correction_depth3"]["bytes"]
    )
    assert record["key_bucket"] == 16 and len(calls) == len(names)
    correction = calls[2]  # the depth-3 correction: [R, Hq, D] in q's dtype, finite
    assert correction.shape == (2, 2, 32) and torch.isfinite(correction.float()).all()


def test_unknown_parts_are_refused_by_name_before_the_gpu():
    from flashloop_backend.config import ConfigError

    with pytest.raises(
        ConfigError, match=r"parts \['select'\] are not among \['decode', 'sparse_ops'\]"
    ):
        bench_packed.bench_packed_kv([1024], [1], parts=("sparse_ops", "select"))
