"""A batch's routes come from one lookup per output in a table of every (row mode, depth)
pair (``dispatch.router.route_table``): the same routes the rules give, for every feature
combination, every mode and any depth, in a few tensor operations."""

import itertools

import pytest
import torch

from flashloop_backend import FlashLoopConfig
from flashloop_backend.dispatch import RowMode
from flashloop_backend.dispatch.router import base_routes_of, route_table, routes_by_rule

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


def test_the_table_is_made_once_per_config_and_device():
    config = FlashLoopConfig(sparse_decode_attention={"enabled": True})
    first = route_table(config, torch.device("cpu"))
    assert all(a is b for a, b in zip(first, route_table(config, torch.device("cpu")), strict=True))
    same_fields = FlashLoopConfig(sparse_decode_attention={"enabled": True})
    assert route_table(same_fields, torch.device("cpu"))[0] is not first[0]  # keyed by object
