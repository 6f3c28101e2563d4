"""What the host commands (``demo``, ``generate``) share: the engine set up from their
arguments, a prompt's encoding, and the words for why a request stopped.

The parser is built without torch; each function imports what it runs when it runs.
"""

from __future__ import annotations

import argparse

from flashloop_backend.cli.arguments import load_from_args, speculation_from_args
from flashloop_backend.config import ConfigError, UnservableError

FINISH_WORDS = {
    "length": "reached --max-new-tokens",
    "eos": "end-of-sequence token",
    "stop": "stop string",
    "forced": "teacher-forced continuation",
    "snapshot": "saved with --snapshot",
}


def setup_engine(args: argparse.Namespace, log):
    """(engine, tokenizer, backend selection) for a host command's arguments, logging the
    backend chosen, the ones skipped and the effective config through ``log``."""
    from flashloop_backend.host.engine import Engine
    from flashloop_backend.registry import Registry, resolve

    _, _, config, model, tokenizer = load_from_args(args)
    request = model.support_request(args.block_size)
    registry = Registry.discover()
    selection = registry.select_backend(args.backend, request, config)
    try:
        backend = selection.spec.create(request, config, registry, selection.info)
    except ValueError as exc:
        raise UnservableError(str(exc)) from None
    info = selection.info
    log(f"backend: {info.selected_backend} (requested {args.backend!r}: {info.selection_reason})")
    for name, reasons in selection.rejected.items():
        log(f"  skipped {name}: {'; '.join(reasons)}")
    effective = resolve(config, info.selected_backend, request, registry)
    features = list(config.enabled_features()) or "none (dense)"
    log(
        f"effective config digest {effective.digest()}: features {features}; "
        f"kernels {dict(effective.kernels)}"
    )
    speculation = speculation_from_args(args) if hasattr(args, "speculate") else None
    budget = getattr(args, "kv_memory_gib", None)
    if budget is not None and args.num_blocks is not None:
        raise ConfigError("--kv-memory-gib sizes the pools: give it or --num-blocks, not both")
    pools = {"num_blocks": 512 if args.num_blocks is None else args.num_blocks}
    if budget is not None:
        pools = {"kv_memory_bytes": int(budget * 2**30)}
    try:
        engine = Engine(
            model,
            backend,
            block_size=args.block_size,
            detokenize=tokenizer.decode,
            speculation=speculation,
            **pools,
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if engine.capacity_plan is not None:
        plan = engine.capacity_plan
        log(
            f"KV pools from {budget:g} GiB: {plan.requests} requests of {engine.max_context} "
            f"tokens ({plan.num_blocks} BF16 blocks, {plan.packed_pages} packed pages)"
        )
    return engine, tokenizer, selection


def encode_prompt(tokenizer, engine, text: str) -> list[int]:
    """``text``'s token ids after the model's BOS token (when it has one)."""
    ids = tokenizer.encode(text).ids
    bos = engine.cfg.bos_token_id
    return ([bos] if bos is not None else []) + ids
