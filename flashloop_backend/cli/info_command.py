"""``flashloop-backend info``: what is installed and what a configuration would select
here (backends, kernel providers, capabilities, the effective config and its digest) and,
with ``--context``, how many requests fit a KV memory budget."""

from __future__ import annotations

import argparse
import json
import sys

from flashloop_backend._version import __version__
from flashloop_backend.cli.arguments import positive_float, positive_int
from flashloop_backend.config import ConfigError


def _info(args: argparse.Namespace) -> int:
    from flashloop_backend.backends.flashloop_support import feature_support
    from flashloop_backend.capabilities import Capability, SupportRequest
    from flashloop_backend.cli.main import EXIT_UNSERVABLE
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
        "backends": _backend_rows(registry, config, request),
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
    if args.context is not None and not status:
        report["capacity"] = _capacity(args, registry, request, config)
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        _print_text(report)
    if status:
        print(f"error: {report['error']}", file=sys.stderr)
    return status


def _capacity(args, registry, request, config) -> dict[str, object]:
    """How many requests of ``--context`` tokens (``--new-tokens`` of them generated) a
    KV budget of ``--kv-memory-gib`` holds at Ouro-1.4B's shapes, dense and under
    ``config``: the accounting ``Engine(kv_memory_bytes=...)`` sizes its pools by."""
    from flashloop_backend.config import FlashLoopConfig
    from flashloop_backend.host.capacity import requests_that_fit
    from flashloop_backend.tools.bench.bench_models import ouro_1p4b_shapes

    if not 1 <= args.new_tokens < args.context:
        raise ConfigError(
            f"--new-tokens {args.new_tokens} must be at least 1 and below --context {args.context}"
        )
    budget = int(args.kv_memory_gib * 2**30)
    prompt = args.context - args.new_tokens
    rows: dict[str, object] = {
        "model": "Ouro-1.4B shapes (24 layers, 16 KV heads of 128, 4 loops), BF16 cache",
        "kv_memory_bytes": budget,
        "prompt_tokens": prompt,
        "new_tokens": args.new_tokens,
    }
    for name, chosen in (("dense", FlashLoopConfig()), ("config", config)):
        backend = registry.create("flashloop", request, chosen)
        requests, cost = requests_that_fit(
            backend, ouro_1p4b_shapes(), args.context, args.new_tokens, budget
        )
        rows[name] = {
            "requests": requests,
            "prefill_bytes_per_request": cost.prefill_bytes,
            "decode_bytes_per_request": cost.decode_bytes,
        }
    return rows


def _backend_rows(registry, config, request) -> dict[str, object]:
    """Each backend's row; ``unavailable_here``: why it cannot serve ``request`` (this
    machine's default request) with ``config`` (empty: it can)."""
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
            "unavailable_here": registry.backend_reasons(name, request, config),
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
                "unavailable_here": impl.support.machine_reasons(
                    registry.env.devices()[-1], registry.env
                ),
            }
            ops[op.value]["usable_here"] = not ops[op.value]["unavailable_here"]
            if impl.support.min_prefill_retention is not None:
                ops[op.value]["min_prefill_retention"] = impl.support.min_prefill_retention
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
        head = f"  {name} {row['version']} (priority {row['priority']})"
        if row["unavailable_here"]:
            print(f"{head}: unavailable here: {'; '.join(row['unavailable_here'])}")
        else:
            print(f"{head}: {', '.join(on) or 'no optional capabilities'}")
    print("\nkernel implementations:")
    for name, row in report["kernels"].items():
        if not row["loaded"]:
            print(f"  {name}: NOT LOADED — {row['reason']}")
            continue
        head = f"  {name} {row['version']} (priority {row['priority']})"
        usable = [op for op, entry in row["ops"].items() if entry["usable_here"]]
        if row["ops"] and not usable:
            why = dict.fromkeys(r for e in row["ops"].values() for r in e["unavailable_here"])
            print(f"{head}: {', '.join(row['ops'])}; unavailable here: {'; '.join(why)}")
        else:
            print(f"{head}: {', '.join(row['ops'])}")
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
    capacity = report.get("capacity")
    if capacity:
        dense, mine = capacity["dense"], capacity["config"]
        ratio = f"{mine['requests'] / dense['requests']:.2f}x" if dense["requests"] else "-"
        print(
            f"\ncapacity at {capacity['kv_memory_bytes'] / 2**30:g} GiB of KV memory, "
            f"{capacity['model']}, requests of {capacity['prompt_tokens']} + "
            f"{capacity['new_tokens']} tokens (one prefilling at a time):"
        )
        for label, row in (("dense", dense), ("this config", mine)):
            print(
                f"  {label}: {row['requests']} requests "
                f"({row['prefill_bytes_per_request'] / 2**30:.2f} GiB each while prefilling, "
                f"{row['decode_bytes_per_request'] / 2**30:.2f} GiB decoding)"
            )
        print(f"  this config / dense: {ratio}")


def add_info_command(sub) -> None:
    info = sub.add_parser("info", help="installed backends/kernels, capabilities, selection")
    info.add_argument("--backend", help="explicit backend to resolve (default: flashloop)")
    info.add_argument("--config", help="FlashLoop config file (.json or .toml)")
    info.add_argument("--json", action="store_true", help="machine-readable output")
    info.add_argument(
        "--context",
        type=positive_int,
        help="also report how many requests of this many tokens (prompt and new) fit a KV "
        "memory budget, dense and under the config, at Ouro-1.4B's shapes",
    )
    info.add_argument(
        "--new-tokens",
        type=positive_int,
        default=256,
        help="tokens each of those requests generates (default 256)",
    )
    info.add_argument(
        "--kv-memory-gib",
        type=positive_float,
        default=64.0,
        help="the KV memory budget in GiB for that report (default 64)",
    )
    info.set_defaults(handler=_info)
