"""``flashloop-backend``: its parser, the ``report`` and ``pareto`` commands and the exit
codes; ``info`` (:mod:`~flashloop_backend.cli.info_command`), the bench
(:mod:`~flashloop_backend.cli.bench_command`) and host commands register their own parsers.

User mistakes print a message to stderr, never a traceback: a bad value or file exits 2,
a request that no backend (or not the named one) can serve exits 3. torch loads only
inside the commands that need it, so ``--help`` answers at once.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from flashloop_backend._version import __version__
from flashloop_backend.config import ConfigError, UnservableError

EXIT_USAGE = 2
EXIT_UNSERVABLE = 3


def _report(args: argparse.Namespace) -> int:
    from pathlib import Path

    from flashloop_backend.tools.report import make_plots

    results = Path(args.results)
    if not results.is_dir():
        raise ConfigError(f"--results {args.results!r} is not a directory of JSON records")
    if args.readme:
        from flashloop_backend.tools.results_table import rewrite

        document = Path(args.readme)
        if not document.is_file():
            raise ConfigError(f"--readme {args.readme!r} is not a file")
        try:
            changed = rewrite(document, results)
        except (OSError, KeyError, ValueError) as exc:
            raise ConfigError(f"cannot write the results table of {args.readme!r}: {exc}") from None
        print(f"{'rewrote' if changed else 'unchanged:'} the results table of {args.readme}")
        return 0
    written = make_plots(results, Path(args.out))
    return 0 if written else 1


def _read_record(path: str, kind: str) -> dict:
    from pathlib import Path

    try:
        record = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path!r} is not a readable JSON record ({exc})") from None
    if not isinstance(record, dict) or record.get("kind") != kind:
        found = record.get("kind") if isinstance(record, dict) else type(record).__name__
        raise ConfigError(f"{path!r} is a {found!r} record; this needs a {kind!r} record")
    return record


def _pareto(args: argparse.Namespace) -> int:
    from pathlib import Path

    from flashloop_backend.tools import pareto

    grid = _read_record(args.grid, "eval_grid")
    speed = _read_record(args.speed, "end_to_end_host") if args.speed else None
    try:
        points = pareto.load_points(grid, speed, args.shape)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    front = pareto.pareto_front(points)
    chosen, reasons = pareto.recommend(points)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig = pareto.draw(points, front, chosen, plt)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        plt.close(fig)
    config = pareto.recommended_config(chosen) if chosen else None
    if args.write_config and config:
        Path(args.write_config).write_text(json.dumps(config, indent=1) + "\n")
    if args.json:
        rows = [
            {**p.__dict__, "on_front": p in front, "budget_misses": pareto.budget_misses(p)}
            for p in points
        ]
        print(json.dumps({"points": rows, "recommended": config, "reasons": reasons}, indent=2))
    else:
        print(f"{'point':<100} {'Δ %':>7} {'decode':>7} {'prefill':>7}  budgets")
        for p in points:
            ratios = [
                f"{r:.2f}x" if r is not None else "-" for r in (p.decode_ratio, p.prefill_ratio)
            ]
            misses = "; ".join(pareto.budget_misses(p)) or "within"
            mark = "*" if p in front else " "
            print(f"{mark}{p.name:<99} {p.delta:>+7.2f} {ratios[0]:>7} {ratios[1]:>7}  {misses}")
        print("recommended:" if chosen else "no recommendation:", *reasons, sep="\n  ")
    return 0 if chosen else 1


def _shape(text: str) -> tuple[int, int]:
    context, sep, concurrency = text.partition("x")
    if not sep or not context.isdigit() or not concurrency.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not CONTEXTxCONCURRENCY, e.g. 32768x1")
    return int(context), int(concurrency)


def build_parser() -> argparse.ArgumentParser:
    # the host's torch model loads only when a command runs
    from flashloop_backend.cli.bench_command import add_bench_command
    from flashloop_backend.cli.host_commands import add_commands
    from flashloop_backend.cli.info_command import add_info_command

    parser = argparse.ArgumentParser(
        prog="flashloop-backend",
        description="FlashLoop attention backend for looped language models (Ouro): see what "
        "is installed and which backend and kernels a configuration selects, benchmark, "
        "evaluate quality and generate. A bad value or file exits 2; a request that no "
        "backend (or not the named one) can serve exits 3.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_info_command(sub)
    add_bench_command(sub)
    report = sub.add_parser("report", help="PNG plots from the committed JSON records")
    report.add_argument("--results", default="results", help="directory of JSON records")
    report.add_argument("--out", default="docs/figures", help="where the PNGs go")
    report.add_argument(
        "--readme",
        metavar="FILE",
        help="instead of plots: rewrite the measured-results table of FILE (README.md) from "
        "the records",
    )
    report.set_defaults(handler=_report)
    front = sub.add_parser(
        "pareto",
        help="quality vs speed over the grid: the front and the recommended configuration",
    )
    front.add_argument("--grid", required=True, help="eval --grid record")
    front.add_argument("--speed", help="bench e2e --grid record (without it: quality only)")
    front.add_argument(
        "--shape",
        type=_shape,
        help="the speed record's run, CONTEXTxCONCURRENCY (default: its first)",
    )
    front.add_argument("--plot", help="write the quality-vs-speed PNG here")
    front.add_argument("--write-config", help="write the recommended configuration here")
    front.add_argument(
        "--json", action="store_true", help="print the points and the recommendation as JSON"
    )
    front.set_defaults(handler=_pareto)
    add_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args))
    except UnservableError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_UNSERVABLE
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (RuntimeError, MemoryError) as exc:
        # a request larger than the pools: a bad value, like a config's (loaded only here,
        # where an error already happened: these modules need torch)
        from flashloop_backend.host.kvcache import OutOfBlocksError
        from flashloop_backend.kv.sequence_levels import OutOfPackedPagesError

        if not isinstance(exc, OutOfBlocksError | OutOfPackedPagesError):
            raise
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # output piped into a closed reader (e.g. `| head`)
        return 0


if __name__ == "__main__":
    sys.exit(main())
