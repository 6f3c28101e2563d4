"""Size and time of one request's snapshot and restore: a prompt of --context tokens runs
to its --after-th generated token, is saved (``Engine.snapshot`` + ``save_snapshot``),
loaded and restored into a fresh engine, which makes one more token. Prints one JSON
line: seconds of each stage, the snapshot's bytes by part beside the KV the request held
(``Engine.kv_held``: BF16 blocks in use plus packed steady bytes).

    python3 scripts/profile_snapshot.py --config configs/all_on.json --context 32768

On a GPU the model has Ouro-1.4B shapes with random weights; ``--tiny`` (any device) a
small model of the same depth."""

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from profile_host import _model

from flashloop_backend import FlashLoopConfig
from flashloop_backend.host.engine import Engine, SamplingParams
from flashloop_backend.host.snapshot import load_snapshot, save_snapshot
from flashloop_backend.registry import Registry


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--after", type=int, default=4, help="tokens before the snapshot")
    parser.add_argument("--prefill-chunk", type=int, default=2048)
    parser.add_argument("--tiny", action="store_true", help="a small model (CPU or GPU)")
    args = parser.parse_args()
    if args.context < 2 or args.after < 1:
        parser.error(f"--context {args.context} must be >= 2 and --after {args.after} >= 1")
    model, request = _model(args)
    config = FlashLoopConfig()
    if args.config:
        config = FlashLoopConfig.from_dict(json.load(open(args.config)))
    sync = torch.cuda.synchronize if torch.cuda.is_available() and not args.tiny else lambda: None

    def engine() -> Engine:
        backend = Registry.discover().create("flashloop", request, config)
        tokens = args.context + args.after + 2
        blocks = -(-tokens // 16) * model.config.total_ut_steps + 8
        return Engine(
            model,
            backend,
            num_blocks=blocks,
            block_size=16,
            prefill_chunk=args.prefill_chunk,
            max_batch_tokens=args.prefill_chunk,
            max_context=tokens,
            max_slots=1,
        )

    source = engine()
    prompt = torch.randint(0, model.config.vocab_size, (args.context,)).tolist()
    rid = source.add_request(prompt, SamplingParams(max_new_tokens=args.after + 2))
    while source.output_count(rid) < args.after or not source.at_token_boundary(rid):
        source.step()
    source.hand_over_prompts()
    _, held = source.kv_held()
    seconds = {}
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "request.safetensors"
        start = time.perf_counter()
        snapshot = source.snapshot(rid)
        seconds["snapshot"] = time.perf_counter() - start
        start = time.perf_counter()
        save_snapshot(snapshot, path)
        seconds["save"] = time.perf_counter() - start
        file_bytes = path.stat().st_size
        del source, snapshot
        start = time.perf_counter()
        loaded = load_snapshot(path)
        seconds["load"] = time.perf_counter() - start
    target = engine()
    start = time.perf_counter()
    restored = target.restore(loaded)
    sync()
    seconds["restore"] = time.perf_counter() - start
    while target.output_count(restored) == args.after:
        target.step()
    record = {
        "context": args.context,
        "layers": model.config.num_hidden_layers,
        "config": args.config,
        "device": str(target.device),
        "after_tokens": args.after,
        "seconds": seconds,
        "snapshot_bytes": loaded.manifest["bytes"],
        "file_bytes": file_bytes,
        "kv_held_bytes": held,
    }
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
