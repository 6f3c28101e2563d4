"""How many tensor operations the flashloop backend issues per layer call around its
kernels, by decode depth: each is a kernel launch on a GPU (a graph replays them all).
Runs the embedded model through the host on the CPU with a config and counts the aten
operations dispatched inside ``FlashLoopBackend.forward``, minus those inside the chosen
kernels and minus views and allocations (which launch nothing).

    python3 scripts/backend_launches.py --config configs/all_on.json
"""

import argparse
import json
from collections import defaultdict

from torch.utils._python_dispatch import TorchDispatchMode

from flashloop_backend import FlashLoopConfig
from flashloop_backend.host.embedded import embedded_model_path
from flashloop_backend.host.engine import Engine, SamplingParams
from flashloop_backend.host.loader import load_model
from flashloop_backend.registry import Registry

VIEW_WORDS = ("view", "select", "slice", "expand", "alias", "transpose", "unsqueeze", "detach")
VIEW_WORDS += ("permute", "squeeze", "as_strided", "t.default", "split", "unbind", "empty")
VIEW_WORDS += ("scalar_tensor",)  # a Python scalar operand: a host value, not a launch


class _Counter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.active = False
        self.count = 0
        self.names: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if self.active and not any(word in name for word in VIEW_WORDS):
            self.count += 1
            self.names[name] += 1
        return func(*args, **(kwargs or {}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="configs/all_on.json")
    parser.add_argument("--new-tokens", type=int, default=6)
    parser.add_argument("--names", action="store_true", help="list the operations per depth")
    parser.add_argument("--json", action="store_true", help="end with the averages as JSON")
    args = parser.parse_args()
    config = FlashLoopConfig.from_dict(json.load(open(args.config)))
    model = load_model(embedded_model_path())
    backend = Registry.discover().create("flashloop", model.support_request(16), config)
    engine = Engine(model, backend, num_blocks=256, block_size=16, max_context=512)
    counter = _Counter()
    per_depth: dict[str, list[int]] = defaultdict(list)
    names: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    forward = backend.forward

    def counted(q, key_cache, value_cache, view, layer=0, scale=None):
        counter.count, counter.active, counter.names = 0, True, defaultdict(int)
        try:
            return forward(q, key_cache, value_cache, view, layer, scale)
        finally:
            counter.active = False
            key = "decode depths " + ",".join(str(d) for d in sorted(view.decode_depths or ()))
            key = key if view.decode_only else "with prefill"
            per_depth[key].append(counter.count)
            for name, n in counter.names.items():
                names[key][name] += n

    for choice in backend.kernels.values():  # the kernels' own operations are not counted
        original = choice.impl.fn

        def quiet(*a, original=original, **k):
            was, counter.active = counter.active, False
            try:
                return original(*a, **k)
            finally:
                counter.active = was

        object.__setattr__(choice.impl, "fn", quiet)
    backend.forward = counted
    prompt = list(range(40, 140))
    with counter:
        engine.generate([prompt], SamplingParams(max_new_tokens=args.new_tokens))
    for key, counts in sorted(per_depth.items()):
        print(f"{key}: {sum(counts) / len(counts):.1f} operations per layer call")
        if args.names:
            ops = {
                k.removeprefix("aten."): round(v / len(counts), 2) for k, v in names[key].items()
            }
            print("   ", dict(sorted(ops.items(), key=lambda kv: -kv[1])))
    if args.json:
        print(json.dumps({key: sum(c) / len(c) for key, c in sorted(per_depth.items())}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
