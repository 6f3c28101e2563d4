"""The bytes a decode replay moves (``tools/bench/replay_bytes.py``): each term against the
layout and the model it counts, and the byte bounds the decode issue names."""

import json
from pathlib import Path

import pytest
import torch

from flashloop_backend.config import FlashLoopConfig
from flashloop_backend.kv.layout import PackedLayout
from flashloop_backend.tools.bench.bench_models import ouro_1p4b_shapes
from flashloop_backend.tools.bench.replay_bytes import (
    LEVEL_BYTES,
    ModelShapes,
    attention_bytes,
    key_bytes,
    record_bandwidth,
    replay_bytes,
)

from .host_helpers import tiny_model

RESULTS = Path(__file__).resolve().parents[1] / "results"
ALL_ON = FlashLoopConfig.from_dict(
    json.loads((Path(__file__).resolve().parents[1] / "configs" / "all_on.json").read_text())
)


def test_a_level_costs_a_v3_blocks_bytes_per_token():
    layout = PackedLayout(group_size=64, head_dim=128)
    assert LEVEL_BYTES * layout.group_size == layout.block_bytes


def test_the_weights_are_the_models_projection_bytes():
    model = tiny_model()
    layer = model.model.layers[0]
    linear = sum(m.weight.numel() for m in layer.modules() if isinstance(m, torch.nn.Linear))
    assert ModelShapes.of(model.config).layer_weight_bytes() == 2 * linear


@pytest.mark.parametrize(("context", "layers", "bound"), [(8192, 24, 1.39), (32768, 24, 2.06)])
def test_all_on_moves_the_byte_bound_the_decode_issue_names(context, layers, bound):
    """Four loops of all on against four of dense at batch 1: the issue's byte bounds
    (about 1.38x / 2.03x with the LM head; the replays leave it out)."""
    shapes = ModelShapes.of(ouro_1p4b_shapes(layers))
    dense = sum(
        replay_bytes(("dense_attention",), d, 1, context, shapes, ALL_ON)["total"]
        for d in range(1, 5)
    )
    ops = {
        1: ("packed_decode",),
        2: ("packed_dense_source",),
        3: ("packed_decode", "packed_sparse_correction"),
        4: ("packed_decode", "packed_sparse_correction"),
    }
    flashloop = sum(replay_bytes(ops[d], d, 1, context, shapes, ALL_ON)["total"] for d in ops)
    assert dense / flashloop == pytest.approx(bound, abs=0.03)


def test_a_replay_reads_its_layers_weights_at_every_loop_and_not_the_lm_head():
    """The graph holds the recurrent traversal; the LM head runs after it."""
    shapes = ModelShapes.of(ouro_1p4b_shapes(2))
    every = key_bytes("(1, 1, ('dense_attention',))", 1024, shapes, ALL_ON)
    last = replay_bytes(("dense_attention",), 4, 1, 1024, shapes, ALL_ON)
    assert every["weights"] == last["weights"] == 2 * shapes.layer_weight_bytes()


def test_a_fallback_only_read_is_marked_and_moves_nothing():
    shapes = ModelShapes.of(ouro_1p4b_shapes(1))
    key = "(1, 3, ('packed_decode:few_rows', 'packed_sparse_correction'))"
    marked = key_bytes(key, 4096, shapes, ALL_ON)
    alone = replay_bytes(("packed_sparse_correction",), 3, 1, 4096, shapes, ALL_ON)
    assert marked == alone


def test_the_fallback_reader_of_loops_3_4_moves_nothing_but_kv_quantization_alone_reads():
    shapes = ModelShapes.of(ouro_1p4b_shapes(1))
    assert attention_bytes("packed_decode", 3, 1, 4096, shapes, ALL_ON) == 0
    alone = FlashLoopConfig.from_dict({"kv_residual_quantization": {"enabled": True}})
    assert attention_bytes("packed_decode", 3, 1, 4096, shapes, alone) == 4096 * 16 * 3 * 144


def test_an_unknown_op_is_named_with_the_ones_counted():
    shapes = ModelShapes.of(ouro_1p4b_shapes(1))
    with pytest.raises(ValueError, match=r"op 'sparse_prefill'.*knows dense_attention"):
        attention_bytes("sparse_prefill", 1, 1, 64, shapes, ALL_ON)


def test_a_committed_record_gets_rates_below_the_hbm_peak():
    record = json.loads((RESULTS / "decode_v3/bench_e2e_all_on_32k1_6fd9505.json").read_text())
    bandwidth = record_bandwidth(record["runs"][0])
    assert set(bandwidth) == {"triton+graphs", "flashloop+graphs"}
    rates = [e["fraction_of_hbm"] for keys in bandwidth.values() for e in keys.values()]
    assert len(rates) == 5 and all(0 < r < 1 for r in rates)


def test_the_hbm_fraction_follows_the_gpu_a_record_ran_on():
    from flashloop_backend.tools.bench.replay_bytes import achieved, hbm_tb_s

    assert hbm_tb_s("NVIDIA H100 80GB HBM3") == 3.35
    assert hbm_tb_s("NVIDIA H200") == hbm_tb_s(None) == 4.8
    nbytes = {"total": 3.35e9}
    assert achieved(nbytes, 1.0, "NVIDIA H100 80GB HBM3")["fraction_of_hbm"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match=r"GPU 'NVIDIA A10'; known: \['H100', 'H200'\]"):
        hbm_tb_s("NVIDIA A10")
