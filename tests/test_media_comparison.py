"""The clauses' media comparison (conformance/clauses/_check.py media_difference): it accepts
every representation that gives the model the same inputs and rejects each way the inputs
change."""

from __future__ import annotations

import torch

from rlconform.conformance.clauses._check import batch_difference, media_difference
from rlconform.fixtures.synthetic import RowPlan, build_batch
from rlconform.reference_impl.packed import PackedTensor

A, B, C = torch.arange(8.0).reshape(2, 4), torch.arange(4.0).reshape(1, 4) + 8, torch.ones(3, 4)
WANT = PackedTensor.from_rows([[A, B], None, [C]])


def test_a_rows_images_merged_into_one_segment_are_the_same_input():
    merged = PackedTensor.from_rows([torch.cat([A, B]), None, C])
    assert media_difference("pixel_values", WANT, merged) is None


def test_shared_segments_and_their_copies_are_the_same_input():
    shared = PackedTensor([A, C], [(0,), (0,), (1,)])
    copied = PackedTensor.from_rows([A, A.clone(), C])
    assert media_difference("pixel_values", shared, copied) is None


def test_a_missing_field_is_all_none_rows_only():
    assert media_difference("pixel_values", PackedTensor.from_rows([None, None]), None) is None
    assert "missing" in media_difference("pixel_values", WANT, None)


def test_each_change_of_the_model_input_is_named():
    cases = {
        "is present": PackedTensor.from_rows([[A, B], [torch.zeros(0, 4)], [C]]),  # a (0, ...) row
        "entries on the packing dim": PackedTensor.from_rows([[A], [B], [C]]),  # moved a row
        "model input": PackedTensor.from_rows([[A, B], None, [C + 1]]),
        "PackedTensor": torch.cat([A, B, C]),  # densified
        "rows": PackedTensor.from_rows([[A, B], None]),
    }
    for what, got in cases.items():
        why = media_difference("pixel_values", WANT, got)
        assert why is not None and what in why, f"{what}: {why}"


def test_a_turned_image_is_a_different_input():
    portrait = torch.arange(24.0).reshape(1, 2, 3, 4)
    landscape = portrait.reshape(1, 2, 4, 3)
    want = PackedTensor.from_rows([[portrait], [torch.zeros(1, 2, 4, 4)]])
    got = PackedTensor.from_rows([[landscape], [torch.zeros(1, 2, 4, 4)]])
    assert "model input" in media_difference("pixel_values", want, got)


def test_batch_difference_keeps_non_media_fields_exact():
    batch = build_batch("qwen2_vl", [RowPlan(3, images=[1, 2]), RowPlan(4)])
    assert batch_difference(batch, batch) is None
    changed = batch.replace(input_ids=batch["input_ids"] + 1)
    assert "input_ids" in batch_difference(batch, changed)
