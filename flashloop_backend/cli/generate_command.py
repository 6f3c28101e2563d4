"""The ``generate`` command: one request from an Ouro checkpoint, with sampling,
self-speculation, snapshots (save and restore), PD hand-over over NIXL and tensor
parallel ranks.

The parser is built without torch; each command imports what it runs when it runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from flashloop_backend.cli.arguments import (
    add_common_options,
    at_least_two,
    non_negative_float,
    pick_device,
    positive_int,
)
from flashloop_backend.cli.engine_setup import FINISH_WORDS, encode_prompt, setup_engine
from flashloop_backend.config import ConfigError, UnservableError


def _check_generate_args(args: argparse.Namespace) -> None:
    if (args.prompt is None) == (args.restore is None):
        raise ConfigError("give exactly one of --prompt TEXT and --restore FILE")
    if (args.snapshot is None) != (args.snapshot_after is None):
        raise ConfigError("--snapshot FILE and --snapshot-after M go together")
    if args.snapshot is not None and args.restore is not None:
        raise ConfigError("--snapshot with --restore: restore first, snapshot in a later run")
    if args.restore is not None and (args.temperature is not None or args.seed is not None):
        raise ConfigError(
            "--temperature and --seed come from the snapshot: leave them out with --restore"
        )
    if args.snapshot_after is not None and args.snapshot_after >= args.max_new_tokens:
        raise ConfigError(
            f"--snapshot-after {args.snapshot_after} must be below --max-new-tokens "
            f"{args.max_new_tokens} (the request must still run when it is saved)"
        )


def _run_one(engine, submit, prompt_rows: int, args, label: str):
    """Submit one request (``submit()`` returns its id) and run it to its end, or to its
    ``--snapshot-after`` token boundary, saved and cancelled there; returns its result and
    the snapshot's bytes by part (None without one).
    ``prompt_rows``: its prompt rows to prefill (0: restored) for the progress bar."""
    from flashloop_backend.host.generation import run_with_progress
    from flashloop_backend.host.kvcache import OutOfBlocksError
    from flashloop_backend.host.snapshot import save_snapshot

    try:  # bad sampling values, a prompt too long for the model, or for the KV pool
        rid = submit()
        if args.snapshot is None:
            rows = prompt_rows * engine.cfg.total_ut_steps
            return run_with_progress(engine, [rid], rows, args.max_new_tokens, label)[0], None
        while engine.output_count(rid) is not None and not (
            engine.output_count(rid) >= args.snapshot_after and engine.at_token_boundary(rid)
        ):
            finished = engine.step()
            if finished:
                made = len(finished[0].output_token_ids)
                raise ConfigError(
                    f"the request finished ({finished[0].finish_reason}) after {made} tokens, "
                    f"before --snapshot-after {args.snapshot_after}: nothing to snapshot"
                )
        snapshot = engine.snapshot(rid)
        save_snapshot(snapshot, args.snapshot)
        return engine.cancel(rid), snapshot.manifest["bytes"]
    except (ValueError, OutOfBlocksError) as exc:
        raise ConfigError(str(exc)) from None


def _generated_record(result, tokenizer, selection, loops, seconds, before=0, finish=None) -> dict:
    """``generate --json``'s fields for the output tokens from index ``before`` on."""
    tokens = result.output_token_ids[before:]
    # output token i comes from the loop the state before it left: the prompt's last token
    # runs every loop, each generated one until its exit
    exits = [loops - 1, *result.exit_depths][: len(result.output_token_ids)][before:]
    return {
        "prompt_token_ids": result.prompt_token_ids,
        "output_token_ids": tokens,
        "output_text": tokenizer.decode(tokens),
        "finish_reason": finish or result.finish_reason,
        "exit_depths": exits,
        "backend": selection.info.selected_backend,
        "seconds": seconds,
    }


def _generate_pd(args: argparse.Namespace) -> int:
    """``generate --pd nixl``: a producer engine prefills and makes the first token, hands
    the request over NIXL to a consumer engine (same model, config and backend, two agents
    in this process), which makes the rest (docs/pd_handoff.md)."""
    from flashloop_backend.host.engine import SamplingParams
    from flashloop_backend.host.generation import run_with_progress
    from flashloop_backend.host.kvcache import OutOfBlocksError
    from flashloop_backend.host.snapshot import SnapshotError

    taken = [f"--{n}" for n in ("snapshot", "restore", "speculate") if getattr(args, n, None)]
    taken += ["--tp"] if args.tp > 1 else []
    if taken or args.prompt is None:
        raise ConfigError(f"--pd runs one --prompt through a handoff; leave out {taken}")
    try:
        from flashloop_backend.host import pd_handoff as pd

        producer_agent, consumer_agent = pd.nixl_agent("P"), pd.nixl_agent("D")
    except ImportError as exc:
        raise ConfigError(str(exc)) from None
    log = (lambda msg: print(msg, file=sys.stderr)) if args.json else print
    p_engine, tokenizer, selection = setup_engine(args, log)
    d_engine, _, _ = setup_engine(args, lambda msg: None)
    producer, consumer = pd.Producer(producer_agent), pd.Consumer(consumer_agent, d_engine)
    producer.connect(consumer_agent.get_agent_metadata())
    prompt = encode_prompt(tokenizer, p_engine, args.prompt)
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature or 0.0, seed=args.seed
    )
    for engine in (p_engine, d_engine):  # the model fingerprint is computed once, not timed
        engine.snapshot_identity()
    start = time.perf_counter()
    try:
        rid = p_engine.add_request(prompt, params)
        while p_engine.output_count(rid) is not None and not (
            p_engine.has_first_token(rid) and p_engine.at_token_boundary(rid)
        ):
            done = p_engine.step()
        if p_engine.output_count(rid) is None:  # finished at its first token: nothing to hand
            result, record = done[0], {"transport": "nixl", "handoff": "none (finished on P)"}
        else:
            p_engine.hand_over_prompts()  # packing the prompt is P's prefill, not the handoff
            descriptor = producer.export(p_engine, rid)
            d_rid = consumer.receive(descriptor)
            producer.settle(descriptor.generation)
            p_engine.cancel(rid)  # D acknowledged: P's copy of the request ends
            timings = consumer.timings[descriptor.generation]
            record = pd.handoff_record(descriptor, producer.timings[descriptor.generation], timings)
            result = run_with_progress(d_engine, [d_rid], 0, args.max_new_tokens, "generate")[0]
    except (ValueError, OutOfBlocksError, SnapshotError, pd.HandoffError) as exc:
        raise ConfigError(str(exc)) from None
    finally:
        producer.close()
        consumer.close()
    seconds = time.perf_counter() - start
    tokens = result.output_token_ids
    if args.json:
        loops = p_engine.cfg.total_ut_steps
        generated = _generated_record(result, tokenizer, selection, loops, seconds)
        print(json.dumps({**generated, "pd": record}))
    else:
        print(args.prompt + tokenizer.decode(tokens))
        moved = record.get("transferred_bytes", {}).get("total", 0)
        log(f"[{len(tokens)} tokens, {seconds:.2f} s, handed over P -> D: {moved} bytes]")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from flashloop_backend.host.engine import SamplingParams
    from flashloop_backend.host.snapshot import SnapshotError, load_snapshot

    if getattr(args, "pd", None):
        return _generate_pd(args)

    _check_generate_args(args)
    if args.tp > 1 and getattr(args, "tensor_parallel", None) is None:
        return _generate_tensor_parallel(args)
    snapshot = None
    if args.restore is not None:  # a bad file is refused before the model loads
        try:
            snapshot = load_snapshot(args.restore)
        except SnapshotError as exc:
            raise ConfigError(str(exc)) from None
    log = (lambda msg: print(msg, file=sys.stderr)) if args.json else print
    engine, tokenizer, selection = setup_engine(args, log)
    start = time.perf_counter()
    if snapshot is not None:
        before = len(snapshot.manifest["request"]["output"])

        def submit() -> int:
            try:
                return engine.restore(snapshot, args.max_new_tokens)
            except SnapshotError as exc:
                raise ConfigError(str(exc)) from None

        prompt_text = tokenizer.decode(snapshot.manifest["request"]["prompt"])
    else:
        prompt = encode_prompt(tokenizer, engine, args.prompt)
        before, prompt_text = 0, args.prompt

        def submit() -> int:
            params = SamplingParams(
                max_new_tokens=args.max_new_tokens,
                temperature=args.temperature or 0.0,
                seed=args.seed,
            )
            return engine.add_request(prompt, params)

    rows = 0 if args.restore else len(prompt)
    result, saved_bytes = _run_one(engine, submit, rows, args, "generate")
    seconds = time.perf_counter() - start
    tokens = result.output_token_ids[before:]
    finish = "snapshot" if args.snapshot is not None else result.finish_reason
    if args.json:
        loops = engine.cfg.total_ut_steps
        record = _generated_record(result, tokenizer, selection, loops, seconds, before, finish)
        if args.tp > 1:
            record["tensor_parallel"] = args.tp
        if args.snapshot is not None:
            record["snapshot"] = args.snapshot
            record["snapshot_bytes"] = saved_bytes
        if engine.capacity_plan is not None:
            record["capacity_plan"] = dataclasses.asdict(engine.capacity_plan)
        if engine.speculation is not None:
            counts = engine.speculation.counters()
            record["acceptance_rate"] = counts.pop("acceptance_rate")
            record["speculation"] = {k.removeprefix("speculation_"): v for k, v in counts.items()}
        print(json.dumps(record))
    else:
        print(prompt_text + tokenizer.decode(result.output_token_ids))
        why = FINISH_WORDS.get(finish, finish)
        log(f"[{len(tokens)} tokens, {seconds:.2f} s, stopped: {why}]")
        if engine.speculation is not None:
            counts = engine.speculation.counters()
            log(
                f"[speculation: {counts['speculation_accepted']} of "
                f"{counts['speculation_drafted']} drafts accepted "
                f"({counts['acceptance_rate']:.0%}) in {counts['speculation_blocks']} blocks]"
            )
    return 0


def _generate_tensor_parallel(args: argparse.Namespace) -> int:
    """``generate --tp R``: R ranks, each with its share of the heads, run the request
    together; rank 0 prints. What would refuse the run in every rank is refused here."""
    import random

    from flashloop_backend.host.config import ModelError, OuroConfig
    from flashloop_backend.host.tensor_parallel import run_ranks, shard_reasons

    if args.snapshot is not None or args.restore is not None:
        raise ConfigError(
            "--tp with --snapshot or --restore: a snapshot holds one engine with every head; "
            "save and restore without --tp"
        )
    device, _ = pick_device(args.device)
    try:
        cfg = OuroConfig.from_file(Path(args.model) / "config.json")
    except (ModelError, OSError) as exc:
        raise ConfigError(f"cannot load model {args.model!r}: {exc}") from None
    reasons = shard_reasons(cfg, args.tp)
    if reasons:
        raise ConfigError(f"--tp {args.tp}: {'; '.join(reasons)}")
    if (args.temperature or 0.0) > 0 and args.seed is None:
        args.seed = random.randrange(2**31)  # every rank must draw the same tokens
    try:
        return run_ranks(args.tp, _generate_rank, (vars(args),), device)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _generate_rank(tp, arguments: dict) -> int:
    """One rank of ``generate --tp``: the same run on this rank's heads; only rank 0
    writes the result."""
    import os

    from flashloop_backend.cli.main import EXIT_UNSERVABLE, EXIT_USAGE

    args = argparse.Namespace(**arguments, tensor_parallel=tp)
    errors = sys.stderr
    if tp.rank:  # output, logs and progress bars come from rank 0 alone
        sys.stdout = sys.stderr = open(os.devnull, "w")
    try:
        return _generate(args)
    except UnservableError as exc:
        print(f"error (rank {tp.rank}): {exc}", file=errors)
        return EXIT_UNSERVABLE
    except ConfigError as exc:
        print(f"error (rank {tp.rank}): {exc}", file=errors)
        return EXIT_USAGE


def add_generate_command(sub) -> None:
    gen = sub.add_parser("generate", help="generate from an Ouro checkpoint")
    add_common_options(gen)
    gen.add_argument("--prompt", help="prompt text (or --restore FILE)")
    gen.add_argument(
        "--max-new-tokens", type=positive_int, default=32, help="tokens to generate (default 32)"
    )
    gen.add_argument(
        "--temperature", type=non_negative_float, default=None, help="0 = greedy (default)"
    )
    gen.add_argument("--seed", type=int, default=None, help="sampling seed (with --temperature)")
    gen.add_argument(
        "--json", action="store_true", help="print the result as JSON (progress to stderr)"
    )
    gen.add_argument(
        "--speculate",
        type=at_least_two,
        metavar="K",
        help="greedy self-speculation: draft K tokens at loop 2 (--draft-depth), verify them "
        "at the later loops together (the output equals the greedy output without it)",
    )
    gen.add_argument(
        "--draft-depth",
        type=positive_int,
        default=2,
        help="--speculate: loops a draft token runs before its guess (1 or 2; default 2)",
    )
    gen.add_argument(
        "--draft-confidence",
        type=float,
        metavar="P",
        help="--speculate: a draft less probable than P (in [0, 1)) ends its block's "
        "drafting, so its rows are verified at once (default 0: K rows every block)",
    )
    gen.add_argument(
        "--tp",
        type=positive_int,
        default=1,
        metavar="R",
        help="tensor parallel: split the heads over R ranks (processes joined by gloo on "
        "the CPU, NCCL on R GPUs); greedy tokens equal the single-engine run's",
    )
    gen.add_argument("--snapshot", metavar="FILE", help="save the request here and stop")
    gen.add_argument(
        "--snapshot-after",
        type=positive_int,
        metavar="M",
        help="save after M generated tokens (with --snapshot)",
    )
    gen.add_argument(
        "--restore",
        metavar="FILE",
        help="continue a saved request for --max-new-tokens more tokens",
    )
    gen.add_argument(
        "--pd",
        choices=["nixl"],
        help="prefill in one engine, hand the request over NIXL, decode in another",
    )
    gen.set_defaults(handler=_generate)
