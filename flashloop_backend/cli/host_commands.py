"""CLI commands that drive the host: ``demo`` (the main job) here, ``generate``
(:mod:`flashloop_backend.cli.generate_command`) and ``eval``
(:mod:`flashloop_backend.cli.eval_command`) registered beside it.

The parser is built without torch; each command imports what it runs when it runs.
"""

from __future__ import annotations

import argparse
import time

from flashloop_backend.cli.arguments import add_common_options, positive_int
from flashloop_backend.cli.engine_setup import FINISH_WORDS, encode_prompt, setup_engine
from flashloop_backend.cli.eval_command import add_eval_command
from flashloop_backend.cli.generate_command import add_generate_command

DEMO_PROMPTS = (
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main():\n",
    "class Stack:\n    def __init__(self):\n",
    "The pass key is 71942. Remember it. 71942 is the pass key. "
    "What is the pass key? The pass key is ",
)


def _demo(args: argparse.Namespace) -> int:
    from flashloop_backend.host.engine import SamplingParams
    from flashloop_backend.host.generation import generate_with_progress

    engine, tokenizer, _ = setup_engine(args, print)
    prompts = [encode_prompt(tokenizer, engine, p) for p in DEMO_PROMPTS]
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    start = time.perf_counter()
    results = generate_with_progress(engine, prompts, params, "demo")
    seconds = time.perf_counter() - start
    generated = sum(len(r.output_token_ids) for r in results)
    for prompt, result in zip(DEMO_PROMPTS, results, strict=True):
        why = FINISH_WORDS.get(result.finish_reason, result.finish_reason)
        print(f"\n--- prompt {result.request_id} (stopped: {why}) ---")
        print(prompt + tokenizer.decode(result.output_token_ids))
    cfg, kv = engine.cfg, engine.kv
    print(
        f"\n{generated} tokens generated in {seconds:.2f} s: {generated / seconds:.1f} tokens/s, "
        f"prefill included, on {engine.device.type} (the first run: it includes warm-up)"
    )
    print(
        f"KV cache format: {kv.bytes_per_token()} bytes per token position = K and V x "
        f"{cfg.total_ut_steps} loop depths x {cfg.num_hidden_layers} layers x "
        f"{cfg.num_key_value_heads} KV heads x {cfg.head_dim} dims x "
        f"{kv.key_pool.element_size()} bytes ({str(kv.key_pool.dtype).removeprefix('torch.')})"
    )
    if not args.no_compare:
        from flashloop_backend.cli.showcase import side_by_side

        side_by_side(engine.model, tokenizer, args.block_size)
    return 0


def add_commands(sub) -> None:
    demo = sub.add_parser("demo", help="main job: generate on the embedded model")
    add_common_options(demo)
    demo.add_argument(
        "--max-new-tokens", type=positive_int, default=48, help="tokens to generate (default 48)"
    )
    demo.add_argument(
        "--no-compare",
        action="store_true",
        help="skip the closing dense vs FlashLoop (all on) table",
    )
    demo.set_defaults(handler=_demo)
    add_generate_command(sub)
    add_eval_command(sub)
