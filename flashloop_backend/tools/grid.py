"""The grid of settings that quality (``eval --grid``) and speed (``bench e2e --grid``)
are measured over, and the label that names a point in both records."""

from __future__ import annotations

import json

from flashloop_backend.config import FlashLoopConfig

KEY_RETENTIONS = (0.1, 0.15, 0.25, 0.4)
# the three schedules, then a milder one for models on which the mildest of those
# is over the token-sparse budget
RETENTION_SCHEDULES = ((1, 1, 0.75, 0.5), (1, 1, 0.5, 0.25), (1, 1, 0.25, 0.1), (1, 1, 1, 0.75))
POLICIES = ("fixed_prompt", "rolling")


def feature_grid(config: FlashLoopConfig) -> list[tuple[tuple[str, ...], FlashLoopConfig]]:
    """The quality grid (issue 24): dense; sparse decode alone at each key retention,
    token-sparse prefill alone at each retention schedule, KV quantization alone under
    each policy; then all three on at every combination of those. The other settings of
    each feature come from ``config`` (which must enable all three). Labels name the
    features and the settings that vary."""
    needed = ("token_sparse_prefill", "sparse_decode_attention", "kv_residual_quantization")
    missing = [name for name in needed if name not in config.enabled_features()]
    if missing:
        raise ValueError(f"--grid needs a config that enables every feature; {missing} are off")
    base = config.model_dump(mode="json")
    off = {k: v for k, v in base.items() if k not in needed}

    def settings(decode=None, schedule=None, policy=None) -> tuple[tuple[str, ...], dict]:
        data, label = dict(off), []
        if decode is not None:
            data[needed[1]] = base[needed[1]] | {"key_retention": decode}
            label.append(f"sparse_decode_attention key_retention={decode}")
        if schedule is not None:
            data[needed[0]] = base[needed[0]] | {"retention": list(schedule)}
            label.append(f"token_sparse_prefill retention={list(schedule)}")
        if policy is not None:
            data[needed[2]] = base[needed[2]] | {"policy": policy}
            label.append(f"kv_residual_quantization policy={policy}")
        return tuple(label), data

    points = [settings()]
    points += [settings(decode=r) for r in KEY_RETENTIONS]
    points += [settings(schedule=s) for s in RETENTION_SCHEDULES]
    points += [settings(policy=p) for p in POLICIES]
    points += [
        settings(r, s, p) for r in KEY_RETENTIONS for s in RETENTION_SCHEDULES for p in POLICIES
    ]
    return [(label, FlashLoopConfig.from_dict(data)) for label, data in points]


def all_on_points(config: FlashLoopConfig) -> list[tuple[tuple[str, ...], FlashLoopConfig]]:
    """The grid's points with every feature on (the candidates for the recommendation)."""
    return [(label, c) for label, c in feature_grid(config) if len(c.enabled_features()) == 3]


def point_name(label: tuple[str, ...] | list[str]) -> str:
    """One string per grid point, the same in the eval and the speed record."""
    return " + ".join(label) or "dense"


def selected(names: list[str], contains: list[str] | None) -> list[bool]:
    """Whether each point name holds every text of ``contains`` and none of its texts
    written ``!TEXT`` (None or empty: every point). A text that no point holds, or texts
    no point satisfies together, are refused."""
    if not contains:
        return [True] * len(names)
    wanted = [t for t in contains if not t.startswith("!")]
    unwanted = [t[1:] for t in contains if t.startswith("!")]
    if "" in unwanted:
        raise ValueError("--grid-points '!' needs the text to exclude, e.g. '!token_sparse'")
    missing = [t for t in wanted + unwanted if not any(t in name for name in names)]
    if missing:
        raise ValueError(f"--grid-points {missing} match no grid point; the points are {names}")
    chosen = [
        all(t in name for t in wanted) and not any(t in name for t in unwanted) for name in names
    ]
    if not any(chosen):
        raise ValueError(f"no grid point satisfies all of --grid-points {contains}")
    return chosen


def finished_points(record: dict, identity: dict) -> dict[str, dict]:
    """The points of an earlier record to keep when a run resumes it, by
    :func:`point_name`. ``identity``: what must be the same for its figures to join this
    run's (kind, model, text, dtype, base config, evaluation settings); the first field
    that differs is named. A point is kept only where its config is the one this run
    would evaluate under that name (checked by the caller)."""
    for key, want in identity.items():
        have = record.get(key)
        if key == "settings":
            have = next(iter(record.get("combinations", [])), {}).get("settings")
        if json.loads(json.dumps(have)) != json.loads(json.dumps(want)):
            raise ValueError(
                f"cannot resume: the record's {key} is {have!r}, this run's is {want!r}"
            )
    return {point_name(r["features"]): r for r in record.get("combinations", [])}


def feature_combinations(config: FlashLoopConfig) -> list[tuple[tuple[str, ...], FlashLoopConfig]]:
    """Every on/off combination of the features ``config`` enables (``eval
    --combinations``), each with those features' settings from ``config`` (the others
    off), dense first, all on last."""
    enabled = config.enabled_features()
    if not enabled:
        raise ValueError("--combinations needs a config that enables at least one feature")
    base = config.model_dump(mode="json")
    out = []
    for mask in range(1 << len(enabled)):
        chosen = tuple(name for bit, name in enumerate(enabled) if mask >> bit & 1)
        data = {k: v for k, v in base.items() if k not in enabled or k in chosen}
        out.append((chosen, FlashLoopConfig.from_dict(data)))
    return sorted(out, key=lambda item: len(item[0]))


_POINTS_BY_KIND = {"eval_grid": feature_grid, "eval_combinations": feature_combinations}


def merge_records(records: list[dict]) -> dict:
    """One grid (or combinations) record from several runs of the same grid (parallel
    processes, each over some of the points): the identity fields must agree (the first
    that differs is named), each point is taken once in the grid's order, and a point two
    runs hold with different figures is refused by name rather than one of them chosen."""
    if not records:
        raise ValueError("nothing to merge: give at least one record")
    first = records[0]
    points_of = _POINTS_BY_KIND.get(first.get("kind"))
    if points_of is None:
        raise ValueError(
            f"merging joins eval --grid or --combinations records ({sorted(_POINTS_BY_KIND)}); "
            f"the first is {first.get('kind')!r}"
        )
    identity = {k: v for k, v in first.items() if k not in ("device", "combinations")}
    identity["settings"] = next(iter(first.get("combinations", [])), {}).get("settings")
    points: dict[str, dict] = {}
    for record in records:
        for name, point in finished_points(record, identity).items():
            if name in points and points[name] != point:
                raise ValueError(f"the records disagree on point {name!r}: run it once")
            points.setdefault(name, point)
    order = [
        point_name(label) for label, _ in points_of(FlashLoopConfig.from_dict(first["config"]))
    ]
    unknown = sorted(set(points) - set(order))
    if unknown:
        raise ValueError(f"points {unknown} are not in the {first['kind']} of the records' config")
    identity.pop("settings")
    merged = [points[name] for name in order if name in points]
    return {**identity, "device": first.get("device"), "combinations": merged}
