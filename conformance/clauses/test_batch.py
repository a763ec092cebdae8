"""Batch-operation clauses: truncation, padding and validation leave media alone."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlconform.fixtures.strategies import batches
from rlconform.fixtures.synthetic import RowPlan, build_batch, default_plan, media_families
from rlconform.reference_impl.packed import PackedTensor
from rlconform.reference_impl.registry import FIELDS, Kind, Stage, multimodal_fields

from ._check import assert_bit_equal

MEDIA = media_families()


def _packed(batch):
    return {n: v for n, v in batch.fields.items() if isinstance(v, PackedTensor)}


def _assert_media_untouched(before, after, what: str):
    for name, v in _packed(before).items():
        got = after.fields.get(name)
        assert isinstance(got, PackedTensor), f"{what}: {name!r} is gone or no longer packed"
        why = v.first_difference(got)
        assert why is None, f"{what} changed packed field {name!r}: {why}"
        assert got.nbytes() == v.nbytes(), f"{what}: {name!r} bytes {got.nbytes()} != {v.nbytes()}"


@pytest.mark.clause("BATCH-TRUNCATE")
@given(batch=batches(), data=st.data())
def test_truncate(batch_ops, batch, data):
    s = batch.seq_len()
    cut = data.draw(st.integers(1, max(1, s)), label="max_len")
    out = batch_ops.truncate(batch, cut)
    _assert_media_untouched(batch, out, "truncate")
    for name in batch.names(Kind.PER_TOKEN):
        got = out[name]
        assert got.shape[1] == min(cut, s), f"per-token {name!r} not truncated to {cut}"
        assert_bit_equal(batch[name][:, :cut], got, f"per-token {name!r} truncated wrongly")
    assert out.seq_lens.tolist() == batch.seq_lens.clamp(max=cut).tolist()


@pytest.mark.clause("BATCH-TRUNCATE")
@pytest.mark.parametrize("family", MEDIA)
def test_truncate_every_family_model_inputs(batch_ops, family):
    batch = build_batch(family, default_plan(family), extra_seq=5)
    out = batch_ops.truncate(batch, batch.seq_lens.max().item())
    _assert_media_untouched(batch, out, "truncate")
    want = batch_ops.multimodal_inputs(batch, Stage.TRAIN)
    got = batch_ops.multimodal_inputs(out, Stage.TRAIN)
    for name, t in want.items():
        if FIELDS[name].kind is Kind.PACKED:
            assert_bit_equal(t, got[name], f"model input {name!r} changed by truncation")


@pytest.mark.clause("BATCH-PAD")
@given(batch=batches(), extra=st.integers(0, 9))
def test_pad_excludes_media(batch_ops, batch, extra):
    target = batch.seq_len() + extra
    out = batch_ops.pad_to(batch, target)
    _assert_media_untouched(batch, out, "pad_to")
    assert out.media_nbytes() == batch.media_nbytes(), "padding changed the media bytes"
    for name in batch.names(Kind.PER_TOKEN):
        got = out[name]
        assert got.shape[1] == target, f"per-token {name!r} padded to {got.shape[1]}, not {target}"
        assert_bit_equal(batch[name], got[:, : batch.seq_len()], f"{name!r} values moved")
        assert (got[:, batch.seq_len():] == FIELDS[name].pad_value).all(), f"{name!r} pad value"


@pytest.mark.clause("BATCH-VALIDATE")
@pytest.mark.parametrize("family", MEDIA)
def test_validator_exempts_media(batch_ops, family):
    batch_ops.validate(build_batch(family, default_plan(family)))
    batch_ops.validate(build_batch(family, [RowPlan(3, images=[2]) for _ in range(4)]))


@pytest.mark.clause("BATCH-VALIDATE")
@pytest.mark.parametrize("family", ["qwen2_vl", "gemma3"])
def test_validator_rejects_misaligned_per_token_field(batch_ops, family):
    batch = build_batch(family, default_plan(family))
    name = "mm_token_type_ids" if family == "qwen2_vl" else "token_type_ids"
    bad = batch.replace(**{name: batch[name][:, :-1]})
    with pytest.raises((ValueError, AssertionError), match=name):
        batch_ops.validate(bad)
    short_rows = batch.replace(**{name: batch[name][:-1]})
    with pytest.raises((ValueError, AssertionError), match=name):
        batch_ops.validate(short_rows)


@pytest.mark.clause("BATCH-STAGE-FIELDS")
@pytest.mark.parametrize("family", MEDIA + ["text"])
def test_stages_get_the_same_multimodal_fields(batch_ops, family):
    batch = build_batch(family, default_plan(family))
    present = {n for n in batch.fields if n in multimodal_fields()}
    seen = {}
    for stage in Stage:
        seen[stage] = set(batch_ops.multimodal_inputs(batch, stage, torch.float32))
    assert seen[Stage.LOGPROB] == seen[Stage.REFERENCE_LOGPROB] == seen[Stage.TRAIN], \
        f"stages differ: { {s.value: sorted(v) for s, v in seen.items()} }"
    assert seen[Stage.TRAIN] == present, \
        f"stage inputs {sorted(seen[Stage.TRAIN])} != multimodal fields present {sorted(present)}"


# -- explicit cases: what the searches above find only through one example, always run ---------
@pytest.mark.clause("BATCH-TRUNCATE")
@pytest.mark.parametrize("family", MEDIA)
def test_truncate_below_the_longest_row(batch_ops, family):
    """Truncation that really cuts (below the longest row): every per-token field in step."""
    batch = build_batch(family, default_plan(family), extra_seq=2)
    cut = 3
    out = batch_ops.truncate(batch, cut)
    _assert_media_untouched(batch, out, "truncate")
    for name in batch.names(Kind.PER_TOKEN):
        assert_bit_equal(batch[name][:, :cut], out[name], f"per-token {name!r} truncated to {cut}")
    assert out.seq_lens.tolist() == batch.seq_lens.clamp(max=cut).tolist()


@pytest.mark.clause("BATCH-PAD")
@pytest.mark.parametrize("family", MEDIA)
def test_pad_beyond_the_longest_row(batch_ops, family):
    """Padding well past the longest row (beyond every media dim 1) leaves media alone."""
    batch = build_batch(family, default_plan(family))
    target = batch.seq_len() + 9
    out = batch_ops.pad_to(batch, target)
    _assert_media_untouched(batch, out, "pad_to")
    for name in batch.names(Kind.PER_TOKEN):
        assert out[name].shape[1] == target, f"per-token {name!r} not padded to {target}"
        assert_bit_equal(batch[name], out[name][:, : batch.seq_len()], f"{name!r} values moved")
