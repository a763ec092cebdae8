"""Codec clauses: a batch's media cross the wire exactly, with their row boundaries."""

from __future__ import annotations

import copy

import pytest
import torch

from rlconform.fixtures.strategies import given_batches
from rlconform.fixtures.synthetic import RowPlan, build_batch, default_plan, media_families
from rlconform.reference_impl.codec import WireBatch
from rlconform.reference_impl.packed import PackedTensor
from rlconform.reference_impl.registry import FAMILIES, FIELDS

from ._check import assert_batch_equal, assert_bit_equal

MEDIA = media_families()


@pytest.mark.clause("WIRE-ROUNDTRIP")
@given_batches()
def test_property_roundtrip(codec, batch):
    assert_batch_equal(batch, codec.decode(codec.encode(batch)), "decode(encode(batch))")


@pytest.mark.clause("WIRE-ROUNDTRIP")
@pytest.mark.parametrize("family", MEDIA)
def test_one_row_roundtrip(codec, family):
    """A batch of one row (two images, and a video where the family has them), always run."""
    batch = build_batch(family, [RowPlan(5, images=[2, 3], videos=[1])], seed=1)
    assert_batch_equal(batch, codec.decode(codec.encode(batch)), f"{family}, one row")


@pytest.mark.clause("WIRE-ROUNDTRIP")
@pytest.mark.parametrize("family", MEDIA)
def test_family_roundtrip_with_shared_media(codec, family):
    batch = build_batch(family, default_plan(family))
    assert any(v.is_deduplicated() for v in batch.fields.values()
               if isinstance(v, PackedTensor)), "fixture lost its de-duplicated row"
    assert_batch_equal(batch, codec.decode(codec.encode(batch)), family)


def _uniform(family: str) -> list[RowPlan]:
    return [RowPlan(4 + i, images=[2]) for i in range(4)]  # every row one image of one shape


@pytest.mark.clause("WIRE-JAGGED")
@pytest.mark.parametrize("family", MEDIA)
def test_uniform_rows_stay_jagged(codec, family):
    """Each packed field's column is jagged with one row per sample holding exactly that sample's
    values (in any row layout: flattened, or `(entries, *trailing dims)`), also when every row
    has one segment of one shape; a data-parallel rank that fetches some keys gets exactly those
    samples' media. How a codec records segment shapes (tags, trailing dims, a companion column)
    is its own business: the decode is judged by the model inputs it gives back."""
    batch = build_batch(family, _uniform(family))
    wire = codec.encode(batch)
    # a field no row has media for needs no column (no consumer reads one)
    media = [n for n in FAMILIES[family].packed_fields()
             if n in batch and any(not batch[n].is_none(i) for i in range(len(batch)))]
    assert media, f"{family}: the fixture has no media"
    for name in media:
        col = wire.columns.get(name)
        if col is None:  # the field may travel inside per-row dicts (verl's multi_modal_inputs)
            rows = _dict_rows_holding(wire, name, len(batch))
            assert rows is not None, \
                f"packed field {name!r} has no wire column, and no per-row dict column holds it"
        else:
            assert col.is_nested, \
                f"packed field {name!r} went dense on the wire: {list(col.shape)}"
            rows = col.unbind()
        assert len(rows) == len(batch), \
            f"packed field {name!r} has {len(rows)} wire rows for {len(batch)} samples"
        v = batch[name]
        for i, row in enumerate(rows):
            segs = v.row_segments(i)
            if segs is None:  # e.g. the videos of an image-only row
                assert row.numel() == 0, \
                    f"{name!r} row {i} has no media but carries {row.numel()} values"
                continue
            assert row.numel(), f"{name!r} wire row {i} lost logical row {i}'s media"
            want = torch.cat([s.reshape(-1) for s in segs]).to(row.dtype)
            assert_bit_equal(want, row.reshape(-1), f"{name!r} wire row {i} is not logical row {i}")
    assert_batch_equal(batch, codec.decode(wire), "uniform rows")


def _dict_rows_holding(wire, name: str, n: int) -> list | None:
    """Row i's values of packed field `name` (flattened, one tensor; empty for a row without
    it), from a wire column of per-row dicts (None or {key: tensor or per-image list}) that holds
    the field, or None when no column does."""
    for col in wire.columns.values():
        rows = col.tolist() if not isinstance(col, torch.Tensor) and hasattr(col, "tolist") \
            else None
        if not isinstance(rows, list) or len(rows) != n:
            continue
        if not all(r is None or isinstance(r, dict) for r in rows):
            continue
        if not any(isinstance(r, dict) and name in r for r in rows):
            continue
        out = []
        for r in rows:
            v = r.get(name) if isinstance(r, dict) else None
            parts = [] if v is None else (list(v) if isinstance(v, (list, tuple)) else [v])
            out.append(torch.cat([t.reshape(-1) for t in parts]) if parts else torch.zeros(0))
        return out
    return None


@pytest.mark.clause("WIRE-JAGGED")
def test_shared_segments_travel_per_logical_row(codec):
    rows = [RowPlan(3, images=[1]), RowPlan(3, images=[3]), RowPlan(3, share_media_of=1),
            RowPlan(3, share_media_of=0)]
    batch = build_batch("qwen2_vl", rows)
    pv = batch["pixel_values"]
    assert pv.is_deduplicated(), "fixture lost its shared segments"
    wire = codec.encode(batch)
    col = wire.columns.get("pixel_values")
    got = col.unbind() if col is not None else _dict_rows_holding(wire, "pixel_values", len(batch))
    assert got is not None, "pixel_values has no wire column, and no per-row dict column holds it"
    assert len(got) == len(batch), f"pixel_values has {len(got)} wire rows for {len(batch)} samples"
    for i, row in enumerate(got):
        assert row.numel() == sum(s.numel() for s in pv.row_segments(i)), \
            f"pixel_values wire row {i} does not carry logical row {i}'s media"


@pytest.mark.clause("WIRE-NONE-ROWS")
@pytest.mark.parametrize("family", MEDIA)
def test_none_rows_and_media_free_batches(codec, family):
    mixed = build_batch(family, [RowPlan(3, images=[1]), RowPlan(4), RowPlan(2, images=[2])])
    free = build_batch(family, [RowPlan(3), RowPlan(5)])
    media = [n for n in FAMILIES[family].packed_fields() if n in mixed]
    assert any(mixed[n].is_none(1) and not mixed[n].is_none(0) for n in media), \
        f"{family}: the fixture lost its text-only row beside media rows"
    for batch in (mixed, free):
        out = codec.decode(codec.encode(batch))
        for name in FAMILIES[family].packed_fields():
            if name not in batch:
                continue
            want, got = batch[name], out.fields.get(name)
            if got is None and all(want.is_none(i) for i in range(len(want))):
                continue  # no row has this medium: no field is as good as all-None rows
            assert isinstance(got, PackedTensor), \
                f"{name!r} decoded as {type(got).__name__} ({'missing' if got is None else ''})"
            for i in range(len(want)):
                if want.is_none(i):
                    assert got.is_none(i), (f"{name!r} row {i} has no media but decoded as "
                                            f"{got.segment_shapes(i)}")
        if batch is free:
            model_in = out.multimodal_inputs("train")
            assert not any(n in model_in for n in FAMILIES[family].packed_fields()), \
                "a media-free batch must give no media tensor (legacy passes None)"


def _wire_tensors(name: str, obj):
    """(field, tensor) for every tensor a wire column holds, whatever holds it: a dense or
    jagged tensor, or containers of them (a dict inside names the field of its values, as in
    verl's per-row media dicts); an object column `f.key` names field `key`."""
    if isinstance(obj, torch.Tensor):
        yield name, (obj.values() if obj.is_nested else obj)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _wire_tensors(k if k in FIELDS else name, v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _wire_tensors(name, v)
    elif callable(getattr(obj, "tolist", None)):  # numpy object arrays, non-tensor stacks
        yield from _wire_tensors(name, obj.tolist())


def _media_dtypes(batch) -> dict[str, torch.dtype]:
    """The dtype each medium was encoded from: packed fields, and per-row dict keys."""
    out = {n: v.dtype for n, v in batch.fields.items()
           if isinstance(v, PackedTensor) and v.dtype is not None}
    for v in batch.fields.values():
        for row in getattr(v, "rows", ()) if not isinstance(v, PackedTensor) else ():
            for key, x in (row or {}).items():
                out.setdefault(key, (x[0] if isinstance(x, list) else x).dtype)
    return out


def _assert_wire_dtypes(wire, batch, policy: torch.dtype) -> None:
    """The encoded columns themselves follow the policy: a floating POLICY medium is `policy`
    on the wire (half the bytes of fp32), and every other medium (integer geometry, media a
    family keeps in their dtype) keeps the dtype it was encoded from, whatever decode returns
    afterwards."""
    fam = FAMILIES[batch.family]
    put = _media_dtypes(batch)
    seen = 0
    for column, value in wire.columns.items():
        head = column.rsplit(".", 1)[-1]
        for name, t in _wire_tensors(head if head in FIELDS else column, value):
            fs = FIELDS.get(name)
            if fs is None or fs.kind.value != "packed" or name not in put:
                continue
            cast = fs.dtype_policy.value == "policy" and name not in fam.keep_dtype and \
                put[name].is_floating_point
            seen += 1
            want = policy if cast else put[name]
            why = "the policy dtype" if cast else "never cast"
            assert t.dtype == want, (f"wire column {column!r} holds {name!r} as {t.dtype}: on "
                                     f"the wire it is {want} ({why}; {t.element_size()} bytes "
                                     f"a value instead of {want.itemsize})")
    assert seen, f"no medium found in the wire columns {sorted(wire.columns)}"


@pytest.mark.clause("WIRE-DTYPE")
@pytest.mark.parametrize("family", MEDIA)
def test_dtype_policy(codec_factory, family):
    codec = codec_factory(pixel_dtype=torch.bfloat16)
    batch = build_batch(family, default_plan(family), media_dtype=torch.float32)
    wire = codec.encode(batch)
    _assert_wire_dtypes(wire, batch, torch.bfloat16)
    out = codec.decode(wire)
    fam = FAMILIES[family]
    floating = [n for n in fam.packed_fields() if n in batch and batch[n].dtype is not None
                and batch[n].dtype.is_floating_point]
    assert floating, f"{family}: the fixture has no floating media for the policy to judge"
    for name in fam.packed_fields():
        if name not in batch or batch[name].dtype is None:  # no row has this medium
            continue
        assert name in out, f"{name!r} did not arrive"
        got = out[name].dtype
        orig = batch[name].dtype
        if name in fam.keep_dtype:
            assert got == orig, f"{name!r} is kept {orig} by {family} on purpose, arrived {got}"
        elif FIELDS[name].dtype_policy.value == "policy" and orig.is_floating_point:
            assert got == torch.bfloat16, f"pixel field {name!r} arrived {got}, policy is bf16"
        else:
            assert got == orig, f"geometry field {name!r} was cast {orig} -> {got}"
    for name in ("input_ids", "input_lengths"):
        assert out[name].dtype == batch[name].dtype, f"{name!r} was cast"


@pytest.mark.clause("WIRE-UNKNOWN-FIELD")
def test_unknown_field_raises(codec):
    batch = build_batch("qwen2_vl", default_plan("qwen2_vl"))
    batch.fields["pixel_values_extra"] = PackedTensor.from_rows(
        [[torch.ones(2, 4)], None, [torch.ones(1, 4)], None])
    with pytest.raises(KeyError, match="pixel_values_extra"):
        codec.encode(batch)


@pytest.mark.clause("WIRE-TAG-ALIGN")
def test_misaligned_tags_rejected(codec):
    batch = build_batch("qwen2_vl", [RowPlan(3, images=[1]), RowPlan(4, images=[2]),
                                     RowPlan(5, images=[3])])
    wire = codec.encode(batch)
    cases = {
        "a tag missing": wire.tags[:-1],
        "rows' tags swapped": [wire.tags[1], wire.tags[0], wire.tags[2]],
        "an extra tag": wire.tags + [copy.deepcopy(wire.tags[0])],
    }
    for what, tags in cases.items():
        with pytest.raises((ValueError, KeyError)):
            codec.decode(WireBatch(dict(wire.columns), copy.deepcopy(tags)))
            pytest.fail(f"decode accepted {what}")


def _real_batches():
    from rlconform.fixtures.processed import processed_batches

    return processed_batches()


def build_family(name):
    from rlconform.fixtures.families import build_family

    return build_family(name, "tiny")  # as processed_batches(): processors at the tiny size


def model_inputs_match(family, features, batch):
    from rlconform.fixtures.processed import model_inputs_match

    return model_inputs_match(family, features, batch)


@pytest.mark.clause("WIRE-REGISTRY-COVERAGE")
def test_registry_covers_real_processor_output(codec):
    """Every field the real processors emit is registered, and round-trips."""
    produced = _real_batches()
    assert produced, "no family fixture produced a batch"
    for family, (features, batch) in produced.items():
        unregistered = sorted(set(features) - set(FIELDS))
        assert not unregistered, f"{family} emits unregistered fields {unregistered}"
        for name in features:
            if FIELDS[name].multimodal:
                assert name in batch, f"{family}: {name!r} emitted but not carried in the batch"
        decoded = codec.decode(codec.encode(batch))
        assert_batch_equal(batch, decoded, family)
        # the decoded batch rebuilds exactly the tensors the processor gave the model
        why = model_inputs_match(build_family(family), features, decoded)
        assert why is None, f"{family}: {why}"


# -- per-row dict media and multi-dim per-token fields ----------------------------------------
def _object_cases():
    from rlconform.fixtures.synthetic import MEDIA_FORMS

    for family in MEDIA:
        for form in MEDIA_FORMS[1:]:
            yield family, form


@pytest.mark.clause("WIRE-OBJECT")
@pytest.mark.parametrize("family, form", list(_object_cases()))
def test_object_columns_roundtrip(codec, family, form):
    for plan in (default_plan(family), [RowPlan(3), RowPlan(4)],
                 [RowPlan(2, images=[1, 3]), RowPlan(3), RowPlan(2, images=[2])]):
        batch = build_batch(family, plan, media_form=form)
        assert_batch_equal(batch, codec.decode(codec.encode(batch)), f"{family} {form}")


def _object_batch(rows: list):
    from rlconform.reference_impl.batch import Batch
    from rlconform.reference_impl.objects import ObjectColumn

    n = len(rows)
    return Batch({"input_lengths": torch.full((n,), 2), "input_ids": torch.ones(n, 2).long(),
                  "mm_train_inputs": ObjectColumn(rows)}, "llava_next")


@pytest.mark.clause("WIRE-OBJECT")
def test_object_rows_edge_cases(codec):
    nan = torch.tensor([[float("nan"), -0.0, 1e-42, float("inf")]])
    cases = {
        "None and {} side by side": [None, {}, {"image_sizes": torch.tensor([[4, 8]])}],
        "only {}": [{}, {}],
        "only None": [None, None, None],
        "a key in one row only": [{"image_sizes": torch.tensor([[4, 8]])}, {}, None],
        "per-image list values": [{"pixel_values": [torch.ones(1, 2, 3, 4, 4),
                                                    torch.zeros(1, 3, 3, 4, 4)]},
                                  {"pixel_values": [torch.ones(1, 1, 3, 4, 4)]}],
        "non-finite and signed-zero values": [{"pixel_values": nan}, None],
    }
    for what, rows in cases.items():
        batch = _object_batch(rows)
        assert_batch_equal(batch, codec.decode(codec.encode(batch)), what)


@pytest.mark.clause("WIRE-OBJECT")
@given_batches(media_forms=("multi_modal_inputs", "mm_train_inputs"))
def test_property_object_roundtrip(codec, batch):
    assert_batch_equal(batch, codec.decode(codec.encode(batch)), "decode(encode(batch))")


@pytest.mark.clause("WIRE-DTYPE")
@pytest.mark.parametrize("family", ["qwen2_vl", "nemotron_omni", "gemma3"])
def test_dtype_policy_reaches_dict_media(codec_factory, family):
    codec = codec_factory(pixel_dtype=torch.bfloat16)
    batch = build_batch(family, default_plan(family), media_form="multi_modal_inputs")
    wire = codec.encode(batch)
    _assert_wire_dtypes(wire, batch, torch.bfloat16)
    out = codec.decode(wire)["multi_modal_inputs"]
    fam = FAMILIES[family]
    for i, row in enumerate(batch["multi_modal_inputs"]):
        for key, value in row.items():
            got = out[i][key]
            got = got[0] if isinstance(got, list) else got
            value = value[0] if isinstance(value, list) else value
            if key in fam.keep_dtype or not value.is_floating_point():
                assert got.dtype == value.dtype, f"row {i} {key!r} cast {value.dtype} -> {got.dtype}"
            else:
                assert got.dtype == torch.bfloat16, f"row {i} pixel key {key!r} arrived {got.dtype}"


@pytest.mark.clause("WIRE-SEQ-DIM")
@pytest.mark.parametrize("channels", [0, 3, 4])
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_position_ids_roundtrip_on_their_sequence_dim(codec, family, channels):
    batch = build_batch(family, default_plan(family) + [RowPlan(1)], position_ids=channels)
    wire = codec.encode(batch)
    col = wire.columns.get("position_ids")
    assert col is not None and col.is_nested, "position_ids must travel as a jagged column"
    per_pos = max(channels, 1)
    for i, row in enumerate(col.unbind()):
        n = int(batch.seq_lens[i])
        assert row.numel() == n * per_pos, \
            f"position_ids row {i} carries {row.numel()} values for {n} tokens x {per_pos} channels"
    got = codec.decode(wire)
    assert_batch_equal(batch, got, f"position_ids {list(batch['position_ids'].shape)}")
