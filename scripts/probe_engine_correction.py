"""Why a loop 3-4 correction costs more inside the host than in ``bench packed``: the
CUDA correction's inputs are captured from an engine's decode step (Ouro-1.4B shapes,
random weights) and timed from CUDA graphs as they are, and with each head's selected
positions replaced by as many uniformly drawn ones (same store, same count), beside
statistics of the selection (keys per 64-token group, blocks the kernel forms).

    python3 scripts/probe_engine_correction.py --context 32768 --layers 24
"""

import argparse
import itertools
import json
import sys

import torch

from flashloop_backend import FlashLoopConfig
from flashloop_backend.host.engine import Engine, SamplingParams
from flashloop_backend.kernels.cuda import packed_selected as selected_module
from flashloop_backend.registry import Registry
from flashloop_backend.tools.bench.bench_models import random_ouro
from flashloop_backend.tools.bench.timing import graph_ms

GROUP = 64


def _engine(context: int, layers: int, config_path: str):
    model, request = random_ouro(layers, 16, fused=True)
    config = FlashLoopConfig.from_dict(json.load(open(config_path)))
    backend = Registry.discover().create("flashloop", request, config)
    blocks = (-(-(context + 64) // 16)) * model.config.total_ut_steps + 8
    engine = Engine(
        model,
        backend,
        num_blocks=blocks,
        block_size=16,
        prefill_chunk=2048,
        max_batch_tokens=2048,
        max_context=context + 64,
        max_slots=1,
    )
    return model, engine


def _blocks(positions: torch.Tensor, per_warp: int) -> int:
    """Blocks of at most 16 keys within 8 consecutive groups, each warp's range apart."""
    count = 0
    for start in range(0, len(positions), per_warp):
        part = positions[start : start + per_warp].tolist()
        i = 0
        while i < len(part):
            first = part[i] // GROUP
            take = 1
            while take < 16 and i + take < len(part) and part[i + take] // GROUP - first < 8:
                take += 1
            i += take
            count += 1
    return count


def _stats(indices: torch.Tensor, packed: int, keys_per_split: int) -> dict:
    heads = indices.shape[1]
    counts, groups, blocks = [], [], []
    for h in range(heads):
        pos = indices[0, h]
        pos = pos[(pos >= 0) & (pos < packed)].long().cpu()
        counts.append(len(pos))
        groups.append(len(torch.unique(pos // GROUP)))
        blocks.append(_blocks(pos, keys_per_split // 4))
    keys = sum(counts)
    return {
        "keys_per_head": keys / heads,
        "groups_per_head": sum(groups) / heads,
        "keys_per_group": keys / max(1, sum(groups)),
        "keys_per_block": keys / max(1, sum(blocks)),
    }


def _uniform(indices: torch.Tensor, packed: int, gen: torch.Generator) -> torch.Tensor:
    out = torch.full_like(indices, -1)
    for h in range(indices.shape[1]):
        pos = indices[0, h]
        tail = pos[pos >= packed]
        n = int(((pos >= 0) & (pos < packed)).sum())
        drawn = torch.randperm(packed, generator=gen)[:n].sort().values.to(indices.device)
        row = torch.cat([drawn.to(indices.dtype), tail])
        out[0, h, : len(row)] = row
    return out


def _shifted(indices: torch.Tensor, packed: int, gen: torch.Generator) -> torch.Tensor:
    """Each head's packed positions moved cyclically by its own multiple of 64 (clusters
    kept within a head, their alignment across heads broken)."""
    out = torch.full_like(indices, -1)
    for h in range(indices.shape[1]):
        pos = indices[0, h]
        tail = pos[pos >= packed]
        kept = pos[(pos >= 0) & (pos < packed)].long()
        shift = GROUP * int(torch.randint(0, packed // GROUP, (1,), generator=gen))
        moved = ((kept + shift) % packed).sort().values.to(indices.dtype)
        row = torch.cat([moved, tail])
        out[0, h, : len(row)] = row
    return out


def _clustered(indices: torch.Tensor, packed: int, gen: torch.Generator) -> torch.Tensor:
    """As many positions per head as the engine's, in as many 64-token groups as the
    engine's head touches, groups and positions within them drawn uniformly."""
    out = torch.full_like(indices, -1)
    for h in range(indices.shape[1]):
        pos = indices[0, h]
        tail = pos[pos >= packed]
        kept = pos[(pos >= 0) & (pos < packed)].long().cpu()
        groups = len(torch.unique(kept // GROUP))
        chosen = torch.randperm(packed // GROUP, generator=gen)[:groups]
        slots = (chosen[:, None] * GROUP + torch.arange(GROUP)).flatten()
        drawn = slots[torch.randperm(len(slots), generator=gen)[: len(kept)]].sort().values
        row = torch.cat([drawn.to(indices.device, indices.dtype), tail])
        out[0, h, : len(row)] = row
    return out


def _overlap(indices: torch.Tensor, packed: int) -> float:
    """Mean share of a head's positions that the next head also selects."""
    sets = []
    for h in range(indices.shape[1]):
        pos = indices[0, h]
        sets.append(set(pos[(pos >= 0) & (pos < packed)].tolist()))
    pairs = [len(a & b) / max(1, len(a)) for a, b in itertools.pairwise(sets)]
    return sum(pairs) / max(1, len(pairs))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--config", default="configs/all_on.json")
    args = parser.parse_args()
    model, engine = _engine(args.context, args.layers, args.config)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    prompt = torch.randint(0, model.config.vocab_size, (args.context,)).tolist()
    engine.generate([prompt[:2048]], params)
    engine.add_request(prompt, params)
    while engine.counters()["prompts_running"]:
        engine.step()
    engine.hand_over_prompts()
    captured: dict = {}
    original = selected_module.packed_sparse_correction_cuda

    def capture(q, store, layer, meta, *rest, **kwargs):
        levels = meta.tables.shape[1]
        if (levels, layer) not in captured and layer in (0, args.layers // 2):
            kept = [t.clone() if isinstance(t, torch.Tensor) else t for t in rest]
            captured[(levels, layer)] = (q.clone(), store, layer, meta, kept, kwargs)
        return original(q, store, layer, meta, *rest, **kwargs)

    selected_module.packed_sparse_correction_cuda = capture
    for _ in range(4):
        engine.step()
    selected_module.packed_sparse_correction_cuda = original
    torch.cuda.synchronize()
    gen = torch.Generator().manual_seed(0)
    tuning = selected_module.DEFAULT_SELECTED
    for (levels, layer), (q, store, _, meta, rest, kwargs) in sorted(captured.items()):
        key_cache, value_cache, tables, indices = rest[:4]
        packed = int(meta.packed_lengths[0])
        variants = {
            "engine": indices,
            "uniform": _uniform(indices, packed, gen),
            "heads_shifted": _shifted(indices, packed, gen),
            "clustered_uniform": _clustered(indices, packed, gen),
        }
        row = {"levels": levels, "layer": layer, "packed": packed, "kinds": meta.kinds.tolist()}
        row["head_overlap"] = _overlap(indices, packed)
        for name, idx in variants.items():
            call = (q, store, layer, meta, key_cache, value_cache, tables, idx, *rest[4:])
            ms = graph_ms(lambda c=call, k=kwargs: original(*c, **k))
            row[name] = {"us": 1e3 * ms, **_stats(idx, packed, tuning.keys_per_split)}
            row[name]["head_overlap"] = _overlap(idx, packed)
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
