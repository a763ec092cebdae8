"""The openrlhf adapter's own tests, and OpenRLHF 0.11.2's defects pinned as strict xfails.

Each backend-bug the expectations file (conformance/expectations/openrlhf.toml) waives is shown
here on the smallest input, calling OpenRLHF's function directly: a fix upstream turns the xfail
into a failure to act on (drop the pin and the waiver). The rest checks that the adapter maps
rlconform batches onto `Experience` without loss and hands back what OpenRLHF returns.
"""

from __future__ import annotations

import importlib
import os
import types

import pytest
import torch

if os.environ.get("CI"):  # CI installs the openrlhf backend (nox -s tests): never skip there
    importlib.import_module("openrlhf.trainer.ppo_utils.experience")
else:
    pytest.importorskip("openrlhf.trainer.ppo_utils.experience",
                        reason="the openrlhf backend needs `pip install --no-deps "
                               "openrlhf==0.11.2 pylatexenc`")

from openrlhf.trainer.ppo_utils.experience import (  # noqa: E402
    Experience,
    balance_experiences,
    make_experience_batch,
    split_experience_batch,
)
from openrlhf.utils.vlm_utils import merge_mm_train_inputs  # noqa: E402

from rlconform.conformance.backend import load_backend  # noqa: E402
from rlconform.conformance.backends import openrlhf as adapter  # noqa: E402
from rlconform.conformance.backends import requirements  # noqa: E402
from rlconform.conformance.engine.waivers import load_expectations  # noqa: E402
from rlconform.fixtures.synthetic import MEDIA_FORMS, RowPlan, build_batch, default_plan  # noqa: E402
from rlconform.reference_impl.objects import row_difference  # noqa: E402
from rlconform.reference_impl.registry import Stage  # noqa: E402


def _sample(i: int, n_tokens: int, media: bool) -> Experience:
    """One sample as OpenRLHF's rollout makes it (SamplesGenerator._process_response_into_
    experience): batch size 1, mm_train_inputs=[dict or None], per-sample info tensors."""
    mm = {"pixel_values": torch.full((4, 6), float(i)),
          "image_grid_thw": torch.tensor([[1, 2, 2]])} if media else None
    return Experience(
        sequences=torch.arange(1, n_tokens + 1).unsqueeze(0),
        attention_mask=torch.ones(1, n_tokens, dtype=torch.long),
        action_mask=torch.ones(1, n_tokens - 1, dtype=torch.long),
        total_length=torch.tensor([float(n_tokens)]),
        rewards=torch.tensor([float(i)]),
        mm_train_inputs=[mm],
        info={"reward": torch.tensor([float(i)])},
    )


def _batched(sizes_and_media) -> Experience:
    return Experience.concat_experiences(
        [_sample(i, n, m) for i, (n, m) in enumerate(sizes_and_media)], pad_token_id=0)


# -- declarations -------------------------------------------------------------------------------
def test_backend_declares_what_it_wraps_and_why_not_the_rest():
    backend = load_backend("openrlhf")
    assert backend.surfaces == ("batch_ops",)
    assert {"batch_algebra", "micro_batching"} <= backend.capabilities
    # the surfaces it leaves out and the one capability of its surface it cannot declare
    assert set(backend.notes) == {"transport", "codec", "meta", "trainer", "rollout", "batch_union",
                                  "truncation", "padding"}
    assert "OpenRLHF 0.11.2" in backend.description
    reqs = requirements("openrlhf")
    assert "--no-deps openrlhf==0.11.2" in reqs and "pylatexenc" in reqs


def test_every_waiver_is_known_and_unexpired():
    from rlconform.conformance.catalogue import BY_ID

    expectations, problems = load_expectations("openrlhf", None, set(BY_ID))
    assert not problems, problems
    # merge_mm_train_inputs' two defects also reach the stage inputs (BATCH-STAGE-FIELDS), the
    # processor comparison (BATCH-MODEL-INPUTS), rows that differ (BATCH-HETERO-ROWS) and the
    # dict rows it hands back (BATCH-NO-ALIAS)
    assert {w.clause for w in expectations.waivers if w.category == "backend-bug"} == {
        "BATCH-ALGEBRA", "BATCH-MICRO-BATCH", "BATCH-OBJECT-INPUTS", "BATCH-STAGE-FIELDS",
        "BATCH-MODEL-INPUTS", "BATCH-HETERO-ROWS", "BATCH-NO-ALIAS"}
    for w in expectations.waivers:
        assert w.match and w.function and w.input, f"{w.label}: say the failure, function, input"
        assert w.tests, f"{w.label}: name the tests it covers"


def test_missing_openrlhf_is_named(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_openrlhf(name, *a, **kw):
        if name == "openrlhf" or name.startswith("openrlhf."):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(adapter, "_ORL", None)
    monkeypatch.setattr(builtins, "__import__", no_openrlhf)
    with pytest.raises(ImportError, match="pip install --no-deps openrlhf==0.11.2"):
        adapter.backend()


# -- the mapping --------------------------------------------------------------------------------
@pytest.mark.parametrize("form", MEDIA_FORMS)
@pytest.mark.parametrize("family", ["qwen2_5_vl", "idefics3", "nemotron_omni", "text"])
def test_experience_mapping_is_lossless(family, form):
    batch = build_batch(family, default_plan(family), media_form=form)
    exp, f = adapter.to_experience(batch)
    assert len(exp.mm_train_inputs) == len(batch), "one mm_train_inputs entry per sample"
    # row 2 is text-only: None, as OpenRLHF's rollout makes it; verl's {} rows pass as they are
    assert exp.mm_train_inputs[2] == ({} if form == "multi_modal_inputs" else None)
    back = adapter.from_experience(exp, f)
    assert batch.first_difference(back) is None, batch.first_difference(back)
    assert set(back.fields) == set(batch.fields)


def test_object_rows_reach_openrlhf_as_they_are():
    """The adapter hands OpenRLHF the batch's own row dicts, so sharing is OpenRLHF's doing."""
    batch = build_batch("qwen2_vl", default_plan("qwen2_vl"), media_form="mm_train_inputs")
    exp, _ = adapter.to_experience(batch)
    assert all(a is b for a, b in zip(exp.mm_train_inputs, batch["mm_train_inputs"].rows))


def test_wrong_row_count_is_named():
    batch = build_batch("qwen2_vl", default_plan("qwen2_vl"))
    exp, f = adapter.to_experience(batch)
    exp.total_length = torch.cat([exp.total_length, exp.total_length])
    with pytest.raises(ValueError, match=r"total_length \(rlconform 'input_lengths'\) with 8 "
                                         r"rows for 4 sequences"):
        adapter.from_experience(exp, f)


def test_validate_is_split_experience_batchs_row_check():
    ops = adapter.OpenRLHFBatchOps()
    batch = build_batch("qwen2_vl", default_plan("qwen2_vl"))
    ops.validate(batch)
    with pytest.raises(ValueError, match="mm_token_type_ids"):
        ops.validate(batch.replace(mm_token_type_ids=batch["mm_token_type_ids"][:-1]))


def test_truncation_and_padding_are_declared_missing_with_the_reason():
    backend = adapter.backend()
    assert not {"truncation", "padding"} & backend.capabilities
    assert "no batch truncation" in backend.notes["truncation"]
    assert "longest row" in backend.notes["padding"]
    assert not hasattr(adapter.OpenRLHFBatchOps, "truncate")
    assert not hasattr(adapter.OpenRLHFBatchOps, "pad_to")


# -- what holds in OpenRLHF -----------------------------------------------------------------------
def test_split_and_make_batch_keep_media_with_their_sample():
    exp = _batched([(5, True), (3, False), (7, True), (4, True)])
    items = split_experience_batch(exp)
    picked = make_experience_batch([items[i] for i in (3, 1, 0)])
    assert [None if m is None else float(m["pixel_values"][0, 0]) for m in
            picked.mm_train_inputs] == [3.0, None, 0.0], "media left their sample"
    assert picked.total_length.tolist() == [4.0, 3.0, 5.0]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_balance_experiences_keeps_every_row_with_its_media(world):
    exp = _batched([(n, n % 2 == 0) for n in (5, 3, 7, 4, 6, 2, 8, 9)])
    args = types.SimpleNamespace(actor=types.SimpleNamespace(num_nodes=1, num_gpus_per_node=world),
                                 ds=types.SimpleNamespace(ring_attn_size=1, tensor_parallel_size=1))
    parts = balance_experiences([exp], args)
    assert len(parts) == world
    seen = []
    for p in parts:
        for k in range(len(p.sequences)):
            i = int(p.rewards[k])  # _sample(i) carries reward i and pixel value i
            media = p.mm_train_inputs[k]
            assert (media is None) == (exp.mm_train_inputs[i] is None), f"row {i}'s media moved"
            if media is not None:
                assert float(media["pixel_values"][0, 0]) == i
            seen.append(i)
    assert sorted(seen) == list(range(8))


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "gemma3", "llava"])
def test_merge_gives_the_packed_media_inputs(family):
    ops = adapter.OpenRLHFBatchOps()
    batch = build_batch(family, default_plan(family))
    want = batch.multimodal_inputs(Stage.TRAIN)
    for stage in Stage:
        got = ops.multimodal_inputs(batch, stage)
        for k, v in got.items():
            assert torch.equal(v, want[k]), f"{family} {stage.value} {k}"
        # the per-token map is not a stage input from the batch (see BATCH-STAGE-FIELDS)
        assert set(want) - set(got) <= {"mm_token_type_ids", "token_type_ids"}


def test_micro_batches_with_a_divisor_keep_every_row():
    ops = adapter.OpenRLHFBatchOps()
    batch = build_batch("qwen2_vl", default_plan("qwen2_vl") * 2, media_form="mm_train_inputs")
    for seed in (None, 5):
        mbs = ops.micro_batches(batch, 4, shuffle_seed=seed)
        assert len(mbs) == 4
        assert sorted(i for idx, _ in mbs for i in idx) == list(range(8))
        for idx, mb in mbs:
            for k, i in enumerate(idx):
                why = row_difference(k, batch["mm_train_inputs"].rows[i], mb["mm_train_inputs"].rows[k])
                assert why is None, f"micro-batch row {k} (source row {i}): {why}"


# -- OpenRLHF 0.11.2's defects, pinned --------------------------------------------------------------
@pytest.mark.xfail(strict=True, reason="concat_experiences pads episode tensors [B] on their last "
                   "dim, the batch dim (waiver BATCH-ALGEBRA)")
def test_concat_experiences_of_unequal_sizes_keeps_one_value_per_sample():
    a = _batched([(5, True), (3, False)])
    b = _batched([(4, True)])
    joined = Experience.concat_experiences([a, b], pad_token_id=0)
    assert len(joined.sequences) == 3
    assert joined.total_length.tolist() == [5.0, 3.0, 4.0], joined.total_length.tolist()


@pytest.mark.xfail(strict=True, reason="split_experience_batch / make_experience_batch hand on "
                   "the source's mm_train_inputs dicts (waiver BATCH-ALGEBRA)")
def test_split_gives_each_sample_its_own_media_dict():
    exp = _batched([(5, True), (3, True)])
    items = split_experience_batch(exp)
    assert items[0].mm_train_inputs[0] is not exp.mm_train_inputs[0]


@pytest.mark.xfail(strict=True, reason="the trainer's loader drops the rows past the last full "
                   "micro-batch (drop_last=True; waiver BATCH-MICRO-BATCH)")
def test_trainer_loader_trains_every_row():
    ops = adapter.OpenRLHFBatchOps()
    batch = build_batch("qwen2_vl", default_plan("qwen2_vl") * 2)
    mbs = ops.micro_batches(batch, 3, shuffle_seed=1)  # micro_batch_size 3 for 8 rows
    assert sorted(i for idx, _ in mbs for i in idx) == list(range(8))


@pytest.mark.xfail(strict=True, raises=RuntimeError, reason="merge_mm_train_inputs torch.cat()s "
                   "[1, tiles, ...] rows of differing tile counts (waiver BATCH-OBJECT-INPUTS)")
def test_merge_joins_dim1_tiles_of_differing_counts():
    rows = [{"pixel_values": torch.zeros(1, 2, 3, 4, 4)}, {"pixel_values": torch.zeros(1, 1, 3, 4, 4)}]
    assert merge_mm_train_inputs(rows, "cpu")["pixel_values"].shape[1] == 2


@pytest.mark.xfail(strict=True, raises=ValueError, reason="merge_mm_train_inputs sends a per-image "
                   "list through torch.tensor(list) (waiver BATCH-OBJECT-INPUTS)")
def test_merge_joins_per_image_lists():
    rows = [{"pixel_values": [torch.zeros(1, 3, 4, 4), torch.zeros(1, 3, 8, 4)]}]
    assert len(merge_mm_train_inputs(rows, "cpu")["pixel_values"]) == 2


@pytest.mark.xfail(strict=True, reason="Experience has no per-token modality map; Actor.forward "
                   "rebuilds it (waiver BATCH-STAGE-FIELDS, unsupported)")
def test_stage_inputs_carry_the_per_token_map():
    ops = adapter.OpenRLHFBatchOps()
    batch = build_batch("qwen2_vl", default_plan("qwen2_vl"))
    assert "mm_token_type_ids" in ops.multimodal_inputs(batch, Stage.TRAIN)


@pytest.mark.xfail(strict=True, reason="OpenRLHF has no sequence-dim validator (waiver "
                   "BATCH-VALIDATE, unsupported)")
def test_validate_rejects_a_short_per_token_field():
    ops = adapter.OpenRLHFBatchOps()
    batch = build_batch("qwen2_vl", [RowPlan(4, images=[1]), RowPlan(3)])
    with pytest.raises(ValueError):
        ops.validate(batch.replace(mm_token_type_ids=batch["mm_token_type_ids"][:, :-1]))


def test_every_entered_step_of_the_declared_path_is_called():
    from _data_path import assert_entered

    def run():
        ops = adapter.OpenRLHFBatchOps()
        batch = build_batch("qwen2_vl", default_plan("qwen2_vl") * 2)
        ops.validate(batch)
        ops.multimodal_inputs(batch, Stage.TRAIN)
        ops.select(batch, [2, 0])
        ops.micro_batches(batch, 2)

    assert_entered(load_backend("openrlhf"), run)
