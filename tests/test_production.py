"""The production model size: published widths per family, the option that selects it, and the
mutants' numeric effect in the report. Building the models themselves needs a GPU (nightly);
here the configs are checked on the meta device, which allocates nothing."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from rlconform.fixtures.families import build_family
from rlconform.fixtures.sizes import PRODUCTION_MODELS, has_size, model_size
from rlconform.reports.html import render_html
from rlconform.reports.markdown import render_markdown
from rlconform.reports.model import validate_report
from rlconform.reports.sample import example_report

# family -> (text hidden size, layers, parameters in billions +- 10 %), as published
PUBLISHED = {
    "qwen2_vl": (1536, 28, 2.2),
    "qwen2_5_vl": (2048, 36, 3.75),
    "qwen3_vl": (2048, 28, 2.3),
    "gemma3": (2560, 34, 4.3),
    "smolvlm": (2048, 24, 2.25),
    "text": (1536, 28, 1.54),
}


def _text_config(config):
    return getattr(config, "text_config", config)


@pytest.mark.parametrize("family", sorted(PRODUCTION_MODELS))
def test_production_size_has_the_published_widths(family):
    fam = build_family(family, "production")
    hidden, layers, billions = PUBLISHED[family]
    text = _text_config(fam.config)
    assert (text.hidden_size, text.num_hidden_layers) == (hidden, layers)
    with torch.device("meta"):
        model = fam.model_class._from_config(fam.config, attn_implementation="eager",
                                             dtype=torch.bfloat16)
    n = sum(p.numel() for p in model.parameters()) / 1e9
    assert abs(n - billions) <= 0.1 * billions, f"{family}: {n:.2f}B parameters"
    tiny = build_family(family, "tiny")
    assert _text_config(tiny.config).hidden_size == 64, "the tiny size changed"
    assert fam.tokenizer.get_vocab() == tiny.tokenizer.get_vocab()


@pytest.mark.parametrize("family", ["qwen2_vl", "gemma3", "smolvlm"])
def test_production_processors_feed_the_production_vision_towers(family):
    """The processor's image size and tokens per image match the production vision config."""
    from rlconform.fixtures.images import make_prompts

    fam = build_family(family, "production")
    prompts, images, _ = make_prompts(2, [1, 2], seed=0)
    feats = fam.process(prompts, images)
    n_image_tokens = int((feats["input_ids"] == fam.image_token_id).sum())
    if family == "gemma3":
        assert list(feats["pixel_values"].shape[1:]) == [3, 896, 896]
        assert n_image_tokens == 3 * 256
    elif family == "smolvlm":
        assert list(feats["pixel_values"].shape[-2:]) == [384, 384]
        assert n_image_tokens % 81 == 0
    else:
        grid = feats["image_grid_thw"]
        assert n_image_tokens == int(grid.prod(-1).sum()) // 4
        assert int(grid.prod(-1).min()) >= 256, "production images give >= 64 tokens each"


def test_families_without_a_production_size_refuse_it():
    with pytest.raises(KeyError, match="no production size"):
        build_family("llava", "production")
    assert has_size("llava", "tiny") and not has_size("llava", "production")


def test_model_size_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("RLCONFORM_MODEL_SIZE", "production")
    assert model_size() == "production"
    monkeypatch.setenv("RLCONFORM_MODEL_SIZE", "huge")
    with pytest.raises(ValueError, match="huge"):
        model_size()


def test_option_deselects_trainer_tests_of_families_without_the_size():
    out = subprocess.run(
        [sys.executable, "-m", "rlconform.conformance.cli", "run", "--workers", "0",
         "--model-size", "production", "--no-report", "--collect-only", "-q",
         "--surfaces", "trainer,rollout"],
        capture_output=True, text=True, timeout=600)
    text = out.stdout
    assert "deselected" in text, text[-2000:]
    collected = "\n".join(ln for ln in text.splitlines() if "::" in ln)
    assert "llava_next" not in collected and "idefics3" not in collected, \
        "7-8B families were collected"
    assert "test_ratio_one_from_independent_recompute[gemma3]" in collected
    # the run names what the size dropped (its cells), never silently
    assert "family 'llava_next' has no production model" in text, text[-2000:]


def test_on_cuda_the_model_tests_form_two_xdist_groups_dealt_first():
    """Under --dist loadgroup on CUDA, trainer/rollout tests carry the group suffix xdist's
    scheduler reads, data-plane tests do not (xdist's own marker handling is a no-op on
    pytest 9.2). Collection only: no GPU needed."""
    from rlconform.conformance.engine.items import DEVICE_GROUP
    from rlconform.conformance.engine.runner import pytest_args

    ids: list[str] = []

    class AsAWorker:
        def pytest_configure(self, config):
            config.option.loadgroup = True  # what xdist sets in each worker

        @pytest.hookimpl(trylast=True)
        def pytest_collection_modifyitems(self, items):
            ids.extend(i.nodeid for i in items)

    pytest.main(pytest_args("reference", ["--device", "cuda", "--no-report", "--co", "-q",
                                          "-k", "ratio_one_from or one_row_roundtrip"], None),
                plugins=[AsAWorker()])
    grouped = [i for i in ids if "@" + DEVICE_GROUP in i]
    assert any("test_ratio_one_from_independent_recompute" in i for i in grouped), ids
    assert not any("test_codec" in i for i in grouped), grouped
    assert any("test_codec" in i for i in ids), ids
    groups = {i.rsplit("@", 1)[1] for i in grouped}
    assert len(groups) == 2, groups  # two production trainers fit one GPU at once
    assert [i for i in grouped if "[gemma3]" in i][0].rsplit("@")[1] != \
        [i for i in grouped if "[smolvlm]" in i][0].rsplit("@")[1], "largest two share a group"
    # the groups are the longest work units: collected first, so xdist deals them out first
    assert ids[:len(grouped)] == grouped, ids


def test_mutant_effects_render_in_the_report():
    report = example_report()
    report["mutant_effects"] = {
        "device": "cuda", "dtype": "bfloat16", "model_size": "production",
        "gates": {"probs_ratio": "|ratio - 1| > 0.2"},
        "rows": [
            {"family": "qwen2_vl", "mutant": "reference", "killed_by": [],
             "probs_ratio": {"min": 1.0, "max": 1.0, "mean": 1.0},
             "numeric_gate_catches": False},
            {"family": "qwen2_vl", "mutant": "image_blind_train_fetch",
             "killed_by": ["TRAIN-RATIO-ONE"],
             "probs_ratio": {"min": 0.0, "max": 2661.0, "mean": 0.998},
             "numeric_gate_catches": True},
        ]}
    validate_report(report)
    md = render_markdown(report)
    assert "Mutants' effect on the numeric metrics" in md and "| 2661 |" in md
    html = render_html(report)
    assert 'id="mutant-effects"' in html and "image_blind_train_fetch" in html


def _outcome(**weights):
    from types import SimpleNamespace

    return SimpleNamespace(state_dict={k: torch.tensor(v) for k, v in weights.items()})


def test_fused_attention_parity_bounds_each_module_by_its_own_update():
    """The fused-attention regime of TRAIN-LEGACY-PARITY: a module whose weights moved by a
    small fraction of its update passes, one that missed its update fails and is named."""
    from rlconform.conformance.clauses.test_trainer import (
        _assert_same_step,
        _differing_weights,
        _module_update_gaps,
    )

    initial = {"model.tower.w": torch.zeros(4), "model.lm.w": torch.zeros(2)}
    legacy = _outcome(**{"model.tower.w": [1.0, -1.0, 1.0, -1.0], "model.lm.w": [1.0, 1.0]})
    near = _outcome(**{"model.tower.w": [1.0, -1.0, 1.0, -0.98], "model.lm.w": [1.0, 1.0]})
    blind = _outcome(**{"model.tower.w": [0.0, 0.0, 0.0, 0.0], "model.lm.w": [1.0, 1.0]})
    for o in (legacy, near, blind):
        o.shards, o.loss, o.grad_norm, o.metrics = [[0]], 1.0, 2.0, {}
    near_diff, blind_diff = _differing_weights(near, legacy), _differing_weights(blind, legacy)
    assert near_diff == blind_diff == ["model.tower.w"]
    gaps = _module_update_gaps(near, legacy, initial, near_diff)
    assert gaps == pytest.approx({"model.tower": 0.01})  # the equal module is not listed
    _assert_same_step(near, legacy, near_diff, initial, gaps, 2 ** -4)
    with pytest.raises(AssertionError, match="differ in 1 tensors"):
        _assert_same_step(near, legacy, near_diff, initial)  # no gaps: the bitwise regime
    with pytest.raises(AssertionError, match=r"tolerance 0.0625 .*: model.tower 1;"):
        _assert_same_step(blind, legacy, blind_diff, initial,
                          _module_update_gaps(blind, legacy, initial, blind_diff), 2 ** -4)


def test_production_width_runs_the_splits_the_split_clause_needs(monkeypatch):
    """TRAIN-SPLIT-INVARIANCE at production width: every kind of cut its mutants need (unequal
    micro-batches, a token budget, even and uneven ranks), fewer repeats; tiny runs all seven.
    (Checked against its four mutants with the production set forced: all killed.)"""
    from rlconform.conformance.clauses.test_trainer_numerics import _PRODUCTION_SPLITS, _splits
    from rlconform.fixtures.sizes import SIZE_ENV

    tiny = _splits(6, 40)
    assert len(tiny) == 7 and set(_PRODUCTION_SPLITS) < set(tiny)
    monkeypatch.setenv(SIZE_ENV, "production")
    prod = _splits(6, 40)
    assert list(prod) == [k for k in tiny if k in _PRODUCTION_SPLITS]
    assert next(iter(prod)) == "one micro-batch"  # the baseline stays first
    worlds = {w for w, _ in prod.values()}
    assert {1, 2, 3} <= worlds
    assert any("max_tokens_per_micro_batch" in kw for _, kw in prod.values())
    assert any(kw.get("micro_batch_size") == 1 for _, kw in prod.values())
