"""The regime fixtures build what they name, and the snapshot helpers see what they must.

A regime case that silently falls back to an ordinary batch, or a snapshot that misses a change,
would make the kinds-of-check clauses pass on nothing; these pin both.
"""

from __future__ import annotations

import pytest
import torch

from rlconform.conformance.clauses._check import assert_unchanged, scribble, snapshot
from rlconform.fixtures.strategies import batch_cases, hetero_cases, tiles_images
from rlconform.fixtures.synthetic import (
    LAYOUTS,
    MEDIA_REGIMES,
    images_per_row,
    layout_of,
    media_families,
    media_regime_of,
    regime_plan,
    row_heterogeneity,
)
from rlconform.reference_impl.batch import Batch
from rlconform.reference_impl.meta import BatchMeta

COUNTED = [m for m in MEDIA_REGIMES if m != "turned"]  # turned media differ by shape, not count


@pytest.mark.parametrize("media", COUNTED)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_regime_plans_are_in_the_regime_they_name(layout, media):
    from rlconform.fixtures.synthetic import build_batch

    for family in ("qwen2_vl", "idefics3", "llava_next"):
        batch = build_batch(family, regime_plan(family, layout, media))
        assert layout_of(batch) == layout, (family, layout, media, batch.seq_lens.tolist())
        if layout != "single_row" or media in ("ragged", "media_free", "all_media", "uniform",
                                               "equal_count"):
            got = media_regime_of(batch)
            want = {"ragged": {"ragged", "all_media"}}.get(media, {media})
            if layout == "single_row":  # one row: uniform, all media and equal counts coincide
                want |= {"uniform", "all_media", "equal_count"}
            if media == "equal_count" and tiles_images(family):  # one run of tiles a row
                want = {"uniform"}
            assert got in want, (family, layout, media, images_per_row(batch))


def test_explicit_cases_cover_every_family_layout_and_media_regime():
    cases = batch_cases()
    assert {c.family for c in cases} == set(media_families())
    assert {c.layout for c in cases} == set(LAYOUTS)
    assert {c.media for c in cases} == set(MEDIA_REGIMES)
    mrope = {c.layout for c in cases if c.position_ids in (3, 4)}
    assert mrope == set(LAYOUTS), f"M-RoPE position ids only in {sorted(mrope)}"


def test_heterogeneous_cases_differ_in_every_way():
    kinds = set()
    for case in hetero_cases():
        kinds |= row_heterogeneity(case.build())
    assert kinds == {"None and {} rows", "different key sets", "keys in another order",
                     "list and tensor values of one key"}, kinds


def test_a_case_is_built_afresh_each_time():
    case = batch_cases()[0]
    a, b = case.build(), case.build()
    assert a is not b and a.first_difference(b) is None
    a.fields["input_ids"].add_(1)
    assert a.first_difference(b) is not None, "two builds share a tensor"


def _batch() -> Batch:
    return hetero_cases(families=("llava_next",))[0].build()


@pytest.mark.parametrize("change", ["tensor bit", "dict row key", "list value", "field dict",
                                    "packed rows"])
def test_snapshot_sees_every_in_place_change(change):
    from rlconform.fixtures.synthetic import build_batch, default_plan

    batch = build_batch("qwen2_vl", default_plan("qwen2_vl")) if change == "packed rows" \
        else _batch()
    before = snapshot(batch)
    assert_unchanged(before, batch, "untouched")
    col = batch.fields.get("mm_train_inputs") or batch.fields.get("multi_modal_inputs")
    if change == "tensor bit":
        t = batch["generation_logprobs"]
        t.view(torch.int32)[0, 0] ^= 1  # one bit of one value
    elif change == "dict row key":
        next(r for r in col.rows if r).pop(next(iter(next(r for r in col.rows if r))))
    elif change == "list value":
        row = next(r for r in col.rows if r and any(isinstance(v, list) for v in r.values()))
        next(v for v in row.values() if isinstance(v, list)).append(torch.zeros(1))
    elif change == "field dict":
        batch.fields.pop("advantages")
    else:
        batch["pixel_values"].rows.reverse()
    with pytest.raises(AssertionError, match="was changed"):
        assert_unchanged(before, batch, change)


def test_scribble_reaches_every_container_of_a_meta():
    m = BatchMeta("p", ["a", "b"], ["input_ids"], [3, 4],
                  [{"x": {"shapes": [[1, 2]]}}, {"x": None}], {"step": [1]})
    before = snapshot(m)
    assert scribble(m) >= 6
    with pytest.raises(AssertionError, match="was changed"):
        assert_unchanged(before, m, "scribbled meta")
