"""Transferred bytes, handoff latency and NIXL registered bytes of a PD handoff on the
model (--model, the embedded one by default): for dense and for --config (all on), a
prompt of --context tokens of the
held-out text is prefilled by a producer engine to its first token, handed over NIXL
(UCX, host memory, two agents in this process) to a consumer engine, which makes
--new-tokens more (packing the completed prompt, which P's next step would do, is timed
apart from the handoff); the consumer's greedy tokens are checked against one engine's. Writes
one JSON record.

    python3 scripts/pd_record.py --config configs/all_on.json --context 1000 \\
        --out results/pd_handoff/pd_handoff_cpu.json
    python3 scripts/pd_record.py --model models/ouro-eval-bytes-20m --device cuda \\
        --out $OUT/pd_handoff_h200.json
"""

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from flashloop_backend.config import load_config
from flashloop_backend.host.embedded import embedded_model_path
from flashloop_backend.host.engine import Engine, SamplingParams
from flashloop_backend.host.loader import load_model, load_tokenizer
from flashloop_backend.host.pd_handoff import Consumer, Producer, handoff_record, nixl_agent
from flashloop_backend.registry import Registry
from flashloop_backend.tools.evaluation import heldout_text


def _engine(model, config) -> Engine:
    request = model.support_request(16)
    backend = Registry.discover().create("flashloop", request, config)
    return Engine(model, backend, num_blocks=1024, block_size=16)


def _handoff(model, config, prompt, new, producer, consumer_agent) -> dict:
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    whole = _engine(model, config).generate([prompt], params)[0].output_token_ids
    p_engine, d_engine = _engine(model, config), _engine(model, config)
    for engine in (p_engine, d_engine):  # the model fingerprint once, outside the timing
        engine.snapshot_identity()
    rid = p_engine.add_request(prompt, params)
    while not (p_engine.has_first_token(rid) and p_engine.at_token_boundary(rid)):
        p_engine.step()
    start = time.perf_counter()
    p_engine.hand_over_prompts()  # packing the prompt is P's prefill work, not the handoff's
    packed_s = time.perf_counter() - start
    descriptor = producer.export(p_engine, rid)
    consumer = Consumer(consumer_agent, d_engine)
    d_rid = consumer.receive(descriptor)
    producer.settle(descriptor.generation)
    p_engine.cancel(rid)
    out = {}
    while d_engine.has_unfinished():
        out.update({r.request_id: r for r in d_engine.step()})
    consumer.close()
    record = handoff_record(
        descriptor, producer.timings[descriptor.generation], consumer.timings[descriptor.generation]
    )
    record["producer_prompt_packing_s"] = packed_s
    record["same_tokens_as_one_engine"] = out[d_rid].output_token_ids == whole
    record["config_digest"] = descriptor.manifest["identity"]["config_digest"]
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="configs/all_on.json")
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--out", default="results/pd_handoff/pd_handoff_cpu.json")
    parser.add_argument("--model", default=str(embedded_model_path()), help="checkpoint dir")
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="cuda: BF16 engines on the GPU"
    )
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = load_model(args.model, args.device, dtype)
    tokenizer = load_tokenizer(args.model)
    text, source = heldout_text()
    prompt = tokenizer.encode(text).ids[: args.context]
    producer, consumer_agent = Producer(nixl_agent("P")), nixl_agent("D")
    producer.connect(consumer_agent.get_agent_metadata())
    runs = {
        name: _handoff(model, config, prompt, args.new_tokens, producer, consumer_agent)
        for name, config in (("dense", load_config(None)), ("all_on", load_config(args.config)))
    }
    producer.close()
    record = {
        "what": "PD handoff over NIXL (UCX, one process): the snapshot stages through host "
        "memory, so the ranges move DRAM to DRAM on either device",
        "model": args.model,
        "device": args.device,
        "dtype": str(dtype).removeprefix("torch."),
        "config": args.config,
        "prompt_tokens": len(prompt),
        "text_source": source,
        "new_tokens": args.new_tokens,
        "machine": platform.processor() or platform.machine(),
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
