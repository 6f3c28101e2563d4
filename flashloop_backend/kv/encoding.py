"""The packed format's version and its versioned description (``encoding_descriptor``, part
of every effective config, snapshot and PD descriptor), and the tensor names a store's
exports carry."""

from __future__ import annotations

# 3: one block per (page, layer, KV head), K and V codes token-major in the nibble order of
# ``kv.layout``; 2 (refused): separate pools, V codes channel-major
ENCODING_VERSION = 3


def encoding_descriptor(group_size: int, policy: str, tail_size: int, compact: bool) -> dict:
    """The versioned description of the packed format (goes into the effective config)."""
    return {
        "version": ENCODING_VERSION,
        "bits": 4,
        "byte_order": "one block per (page, layer, KV head): K codes [G][D/2], V codes "
        "[G][D/2] token-major (nibble order of kv.layout), K params [scale x D][min x D], "
        "V records [G][D/G][min, scale]",
        "k_groups": f"per channel across {group_size} token rows (post-RoPE)",
        "v_groups": f"per token row across {group_size} channels",
        "params": "float16 minimum and scale",
        "depths": "INT4 base at depth 0; INT4 residual against the reconstruction per depth",
        "token_sparse_depths": "compact residual rows + logical->compact map"
        if compact
        else "dense",
        "window_policy": policy,
        "tail_policy": f"bfloat16 tail of >= {tail_size} rows" if policy == "rolling" else "none",
    }


POOL_NAMES = ("blocks",)  # ``pools`` order
# the per-level tensor names of encoding 2's exports: named when a v2 export is offered
V2_POOL_NAMES = ("k_codes", "k_min", "k_scale", "v_codes", "v_min", "v_scale")
