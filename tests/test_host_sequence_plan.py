"""The host's sequence plan through the engine: a ``dense_prefill`` kernel declaring
``host_sequence_plan`` gets, for every batch without decode rows, the plan of the rows it
serves made from the host's own copy of them; it equals the plan from the device's tables
and lengths, and the tokens are those of the same kernel planning nothing."""

import dataclasses

import pytest
import torch

from flashloop_backend.capabilities import Capability
from flashloop_backend.host import Engine, SamplingParams
from flashloop_backend.kernels.op_protocols import OpName
from flashloop_backend.kernels.ops import KernelImpl
from flashloop_backend.kernels.sequence_plan import plan_sequences
from flashloop_backend.kernels.torch_ref.paged import paged_attention
from flashloop_backend.registry import Registry

from .host_helpers import tiny_model
from .test_feature_combinations import _config

REQUEST_SHAPE = dict(head_dim=16, block_size=4, num_q_heads=4, num_kv_heads=2)
PROMPTS = [[(5 * i + 2) % 61 for i in range(n)] for n in (37, 12, 26)]


def _engine(model, flags, record):
    """An engine whose ``dense_prefill`` runs the torch reference, declaring
    ``host_sequence_plan`` when ``record`` is a list (it gets every call's plan, tables
    and lengths)."""
    from flashloop_backend.capabilities import SupportRequest

    backend = Registry.discover().create(
        "flashloop", SupportRequest(**REQUEST_SHAPE), _config(flags)
    )
    if record is not None:
        choice = backend.kernels[OpName.DENSE_PREFILL]

        def prefill(q, kc, vc, tables, lengths, scale=None, sequence_plan=None):
            record.append((sequence_plan, tables, lengths))
            return paged_attention(q, kc, vc, tables, lengths, scale)

        support = choice.impl.support
        support = dataclasses.replace(
            support, capabilities=support.capabilities | {Capability.HOST_SEQUENCE_PLAN}
        )
        impl = KernelImpl(OpName.DENSE_PREFILL, prefill, support)
        backend.kernels[OpName.DENSE_PREFILL] = dataclasses.replace(choice, impl=impl)
    sizes = dict(num_blocks=240, block_size=4, prefill_chunk=16, max_batch_tokens=40)
    return Engine(model, backend, pad_to_multiple=8, **sizes)


FEATURES = ("token_sparse_prefill", "sparse_decode_attention", "kv_residual_quantization")


@pytest.mark.parametrize(
    "flags",
    [dict.fromkeys(FEATURES, False), dict.fromkeys(FEATURES, True)],
    ids=["no_features", "all_on"],
)
def test_prefill_batches_carry_the_host_plan_of_their_rows(flags):
    model = tiny_model(seed=11)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    calls: list = []
    planned = _engine(model, flags, calls).generate(PROMPTS, params)
    plain = _engine(model, flags, None).generate(PROMPTS, params)
    assert [r.output_token_ids for r in planned] == [r.output_token_ids for r in plain]
    with_plan = [call for call in calls if call[0] is not None]
    assert with_plan, "no prefill batch carried the host's plan"
    for plan, tables, lengths in with_plan:
        expected = plan_sequences(tables, lengths, 4)
        for field in ("qo_indptr", "kv_indptr", "page_indices", "last_page_lengths"):
            assert torch.equal(getattr(plan, field), getattr(expected, field)), field
        assert plan.has_empty_rows == expected.has_empty_rows
    # a chunk's rows form a few causal sequences, not one sequence a row
    assert any(plan.num_sequences < plan.num_rows for plan, *_ in with_plan)


def test_host_rows_must_match_their_view_and_stay_on_the_host():
    from dataclasses import replace

    from flashloop_backend.dispatch import BatchView, RowMode
    from flashloop_backend.host.batch import RowGroup, build_batch
    from flashloop_backend.host.kvcache import PagedKVCache

    kv = PagedKVCache(64, 1, 4, 2, 16, 3, torch.float32, "cpu")
    kv.reserve(0, 12)
    view = build_batch([RowGroup(0, RowMode.PREFILL, 1, 0, 6)], kv, "cpu", pad_to=8).view
    host = view.host_rows
    assert host.row_modes.tolist() == [RowMode.PREFILL] * 6 + [RowMode.PAD] * 2
    assert host.context_lengths.tolist() == [1, 2, 3, 4, 5, 6, 0, 0]
    fields = {name: getattr(view, name) for name in BatchView.__dataclass_fields__}
    narrow = replace(host, owner_tables=host.owner_tables[:, :, :1])
    with pytest.raises(ValueError, match=r"host_rows hold 8 rows, 3 planes, tables 1 wide; "):
        BatchView(**{**fields, "host_rows": narrow})
    with pytest.raises(ValueError, match=r"host rows' depths must be \[rows=8\]; got \(7,\)"):
        replace(host, depths=host.depths[:7])
    with pytest.raises(ValueError, match=r"host rows must be on the host; got devices"):
        replace(host, table_owners=host.table_owners.to("meta"))
