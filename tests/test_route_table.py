"""A batch's routes come from one lookup per output in a table of every (row mode, depth)
pair (``dispatch.router.route_table``): the same routes the rules give, for every feature
combination, every mode and any depth."""

import gc
import itertools

import pytest
import torch

from flashloop_backend import FlashLoopConfig
from flashloop_backend.dispatch import SPARSE_START_DEPTH, RowMode, routable_ops, sparse_decode_ops
from flashloop_backend.dispatch.router import (
    _ROUTE_TABLES,
    base_routes_of,
    route_table,
    routes_by_rule,
)

FEATURES = {
    "token_sparse_prefill": {"enabled": True, "retention": [1, 1, 0.75, 0.5]},
    "sparse_decode_attention": {"enabled": True},
    "kv_residual_quantization": {"enabled": True},
}
CONFIGS = [
    FlashLoopConfig(**{name: FEATURES[name] for name in chosen})
    for size in range(len(FEATURES) + 1)
    for chosen in itertools.combinations(FEATURES, size)
]
CONFIGS += [
    FlashLoopConfig(num_loops=1),
    FlashLoopConfig(num_loops=6, sparse_decode_attention={"enabled": True}),
    FlashLoopConfig(token_sparse_prefill={"enabled": True, "retention": [1, 1, 1, 0.25]}),
]


@pytest.mark.parametrize("config", CONFIGS, ids=range(len(CONFIGS)))
def test_the_table_routes_every_mode_and_depth_as_the_rules_do(config):
    pairs = [(mode, depth) for mode in RowMode for depth in range(-2, config.num_loops + 4)]
    modes = torch.tensor([int(mode) for mode, _ in pairs], dtype=torch.int8)
    depths = torch.tensor([depth for _, depth in pairs])
    routes, correctable = base_routes_of(modes, depths, config)
    want_routes, want_correctable = routes_by_rule(modes, depths, config)
    assert routes.dtype == torch.int64 and torch.equal(routes, want_routes)
    if want_correctable is None:
        assert correctable is None
    else:
        assert torch.equal(correctable, want_correctable)


def test_the_table_is_made_once_per_config_and_device_and_leaves_with_its_config():
    config = FlashLoopConfig(sparse_decode_attention={"enabled": True})
    first = route_table(config, torch.device("cpu"))
    assert all(a is b for a, b in zip(first, route_table(config, torch.device("cpu")), strict=True))
    key = (id(config), torch.device("cpu"))
    assert key in _ROUTE_TABLES
    del config
    gc.collect()
    assert key not in _ROUTE_TABLES


def test_a_table_first_needed_inside_a_graph_capture_is_refused(monkeypatch):
    """Captured kernels run at replay: a table made during a capture would be read
    unwritten by every step before it. The backend makes it when it reserves."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="inside a CUDA graph capture"):
        route_table(FlashLoopConfig(), torch.device("cuda"))


def test_a_row_group_mode_must_be_a_row_mode():
    from flashloop_backend.host.batch import RowGroup

    assert RowGroup(1, 0, 2, 5, 1).mode is RowMode.DECODE
    with pytest.raises(ValueError, match="row group mode 7 is not a RowMode"):
        RowGroup(1, 7, 2, 5, 1)


def test_a_correction_is_among_a_steps_ops_exactly_where_a_decode_row_is_at_loop_3_or_4():
    """The batch plan skips the readiness gather where no decode depth is at loop 3 or 4;
    a graph captured without it must never serve a step whose ops include a correction."""
    for config in CONFIGS:
        if not config.sparse_decode_attention.enabled:
            continue
        correction = sparse_decode_ops(config)[1]
        for size in range(1, config.num_loops + 1):
            for depths in itertools.combinations(range(config.num_loops), size):
                ops = routable_ops(config, True, depths)
                assert (correction in ops) == (max(depths) >= SPARSE_START_DEPTH)
