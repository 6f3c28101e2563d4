"""GPU checks of the dense baselines (run on the H200; skipped without CUDA)."""

import pytest
import torch

from flashloop_backend import FlashLoopConfig, embedded_model_path
from flashloop_backend.capabilities import SupportRequest
from flashloop_backend.host import Engine, load_model, load_tokenizer
from flashloop_backend.kernels.torch_ref.paged import paged_attention
from flashloop_backend.registry import Registry

from .test_packed_admission import run_watching_admission

pytestmark = pytest.mark.gpu
TOL = {torch.float16: 3e-3, torch.bfloat16: 2e-2}


def _mixed_batch(
    gen, hq, hkv, dtype, block=16, dim=128, decode_lengths=(1, 16, 17, 33, 100), empty_rows=1
):
    """Decode rows, a prefill chunk (consecutive rows, one table), page-boundary positions,
    fragmented pages and ``empty_rows`` rows of length 0 (padding, and rows of the chunk's
    table that another op serves, alternating), over per-layer strided views of one pool."""
    pool = torch.randn(64, 2, block, hkv, dim, generator=gen, device="cuda").to(dtype)
    kc, vc = pool[:, 0], pool[:, 1]
    perm = torch.randperm(64, generator=gen, device="cuda").int()
    tables, lengths = [], []
    for length in decode_lengths:  # decode rows, incl. page boundaries
        tables.append(perm[:8])
        lengths.append(length)
        perm = perm.roll(5)
    chunk_table = perm[:8]
    for position in range(40, 52):  # a prefill chunk: positions 40..51 of one sequence
        tables.append(chunk_table)
        lengths.append(position + 1)
    padding = torch.full((8,), -1, dtype=torch.int32, device="cuda")
    for row in range(empty_rows):
        tables.append(padding if row % 2 == 0 else chunk_table)
        lengths.append(0)
    tables = torch.stack(tables)
    lengths = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    q = torch.randn(len(lengths), hq, dim, generator=gen, device="cuda").to(dtype)
    return q, kc, vc, tables, lengths


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("hq", "hkv"), [(16, 16), (16, 4)])
@pytest.mark.parametrize("empty_rows", [1, 150])
def test_dense_backends_match_reference(backend, dtype, hq, hkv, empty_rows):
    """150 rows of length 0 beside the chunk: FlashInfer plans them as runs of causal
    sequences (``EMPTY_RUN``), and they still return zeros."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, kc, vc, tables, lengths = _mixed_batch(gen, hq, hkv, dtype, empty_rows=empty_rows)
    request = SupportRequest("cuda", dtype, 128, 16, hq, hkv)
    fn = Registry.discover().create(backend, request, FlashLoopConfig())
    out = fn(q, kc, vc, tables, lengths)
    ref = paged_attention(q.float(), kc.float(), vc.float(), tables, lengths)
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(out[-empty_rows:], torch.zeros_like(out[-empty_rows:]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flashinfer_from_the_host_plan_equals_the_device_plan(dtype):
    """The same rows planned from the host's copy (distinct keys per table) and from the
    device's tables give the same plan, hence the same output bit for bit; across more
    calls than the adapter has plan slots, each with its own lengths, planned while a long
    kernel is still queued (so a slot's copies are pending when it is planned again), each
    call's output stays its own."""
    from flashloop_backend.kernels.flashinfer import PLAN_SLOTS, paged_attention_flashinfer
    from flashloop_backend.kernels.sequence_plan import plan_host_sequences

    gen = torch.Generator(device="cuda").manual_seed(2)
    batches = []
    for i in range(PLAN_SLOTS + 2):
        decode_lengths = (1 + i, 16 + 3 * i, 17, 33 + i, 100 - 7 * i)
        q, kc, vc, tables, lengths = _mixed_batch(gen, 16, 4, dtype, decode_lengths=decode_lengths)
        # every row's table is one of a few distinct tables: give each its own key
        distinct, keys = torch.unique(tables.cpu(), dim=0, return_inverse=True)
        plan = plan_host_sequences(keys, lengths.cpu(), distinct, 16, pin=True)
        batches.append((q, kc, vc, tables, lengths, plan))
    paged_attention_flashinfer(*batches[0][:5], sequence_plan=batches[0][5])  # compiled
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)
    # host plans queued back to back, each call's output compared after all have run
    outs = [paged_attention_flashinfer(*b[:5], sequence_plan=b[5]) for b in batches]
    for (q, kc, vc, tables, lengths, _), out in zip(batches, outs, strict=True):
        assert torch.equal(out, paged_attention_flashinfer(q, kc, vc, tables, lengths))
        ref = paged_attention(q.float(), kc.float(), vc.float(), tables, lengths)
        torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


def test_flashinfer_planned_from_the_host_does_not_wait_for_queued_kernels():
    """With a long kernel queued, ``PLAN_SLOTS`` calls planned from the host's plans (the
    prefill wrapper's mixed batches and the decode wrapper's decode-only ones) all return
    before it ends (no device read, and FlashInfer's own plan copies do not wait), and each
    output equals the device-planned one once the device has run them."""
    from flashloop_backend.kernels.flashinfer import PLAN_SLOTS, paged_attention_flashinfer
    from flashloop_backend.kernels.sequence_plan import plan_host_sequences

    gen = torch.Generator(device="cuda").manual_seed(3)
    batches = []
    for i in range(PLAN_SLOTS):
        q, kc, vc, tables, lengths = _mixed_batch(gen, 16, 4, torch.bfloat16)
        if i % 2:  # the decode rows alone: the decode wrapper's plan
            q, tables, lengths = q[:5], tables[:5], lengths[:5]
        batches.append((q, kc, vc, tables, lengths))

    def host_plan(tables, lengths):
        distinct, keys = torch.unique(tables.cpu(), dim=0, return_inverse=True)
        return plan_host_sequences(keys, lengths.cpu(), distinct, 16, pin=True)

    for batch in batches:  # every slot's wrappers made and planned once
        paged_attention_flashinfer(*batch, sequence_plan=host_plan(*batch[3:]))
    plans = [host_plan(*batch[3:]) for batch in batches]
    torch.cuda.synchronize()
    queued = torch.cuda.Event()
    torch.cuda._sleep(4_000_000_000)  # about two seconds of one SM spinning
    queued.record()
    outs = [
        paged_attention_flashinfer(*b, sequence_plan=p) for b, p in zip(batches, plans, strict=True)
    ]
    assert not queued.query(), "planning waited for the kernel queued before it"
    torch.cuda.synchronize()
    for batch, out in zip(batches, outs, strict=True):
        assert torch.equal(out, paged_attention_flashinfer(*batch))


@pytest.mark.parametrize("hq, hkv", [(20, 4), (32, 2)])
def test_flashinfer_decode_rows_at_a_ratio_its_decode_kernel_lacks(hq, hkv):
    """Single-row sequences at 5 or 16 query heads per KV head go to FlashInfer's prefill
    wrapper (its decode kernel serves 1, 2, 3, 4 and 8): the reference's output, padding
    rows zeroed, from the device's rows and from the host's plan alike."""
    from flashloop_backend.kernels.flashinfer import paged_attention_flashinfer
    from flashloop_backend.kernels.sequence_plan import plan_host_sequences

    gen = torch.Generator(device="cuda").manual_seed(4)
    q, kc, vc, tables, lengths = _mixed_batch(gen, hq, hkv, torch.bfloat16)
    rows = [0, 1, 2, 3, 4, len(lengths) - 1]  # the decode rows and the padding row
    q, tables, lengths = q[rows].contiguous(), tables[rows].contiguous(), lengths[rows]
    distinct, keys = torch.unique(tables.cpu(), dim=0, return_inverse=True)
    plan = plan_host_sequences(keys, lengths.cpu(), distinct, 16, pin=True)
    ref = paged_attention(q.float(), kc.float(), vc.float(), tables, lengths)
    for out in (
        paged_attention_flashinfer(q, kc, vc, tables, lengths),
        paged_attention_flashinfer(q, kc, vc, tables, lengths, sequence_plan=plan),
    ):
        torch.testing.assert_close(out.float(), ref, atol=TOL[torch.bfloat16], rtol=2e-2)
        assert bool((out[-1] == 0).all())


def test_triton_captures_into_a_cuda_graph():
    """Evidence for the triton provider's cuda_graphs claim: capture once, replay on new data."""
    from flashloop_backend.kernels.triton.paged_decode import paged_attention_triton

    gen = torch.Generator(device="cuda").manual_seed(1)
    q, kc, vc, tables, lengths = _mixed_batch(gen, 16, 16, torch.bfloat16)
    paged_attention_triton(q, kc, vc, tables, lengths)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention_triton(q, kc, vc, tables, lengths)
    q.copy_(torch.randn(q.shape, generator=gen, device="cuda").to(q.dtype))
    lengths.copy_(torch.clamp(lengths - 1, min=0))
    graph.replay()
    ref = paged_attention(q.float(), kc.float(), vc.float(), tables, lengths)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("backend", ["torch", "triton", "flashinfer"])
def test_host_on_gpu_agrees_with_cpu_reference(backend):
    """Teacher-forced log-probs through the host in bf16 on the GPU vs fp32 on the CPU."""
    path = embedded_model_path()
    tokenizer = load_tokenizer(path)
    text = "def merge(a, b):\n    out = []\n    while a and b:\n        out.append(a.pop(0))\n" * 3
    tokens = [256, *tokenizer.encode(text).ids]
    context, target = tokens[:120], tokens[120:180]
    runs = {}
    for device, dtype, name in (("cpu", torch.float32, "torch"), ("cuda", torch.bfloat16, backend)):
        model = load_model(path, device, dtype)
        request = SupportRequest(device, dtype, 128, 16, 2, 2)
        engine = Engine(model, Registry.discover().create(name, request, FlashLoopConfig()))
        runs[device] = engine.generate([context], forced=[target], keep_logprobs=True)[0].logprobs
    cpu, gpu = runs["cpu"], runs["cuda"]
    agreement = (cpu.argmax(-1) == gpu.argmax(-1)).float().mean().item()
    assert agreement >= 0.95, agreement
    assert (cpu.exp() * (cpu - gpu)).sum(-1).mean().item() < 0.02  # KL(fp32 || bf16)


def _all_on_combinations() -> list:
    """Every non-empty combination of configs/all_on.json's features, plus the RFC's
    aggressive token sparsity alone and with KV quantization (compact levels)."""
    import json
    from pathlib import Path

    from flashloop_backend.tools.grid import feature_combinations

    path = Path(__file__).resolve().parents[1] / "configs" / "all_on.json"
    combos = feature_combinations(FlashLoopConfig.from_dict(json.loads(path.read_text())))
    params = [
        pytest.param(config, id="+".join(features)) for features, config in combos if features
    ]
    aggressive = {"enabled": True, "window_size": 64, "retention": [1, 1, 0.5, 0.25]}
    params.append(
        pytest.param(FlashLoopConfig(token_sparse_prefill=aggressive), id="token_sparse_0.5_0.25")
    )
    params.append(pytest.param(FlashLoopConfig(token_sparse_prefill=aggressive,
                                               kv_residual_quantization={"enabled": True}),
                               id="token_sparse_0.5_0.25+kv_quant"))  # fmt: skip
    return params


@pytest.mark.parametrize("features", _all_on_combinations())
def test_flashloop_features_on_gpu_agree_with_cpu(features):
    """The flashloop backend with GPU kernels (Triton sparse correction, device selection)
    against the same configuration on the CPU reference path, teacher-forced."""
    path = embedded_model_path()
    tokenizer = load_tokenizer(path)
    text = (
        "class Queue:\n    def __init__(self):\n        self.items = []\n    def push(self, x):\n"
        * 3
    )
    tokens = [256, *tokenizer.encode(text).ids]
    context, target = tokens[:128], tokens[128:176]
    config = features
    runs = {}
    for device, dtype in (("cpu", torch.float32), ("cuda", torch.bfloat16)):
        model = load_model(path, device, dtype)
        request = SupportRequest(device, dtype, 128, 16, 2, 2)
        engine = Engine(
            model, Registry.discover().create("flashloop", request, config), prefill_chunk=128
        )
        runs[device] = engine.generate([context], forced=[target], keep_logprobs=True)[0].logprobs
    cpu, gpu = runs["cpu"], runs["cuda"]
    assert (cpu.argmax(-1) == gpu.argmax(-1)).float().mean().item() >= 0.9
    assert (cpu.exp() * (cpu - gpu)).sum(-1).mean().item() < 0.05


PACKED_FEATURES = {
    "fixed_prompt": {"kv_residual_quantization": {"enabled": True}},
    "rolling": {"kv_residual_quantization": {"enabled": True, "policy": "rolling"}},
    "fixed_prompt+token_sparse": {
        "kv_residual_quantization": {"enabled": True},
        "token_sparse_prefill": {
            "enabled": True,
            "window_size": 64,
            "retention": [1, 1, 0.5, 0.25],
        },
    },
}


@pytest.mark.parametrize("features", PACKED_FEATURES.values(), ids=PACKED_FEATURES.keys())
def test_more_requests_than_the_packed_pool_holds_wait_on_gpu(features):
    """KV quantization in bf16 with the Triton kernels: five concurrent requests need 44
    packed pages (groups of 64 at four depths) and the pool has 20, while the BF16 pool
    takes them all. They wait for pages and read what each reads alone."""
    path = embedded_model_path()
    tokenizer = load_tokenizer(path)
    text = "def push(self, item):\n    self.items.append(item)\n    return len(self.items)\n" * 6
    tokens = [256, *tokenizer.encode(text).ids]
    prompts = [tokens[7 * i : 7 * i + n] for i, n in enumerate((200, 180, 170, 150, 140))]
    forced = [tokens[7 * i + n : 7 * i + n + 64] for i, n in enumerate((200, 180, 170, 150, 140))]
    config = FlashLoopConfig(**features)
    model = load_model(path, "cuda", torch.bfloat16)
    request = SupportRequest("cuda", torch.bfloat16, 128, 16, 2, 2)

    def engine() -> Engine:
        backend = Registry.discover().create("flashloop", request, config)
        return Engine(model, backend, num_blocks=512, prefill_chunk=128, packed_pages=20)

    together = engine()
    packed = together.backend.packed
    assert sum(packed.pages_needed(len(p), 64, 4) for p in prompts) == 44
    ids = [together.add_request(p, None, f, True) for p, f in zip(prompts, forced, strict=True)]
    results, held_back, flushed = run_watching_admission(together)
    assert held_back and packed.store.accounting()["pages_used"] == 0
    assert flushed == (config.kv_residual_quantization.policy == "rolling")
    for prompt, target, rid in zip(prompts, forced, ids, strict=True):
        alone = engine().generate([prompt], forced=[target], keep_logprobs=True)[0].logprobs
        mixed = results[rid].logprobs
        assert (alone.argmax(-1) == mixed.argmax(-1)).float().mean().item() >= 0.95
        assert (alone.exp() * (alone - mixed)).sum(-1).mean().item() < 0.02
