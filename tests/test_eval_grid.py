"""The quality grid of ``eval --grid``: dense, each feature alone at each of its settings,
all on at every combination of them; a config without every feature is refused by name."""

import json

import pytest

from flashloop_backend import FlashLoopConfig
from flashloop_backend.cli.main import EXIT_USAGE, main
from flashloop_backend.tools.evaluation import (
    KEY_RETENTIONS,
    POLICIES,
    RETENTION_SCHEDULES,
    feature_grid,
)

ALL_ON = FlashLoopConfig.from_dict(json.load(open("configs/all_on.json")))


def test_the_grid_holds_each_feature_alone_and_all_on_at_every_setting():
    grid = feature_grid(ALL_ON)
    alone = len(KEY_RETENTIONS) + len(RETENTION_SCHEDULES) + len(POLICIES)
    product = len(KEY_RETENTIONS) * len(RETENTION_SCHEDULES) * len(POLICIES)
    assert len(grid) == 1 + alone + product
    label, dense = grid[0]
    assert label == () and dense.enabled_features() == ()
    enabled = [config.enabled_features() for _, config in grid]
    assert sum(len(e) == 1 for e in enabled) == alone
    assert sum(len(e) == 3 for e in enabled) == product
    decode = [c.sparse_decode_attention.key_retention for _, c in grid[1:5]]
    assert decode == list(KEY_RETENTIONS)
    points = {
        (
            c.sparse_decode_attention.key_retention,
            tuple(c.token_sparse_prefill.retention),
            c.kv_residual_quantization.policy,
        )
        for _, c in grid[1 + alone :]
    }
    assert len(points) == product  # every combination once
    # settings that do not vary come from the config
    assert all(
        c.kv_residual_quantization.group_size == 64
        for _, c in grid
        if c.kv_residual_quantization.enabled
    )
    label, _ = grid[-1]
    assert label[0].startswith("sparse_decode_attention key_retention=")


def test_a_config_without_every_feature_is_refused_by_name():
    config = ALL_ON.model_copy(
        update={"kv_residual_quantization": FlashLoopConfig().kv_residual_quantization}
    )
    with pytest.raises(ValueError, match=r"\['kv_residual_quantization'\] are off"):
        feature_grid(config)


def test_combinations_and_grid_together_are_refused(capsys):
    assert main(["eval", "--combinations", "--grid", "--windows", "1"]) == EXIT_USAGE
    assert "--combinations and --grid are two runs" in capsys.readouterr().err
