"""``flashloop-backend``: inspect what is installed and what would be selected.

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


def _info(args: argparse.Namespace) -> int:
    from flashloop_backend.backends.flashloop import feature_support
    from flashloop_backend.capabilities import Capability, SupportRequest
    from flashloop_backend.config import load_config
    from flashloop_backend.registry import AUTO, Registry, resolve

    config = load_config(args.config)
    registry = Registry.discover()
    request = SupportRequest.default(registry.env)
    report: dict[str, object] = {
        "package_version": __version__,
        "machine": {
            "device": registry.env.device_name,
            "devices": list(registry.env.devices()),
            "compute_capability": registry.env.compute_capability,
        },
        "request": request.describe(),
        "capability_names": [c.value for c in Capability],
        "backends": _backend_rows(registry, config),
        "kernels": _kernel_rows(registry),
        "load_failures": [f.reason() for f in registry.failures.values()],
        "feature_support": feature_support(),
    }
    try:
        auto = registry.select_backend(AUTO, request, config)
        report["auto"] = {
            "selected": auto.info.selected_backend,
            "reason": auto.info.selection_reason,
            "rejected": dict(auto.rejected),
        }
    except ValueError as exc:
        report["auto"] = {"selected": None, "reason": str(exc), "rejected": {}}
    status = 0
    # the named backend, else flashloop when it serves the config, else auto's choice: a
    # config that no backend can serve resolves nothing and exits 3, as in every command
    chosen = args.backend or "flashloop"
    if not args.backend and report["auto"]["selected"] not in (None, "flashloop"):
        if registry.backend_reasons("flashloop", request, config):
            chosen = report["auto"]["selected"]
    try:
        effective = resolve(config, chosen, request, registry)
        report["effective_config"] = json.loads(effective.canonical_json())
        report["digest"] = effective.digest()
        quant = config.kv_residual_quantization
        if quant.enabled:
            from flashloop_backend.kv.store import bytes_per_token_report

            report["kv_bytes"] = bytes_per_token_report(
                request.num_kv_heads, request.head_dim, quant.group_size, config.num_loops
            )
    except ConfigError as exc:
        report["effective_config"] = None
        report["digest"] = None
        report["error"] = str(exc)
        status = EXIT_UNSERVABLE
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        _print_text(report)
    if status:
        print(f"error: {report['error']}", file=sys.stderr)
    return status


def _backend_rows(registry, config) -> dict[str, object]:
    from flashloop_backend.capabilities import SupportRequest
    from flashloop_backend.registry import capability_table

    caps = capability_table(registry, config)
    rows: dict[str, object] = {}
    for name in registry.backend_names():
        spec = registry.backends.get(name)
        if spec is None:
            rows[name] = {
                "loaded": False,
                "reasons": registry.backend_reasons(name, SupportRequest(), config),
            }  # type: ignore[arg-type]
            continue
        rows[name] = {
            "loaded": True,
            "version": spec.version,
            "priority": spec.priority,
            "description": spec.description,
            "capabilities": caps[name],
        }
    return rows


def _kernel_rows(registry) -> dict[str, object]:
    from flashloop_backend.capabilities import dtype_name

    rows: dict[str, object] = {}
    for name in registry.kernel_names():
        provider = registry.kernels.get(name)
        if provider is None:
            rows[name] = {
                "loaded": False,
                "reason": registry.failures[("flashloop_backend.kernels", name)].reason(),
            }
            continue
        ops = {}
        for op, impl in provider.impls.items():
            ops[op.value] = {
                "devices": sorted(impl.support.devices),
                "dtypes": sorted(dtype_name(d) for d in impl.support.dtypes),
                "capabilities": sorted(
                    c.value for c in impl.support.usable_capabilities(registry.env)
                ),
                "usable_here": not impl.support.machine_reasons(
                    registry.env.devices()[-1], registry.env
                ),
            }
        rows[name] = {
            "loaded": True,
            "version": provider.version,
            "priority": provider.priority,
            "ops": ops,
        }
    return rows


def _print_text(report: dict) -> None:
    print(f"flashloop-backend {report['package_version']} on {report['machine']['device']}")
    print("\nbackends:")
    for name, row in report["backends"].items():
        if not row["loaded"]:
            print(f"  {name}: NOT LOADED — {'; '.join(row['reasons'])}")
            continue
        on = [c for c, v in row["capabilities"].items() if v]
        print(f"  {name} {row['version']} (priority {row['priority']}): {', '.join(on) or '-'}")
    print("\nkernel implementations:")
    for name, row in report["kernels"].items():
        if not row["loaded"]:
            print(f"  {name}: NOT LOADED — {row['reason']}")
            continue
        print(f"  {name} {row['version']} (priority {row['priority']}): {', '.join(row['ops'])}")
    print("\nflashloop features serve:")
    for mode, features in report["feature_support"].items():
        print(f"  {mode}: {', '.join(f for f, ok in features.items() if ok) or '-'}")
    auto = report["auto"]
    print(f"\nauto picks: {auto['selected']} — {auto['reason']}")
    for name, reasons in auto["rejected"].items():
        print(f"  skipped {name}: {'; '.join(reasons)}")
    if report.get("digest"):
        print(f"\neffective config (digest {report['digest']}):")
        print(json.dumps(report["effective_config"], indent=2, sort_keys=True))
        if report.get("kv_bytes"):
            kv = report["kv_bytes"]
            packed = kv["packed_bytes_per_token_per_level_per_layer"]
            bf16 = kv["bf16_bytes_per_token_per_depth_per_layer"]
            saving = kv["dense_levels_ratio_vs_bf16"]
            print(
                f"\npacked KV: {packed:.0f} B per token, level and layer "
                f"vs BF16 {bf16} B per depth ({saving:.2f}x smaller with dense levels)"
            )
    elif report.get("error"):
        print(f"\nno effective config: {report['error']}")


def _float_list(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",") if part]
    except ValueError:
        values = []
    if not values or not all(0 < v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r} must list retention values in (0, 1]")
    return values


def _bench(args: argparse.Namespace) -> int:
    from flashloop_backend.cli.host_commands import speculation_from_args
    from flashloop_backend.config import FlashLoopConfig, load_config
    from flashloop_backend.registry import Registry
    from flashloop_backend.tools.bench.timing import environment_record, progress_log

    names = [n for n in args.backends.split(",") if n]
    registry = Registry.discover()
    unknown = [n for n in names if n.partition("+")[0] not in registry.backend_names()]
    if not names or unknown:
        raise UnservableError(
            f"unknown backends {unknown or names}; installed: {registry.backend_names()}"
        )
    graphed = [n for n in names if "+" in n]
    if args.grid_points and not args.grid:
        raise ConfigError("--grid-points chooses points of --grid; give --grid")
    e2e_only = (
        ("--grid", args.grid),
        ("--speculate", args.speculate),
        ("--draft-confidence", args.draft_confidence),
        ("--model", args.model),
        ("--exit-threshold", args.exit_threshold),
    )
    for flag, given in e2e_only:
        if given and args.mode != "e2e":
            raise ConfigError(f"{flag} applies to bench e2e, not bench {args.mode}")
    if graphed and args.mode not in ("e2e", "serving"):
        raise ConfigError(
            f"{graphed}: CUDA-graph entries (NAME+graphs) apply to e2e and serving only"
        )
    config = load_config(args.config) if args.config else FlashLoopConfig()

    def keep(partial: dict) -> None:
        if args.out:
            with open(args.out, "w") as handle:
                handle.write(json.dumps(partial, indent=2) + "\n")

    if args.mode == "serving":
        from flashloop_backend.tools.bench.serving import bench_serving

        record = bench_serving(
            config,
            baseline=names[0],
            contexts=args.contexts,
            concurrency=args.concurrency,
            new_tokens=args.new_tokens,
            layers=args.layers,
            rate_per_s=args.rate,
            log=progress_log,
            on_partial=keep,
            variant_keys=args.variants.split(",") if args.variants else None,
            prefix_cache=args.prefix_cache,
            shared_prefix=args.shared_prefix,
        )
    elif args.mode == "packed":
        from flashloop_backend.tools.bench.packed import bench_packed_kv

        parts = tuple(args.parts.split(","))
        record = bench_packed_kv(args.contexts, args.concurrency, log=progress_log, parts=parts)
    elif args.mode == "prefill":
        from flashloop_backend.tools.bench.prefill import bench_prefill_attention

        record = bench_prefill_attention(args.contexts, args.retention, log=progress_log)
    elif args.mode == "sparse":
        from flashloop_backend.tools.bench.sparse import bench_sparse_decode

        record = bench_sparse_decode(
            args.contexts, args.concurrency, args.key_retention, log=progress_log
        )
    elif args.mode == "kernel":
        from flashloop_backend.tools.bench.kernels import bench_decode_kernels

        record = bench_decode_kernels(
            names, args.contexts, args.concurrency, repeats=args.repeats, log=progress_log
        )
    else:
        from flashloop_backend.tools.bench.e2e import bench_end_to_end
        from flashloop_backend.tools.grid import feature_grid, point_name, selected

        points = None
        if args.grid:  # every grid point but dense, which the first backend is
            try:
                points = [(point_name(label), c) for label, c in feature_grid(config)[1:]]
                chosen = selected([name for name, _ in points], args.grid_points)
                points = [point for point, run in zip(points, chosen, strict=True) if run]
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
            if not any(n.partition("+")[0] == "flashloop" for n in names):
                raise ConfigError(f"--grid runs the flashloop backend; --backends {names} has none")
        speculation = speculation_from_args(args)
        record = {"kind": "end_to_end_host", "runs": [], "environment": environment_record()}
        for ctx in args.contexts:
            for conc in args.concurrency:
                run = bench_end_to_end(
                    names,
                    context=ctx,
                    concurrency=conc,
                    new_tokens=args.new_tokens,
                    layers=args.layers,
                    log=progress_log,
                    config=config,
                    max_batch_tokens=args.max_batch_tokens,
                    warmup_context=args.warmup_context,
                    layer_ops=tuple(v for v in args.layer_ops.split(",") if v),
                    passes=args.passes,
                    points=points,
                    speculation=speculation,
                    checkpoint=args.model,
                    exit_threshold=args.exit_threshold,
                )
                record["runs"].append(run)
                keep(record)  # a long sweep keeps what it measured
    text = json.dumps(record, indent=2)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text + "\n")
    print(text if args.json else f"wrote {args.out}" if args.out else text)
    return 0


def _report(args: argparse.Namespace) -> int:
    from pathlib import Path

    from flashloop_backend.tools.report import make_plots

    results = Path(args.results)
    if not results.is_dir():
        raise ConfigError(f"--results {args.results!r} is not a directory of JSON records")
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
    from flashloop_backend.cli.host_commands import (
        add_commands,
        at_least_two,
        int_list,
        non_negative_int,
    )

    parser = argparse.ArgumentParser(prog="flashloop-backend", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="installed backends/kernels, capabilities, selection")
    info.add_argument("--backend", help="explicit backend to resolve (default: flashloop)")
    info.add_argument("--config", help="FlashLoop config file (.json or .toml)")
    info.add_argument("--json", action="store_true", help="machine-readable output")
    info.set_defaults(handler=_info)
    bench = sub.add_parser(
        "bench", help="GPU benchmarks: kernel level or end to end through the host"
    )
    bench.add_argument("mode", choices=["kernel", "e2e", "sparse", "prefill", "packed", "serving"])
    bench.add_argument(
        "--variants",
        help="serving: comma-separated variants to run (dense, flashloop_dense: the backend "
        "with no feature, a feature name, or feature names joined by '+'; default: dense, "
        "flashloop_dense, each feature alone and cumulatively)",
    )
    bench.add_argument(
        "--rate", type=float, default=2.0, help="serving: fixed-arrival requests per second"
    )
    bench.add_argument(
        "--prefix-cache",
        action="store_true",
        help="serving: engines share published prompt prefixes (hits, misses and reused "
        "positions recorded per workload)",
    )
    bench.add_argument(
        "--shared-prefix",
        type=non_negative_int,
        default=0,
        help="serving: add closed loops whose prompts all start with this many equal tokens",
    )
    bench.add_argument(
        "--config",
        help="e2e / serving: FlashLoop config file for the flashloop backend (others: dense)",
    )
    bench.add_argument(
        "--retention",
        type=_float_list,
        default=[0.25, 0.10],
        help="prefill: token-sparse retention values to time, one case each",
    )
    bench.add_argument(
        "--key-retention",
        type=float,
        default=0.10,
        help="sparse: sparse_decode_attention.key_retention (fraction of keys kept)",
    )
    bench.add_argument(
        "--parts",
        default="decode,sparse_ops",
        help="packed: cases to run (decode: the reader per depth with its launch sweep; "
        "sparse_ops: the packed sparse-decode ops per selected-key launch)",
    )
    bench.add_argument(
        "--backends",
        default="flashinfer,triton",
        help="comma-separated; the first is the baseline; "
        "e2e: NAME+graphs replays decode steps from CUDA graphs",
    )
    bench.add_argument("--contexts", type=int_list, default=[1024, 8192, 32768])
    bench.add_argument("--concurrency", type=int_list, default=[1, 16])
    bench.add_argument("--repeats", type=int, default=30)
    bench.add_argument(
        "--new-tokens", type=int, default=16, help="e2e: generated tokens per request"
    )
    bench.add_argument(
        "--layers", type=int, default=None, help="e2e: fewer layers than Ouro-1.4B's 24"
    )
    bench.add_argument(
        "--max-batch-tokens",
        type=int,
        default=None,
        help="e2e: tokens per host step (default: one 2048-token prefill chunk per request)",
    )
    bench.add_argument(
        "--layer-ops",
        default="fused",
        help="e2e: the model's per-layer work, comma-separated: fused (one QKV and one gate-up "
        "GEMM, fused norm/RoPE/SiLU/KV-write kernels) and/or reference (separate projections, "
        "torch ops), each timed beside the other",
    )
    bench.add_argument(
        "--warmup-context",
        type=int,
        default=None,
        help="e2e: prompt length of the untimed warm-up pass (default: the timed context)",
    )
    bench.add_argument(
        "--grid",
        action="store_true",
        help="e2e: the flashloop backend at every point of the quality grid (eval --grid) in "
        "place of --config's settings, which must enable every feature",
    )
    bench.add_argument(
        "--model",
        help="e2e: a trained checkpoint directory in place of Ouro-1.4B's shapes with random "
        "weights, prompted with held-out text (speculation then accepts as on real text)",
    )
    bench.add_argument(
        "--grid-points",
        action="append",
        metavar="TEXT",
        help="e2e --grid: only the points whose name holds TEXT (repeat: every TEXT)",
    )
    bench.add_argument(
        "--speculate",
        type=at_least_two,
        metavar="K",
        help="e2e: each backend again with greedy block speculation of K rows",
    )
    bench.add_argument(
        "--draft-depth",
        type=int,
        default=2,
        help="e2e --speculate: loops a draft token runs (1 or 2; default 2)",
    )
    bench.add_argument(
        "--draft-confidence",
        type=float,
        metavar="P",
        help="e2e --speculate: a draft less probable than P ends its block's drafting "
        "(default 0: K rows every block)",
    )
    bench.add_argument(
        "--exit-threshold",
        type=float,
        metavar="P",
        help="e2e --model: tokens leave by Ouro's exit rule at threshold P in (0, 1], every "
        "backend alike; each result counts the tokens that left after each loop",
    )
    bench.add_argument(
        "--passes",
        type=int,
        default=1,
        help="e2e: timed passes per backend (TTFT and TPOT are medians over them)",
    )
    bench.add_argument("--out", help="write the JSON record here")
    bench.add_argument("--json", action="store_true")
    bench.set_defaults(handler=_bench)
    report = sub.add_parser("report", help="PNG plots from the committed JSON records")
    report.add_argument("--results", default="results", help="directory of JSON records")
    report.add_argument("--out", default="docs/figures", help="where the PNGs go")
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
    front.add_argument("--json", action="store_true")
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
        from flashloop_backend.kv.store import OutOfPackedPagesError

        if not isinstance(exc, OutOfBlocksError | OutOfPackedPagesError):
            raise
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # output piped into a closed reader (e.g. `| head`)
        return 0


if __name__ == "__main__":
    sys.exit(main())
