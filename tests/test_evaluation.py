import dataclasses
import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from flashloop_backend import ConfigError, FlashLoopConfig, embedded_model_path
from flashloop_backend.capabilities import SupportRequest
from flashloop_backend.host import Engine, load_model, load_tokenizer
from flashloop_backend.registry import Registry
from flashloop_backend.tools.evaluation import EvalSettings, evaluate

SMALL = EvalSettings(
    windows=2,
    context=24,
    continuation=8,
    passkey_contexts=(128,),
    passkey_depths=(0.5,),
    passkey_samples=2,
    bootstrap=50,
)
TEXT = (
    "def add(a, b):\n    return a + b\n\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n"
    * 8
)


@pytest.fixture(scope="module")
def embedded():
    return load_model(embedded_model_path()), load_tokenizer(embedded_model_path())


def test_teacher_forced_decode_equals_full_sequence_forward(embedded):
    """The decode path's log-probs equal a whole-sequence causal forward of the same tokens."""
    model, tokenizer = embedded
    tokens = tokenizer.encode(TEXT[:60]).ids
    context, target = tokens[:40], tokens[40:]
    backend = Registry.discover().create(
        "torch", SupportRequest(head_dim=128, num_q_heads=2, num_kv_heads=2)
    )
    result = Engine(model, backend).generate([context], forced=[target], keep_logprobs=True)[0]
    with torch.no_grad():
        hiddens, _ = model.full_forward(torch.tensor([tokens]))
        full = F.log_softmax(model.lm_head(hiddens[-1][0]).float(), dim=-1)[39:-1]
    torch.testing.assert_close(result.logprobs, full, atol=2e-4, rtol=1e-4)


def test_rows_keeping_log_probs_beside_rows_that_do_not_each_get_their_own(embedded):
    """A step's log-probs are read for the rows that keep them at once: each request still
    gets its own row's, whichever rows beside it keep theirs."""
    from flashloop_backend.host import SamplingParams

    model, tokenizer = embedded
    tokens = tokenizer.encode(TEXT[:90]).ids
    contexts = [tokens[:40], tokens[10:35], tokens[30:70]]
    backend = Registry.discover().create(
        "torch", SupportRequest(head_dim=128, num_q_heads=2, num_kv_heads=2)
    )
    alone = [
        Engine(model, backend).generate([c], forced=[tokens[70:78]], keep_logprobs=True)[0]
        for c in contexts
    ]
    engine = Engine(model, backend)
    params = SamplingParams(max_new_tokens=8)
    ids = [
        engine.add_request(c, params, forced=tokens[70:78], keep_logprobs=keep)
        for c, keep in zip(contexts, (True, False, True), strict=True)
    ]
    done = {}
    while engine.has_unfinished():
        done |= {r.request_id: r for r in engine.step()}
    assert done[ids[1]].logprobs is None
    for index in (0, 2):
        assert done[ids[index]].logprobs.shape == (8, alone[index].logprobs.shape[1])
        torch.testing.assert_close(done[ids[index]].logprobs, alone[index].logprobs)


def test_an_exit_threshold_applies_to_both_sides_and_records_where_tokens_left(embedded):
    """Ouro's exit rule on (the embedded model runs every loop by default): scored tokens
    leave at several depths, the same on both sides for dense vs dense, and the model's
    own setting is back afterwards."""
    import dataclasses

    model, tokenizer = embedded
    settings = dataclasses.replace(SMALL, exit_threshold=0.5)
    report = evaluate(model, tokenizer, TEXT, FlashLoopConfig(), "auto", settings)
    depths = report["exit_depths"]
    scored = SMALL.windows * (SMALL.continuation - 1)  # the last forced token runs no loop
    assert depths["dense"] == depths["config"] and sum(depths["dense"]) == scored
    assert sum(n > 0 for n in depths["dense"]) > 1 and report["delta_bits_per_byte_percent"] == 0
    assert not model.config.exits_early
    fixed = evaluate(model, tokenizer, TEXT, FlashLoopConfig(), "auto", SMALL)["exit_depths"]
    assert fixed["dense"] == [0, 0, 0, scored]
    seconds = report["seconds"]
    assert all(seconds[side][stage] > 0 for side in seconds for stage in ("windows", "passkey"))


def test_dense_vs_dense_is_exactly_zero(embedded):
    model, tokenizer = embedded
    report = evaluate(model, tokenizer, TEXT, FlashLoopConfig(), "auto", SMALL)
    assert report["delta_bits_per_byte_percent"] == 0.0
    assert report["delta_ci95_percent"] == [0.0, 0.0]
    assert report["kl_mean"] == 0.0 and report["kl_p99"] == 0.0
    assert report["top1_agreement"] == 1.0
    assert report["passkey_accuracy"]["dense"] == report["passkey_accuracy"]["config"]
    assert report["dense_digest"] == report["config_digest"]
    windows = report["per_window"]
    assert len(windows) == SMALL.windows
    assert all(
        w["delta_bits_per_byte_percent"] == 0.0 and w["top1_agreement"] == 1.0 for w in windows
    )


@pytest.mark.parametrize(
    ("settings", "fragment"),
    [
        (EvalSettings(windows=0), "must all be >= 1"),
        (EvalSettings(context=4000, continuation=200), "allows 4096"),
        (EvalSettings(context=2000, passkey_contexts=(128,)), "text has"),
        (EvalSettings(exit_threshold=1.5), r"exit_threshold=1.5 must be in \(0, 1\]"),
    ],
)
def test_bad_settings(embedded, settings, fragment):
    from flashloop_backend import ConfigError

    model, tokenizer = embedded
    with pytest.raises(ConfigError, match=fragment):
        evaluate(model, tokenizer, TEXT, FlashLoopConfig(), "auto", settings)


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "flashloop_backend.cli.main", *args], capture_output=True, text=True
    )


def test_eval_cli_argument_errors(tmp_path):
    missing = _cli("eval", "--text", str(tmp_path / "none.txt"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"sparse_decode_attention": {"key_retention": 2}}))
    rejected = _cli("eval", "--config", str(bad))
    assert rejected.returncode == 2 and "key_retention" in rejected.stderr
    assert "Traceback" not in missing.stderr + rejected.stderr


def test_kv_quantization_runs_the_packed_path_and_changes_the_prompt_kv_only_slightly(embedded):
    model, tokenizer = embedded
    # 24-token contexts: groups of 16 pack the first 16 rows (the rest stays BF16)
    config = FlashLoopConfig(kv_residual_quantization={"enabled": True, "group_size": 16})
    report = evaluate(model, tokenizer, TEXT, config, "auto", SMALL)
    assert report["kv_quantization"].startswith("packed INT4 store (fixed_prompt)")
    assert report["kl_mean"] > 0  # the encoding really changed the prompt's K/V
    assert report["top1_agreement"] >= 0.75
    both = FlashLoopConfig(
        kv_residual_quantization={"enabled": True, "group_size": 16},
        sparse_decode_attention={"enabled": True, "key_retention": 0.5},
    )
    combined = evaluate(model, tokenizer, TEXT, both, "auto", SMALL)
    assert combined["kl_mean"] > 0 and combined["top1_agreement"] >= 0.5


def test_all_features_on_evaluate_with_recycled_slots(embedded):
    """Scoring then passkey requests reuse token-state slots while other rows prefill; a
    state a row does not own must never reach the correction (it indexed past the batch's
    block tables before rows routed elsewhere were cleared)."""
    from flashloop_backend.cli.showcase import ALL_ON

    model, tokenizer = embedded
    settings = EvalSettings(windows=4, context=128, continuation=32, passkey_contexts=(128,),
                            passkey_samples=2, bootstrap=200)  # fmt: skip
    report = evaluate(model, tokenizer, TEXT, ALL_ON, "flashloop", settings)
    assert report["top1_agreement"] >= 0.5


def test_feature_combinations_cover_every_subset_with_the_config_settings():
    from flashloop_backend.tools.grid import feature_combinations

    config = FlashLoopConfig.from_dict(json.load(open("configs/all_on.json")))
    combos = feature_combinations(config)
    assert len(combos) == 8 and combos[0][0] == () and len(combos[-1][0]) == 3
    assert len({features for features, _ in combos}) == 8
    for features, combo in combos:
        assert combo.enabled_features() == features
        for name in features:  # each feature keeps the settings the config gave it
            assert getattr(combo, name) == getattr(config, name)
    with pytest.raises(ValueError, match="enables at least one feature"):
        feature_combinations(FlashLoopConfig())


def test_eval_combinations_needs_a_feature(tmp_path):
    result = _cli("eval", "--combinations", "--windows", "1")
    assert result.returncode == 2 and "enables at least one feature" in result.stderr


def test_the_demo_table_and_configs_all_on_describe_the_same_configuration():
    from flashloop_backend.cli.showcase import ALL_ON

    assert FlashLoopConfig.from_dict(json.load(open("configs/all_on.json"))) == ALL_ON


def test_passkey_cells_follow_the_asked_contexts(embedded):
    model, tokenizer = embedded
    settings = dataclasses.replace(SMALL, passkey_contexts=(128, 160), passkey_samples=1)
    report = evaluate(model, tokenizer, TEXT, FlashLoopConfig(), "auto", settings)
    cells = report["passkey_accuracy"]["dense"]
    assert {cell.split("_")[0] for cell in cells} == {"len128", "len160"}
    short = dataclasses.replace(settings, passkey_contexts=(100, 128))
    with pytest.raises(ConfigError, match=r"passkey contexts \[100\] are too short"):
        evaluate(model, tokenizer, TEXT, FlashLoopConfig(), "auto", short)
