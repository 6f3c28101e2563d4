"""How many compiled variants each Triton kernel would need for a workload, counted on CPU.

Triton compiles a kernel once per specialization key: constexpr values, each integer
argument's class (1, divisible by 16, or neither; 32 or 64 bits) and each pointer's
16-byte alignment. An eager host whose batch shapes change from step to step can reach
new keys at every step, and each costs a compile on the GPU. This script runs a workload
under Triton's interpreter and computes, for every launch, the key the GPU's Triton
(NVIDIA backend) would compute, then reports the distinct keys per kernel and which
arguments differ between them.

    TRITON_INTERPRET=1 python3 scripts/specialization_census.py eval --config configs/all_on.json
    TRITON_INTERPRET=1 python3 scripts/specialization_census.py speculate --config configs/all_on.json

``eval``: ``flashloop-backend eval`` on the embedded model (FP32, a few windows).
``speculate``: greedy block speculation on the embedded model, beside plain decoding.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flashloop_backend import embedded_model_path  # noqa: E402
from flashloop_backend.config import load_config  # noqa: E402
from flashloop_backend.host import SamplingParams, load_model, load_tokenizer  # noqa: E402
from flashloop_backend.kernels.triton.specialization import (  # noqa: E402
    specialization_census,
    varying_arguments,
)
from flashloop_backend.tools.evaluation import EvalSettings, evaluate, heldout_text  # noqa: E402


def _on_triton(config):
    """``config`` with every op the Triton provider implements routed to it. The provider
    declares CUDA alone; under the interpreter its kernels run on CPU tensors, so the
    census widens that declaration before the registry reads it."""
    from flashloop_backend.capabilities.support import Support
    from flashloop_backend.kernels import triton as triton_kernels
    from flashloop_backend.registry import Registry

    for value in vars(triton_kernels).values():
        if isinstance(value, Support):
            object.__setattr__(value, "devices", value.devices | {"cpu"})
    ops = {op.value: "triton" for op in Registry.discover().kernels["triton"].impls}
    return config.model_copy(update={"kernel_overrides": ops})


def _eval(config, args) -> None:
    model = load_model(embedded_model_path(), "cpu", torch.float32)
    text, _ = heldout_text()
    settings = EvalSettings(
        windows=args.windows,
        context=args.context,
        continuation=16,
        passkey_contexts=(256,),
        passkey_samples=0,
    )
    evaluate(model, load_tokenizer(embedded_model_path()), text, config, "flashloop", settings)


def _speculate(config, args) -> None:
    from flashloop_backend.host import Engine
    from flashloop_backend.host.speculation import SpeculationSettings
    from flashloop_backend.registry import Registry

    model = load_model(embedded_model_path(), "cpu", torch.float32)
    tokenizer = load_tokenizer(embedded_model_path())
    text, _ = heldout_text()
    tokens = tokenizer.encode(text).ids
    prompts = [[256, *tokens[i * 300 : i * 300 + args.context]] for i in range(args.windows)]
    request = model.support_request(16)
    for speculation in (None, SpeculationSettings(block_size=4)):
        backend = Registry.discover().create("flashloop", request, config)
        engine = Engine(model, backend, num_blocks=4096, speculation=speculation)
        engine.generate(prompts, SamplingParams(max_new_tokens=24, ignore_eos=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("workload", choices=["eval", "speculate"])
    parser.add_argument("--config", default=str(ROOT / "configs" / "all_on.json"))
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--out", help="JSON record of the keys per kernel")
    args = parser.parse_args()
    config = _on_triton(load_config(args.config))
    with specialization_census() as census:
        try:
            (_eval if args.workload == "eval" else _speculate)(config, args)
        finally:  # a workload stopped part-way still reports the keys it reached
            _report(census, args.out)


def _report(census: dict[str, dict[tuple, int]], out: str | None) -> None:
    record = {}
    for name, seen in sorted(census.items(), key=lambda kv: -len(kv[1])):
        varying = varying_arguments(list(seen))
        record[name] = {"launches": sum(seen.values()), "variants": len(seen), "varying": varying}
        print(f"{name}: {sum(seen.values())} launches, {len(seen)} variants")
        for arg, classes in varying.items():
            print(f"    {arg}: {classes}")
    if out:
        Path(out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
