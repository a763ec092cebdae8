"""Heterogeneous rows: whatever a backend builds from rows that differ keeps every key and every
row's media with its row, or raises.

Real per-row media columns are not uniform: verl's `{}` and OpenRLHF's None text-only rows meet
in one column after a merge, a video-only sample precedes an image sample (its keys first appear
in a later row), one sample's images stay a per-image list while another's is one tensor, keys
come in another order. Packed media spread over rows in counts that look like something else:
as many images as rows but not one per row, one row holding every image. Code that infers a
schema from the first row or an assignment from a count is right on uniform rows and silently
wrong here.
"""

from __future__ import annotations

import pytest
from hypothesis import strategies as st

from rlconform.fixtures.strategies import given_heterogeneous
from rlconform.fixtures.synthetic import (
    MEDIA_FORMS,
    build_batch,
    images_per_row,
    media_families,
    regime_plan,
    row_heterogeneity,
)
from rlconform.reference_impl.objects import value_difference
from rlconform.reference_impl.registry import Kind, Stage

from ._check import assert_batch_equal, assert_rows, batch_rows

MEDIA = media_families()
COINCIDENCES = ("images_as_rows", "one_row_holds_all")


_heterogeneity = row_heterogeneity


def _attempt(fn):
    """fn()'s result, or None when it raised: raising is an allowed answer to such rows."""
    try:
        return fn()
    except Exception:  # noqa: BLE001 - "keeps every key ... or raises"
        return None


# -- codec --------------------------------------------------------------------------------------
@pytest.mark.clause("WIRE-HETERO-ROWS")
@given_heterogeneous()
def test_heterogeneous_dict_rows_roundtrip(codec, batch):
    assert _heterogeneity(batch), "fixture lost its heterogeneous rows"
    assert_batch_equal(batch, codec.decode(codec.encode(batch)), "heterogeneous dict rows")


@pytest.mark.clause("WIRE-HETERO-ROWS")
@pytest.mark.parametrize("media", COINCIDENCES)
@pytest.mark.parametrize("family", MEDIA)
def test_coincident_media_counts_roundtrip(codec, family, media):
    for k, form in enumerate(MEDIA_FORMS):
        batch = build_batch(family, regime_plan(family, "ragged", media, 4 + k % 2),
                            media_form=form, seed=k)
        counts = images_per_row(batch)
        assert sum(counts) and len(set(counts)) > 1, f"fixture lost its {media} pattern: {counts}"
        out = codec.decode(codec.encode(batch))
        # each row keeps its own share of the model input (media_difference: per-row extent on
        # the packing dim and the input's bits), however the codec cuts a row into segments
        assert_batch_equal(batch, out, f"{family} {form} {media} (images per row {counts})")


# -- batch operations ---------------------------------------------------------------------------
def _check_inputs(batch_ops, batch, what: str) -> None:
    """Stage inputs from rows that differ are what the backend itself gives for the same media
    held uniformly (packed, or for packed rows one dict per row): every key of any row, each
    row's media in row order; or the operation raises. (Whether those inputs are the right
    values is BATCH-MODEL-INPUTS' business.)"""
    uniform = batch.packed_form() if batch.names(Kind.OBJECT) else \
        batch.to_row_dicts("multi_modal_inputs")
    for stage in Stage:
        got = _attempt(lambda s=stage: batch_ops.multimodal_inputs(batch, s))
        if got is None:
            continue
        want = _attempt(lambda s=stage: batch_ops.multimodal_inputs(uniform, s))
        if want is None:  # the uniform form is refused: the reference says what it holds
            want = batch.multimodal_inputs(stage)
        assert set(got) == set(want), \
            f"{what}: {stage.value} inputs {sorted(got)}, the rows hold {sorted(want)}"
        for k in want:
            why = value_difference(f"{what}: {stage.value} input {k!r}", want[k], got[k])
            assert why is None, why


def _check_algebra(backend, batch_ops, batch, what: str, micro_counts) -> None:
    rows, b = batch_rows(batch), len(batch)
    if "batch_algebra" in backend.capabilities:
        idx = list(range(b))[::-1] + [b // 2]
        out = _attempt(lambda: batch_ops.select(batch, idx))
        if out is not None:
            assert_rows([rows[i] for i in idx], out, f"{what}: select({idx})")
        for cut in range(1, b):
            parts = _attempt(lambda c=cut: batch_ops.split(batch, [c, b - c]))
            if parts is None:
                continue
            assert_rows(rows[:cut], parts[0], f"{what}: split at {cut}, first chunk")
            assert_rows(rows[cut:], parts[1], f"{what}: split at {cut}, second chunk")
            joined = _attempt(lambda p=parts: batch_ops.concat(p[::-1]))
            if joined is not None:
                assert_rows(rows[cut:] + rows[:cut], joined, f"{what}: concat of the chunks "
                            f"split at {cut}, swapped")
    if "micro_batching" in backend.capabilities:
        for n in micro_counts:
            for seed in (None, 5):
                mbs = _attempt(lambda m=n, s=seed: batch_ops.micro_batches(batch, m, s))
                if mbs is None:
                    continue
                held = sorted(i for idx, _ in mbs for i in idx)
                assert held == list(range(b)), \
                    f"{what}: micro_batches({n}, seed {seed}) hold rows {held} of {b}"
                for idx, mb in mbs:
                    assert_rows([rows[i] for i in idx], mb,
                                f"{what}: micro_batches({n}, seed {seed}), rows {list(idx)}")


@pytest.mark.clause("BATCH-HETERO-ROWS")
@given_heterogeneous(also={"n": (st.integers(1, 6), lambda i: 2 + i % 3)})
def test_heterogeneous_dict_rows_through_batch_operations(backend, batch_ops, batch, n):
    assert _heterogeneity(batch), "fixture lost its heterogeneous rows"
    _check_inputs(batch_ops, batch, "heterogeneous dict rows")
    _check_algebra(backend, batch_ops, batch, "heterogeneous dict rows",
                   sorted({min(n, len(batch)), len(batch)}))


@pytest.mark.clause("BATCH-HETERO-ROWS")
@pytest.mark.parametrize("media", COINCIDENCES)
@pytest.mark.parametrize("family", MEDIA)
def test_coincident_media_counts_through_batch_operations(backend, batch_ops, family, media):
    for k, form in enumerate(MEDIA_FORMS):
        batch = build_batch(family, regime_plan(family, "ragged", media, 4 + k % 2),
                            media_form=form, seed=k)
        counts = images_per_row(batch)
        assert sum(counts) and len(set(counts)) > 1, f"fixture lost its {media} pattern: {counts}"
        what = f"{family} {form} {media} (images per row {counts})"
        _check_inputs(batch_ops, batch, what)
        # micro-batch counts equal to the image count, and to the row count
        _check_algebra(backend, batch_ops, batch, what,
                       sorted({min(sum(counts), len(batch)), len(batch), 2}))

