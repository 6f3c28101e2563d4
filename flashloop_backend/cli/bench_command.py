"""The ``bench`` command: kernel, end-to-end, sparse, prefill, packed and serving
benchmarks, each timed against a dense baseline in the same process (torch loads when it runs)."""

from __future__ import annotations

import argparse
import json

from flashloop_backend.cli.arguments import (
    at_least_two,
    int_list,
    non_negative_int,
    positive_float_list,
    positive_int,
    speculation_from_args,
)
from flashloop_backend.config import ConfigError, UnservableError


def _float_list(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",") if part]
    except ValueError:
        values = []
    if not values or not all(0 < v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r} must list retention values in (0, 1]")
    return values


def _bench(args: argparse.Namespace) -> int:
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
    if args.sync_every_step and args.mode not in ("e2e", "serving", "capacity"):
        raise ConfigError(
            f"--sync-every-step applies to bench e2e, serving and capacity, not bench {args.mode}"
        )
    if graphed and args.mode not in ("e2e", "serving", "capacity"):
        raise ConfigError(
            f"{graphed}: CUDA-graph entries (NAME+graphs) apply to e2e, serving and capacity only"
        )
    config = load_config(args.config) if args.config else FlashLoopConfig()

    def keep(partial: dict) -> None:
        if args.out:
            with open(args.out, "w") as handle:
                handle.write(json.dumps(partial, indent=2) + "\n")

    if args.mode == "capacity":
        from flashloop_backend.tools.bench.capacity import bench_capacity

        record = bench_capacity(
            config,
            baseline=names[0],
            contexts=args.contexts,
            new_tokens=args.new_tokens,
            kv_memory_gib=args.kv_memory_gib,
            layers=args.layers,
            clients=args.clients,
            log=progress_log,
            max_batch_tokens=args.max_batch_tokens,
            split_mixed_steps=not args.one_traversal_mixed_steps,
            sync_every_step=args.sync_every_step,
            variant_keys=args.variants.split(",") if args.variants else None,
        )
    elif args.mode == "serving":
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
            sync_every_step=args.sync_every_step,
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
                    sync_every_step=args.sync_every_step,
                )
                record["runs"].append(run)
                keep(record)  # a long sweep keeps what it measured
    text = json.dumps(record, indent=2)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text + "\n")
    print(text if args.json else f"wrote {args.out}" if args.out else text)
    return 0


BENCH_MODES = {
    "kernel": "dense paged decode attention per layer call, the backends' kernels side by side",
    "e2e": "prefill, TTFT and TPOT through the host (Ouro-1.4B shapes or --model)",
    "sparse": "the sparse-decode ops per layer call beside FlashInfer BF16 decode",
    "prefill": "prefill attention per layer call on token-sparse subsets (--retention)",
    "packed": "the packed INT4 KV readers and sparse ops, bytes and TB/s (--parts)",
    "serving": "arrivals and closed loops per feature variant (--variants, --rate)",
    "capacity": "requests held and served at one KV budget (--kv-memory-gib, --clients)",
}


def add_bench_command(sub) -> None:
    bench = sub.add_parser(
        "bench",
        help="GPU benchmarks: kernel level or end to end through the host",
        description="GPU benchmarks, each against a dense baseline timed in the same process.\n\n"
        + "modes:\n"
        + "\n".join(f"  {mode:<8} {what}" for mode, what in BENCH_MODES.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument("mode", choices=list(BENCH_MODES), help="what to time (see modes above)")
    bench.add_argument(
        "--variants",
        help="serving: comma-separated variants to run (dense, flashloop_dense: the backend "
        "with no feature, a feature name, or feature names joined by '+'; default: dense, "
        "flashloop_dense, each feature alone and cumulatively); capacity: some of dense, "
        "kv_residual_quantization, config (default: all three)",
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
    bench.add_argument(
        "--contexts",
        type=int_list,
        default=[1024, 8192, 32768],
        help="context lengths in tokens, comma-separated (default 1024,8192,32768)",
    )
    bench.add_argument(
        "--concurrency",
        type=int_list,
        default=[1, 16],
        help="requests (rows) per batch, comma-separated (default 1,16)",
    )
    bench.add_argument(
        "--repeats", type=int, default=30, help="kernel: timed samples per case (default 30)"
    )
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
        help="e2e: tokens per host step (default: one 2048-token prefill chunk per request); "
        "capacity: (default: one 2048-token prefill chunk and every client's decode row)",
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
    bench.add_argument(
        "--kv-memory-gib",
        type=positive_float_list,
        default=[64.0],
        help="capacity: KV memory budgets in GiB, comma-separated (default 64); every "
        "variant's pools are planned from each in turn",
    )
    bench.add_argument(
        "--clients",
        type=positive_int,
        help="capacity: requests submitted at once (default three times what the config's "
        "plan holds)",
    )
    bench.add_argument(
        "--one-traversal-mixed-steps",
        action="store_true",
        help="capacity: a step with prompt chunks runs every row in one eager traversal "
        "(GraphSettings.split_mixed_steps=False; default: the decode rows replay from their "
        "CUDA graph beside eager chunks; needs NAME+graphs)",
    )
    bench.add_argument(
        "--sync-every-step",
        action="store_true",
        help="e2e, serving, capacity: wait for the device after every engine step, as every "
        "record before this option did (default: no wait; a token's time is taken when the "
        "step that sampled it returns, so the host plans a step while the device runs the "
        "one before, as a server's would)",
    )
    bench.add_argument("--out", help="write the JSON record here")
    bench.add_argument("--json", action="store_true", help="print the record as JSON")
    bench.set_defaults(handler=_bench)
