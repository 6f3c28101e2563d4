"""The ``eval`` command: a FlashLoop config's quality against dense (teacher-forced
decode, passkey retrieval), one config, its feature combinations or the quality grid."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from flashloop_backend.cli.arguments import (
    add_common_options,
    int_list,
    load_from_args,
    non_negative_int,
    positive_int,
)
from flashloop_backend.config import ConfigError, UnservableError
from flashloop_backend.host.progress import StageBars


def _eval(args: argparse.Namespace) -> int:
    from flashloop_backend.tools.evaluation import EvalSettings, heldout_text
    from flashloop_backend.tools.paths import record_path

    device, dtype, config, model, tokenizer = load_from_args(args)
    if args.text:
        path = Path(args.text)
        if not path.is_file():
            raise ConfigError(f"text file {args.text!r} does not exist")
        text, source = path.read_text(encoding="utf-8", errors="replace"), record_path(args.text)
    else:
        # four bytes of text per scored position keep many windows from overlapping much
        span = args.windows * (args.context + args.continuation)
        text, source = heldout_text(limit_bytes=max(400_000, 4 * span))
    settings = EvalSettings(
        windows=args.windows,
        context=args.context,
        continuation=args.continuation,
        passkey_contexts=tuple(args.passkey_contexts),
        passkey_samples=args.passkey_samples,
        seed=args.seed,
        exit_threshold=args.exit_threshold,
    )
    log = (lambda m: print(m, file=sys.stderr)) if args.json else print
    if args.combinations and args.grid:
        raise ConfigError("--combinations and --grid are two runs: give one")
    if args.grid_points and not (args.grid or args.combinations):
        raise ConfigError(
            "--grid-points chooses points of --grid or --combinations; give one of them"
        )
    if args.combinations or args.grid:
        return _eval_combinations(args, model, tokenizer, text, source, config, settings, log)
    report = _evaluated(args, model, tokenizer, text, config, settings)
    report.update(
        model=record_path(args.model), text_source=source, device=device, dtype=str(dtype)
    )
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        bits = report["bits_per_byte"]
        delta, ci = report["delta_bits_per_byte_percent"], report["delta_ci95_percent"]
        print(
            f"bits/byte dense {bits['dense']:.4f} config {bits['config']:.4f} "
            f"(delta {delta:+.3f}%, 95% CI {ci})"
        )
        print(
            f"KL mean {report['kl_mean']:.3g} p99 {report['kl_p99']:.3g}; "
            f"top-1 agreement {report['top1_agreement']:.4f}"
        )
        print(f"passkey {report['passkey_accuracy']}")
    return 0


def _evaluated(args, model, tokenizer, text, config, settings, dense_cache=None) -> dict:
    """One config's evaluation report, with progress bars; a value the evaluation refuses
    exits 2 naming it (an unservable config exits 3)."""
    from flashloop_backend.tools.evaluation import evaluate

    with StageBars("eval") as bars:
        try:
            return evaluate(
                model,
                tokenizer,
                text,
                config,
                backend=args.backend,
                settings=settings,
                block_size=args.block_size,
                progress=bars.update,
                dense_cache=dense_cache,
            )
        except UnservableError:
            raise
        except ValueError as exc:
            raise ConfigError(str(exc)) from None


def _passkey_mean(cells: dict[str, float]) -> float:
    return sum(cells.values()) / max(1, len(cells))


def _resumed(args, identity: dict) -> dict[str, dict]:
    """``--resume``: the finished points of the ``--out`` record (none if it does not exist
    yet), refused where the record was made with another model, text, config or settings."""
    from flashloop_backend.tools.grid import finished_points

    if not args.resume:
        return {}
    if not args.out:
        raise ValueError("--resume continues the --out record: give --out FILE")
    path = Path(args.out)
    if not path.is_file():
        return {}
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot resume {args.out}: not a readable record ({exc})") from None
    return finished_points(record, identity)


def _eval_combinations(args, model, tokenizer, text, source, config, settings, log) -> int:
    """``eval --combinations``: every on/off combination of the config's features;
    ``eval --grid``: the quality grid of :func:`~flashloop_backend.tools.grid.feature_grid`."""
    from flashloop_backend.tools.grid import (
        feature_combinations,
        feature_grid,
        point_name,
        selected,
    )
    from flashloop_backend.tools.paths import record_path

    param = next(model.parameters())
    identity = {
        "kind": "eval_grid" if args.grid else "eval_combinations",
        "model": record_path(args.model),
        "text_source": source,
        "dtype": str(param.dtype),
        "config": config.model_dump(mode="json"),
        "settings": dict(settings.__dict__),
    }
    try:
        combos = feature_grid(config) if args.grid else feature_combinations(config)
        chosen = selected([point_name(f) for f, _ in combos], args.grid_points)
        done = _resumed(args, identity)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    # the resumed points are kept from the start: a run stopped before it reaches them in
    # the grid's order still writes them
    by_name, dense_cache = {}, {}
    for features, combo in combos:
        earlier = done.get(point_name(features))
        if earlier is not None and earlier["config"] == combo.model_dump(mode="json"):
            by_name[point_name(features)] = earlier
    kept = set(by_name)

    def in_order() -> list[dict]:
        return [by_name[point_name(f)] for f, _ in combos if point_name(f) in by_name]

    def write() -> None:  # after every combination: a long run loses nothing finished
        if args.out:
            record = {**identity, "device": str(param.device), "combinations": in_order()}
            record.pop("settings")  # each combination carries its own
            Path(args.out).write_text(json.dumps(record, indent=2) + "\n")

    for i, ((features, combo), run) in enumerate(zip(combos, chosen, strict=True), 1):
        name = point_name(features)
        if name in kept:
            log(f"combination {i}/{len(combos)}: {name}: kept from {args.out}")
            continue
        if not run:  # a finished point is kept above whatever --grid-points says
            continue
        log(f"combination {i}/{len(combos)}: {' + '.join(features) or 'dense (all off)'}")
        report = _evaluated(args, model, tokenizer, text, combo, settings, dense_cache)
        by_name[name] = {
            "features": list(features),
            "config": combo.model_dump(mode="json"),
            **report,
        }
        write()
    records = in_order()
    if args.json:
        print(json.dumps(records, indent=2))
        return 0
    print(f"{'features':<76} {'d bits/byte':>12} {'95% CI':>18} {'top-1':>7} {'passkey':>15}")
    for r in records:
        ci = "[{:+.2f}, {:+.2f}]".format(*r["delta_ci95_percent"])
        keys = r["passkey_accuracy"]
        passkey = f"{_passkey_mean(keys['config']):.2f} / {_passkey_mean(keys['dense']):.2f}"
        features = " + ".join(r["features"]) or "dense"
        print(
            f"{features:<76} {r['delta_bits_per_byte_percent']:>+11.2f}% "
            f"{ci:>18} {r['top1_agreement']:>7.4f} {passkey:>15}"
        )
    return 0


def add_eval_command(sub) -> None:
    ev = sub.add_parser(
        "eval", help="quality of a FlashLoop config against dense (teacher-forced decode)"
    )
    add_common_options(ev)
    ev.add_argument("--text", help="text file (default: the embedded model's held-out split)")
    ev.add_argument(
        "--windows", type=positive_int, default=8, help="text windows evaluated (default 8)"
    )
    ev.add_argument("--context", type=positive_int, default=256, help="prefilled tokens per window")
    ev.add_argument(
        "--continuation",
        type=positive_int,
        default=64,
        help="teacher-forced decode tokens per window",
    )
    ev.add_argument(
        "--passkey-contexts",
        type=int_list,
        default=[256, 512],
        help="prompt lengths of the passkey cells, comma-separated (each >= 128)",
    )
    ev.add_argument(
        "--passkey-samples",
        type=non_negative_int,
        default=8,
        help="per (context, depth) cell; 0 skips passkey retrieval",
    )
    ev.add_argument("--seed", type=int, default=0, help="seed of the windows' and passkeys' choice")
    ev.add_argument(
        "--exit-threshold",
        type=float,
        default=None,
        help="Ouro's exit rule for dense and config alike, in (0, 1]: a token leaves once its "
        "cumulative exit probability reaches it (default: the model's setting)",
    )
    ev.add_argument(
        "--combinations",
        action="store_true",
        help="evaluate every on/off combination of the features the config enables",
    )
    ev.add_argument(
        "--grid",
        action="store_true",
        help="the quality grid: each feature alone at each setting (key retention, retention "
        "schedule, packing policy) and all on at every combination of them",
    )
    ev.add_argument(
        "--grid-points",
        action="append",
        metavar="TEXT",
        help="--grid / --combinations: run only the points whose name holds TEXT (repeat: "
        "every TEXT; '!TEXT': not that text), e.g. 'retention=[1, 1, 1, 0.75]' or "
        "'!token_sparse_prefill'; points the resumed record holds are kept",
    )
    ev.add_argument(
        "--resume",
        action="store_true",
        help="--grid / --combinations: keep the points the --out record already holds (same "
        "model, text, config and settings) and run the rest",
    )
    ev.add_argument("--out", help="also write the JSON record here")
    ev.add_argument(
        "--json", action="store_true", help="print the record as JSON (progress to stderr)"
    )
    ev.set_defaults(handler=_eval)
