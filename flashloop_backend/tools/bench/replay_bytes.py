"""The bytes one decode traversal (one CUDA-graph key: rows, depth, ops) must move, from
the model's shapes, the layout and the configuration, beside FlashInfer BF16 decode's for
the same rows: with a replay's time they give its achieved TB/s and the fraction of the
H200's HBM bandwidth a replay reached.

Counted once per layer: the weights a traversal reads (attention and MLP projections; the
LM head runs after the graph, outside the replay), and each attention op's reads:

- dense BF16: K and V of every visible position;
- packed read at depth d: every level's 144 B a token-head (K and V codes, K parameters,
  V record; a compact level only its kept rows plus a 4 B map entry);
- loop-2 source: two levels, plus the logits the keys pass writes and the values pass
  reads back (4 B each way);
- loop 3-4 correction: each selected key's K row, V row and V record at every level,
  the K parameters of every 64-token group at every level (a 0.10 selection touches
  nearly all of them), and the loop-2 reference read (indices, output, contribution).

Activations, norms and the KV write of the new token are left out (kilobytes a layer).
"""

from __future__ import annotations

import ast
import math
from dataclasses import dataclass

from flashloop_backend.config import FlashLoopConfig

# HBM bandwidth by GPU (TB/s, the datasheets'); records without a GPU name ran on the H200
HBM_TB_S = {"H200": 4.8, "H100": 3.35}


def hbm_tb_s(gpu: str | None) -> float:
    """The HBM bandwidth of ``gpu`` (a ``torch.cuda.get_device_name``; None: the H200)."""
    if gpu is None:
        return HBM_TB_S["H200"]
    for name, rate in HBM_TB_S.items():
        if name in gpu:
            return rate
    raise ValueError(f"no HBM bandwidth known for GPU {gpu!r}; known: {sorted(HBM_TB_S)}")


CODE_ROW_BYTES = 64  # K or V codes of one token-head (128 channels, 4 bits)
V_RECORD_BYTES = 8  # V scale and minimum per 64-channel group, FP16
K_PARAM_BYTES = 512  # K scale and minimum per channel of one 64-token group, FP16
LEVEL_BYTES = 2 * CODE_ROW_BYTES + V_RECORD_BYTES + K_PARAM_BYTES // 64  # per token-head
MAP_BYTES = 4
LOGIT_BYTES = 4


@dataclass(frozen=True)
class ModelShapes:
    """What a traversal's weight reads depend on (BF16 weights)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    loops: int

    @staticmethod
    def of(config) -> ModelShapes:
        """From an ``OuroConfig``."""
        return ModelShapes(
            config.num_hidden_layers,
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            config.intermediate_size,
            config.total_ut_steps,
        )

    def layer_weight_bytes(self) -> int:
        q_and_o = 2 * self.hidden * self.heads * self.head_dim
        k_and_v = 2 * self.hidden * self.kv_heads * self.head_dim
        mlp = 3 * self.hidden * self.intermediate
        return 2 * (q_and_o + k_and_v + mlp)


def _level_bytes(config: FlashLoopConfig, levels: int) -> float:
    """Bytes a token-head's first ``levels`` packed levels hold (compact levels: their
    kept share and a map entry)."""
    sparse = config.token_sparse_prefill
    total = 0.0
    for level in range(levels):
        kept = sparse.retention[level] if sparse.enabled else 1.0
        total += LEVEL_BYTES if kept >= 1.0 else kept * LEVEL_BYTES + MAP_BYTES
    return total


def attention_bytes(
    op: str,
    depth: int | None,
    rows: int,
    context: int,
    shapes: ModelShapes,
    config: FlashLoopConfig,
) -> float:
    """Bytes ``op`` must read at one layer for ``rows`` rows of ``context`` positions at
    loop ``depth`` (1-based; packed ops need it)."""
    token_heads = rows * context * shapes.kv_heads
    if op == "dense_attention":
        return token_heads * shapes.head_dim * 2 * 2
    if op == "packed_decode:few_rows":  # it serves only rows without a loop-2 reference
        return 0.0
    if op == "packed_decode":
        # beside a correction (records before the few_rows mark, and keys that also hold
        # loop 1-2 rows) the rows it reads are not known: counted as none
        if config.sparse_decode_attention.enabled and depth >= 3:
            return 0.0
        return token_heads * _level_bytes(config, depth)
    if op == "packed_dense_source":  # logits [R, Hq, T]: written, then read back
        logits = rows * context * shapes.heads * 2 * LOGIT_BYTES
        return token_heads * _level_bytes(config, 2) + logits
    if op == "packed_sparse_correction":
        keys = math.ceil(config.sparse_decode_attention.key_retention * context)
        query_heads = rows * shapes.heads
        per_key = depth * (2 * CODE_ROW_BYTES + V_RECORD_BYTES)
        groups = math.ceil(context / 64) * depth * K_PARAM_BYTES * rows * shapes.kv_heads
        reference = query_heads * (keys * 4 + 2 * shapes.head_dim * 4 + 4)
        return query_heads * keys * per_key + groups + reference
    raise ValueError(
        f"op {op!r}: the replay byte count knows dense_attention, packed_decode, "
        "packed_dense_source and packed_sparse_correction"
    )


PACKED_OPS = frozenset(
    {"packed_decode", "packed_decode:few_rows", "packed_dense_source", "packed_sparse_correction"}
)


def key_bytes(
    key: str, context: int, shapes: ModelShapes, config: FlashLoopConfig
) -> dict[str, float]:
    """:func:`replay_bytes` of a graph key as ``DecodeGraphs.replay_ms`` names it, ``"(rows,
    variant, ops)"``: a packed traversal's variant is its level count, the loop it runs
    (steps of one depth); a dense traversal's key serves every loop."""
    rows, variant, ops = ast.literal_eval(key)
    depth = variant if PACKED_OPS.intersection(ops) else None
    return replay_bytes(tuple(ops), depth, rows, context, shapes, config)


def replay_bytes(
    ops: tuple[str, ...],
    depth: int | None,
    rows: int,
    context: int,
    shapes: ModelShapes,
    config: FlashLoopConfig,
) -> dict[str, float]:
    """One traversal's bytes at loop ``depth`` (None: any loop, for a dense traversal):
    ``weights``, ``attention`` (every op, every layer),
    ``total``, and ``flashinfer_attention``: FlashInfer BF16 decode's reads of the same
    rows."""
    weights = shapes.layers * shapes.layer_weight_bytes()
    attention = shapes.layers * sum(
        attention_bytes(op, depth, rows, context, shapes, config) for op in ops
    )
    dense = shapes.layers * attention_bytes("dense_attention", depth, rows, context, shapes, config)
    return {
        "weights": weights,
        "attention": attention,
        "total": weights + attention,
        "flashinfer_attention": dense,
    }


def achieved(
    nbytes: dict[str, float], replay_ms: float, gpu: str | None = None
) -> dict[str, float]:
    """``nbytes`` (:func:`replay_bytes`) over a replay's median time: TB/s of the whole
    traversal and its fraction of ``gpu``'s HBM bandwidth (:func:`hbm_tb_s`)."""
    tb_s = nbytes["total"] / (replay_ms * 1e-3) / 1e12
    return {"tb_s": tb_s, "fraction_of_hbm": tb_s / hbm_tb_s(gpu)}


def record_shapes(record: dict) -> ModelShapes | None:
    """The model shapes of a ``bench e2e`` run record: its ``model_shapes``, or for records
    written before it, Ouro-1.4B's from the model's description (None: unknown)."""
    if record.get("model_shapes"):
        return ModelShapes(**record["model_shapes"])
    described = record.get("model", "")
    if not described.startswith("Ouro-1.4B shapes"):
        return None
    from flashloop_backend.tools.bench.bench_models import ouro_1p4b_shapes

    layers = None
    for part in described.split(", "):
        if part.endswith(" layers"):
            layers = int(part.split()[0])
    return ModelShapes.of(ouro_1p4b_shapes(layers))


def record_bandwidth(
    record: dict, gpu: str | None = None
) -> dict[str, dict[str, dict[str, float]]]:
    """Per backend and graph key of a ``bench e2e`` run record: the bytes a replay moves
    (:func:`key_bytes`, at the mean context of its decode steps) and what its median
    replay time makes of them on ``gpu`` (:func:`achieved`); empty where the shapes are
    unknown."""
    shapes = record_shapes(record)
    if shapes is None:
        return {}
    shared = FlashLoopConfig.model_validate(record["config"])
    context = record["context"] + record["new_tokens"] // 2
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name, result in record["results"].items():
        point = result.get("point_config")  # a grid run's own configuration
        config = FlashLoopConfig.model_validate(point) if point else shared
        for key, timing in (result.get("replay_ms_by_key") or {}).items():
            nbytes = key_bytes(key, context, shapes, config)
            entry = {**nbytes, **achieved(nbytes, timing["median_ms"], gpu)}
            out.setdefault(name, {})[key] = entry
    return out
