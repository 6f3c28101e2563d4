"""The flashloop backend's dispatch path against the reference kernel row by row."""

import dataclasses

import torch

from flashloop_backend import FlashLoopConfig
from flashloop_backend.capabilities import SupportRequest
from flashloop_backend.dispatch import BatchView, RowMode
from flashloop_backend.kernels.torch_ref.paged import paged_attention
from flashloop_backend.registry import Registry

REQUEST = SupportRequest(
    device="cpu", dtype=torch.float32, head_dim=16, block_size=4, num_q_heads=4, num_kv_heads=2
)


def _view(modes, depths, positions, tables):
    rows = len(modes)
    ones = torch.ones(rows, dtype=torch.int64)
    positions = torch.tensor(positions)
    modes_t = torch.tensor([int(m) for m in modes], dtype=torch.int8)
    pad = modes_t == RowMode.PAD
    return BatchView(
        positions=positions,
        depths=torch.tensor(depths),
        row_modes=modes_t,
        slots=ones,
        incarnations=ones,
        request_ids=ones,
        window_ids=-ones,
        context_lengths=torch.where(pad, 0, positions + 1).int(),
        block_tables=tables,
    )


def test_forward_dispatches_and_restores_rows(rng):
    backend = Registry.discover().create(
        "flashloop", REQUEST, FlashLoopConfig(token_sparse_prefill={"enabled": True})
    )
    kc = torch.randn(12, 4, 2, 16, generator=rng)
    vc = torch.randn(12, 4, 2, 16, generator=rng)
    M = RowMode
    modes = [M.INACTIVE, M.DECODE, M.PREFILL, M.PAD, M.DECODE, M.PREFILL, M.VERIFY]
    depths = [2, 0, 3, 0, 3, 1, 2]
    positions = [5, 9, 6, 0, 3, 2, 10]
    planes = torch.randint(0, 12, (4, len(modes), 3), generator=rng, dtype=torch.int32)
    view = _view(modes, depths, positions, planes)
    q = torch.randn(len(modes), 4, 16, generator=rng)
    out = backend.forward(q, kc, vc, view)
    for r, mode in enumerate(modes):
        if mode in (M.INACTIVE, M.PAD):
            assert torch.equal(out[r], torch.zeros_like(out[r]))
            continue
        table = planes[depths[r], r : r + 1]
        ref = paged_attention(q[r : r + 1], kc, vc, table, view.context_lengths[r : r + 1])
        torch.testing.assert_close(out[r : r + 1], ref)


def test_a_view_without_decode_rows_keeps_its_order_and_gives_the_same_rows(rng):
    """``decode_bound`` 0 (a prefill step): no gather or scatter, every prefill op over all
    rows; inactive and padding rows anywhere still come back zero, and each row equals
    what the partitioned path gives."""
    from dataclasses import replace

    from flashloop_backend.backends.batch_plan import BatchPlan

    config = FlashLoopConfig(token_sparse_prefill={"enabled": True})
    backend = Registry.discover().create("flashloop", REQUEST, config)
    kc, vc = (torch.randn(12, 4, 2, 16, generator=rng) for _ in range(2))
    M = RowMode
    modes = [M.PREFILL, M.INACTIVE, M.PREFILL, M.PAD, M.PREFILL, M.PREFILL]
    depths = [3, 2, 1, 0, 3, 0]
    planes = torch.randint(0, 12, (4, len(modes), 3), generator=rng, dtype=torch.int32)
    view = _view(modes, depths, [5, 9, 6, 0, 3, 10], planes)
    q = torch.randn(len(modes), 4, 16, generator=rng)
    partitioned = backend.forward(q, kc, vc, view)
    prefill_only = replace(view, decode_bound=0, decode_depths=frozenset())
    assert BatchPlan.of(prefill_only, config).order is None
    torch.testing.assert_close(backend.forward(q, kc, vc, prefill_only), partitioned)
    assert partitioned[[1, 3]].abs().max() == 0


def test_dense_call_surface_equals_reference(rng):
    backend = Registry.discover().create("flashloop", REQUEST, FlashLoopConfig())
    assert backend.info.selected_backend == "flashloop"
    kc = torch.randn(8, 4, 2, 16, generator=rng)
    q = torch.randn(3, 4, 16, generator=rng)
    tables = torch.tensor([[1, 2], [3, -1], [0, 0]], dtype=torch.int32)
    ctx = torch.tensor([6, 2, 0], dtype=torch.int32)
    torch.testing.assert_close(
        backend(q, kc, kc, tables, ctx), paged_attention(q, kc, kc, tables, ctx)
    )


def test_example_plugin_kernel_matches_reference(installed_plugins, on_path, rng):
    on_path(installed_plugins["example"])
    from flashloop_kernels_example import blockwise_paged_attention

    kc = torch.randn(8, 4, 2, 16, generator=rng)
    vc = torch.randn(8, 4, 2, 16, generator=rng)
    q = torch.randn(3, 4, 16, generator=rng)
    tables = torch.tensor([[1, 2, 5], [3, -1, -1], [0, 0, 0]], dtype=torch.int32)
    ctx = torch.tensor([11, 2, 0], dtype=torch.int32)
    torch.testing.assert_close(
        blockwise_paged_attention(q, kc, vc, tables, ctx), paged_attention(q, kc, vc, tables, ctx)
    )


def test_batch_view_validates_shapes():
    import pytest

    with pytest.raises(ValueError, match="depths must be"):
        BatchView(
            positions=torch.zeros(2, dtype=torch.int64),
            depths=torch.zeros(3, dtype=torch.int64),
            row_modes=torch.zeros(2, dtype=torch.int8),
            slots=torch.zeros(2, dtype=torch.int64),
            incarnations=torch.zeros(2, dtype=torch.int64),
            request_ids=torch.zeros(2, dtype=torch.int64),
            window_ids=torch.zeros(2, dtype=torch.int64),
            context_lengths=torch.zeros(2, dtype=torch.int32),
            block_tables=torch.zeros(1, 2, 1, dtype=torch.int32),
        )


def _all_on() -> FlashLoopConfig:
    return FlashLoopConfig(
        token_sparse_prefill={"enabled": True},
        sparse_decode_attention={"enabled": True},
        kv_residual_quantization={"enabled": True},
    )


def test_routable_ops_cover_every_route_of_every_combination():
    """A decode-only batch launches only ``routable_ops(config, True)``: every route a
    decode row can take (any depth, reference ready or not) must be in that set, and every
    route of any row in the full set; prefill ops are left out of the decode set."""
    from flashloop_backend.dispatch import ROUTE_CODES, routable_ops, route_rows
    from flashloop_backend.tools.grid import feature_combinations

    M = RowMode
    modes = [M.DECODE, M.VERIFY, M.PREFILL, M.INACTIVE, M.PAD] * 4
    depths = [d for d in range(4) for _ in range(5)]
    view = _view(modes, depths, [7] * 20, torch.zeros(4, 20, 2, dtype=torch.int32))
    decode = torch.tensor([m in (M.DECODE, M.VERIFY) for m in modes])
    code_to_op = {code: op for op, code in ROUTE_CODES.items()}
    for _, config in feature_combinations(_all_on()):
        for ready in (torch.zeros(20, dtype=torch.bool), torch.ones(20, dtype=torch.bool)):
            routes = route_rows(view, config, ready)
            seen = {code_to_op[int(c)] for c in routes if int(c) >= 0}
            assert seen <= routable_ops(config, decode_only=False)
            assert {code_to_op[int(c)] for c in routes[decode]} <= routable_ops(config, True)
        assert "sparse_prefill" not in {op.value for op in routable_ops(config, True)}


def test_decode_only_view_skips_prefill_ops(rng):
    """With ``decode_only`` the token-sparse prefill kernel is not launched at all."""
    from flashloop_backend.kernels.op_protocols import OpName

    config = FlashLoopConfig(token_sparse_prefill={"enabled": True})
    backend = Registry.discover().create("flashloop", REQUEST, config)

    calls = []
    choice = backend.kernels[OpName.SPARSE_PREFILL]
    original = choice.impl.fn
    object.__setattr__(choice.impl, "fn", lambda *a, **k: calls.append(1) or original(*a, **k))
    try:
        kc = torch.randn(12, 4, 2, 16, generator=rng)
        M = RowMode
        planes = torch.randint(0, 12, (4, 2, 3), generator=rng, dtype=torch.int32)
        q = torch.randn(2, 4, 16, generator=rng)
        for decode_only in (False, True):
            view = _view([M.DECODE, M.PAD], [0, 0], [5, 0], planes)
            if decode_only:
                from dataclasses import replace

                view = replace(view, decode_only=True)
            backend.forward(q, kc, kc, view)
            assert len(calls) == (0 if decode_only else 1)
            calls.clear()
    finally:
        object.__setattr__(choice.impl, "fn", original)


def test_prefill_steps_launch_only_the_prefill_op_of_their_depths(rng):
    """With ``prefill_depths`` a dense-loop prefill step launches dense_prefill alone and a
    sparse-loop step sparse_prefill alone, with the output of the view that does not say
    (every prefill op launched); padding rows stay zero."""
    from dataclasses import replace

    from flashloop_backend.dispatch import ROUTE_CODES, prefill_route_ops, route_rows
    from flashloop_backend.kernels.op_protocols import OpName

    config = FlashLoopConfig(token_sparse_prefill={"enabled": True})
    assert prefill_route_ops(config, {0, 1}) == {OpName.DENSE_PREFILL}
    assert prefill_route_ops(config, {2, 3}) == {OpName.SPARSE_PREFILL}
    assert prefill_route_ops(FlashLoopConfig(), {3}) == {OpName.DENSE_PREFILL}
    assert prefill_route_ops(config, set()) == frozenset()
    # a sparse loop that keeps every token reads consecutive rows: the dense prefill op
    full_loop_3 = FlashLoopConfig(
        token_sparse_prefill={"enabled": True, "retention": [1, 1, 1, 0.75]}
    )
    assert prefill_route_ops(full_loop_3, {2}) == {OpName.DENSE_PREFILL}
    assert prefill_route_ops(full_loop_3, {3}) == {OpName.SPARSE_PREFILL}
    assert prefill_route_ops(full_loop_3) == {OpName.DENSE_PREFILL, OpName.SPARSE_PREFILL}
    every_token = FlashLoopConfig(token_sparse_prefill={"enabled": True, "retention": [1, 1, 1, 1]})
    assert prefill_route_ops(every_token) == {OpName.DENSE_PREFILL}
    view = _view(
        [RowMode.PREFILL] * 4, [0, 1, 2, 3], [1, 2, 3, 4], torch.zeros(4, 4, 1, dtype=torch.int32)
    )
    codes = {code: op for op, code in ROUTE_CODES.items()}
    assert [codes[int(c)] for c in route_rows(view, full_loop_3)] == [
        OpName.DENSE_PREFILL,
        OpName.DENSE_PREFILL,
        OpName.DENSE_PREFILL,
        OpName.SPARSE_PREFILL,
    ]
    backend = Registry.discover().create("flashloop", REQUEST, config)
    calls = []
    originals = {}
    for op in (OpName.DENSE_PREFILL, OpName.SPARSE_PREFILL):
        impl = backend.kernels[op].impl
        originals[op] = impl.fn
        wrapped = lambda *a, _op=op, **k: calls.append(_op) or originals[_op](*a, **k)  # noqa: E731
        object.__setattr__(impl, "fn", wrapped)
    try:
        kc = torch.randn(12, 4, 2, 16, generator=rng)
        planes = torch.randint(0, 12, (4, 3, 3), generator=rng, dtype=torch.int32)
        q = torch.randn(3, 4, 16, generator=rng)
        for depth, op in ((1, OpName.DENSE_PREFILL), (3, OpName.SPARSE_PREFILL)):
            modes = [RowMode.PREFILL, RowMode.PREFILL, RowMode.PAD]
            view = _view(modes, [depth] * 3, [4, 9, 0], planes)
            expected = backend.forward(q, kc, kc, view)
            assert set(calls) == {OpName.DENSE_PREFILL, OpName.SPARSE_PREFILL}
            calls.clear()
            narrowed = replace(view, prefill_depths=frozenset({depth}))
            torch.testing.assert_close(backend.forward(q, kc, kc, narrowed), expected)
            assert calls == [op]
            assert expected[2].abs().max() == 0
            calls.clear()
    finally:
        for op, fn in originals.items():
            object.__setattr__(backend.kernels[op].impl, "fn", fn)


def test_prefill_rows_route_to_dense_prefill_and_decode_rows_to_dense_attention():
    """Prefill rows of dense loops take the tiled prefill op (one K/V tile serves the
    consecutive rows of a sequence), decode rows the decode op; with token-sparse prefill
    its loops 3-4 rows take sparse_prefill."""
    from flashloop_backend.dispatch import ROUTE_CODES, route_rows
    from flashloop_backend.kernels.op_protocols import OpName

    M = RowMode
    modes = [M.PREFILL] * 4 + [M.DECODE] * 4
    depths = [0, 1, 2, 3] * 2
    view = _view(modes, depths, [7] * 8, torch.zeros(4, 8, 2, dtype=torch.int32))
    code = {op: ROUTE_CODES[op] for op in OpName}
    dense = route_rows(view, FlashLoopConfig()).tolist()
    assert dense == [code[OpName.DENSE_PREFILL]] * 4 + [code[OpName.DENSE_ATTENTION]] * 4
    sparse = route_rows(view, FlashLoopConfig(token_sparse_prefill={"enabled": True})).tolist()
    assert sparse[:4] == [code[OpName.DENSE_PREFILL]] * 2 + [code[OpName.SPARSE_PREFILL]] * 2


def test_cuda_graphs_requirement_binds_decode_ops_only():
    """Only the decode traversal is captured: a required ``cuda_graphs`` constrains the
    kernels of ops decode rows route to, never the prefill ops (which may plan on the host)."""
    from flashloop_backend.backends.flashloop_spec import FlashLoopSpec
    from flashloop_backend.capabilities import Capability
    from flashloop_backend.dispatch import decode_route_ops, prefill_route_ops
    from flashloop_backend.tools.grid import feature_combinations

    request = REQUEST.with_required({Capability.CUDA_GRAPHS})
    for _, config in feature_combinations(_all_on()):
        needs = FlashLoopSpec()._op_needs(request, config)
        for op in decode_route_ops(config):
            assert Capability.CUDA_GRAPHS in needs[op][1], (op, config)
        for op in prefill_route_ops(config):
            assert Capability.CUDA_GRAPHS not in needs[op][1], (op, config)


def test_routable_ops_by_decode_depth_cover_every_route_at_that_depth():
    """``decode_depths`` narrows the launched ops to those a decode row at one of these
    depths can take (reference ready or not), for every combination."""
    from flashloop_backend.dispatch import ROUTE_CODES, routable_ops, route_rows
    from flashloop_backend.tools.grid import feature_combinations

    code_to_op = {code: op for op, code in ROUTE_CODES.items()}
    for _, config in feature_combinations(_all_on()):
        for depth in range(4):
            view = _view([RowMode.DECODE] * 2, [depth] * 2, [7] * 2, torch.zeros(4, 2, 2, dtype=torch.int32))  # fmt: skip
            seen = set()
            for ready in (torch.zeros(2, dtype=torch.bool), torch.ones(2, dtype=torch.bool)):
                seen |= {code_to_op[int(c)] for c in route_rows(view, config, ready)}
            assert seen == routable_ops(config, True, {depth}), (config, depth)
        assert routable_ops(config, True, {0, 1, 2, 3}) == routable_ops(config, True)


def test_decode_steps_launch_only_the_ops_of_their_depths(rng):
    """A loop-1 decode step never launches the loop-2 source or the correction; a loop-2
    step launches only the source."""
    from dataclasses import replace

    from flashloop_backend.kernels.op_protocols import OpName

    config = FlashLoopConfig(sparse_decode_attention={"enabled": True, "key_retention": 0.5})
    backend = Registry.discover().create("flashloop", REQUEST, config)
    backend.reserve_state(4, 1, 4, 16, 12, "cpu")
    calls: list[OpName] = []
    originals = {}
    for op, choice in backend.kernels.items():
        originals[op] = choice.impl.fn
        spy = lambda *a, _op=op, _fn=choice.impl.fn, **k: calls.append(_op) or _fn(*a, **k)  # noqa: E731
        object.__setattr__(choice.impl, "fn", spy)
    try:
        kc = torch.randn(12, 4, 2, 16, generator=rng)
        planes = torch.randint(0, 12, (4, 2, 3), generator=rng, dtype=torch.int32)
        q = torch.randn(2, 4, 16, generator=rng)
        expected = {0: {OpName.DENSE_ATTENTION}, 1: {OpName.DENSE_SOURCE},
                    2: {OpName.DENSE_ATTENTION, OpName.SPARSE_CORRECTION}}  # fmt: skip
        for depth, ops in expected.items():
            view = _view([RowMode.DECODE, RowMode.PAD], [depth, 0], [5, 0], planes)
            view = replace(view, decode_only=True, decode_depths=frozenset({depth}))
            backend.forward(q, kc, kc, view)
            assert set(calls) == ops, (depth, calls)
            calls.clear()
    finally:
        for op, fn in originals.items():
            object.__setattr__(backend.kernels[op].impl, "fn", fn)


def test_decode_only_view_keeps_its_order_with_padding_anywhere(rng):
    """A decode-only view runs in its own row order (no gather or scatter): padding rows
    between decode rows get zeros and every decode row its reference attention, across
    layers (the per-view masks are reused; one op serves every row)."""
    from dataclasses import replace

    M = RowMode
    modes = [M.DECODE, M.PAD, M.VERIFY, M.PAD, M.DECODE]
    depths = [0, 0, 1, 0, 3]
    positions = [7, 0, 4, 0, 10]
    kc = torch.randn(12, 4, 2, 16, generator=rng)
    vc = torch.randn(12, 4, 2, 16, generator=rng)
    planes = torch.randint(0, 12, (4, len(modes), 3), generator=rng, dtype=torch.int32)
    q = torch.randn(len(modes), 4, 16, generator=rng)
    backend = Registry.discover().create("flashloop", REQUEST, FlashLoopConfig())
    view = replace(_view(modes, depths, positions, planes), decode_only=True)
    assert backend._plan is None or backend._plan.view is not view
    for layer in range(2):
        out = backend.forward(q, kc, vc, view, layer=layer)
        assert backend._plan.order is None  # the view's own order
        for r, mode in enumerate(modes):
            if mode == M.PAD:
                assert torch.equal(out[r], torch.zeros_like(out[r]))
                continue
            table = planes[depths[r], r : r + 1]
            lengths = view.context_lengths[r : r + 1]
            torch.testing.assert_close(
                out[r : r + 1], paged_attention(q[r : r + 1], kc, vc, table, lengths)
            )


def test_decode_only_order_gives_what_the_partitioned_order_gives_with_sparse_decode(rng):
    """Sparse decode launches the loop-2 source, the correction and dense attention over
    one decode-only view: in the view's own order (padding between rows) the outputs and
    the reference states written equal those of the same rows gathered decode-first."""
    from dataclasses import replace

    M = RowMode
    modes = [M.DECODE, M.PAD, M.DECODE, M.DECODE, M.PAD, M.DECODE]
    depths = [1, 0, 2, 0, 0, 1]
    positions = [9, 0, 6, 11, 0, 5]
    kc = torch.randn(12, 4, 2, 16, generator=rng)
    vc = torch.randn(12, 4, 2, 16, generator=rng)
    planes = torch.randint(0, 12, (4, len(modes), 3), generator=rng, dtype=torch.int32)
    q = torch.randn(len(modes), 4, 16, generator=rng)
    base = _view(modes, depths, positions, planes)
    slots = torch.tensor([0, -1, 1, 2, -1, 3])
    base = replace(base, slots=slots, incarnations=torch.ones(len(modes), dtype=torch.int64))
    config = FlashLoopConfig(sparse_decode_attention={"enabled": True, "key_retention": 0.5})
    results = []
    for decode_only in (True, False):
        backend = Registry.discover().create("flashloop", REQUEST, config)
        backend.reserve_state(
            4, num_layers=2, num_heads=4, head_dim=16, max_context=64, device="cpu"
        )
        view = replace(base, decode_only=decode_only)
        outs = [backend.forward(q, kc, vc, view, layer=layer) for layer in range(2)]
        assert (backend._plan.order is None) == decode_only
        results.append((outs, backend.states.read(1, slots.clamp(min=0))))
    (outs_own, states_own), (outs_gathered, states_gathered) = results
    for own, gathered in zip(outs_own, outs_gathered, strict=True):
        torch.testing.assert_close(own, gathered)
        assert torch.equal(own[1], torch.zeros_like(own[1]))
    for own, gathered in zip(states_own, states_gathered, strict=True):
        torch.testing.assert_close(own, gathered)


def test_decode_only_view_with_rows_past_its_decode_bound_is_partitioned():
    """Padding past ``decode_bound`` (the host plans packed metadata for the first
    decode_bound rows only) keeps the decode-first gather; a bucket's view (no bound) and
    a view without padding keep their own order."""
    from dataclasses import replace

    from flashloop_backend.backends.batch_plan import BatchPlan

    M = RowMode
    planes = torch.zeros(4, 3, 2, dtype=torch.int32)
    view = replace(
        _view([M.DECODE, M.DECODE, M.PAD], [0, 1, 0], [3, 4, 0], planes), decode_only=True
    )
    assert BatchPlan.of(replace(view, decode_bound=2), FlashLoopConfig()).order is not None
    assert BatchPlan.of(view, FlashLoopConfig()).order is None
    full = replace(_view([M.DECODE, M.DECODE], [0, 1], [3, 4], planes[:, :2]), decode_only=True)
    assert BatchPlan.of(replace(full, decode_bound=2), FlashLoopConfig()).order is None


def test_prefill_kernel_sees_the_same_tables_and_lengths_at_every_layer(rng):
    """A kernel that plans on the host (FlashInfer) recognises the batch by its input
    tensors: every layer of one view passes the very same tables and lengths objects, with
    and without sparse decode (whose decode routes change from layer to layer)."""
    from flashloop_backend.kernels.op_protocols import OpName

    M = RowMode
    modes = [M.PREFILL, M.PREFILL, M.DECODE, M.PAD]
    planes = torch.randint(0, 12, (4, len(modes), 3), generator=rng, dtype=torch.int32)
    kc = torch.randn(12, 4, 2, 16, generator=rng)
    q = torch.randn(len(modes), 4, 16, generator=rng)
    for config in (FlashLoopConfig(), FlashLoopConfig(sparse_decode_attention={"enabled": True})):
        backend = Registry.discover().create("flashloop", REQUEST, config)
        if config.sparse_decode_attention.enabled:
            backend.reserve_state(
                4, num_layers=2, num_heads=4, head_dim=16, max_context=64, device="cpu"
            )
        choice = backend.kernels[OpName.DENSE_PREFILL]
        original, seen = choice.impl.fn, []

        def spy(q, kc, vc, tables, lengths, scale=None, original=original, seen=seen):
            seen.append((tables, lengths))
            return original(q, kc, vc, tables, lengths, scale)

        object.__setattr__(choice.impl, "fn", spy)
        try:
            view = _view(modes, [0, 0, 1, 0], [2, 3, 7, 0], planes)
            for layer in range(2):
                backend.forward(q, kc, kc, view, layer=layer)
        finally:
            object.__setattr__(choice.impl, "fn", original)
        assert len(seen) == 2
        assert seen[0][0] is seen[1][0] and seen[0][1] is seen[1][1]


def test_the_flashinfer_plan_key_compares_contents_of_inference_tensors():
    """Inference tensors keep no version counter: the planner's key has none for them, so
    it compares contents instead of trusting the objects (vLLM-style hosts run the forward
    in inference mode)."""
    from flashloop_backend.kernels.validate import tensor_versions

    plain = torch.zeros(3, dtype=torch.int32)
    assert tensor_versions(plain, plain) == (plain._version, plain._version)
    with torch.inference_mode():
        frozen = torch.zeros(3, dtype=torch.int32)
    assert tensor_versions(plain, frozen) is None


def test_a_batch_of_loop_3_4_rows_only_hints_its_packed_read_as_a_fallback():
    """Where every row decodes at a sparse loop, the packed read serves only rows without
    a loop-2 reference: its inputs carry ``few_rows``; a batch with another depth, a
    prefill row or unknown depths does not."""
    from flashloop_backend import FlashLoopConfig

    config = FlashLoopConfig(
        sparse_decode_attention={"enabled": True}, kv_residual_quantization={"enabled": True}
    )
    backend = Registry.discover().create("flashloop", REQUEST, config)
    tables = torch.zeros(4, 2, 2, dtype=torch.int32)  # depth planes, rows, blocks
    decode = [RowMode.DECODE, RowMode.DECODE]

    def view(depths, modes=decode, known=True, decode_only=True):
        base = _view(modes, depths, [3, 5], tables)
        return dataclasses.replace(
            base,
            decode_only=decode_only,
            decode_depths=frozenset(depths) if known else None,
        )

    assert backend._fallback_only(view([2, 3]))
    assert backend._fallback_only(view([3, 3]))
    assert not backend._fallback_only(view([1, 3]))  # a loop-2 source row
    assert not backend._fallback_only(view([0, 2]))  # a loop-1 read
    assert not backend._fallback_only(view([2, 3], known=False))
    assert not backend._fallback_only(view([2, 3], decode_only=False))
    plain = Registry.discover().create(
        "flashloop", REQUEST, FlashLoopConfig(kv_residual_quantization={"enabled": True})
    )
    assert not plain._fallback_only(view([2, 3]))  # KV quantization alone: a real read
    # the hint is part of the graph key: a graph captured with it never serves loop 1-2 rows
    hinted = backend.decode_ops(frozenset({2, 3}))
    assert "packed_decode:few_rows" in hinted and "packed_sparse_correction" in hinted
    assert "packed_decode" in backend.decode_ops(frozenset({0, 2}))
    assert backend.decode_ops(frozenset({0, 2})) != hinted
