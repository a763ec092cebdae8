"""Batch-operation clauses: truncation, padding and validation leave media alone and honour each
per-token field's sequence dim; stage inputs are the same whatever form media are held in; the
batch algebra and micro-batching keep every field of every row."""

from __future__ import annotations

import pytest
import torch
from hypothesis import strategies as st

from rlconform.fixtures.strategies import given_batches
from rlconform.fixtures.synthetic import (
    MEDIA_FORMS,
    RowPlan,
    build_batch,
    default_plan,
    media_families,
)
from rlconform.reference_impl.batch import Batch
from rlconform.reference_impl.objects import ObjectColumn, value_difference
from rlconform.reference_impl.packed import PackedTensor
from rlconform.reference_impl.registry import (
    FAMILIES,
    FIELDS,
    Kind,
    Stage,
    multimodal_fields,
    spec,
)

from ._check import (
    assert_bit_equal,
    assert_own_dicts,
    assert_rows,
    batch_rows,
    expect_accepted,
    media_difference,
    seq_slice,
)

MEDIA = media_families()


def _packed(batch):
    """Media fields: packed, or per-row dict columns (verl / OpenRLHF form)."""
    return {n: v for n, v in batch.fields.items() if isinstance(v, (PackedTensor, ObjectColumn))}


_seq = seq_slice


def _seq_size(name, v) -> int:
    return int(v.shape[spec(name).seq_axis(v.dim())])


def _assert_media_untouched(before, after, what: str):
    """Media give the model what they gave before (packed: `media_difference`, which also sees a
    cut or an inflated segment in the model-input tensor); dict rows exactly, with their bytes."""
    for name, v in _packed(before).items():
        got = after.fields.get(name)
        if isinstance(v, PackedTensor):
            why = media_difference(name, v, got)
            assert why is None, f"{what} changed packed field {name!r}: {why}"
            continue
        assert type(got) is type(v), f"{what}: {name!r} is gone or no longer a {type(v).__name__}"
        why = v.first_difference(got)
        assert why is None, f"{what} changed packed field {name!r}: {why}"
        assert got.nbytes() == v.nbytes(), f"{what}: {name!r} bytes {got.nbytes()} != {v.nbytes()}"


@pytest.mark.clause("BATCH-TRUNCATE")
@given_batches(also={"raw": (st.integers(0, 2**16), lambda i: 2 + 3 * i)})
def test_truncate(batch_ops, batch, raw):
    s = batch.seq_len()
    cut = raw % (s + 1)  # 0..S: to nothing, into the rows, or no cut
    out = batch_ops.truncate(batch, cut)
    _assert_media_untouched(batch, out, "truncate")
    for name in batch.names(Kind.PER_TOKEN):
        got, want = out[name], batch[name]
        assert _seq_size(name, got) == min(cut, s), \
            f"per-token {name!r} {list(want.shape)} not truncated to {cut}: {list(got.shape)}"
        assert_bit_equal(_seq(name, want, 0, min(cut, s)), got,
                         f"per-token {name!r} {list(want.shape)} truncated wrongly")
    want_lens = batch.seq_lens.clamp(max=cut).tolist()
    assert out.seq_lens.tolist() == want_lens, \
        f"truncate to {cut}: row lengths (input_lengths) {out.seq_lens.tolist()}, expected " \
        f"{want_lens}"


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
@given_batches(also={"extra": (st.integers(0, 9), lambda i: i % 10)})
def test_pad_excludes_media(batch_ops, batch, extra):
    target = batch.seq_len() + extra
    out = batch_ops.pad_to(batch, target)
    _assert_media_untouched(batch, out, "pad_to")  # the model input's bytes, and dict rows'
    for name in batch.names(Kind.PER_TOKEN):
        got, s = out[name], batch.seq_len()
        assert _seq_size(name, got) == target and got.dim() == batch[name].dim(), \
            f"per-token {name!r} {list(batch[name].shape)} padded to {list(got.shape)}, not {target}"
        assert_bit_equal(batch[name], _seq(name, got, 0, s), f"{name!r} values moved")
        assert (_seq(name, got, s, target - s) == FIELDS[name].pad_value).all(), \
            f"{name!r} pad value"


@pytest.mark.clause("BATCH-VALIDATE")
@pytest.mark.parametrize("family", MEDIA)
def test_validator_exempts_media(batch_ops, family):
    for what, batch in (("default rows", build_batch(family, default_plan(family))),
                        ("4 rows of 3 tokens, 2 images each",
                         build_batch(family, [RowPlan(3, images=[2]) for _ in range(4)]))):
        media = [n for n in FAMILIES[family].packed_fields() if n in batch]
        assert media, f"{family} fixture ({what}) holds no media field"
        expect_accepted(lambda b=batch: batch_ops.validate(b),
                        f"validate rejected an aligned {family} batch ({what}) holding media "
                        f"{media}")


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
@pytest.mark.parametrize("form", MEDIA_FORMS)
@pytest.mark.parametrize("family", MEDIA + ["text"])
def test_stages_get_the_same_multimodal_fields(batch_ops, family, form):
    batch = build_batch(family, default_plan(family), media_form=form)
    packed = build_batch(family, default_plan(family))
    present = {n for n in packed.fields if n in multimodal_fields()}
    seen = {}
    for stage in Stage:
        seen[stage] = set(batch_ops.multimodal_inputs(batch, stage, torch.float32))
    assert seen[Stage.LOGPROB] == seen[Stage.REFERENCE_LOGPROB] == seen[Stage.TRAIN], \
        f"stages differ: { {s.value: sorted(v) for s, v in seen.items()} }"
    assert seen[Stage.TRAIN] == present, \
        f"stage inputs {sorted(seen[Stage.TRAIN])} != multimodal fields present {sorted(present)}"


# -- sequence dims: position_ids [B, S], [B, 3, S] (M-RoPE), [B, 4, S] (verl Qwen-VL) -----------
@pytest.mark.clause("BATCH-TRUNCATE")
@pytest.mark.parametrize("channels", [0, 3, 4])
def test_truncate_multi_dim_per_token_fields_on_their_sequence_dim(batch_ops, channels):
    batch = build_batch("qwen3_vl", default_plan("qwen3_vl"), position_ids=channels, extra_seq=2)
    s = batch.seq_len()
    for cut in (1, 3, s):
        out = batch_ops.truncate(batch, cut)
        got, want = out["position_ids"], _seq("position_ids", batch["position_ids"], 0, cut)
        assert got.shape == want.shape and torch.equal(got, want), \
            f"truncate({cut}) of position_ids {list(batch['position_ids'].shape)} gave " \
            f"{list(got.shape)}, expected {list(want.shape)} (cut on the last dim)"


@pytest.mark.clause("BATCH-PAD")
@pytest.mark.parametrize("channels", [0, 3, 4])
def test_pad_multi_dim_per_token_fields_on_their_sequence_dim(batch_ops, channels):
    batch = build_batch("qwen3_vl", default_plan("qwen3_vl"), position_ids=channels, extra_seq=2)
    s = batch.seq_len()
    out = batch_ops.pad_to(batch, s + 4)
    got = out["position_ids"]
    assert _seq_size("position_ids", got) == s + 4 and got.dim() == batch["position_ids"].dim(), \
        f"pad_to({s + 4}) of position_ids {list(batch['position_ids'].shape)} gave {list(got.shape)}"
    assert torch.equal(_seq("position_ids", got, 0, s), batch["position_ids"])


@pytest.mark.clause("BATCH-VALIDATE")
@pytest.mark.parametrize("channels", [0, 3, 4])
def test_validator_honours_sequence_dims(batch_ops, channels):
    batch = build_batch("qwen2_vl", default_plan("qwen2_vl"), position_ids=channels)
    batch_ops.validate(batch)  # [B, C, S] is aligned: its dim 1 is channels, not tokens
    bad = batch.replace(position_ids=_seq("position_ids", batch["position_ids"], 0,
                                          batch.seq_len() - 1))
    with pytest.raises((ValueError, AssertionError), match="position_ids"):
        batch_ops.validate(bad)


# -- model inputs from per-row dict columns ---------------------------------------------------
def _assert_same_inputs(want: dict, got: dict, what: str) -> None:
    assert set(got) == set(want), f"{what}: model inputs {sorted(got)}, expected {sorted(want)}"
    for k in want:
        why = value_difference(f"{what}: model input {k!r}", want[k], got[k])
        assert why is None, why


@pytest.mark.clause("BATCH-OBJECT-INPUTS")
@pytest.mark.parametrize("form", MEDIA_FORMS[1:])
@pytest.mark.parametrize("family", MEDIA)
def test_dict_media_give_the_packed_model_inputs(batch_ops, family, form):
    plans = (default_plan(family), [RowPlan(3), RowPlan(2, images=[2]), RowPlan(4, images=[1, 3])],
             [RowPlan(3), RowPlan(5)])
    for plan in plans:
        packed = build_batch(family, plan)
        held = build_batch(family, plan, media_form=form)
        for stage in Stage:
            for dtype in (None, torch.bfloat16):
                what = f"{family} {form} {stage.value} {dtype}"
                want = batch_ops.multimodal_inputs(packed, stage, dtype)
                _assert_inputs_exercised(packed, stage, want, what)
                _assert_same_inputs(want, batch_ops.multimodal_inputs(held, stage, dtype), what)


def _assert_inputs_exercised(packed, stage, got: dict, what: str) -> None:
    """Anti-vacuity: a batch with media for `stage` must give model inputs from its packed form;
    two empty dicts agree about nothing."""
    media = [n for n, v in packed.fields.items() if isinstance(v, PackedTensor)
             and stage in spec(n).stages and any(not v.is_none(i) for i in range(len(v)))]
    assert got or not media, \
        f"{what}: the packed form gave no model inputs, though {media} hold media for the stage"


@pytest.mark.clause("BATCH-OBJECT-INPUTS")
@given_batches(media_forms=MEDIA_FORMS[1:])
def test_property_dict_media_inputs(batch_ops, batch):
    want = batch_ops.multimodal_inputs(batch.packed_form(), Stage.TRAIN)
    _assert_inputs_exercised(batch.packed_form(), Stage.TRAIN, want, "train inputs")
    _assert_same_inputs(want, batch_ops.multimodal_inputs(batch, Stage.TRAIN), "train inputs")


# -- batch algebra ----------------------------------------------------------------------------
@pytest.mark.clause("BATCH-ALGEBRA")
@pytest.mark.parametrize("form", MEDIA_FORMS)
@pytest.mark.parametrize("family", ["qwen2_5_vl", "idefics3", "nemotron_omni"])
def test_select_concat_split_examples(batch_ops, family, form):
    """Always-run cases: every form, de-duplicated and None rows, several images, video
    (built here, never at import: a defect that shares rows must not leak into other runs)."""
    batch = build_batch(family, default_plan(family) * 2, seed=3, media_form=form)
    rows = batch_rows(batch)
    idx = [7, 0, 2, 2, 5]  # out of order, a repeat (GRPO repeat), a None row, a shared row
    out = batch_ops.select(batch, idx)
    assert_rows([rows[i] for i in idx], out, f"select({idx})")
    assert_own_dicts(batch, out, "select")
    for sizes in ([3, 5], [1, 1, 6], [2, 2, 2, 2]):
        parts = batch_ops.split(batch, sizes)
        assert [len(p) for p in parts] == sizes, f"split({sizes}) gave {[len(p) for p in parts]}"
        start = 0
        for p, n in zip(parts, sizes):
            assert_rows(rows[start:start + n], p, f"split({sizes}) chunk at row {start}")
            start += n
        assert_own_dicts(batch, parts[0], "split")
    parts = [batch.slice(0, 2), batch.slice(2, 3), batch.slice(3, 8)]
    parts = [p.truncate(int(p.seq_lens.max())) for p in parts]  # each with its own width
    out = batch_ops.concat(parts)
    assert_rows(rows, out, "concat of three chunks of differing widths")
    assert_own_dicts(parts[0], out, "concat")


@pytest.mark.clause("BATCH-ALGEBRA")
@pytest.mark.parametrize("form", MEDIA_FORMS)
def test_concat_media_free_and_media_chunks(batch_ops, form):
    media = build_batch("qwen2_vl", [RowPlan(4, images=[1, 2]), RowPlan(3, images=[3])],
                        media_form=form)
    free = build_batch("qwen2_vl", [RowPlan(6), RowPlan(2)], seed=1, media_form=form)
    out = batch_ops.concat([free, media, free])
    assert_rows(batch_rows(free) + batch_rows(media) + batch_rows(free), out, "concat(media-free, media, "
                                                                 "media-free)")


_INDICES = st.lists(st.integers(0, 2**16), min_size=1, max_size=10)
_CUTS = st.sets(st.integers(0, 2**16), max_size=3)


@pytest.mark.clause("BATCH-ALGEBRA")
@given_batches(max_rows=8, also={"raw_idx": (_INDICES, lambda i: [i + 3, 0, 2 * i + 1, i + 3]),
                                 "raw_cuts": (_CUTS, lambda i: {i, 2 * i + 1})})
def test_property_algebra(batch_ops, batch, raw_idx, raw_cuts):
    n = len(batch)
    rows = batch_rows(batch)
    idx = [i % n for i in raw_idx]  # out of order, repeats
    assert_rows([rows[i] for i in idx], batch_ops.select(batch, idx), f"select({idx})")
    cuts = sorted({1 + c % (n - 1) for c in raw_cuts}) if n > 1 else []
    bounds = [0, *cuts, n]
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    parts = batch_ops.split(batch, sizes)
    assert [len(p) for p in parts] == sizes, f"split({sizes}) gave {[len(p) for p in parts]}"
    for p, a, b in zip(parts, bounds, bounds[1:]):
        assert_rows(rows[a:b], p, f"split({sizes}) chunk {a}:{b}")
    assert_rows(rows, batch_ops.concat(parts), f"concat(split({sizes}))")


# -- micro-batches ----------------------------------------------------------------------------
def _check_micro_batches(batch_ops, batch, n, seed):
    rows = batch_rows(batch)
    mbs = batch_ops.micro_batches(batch, n, shuffle_seed=seed)
    what = f"micro_batches(n={n}, shuffle_seed={seed})"
    assert len(mbs) == n, f"{what} gave {len(mbs)} micro-batches"
    flat = [int(i) for idx, _ in mbs for i in idx]
    assert sorted(flat) == list(range(len(batch))), \
        f"{what} holds rows {sorted(flat)}: not every row of {len(batch)} exactly once"
    if seed is None:
        assert flat == list(range(len(batch))), f"{what} reordered rows without a seed: {flat}"
    for k, (idx, mb) in enumerate(mbs):
        assert_rows([rows[i] for i in idx], mb, f"{what} micro-batch {k} (rows {list(idx)})")
    joined = Batch.concat([mb for _, mb in mbs])
    inverse = sorted(range(len(flat)), key=flat.__getitem__)
    assert_rows(rows, joined.select(inverse), f"{what} concatenated in recorded order")
    for k, (_, mb) in enumerate(mbs):
        assert_own_dicts(batch, mb, f"{what} micro-batch {k}")
    return flat


@pytest.mark.clause("BATCH-MICRO-BATCH")
@pytest.mark.parametrize("form", MEDIA_FORMS)
@pytest.mark.parametrize("n", [1, 3, 8])
def test_micro_batch_examples(batch_ops, form, n):
    batch = build_batch("qwen2_5_vl", default_plan("qwen2_5_vl") * 2, media_form=form)
    _check_micro_batches(batch_ops, batch, n, None)
    orders = {tuple(_check_micro_batches(batch_ops, batch, n, seed)) for seed in (1, 2, 3)}
    assert orders != {tuple(range(8))}, "shuffle_seed 1, 2 and 3 all kept the original order"
    again = [list(i) for i, _ in batch_ops.micro_batches(batch, n, shuffle_seed=2)]
    assert again == [list(i) for i, _ in batch_ops.micro_batches(batch, n, shuffle_seed=2)], \
        "the same shuffle_seed gave different micro-batches"


@pytest.mark.clause("BATCH-MICRO-BATCH")
@given_batches(max_rows=8, also={"raw_n": (st.integers(0, 2**16), lambda i: i + 1),
                                 "seed": (st.one_of(st.none(), st.integers(0, 2**16)),
                                          lambda i: None if i % 3 == 0 else i)})
def test_property_micro_batches(batch_ops, batch, raw_n, seed):
    n = 1 + raw_n % len(batch)  # 1..B, counts that do not divide B included
    _check_micro_batches(batch_ops, batch, n, seed)


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
        assert_bit_equal(_seq(name, batch[name], 0, cut), out[name],
                         f"per-token {name!r} truncated to {cut}")
    want_lens = batch.seq_lens.clamp(max=cut).tolist()
    assert out.seq_lens.tolist() == want_lens, \
        f"truncate to {cut}: row lengths (input_lengths) {out.seq_lens.tolist()}, expected " \
        f"{want_lens}"


@pytest.mark.clause("BATCH-PAD")
@pytest.mark.parametrize("family", MEDIA)
def test_pad_beyond_the_longest_row(batch_ops, family):
    """Padding well past the longest row (beyond every media dim 1) leaves media alone."""
    batch = build_batch(family, default_plan(family))
    target = batch.seq_len() + 9
    out = batch_ops.pad_to(batch, target)
    _assert_media_untouched(batch, out, "pad_to")
    for name in batch.names(Kind.PER_TOKEN):
        assert _seq_size(name, out[name]) == target, f"per-token {name!r} not padded to {target}"
        assert_bit_equal(batch[name], _seq(name, out[name], 0, batch.seq_len()),
                         f"{name!r} values moved")
