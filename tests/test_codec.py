"""Unit tests of the reference codec (reference_impl/codec.py): Batch <-> WireBatch round trips and
the pixel cast over every registered family, with the hypothesis strategies of
fixtures/strategies.py and again on fixed plans that are guaranteed to reach each shape the field
defects of BACKGROUND.md section 3 hid in (ragged counts, `None` rows, every row the same shape,
several and de-duplicated segments, differing trailing dims, every allowed dtype, one row and many
rows); bad input; object columns on the wire."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from _helpers import ALL_FAMILIES, CODEC, PROPS, packed_fields, qwen, ragged, through_transport
from hypothesis import given
from hypothesis import strategies as st

from rlconform.fixtures.strategies import MEDIA_DTYPES, batches
from rlconform.fixtures.synthetic import RowPlan, build_batch, default_plan
from rlconform.reference_impl.batch import Batch
from rlconform.reference_impl.bitexact import bit_equal
from rlconform.reference_impl.codec import SEQ_LEN_TAG, ReferenceCodec, WireBatch, jagged
from rlconform.reference_impl.dataplane import InMemoryDataPlane
from rlconform.reference_impl.objects import ObjectColumn
from rlconform.reference_impl.packed import PackedTensor
from rlconform.reference_impl.registry import (
    FAMILIES,
    DtypePolicy,
    Kind,
    spec,
)


def _media_field(batch: Batch) -> str | None:
    """The family's main media field (images, else audio), or None for text."""
    for name in ("pixel_values", "input_features"):
        if name in batch.fields:
            return name
    return None


def _check_round_trip(b: Batch, codec: ReferenceCodec = CODEC) -> WireBatch:
    wire = codec.encode(b)
    assert len(wire.tags) == b.batch_size
    for i, tag in enumerate(wire.tags):
        assert tag[SEQ_LEN_TAG] == int(b.seq_lens[i])
    for name, v in packed_fields(b).items():
        col = wire.columns[name]
        assert col.is_nested and col.size(0) == len(v)
        for i, row in enumerate(col.unbind()):
            shapes = v.segment_shapes(i)
            assert wire.tags[i][name]["shapes"] == shapes
            # logical rows, not physical segments: a de-duplicated row carries its own media
            want = 0 if shapes is None else sum(int(torch.Size(s).numel()) for s in shapes)
            assert row.numel() == want
    for name in b.names(Kind.PER_TOKEN):
        rows = wire.columns[name].unbind()
        assert [r.shape[0] for r in rows] == b.seq_lens.tolist()
    back = codec.decode(wire)
    why = b.first_difference(back)
    assert why is None, why
    assert set(back.fields) == set(b.fields) and back.family == b.family
    for name, v in packed_fields(back).items():
        for i in range(len(v)):
            if b[name].is_none(i):
                assert v.row_segments(i) is None  # None, never a (0, ...) tensor
        if all(b[name].is_none(i) for i in range(len(b))):
            assert v.as_tensor() is None
    return wire


@pytest.mark.parametrize("family", ALL_FAMILIES)
@PROPS
@given(data=st.data())
def test_codec_round_trip_property(family, data):
    b = data.draw(batches(family))
    wire = _check_round_trip(b)
    assert CODEC.decode(through_transport(wire)) == b


@pytest.mark.parametrize("family", ALL_FAMILIES)
@PROPS
@given(data=st.data())
def test_codec_cast_property(family, data):
    """pixel_dtype casts POLICY media once at encode; geometry and keep_dtype media stay."""
    b = data.draw(batches(family, dtypes=(torch.float32,)))
    back = ReferenceCodec(torch.bfloat16).decode(ReferenceCodec(torch.bfloat16).encode(b))
    fam = FAMILIES[family]
    for name, v in b.fields.items():
        got = back[name]
        fs = spec(name)
        cast = (fs.kind is Kind.PACKED and fs.dtype_policy is DtypePolicy.POLICY
                and name not in fam.keep_dtype and v.dtype is not None)
        want = v.to_dtype(torch.bfloat16) if cast else v
        if isinstance(v, ObjectColumn):  # POLICY keys of the per-row dicts are cast too
            want = ObjectColumn([None if r is None else {
                k: _cast_value(x, spec(k).dtype_policy is DtypePolicy.POLICY
                               and k not in fam.keep_dtype) for k, x in r.items()} for r in v])
            assert want.first_difference(got) is None, (name, want.first_difference(got))
        elif isinstance(v, PackedTensor):
            assert want.first_difference(got) is None, (name, want.first_difference(got))
        else:
            assert got.dtype == v.dtype and bit_equal(got, v), name


def _cast_value(x, cast: bool):
    if isinstance(x, list):
        return [_cast_value(t, cast) for t in x]
    return x.to(torch.bfloat16) if cast and x.is_floating_point() else x


# family -> plan; _assert_plan_reached checks each case reaches its shape, so none is vacuous
PLANS = {
    "default_mixed": default_plan,
    "ragged_many_rows": lambda fam: ragged(24),
    "one_row": lambda fam: [RowPlan(5, images=[2, 3], videos=[1])],
    "uniform_one_image": lambda fam: [RowPlan(4 + i, images=[2]) for i in range(5)],
    "uniform_two_images": lambda fam: [RowPlan(3, images=[1, 1]) for _ in range(3)],
    "media_free": lambda fam: [RowPlan(3), RowPlan(7), RowPlan(1)],
    "all_share_row0": lambda fam: [RowPlan(6, images=[1, 3], videos=[2])]
    + [RowPlan(2 + i, share_media_of=0) for i in range(3)],
    "trailing_dims_differ": lambda fam: [RowPlan(4, images=[1]), RowPlan(2, images=[4]),
                                         RowPlan(3, images=[2, 3]), RowPlan(5)],
}


def _assert_plan_reached(case: str, b: Batch) -> None:
    name = _media_field(b)
    if name is None:
        return
    v = b[name]
    present = [i for i in range(len(v)) if not v.is_none(i)]
    shapes = [tuple(map(tuple, v.segment_shapes(i))) for i in present]
    if case == "media_free":
        assert not present and v.as_tensor() is None
    elif case.startswith("uniform"):
        assert len(present) == len(v) > 1 and len(set(shapes)) == 1
    elif case == "all_share_row0":
        assert v.is_deduplicated() and len(set(v.rows)) == 1
    elif case == "default_mixed":
        assert v.is_deduplicated() and len(present) < len(v) and len(set(shapes)) > 1
    elif case == "ragged_many_rows":
        assert len(v) == 24 and len(present) < len(v) and len(set(shapes)) > 1
    elif case == "one_row":
        assert len(v) == 1 and len(v.segments) >= 1
    elif case == "trailing_dims_differ":
        trailing = {tuple(s.shape[1:]) for s in v.segments}
        if b.family in ("nemotron_omni", "audio"):
            assert len(trailing) > 1
        assert len(present) == 3


@pytest.mark.parametrize("case", sorted(PLANS))
@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_codec_round_trip_plans(family, case):
    for dtype in MEDIA_DTYPES:
        b = build_batch(family, PLANS[case](family), seed=7, media_dtype=dtype)
        _assert_plan_reached(case, b)
        wire = _check_round_trip(b)
        assert CODEC.decode(through_transport(wire)) == b


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_codec_every_allowed_dtype(family):
    base = build_batch(family, default_plan(family), seed=11)
    swept = 0
    for name, v in base.fields.items():
        for dtype in spec(name).dtypes:
            if isinstance(v, PackedTensor):
                nv = PackedTensor([s.to(dtype) for s in v.segments], v.rows, v.pack_dim)
            else:
                nv = v.to(dtype)
            b = base.replace(**{name: nv})
            back = CODEC.decode(CODEC.encode(b))
            assert back[name].dtype == dtype, (name, dtype)
            assert b.first_difference(back) is None, (name, dtype, b.first_difference(back))
            swept += 1
    assert swept >= 10


def test_codec_canonicalises_extra_padding():
    b = build_batch("qwen2_vl", default_plan("qwen2_vl"), extra_seq=3)
    back = CODEC.decode(CODEC.encode(b))
    assert back.seq_len() == int(b.seq_lens.max())
    assert back == b.truncate(int(b.seq_lens.max()))


# -- codec: bad input ------------------------------------------------------------------
class TestCodecBadInput:
    def test_encode_wrong_dtype(self):
        b = qwen()
        with pytest.raises(TypeError, match="field 'pixel_values' has dtype torch.int64"):
            CODEC.encode(b.replace(pixel_values=PackedTensor(
                [s.long() for s in b["pixel_values"].segments], b["pixel_values"].rows)))
        with pytest.raises(TypeError, match="field 'generation_logprobs' has dtype"):
            CODEC.encode(b.replace(generation_logprobs=b["generation_logprobs"].double()))

    def test_encode_packed_field_given_dense(self):
        b = qwen()
        bad = b.replace(image_grid_thw=torch.zeros(4, 3, dtype=torch.long))
        with pytest.raises(TypeError, match="packed field 'image_grid_thw' must be a "
                                            "PackedTensor"):
            CODEC.encode(bad)

    def test_encode_unknown_field(self):
        b = qwen()
        b.fields["not_a_field"] = torch.zeros(4)
        with pytest.raises(KeyError, match="'not_a_field' is not registered"):
            CODEC.encode(b)

    def test_decode_unknown_field(self):
        wire = CODEC.encode(qwen())
        wire.columns["not_a_field"] = torch.zeros(4)
        with pytest.raises(KeyError, match="'not_a_field' is not registered"):
            CODEC.decode(wire)

    def test_decode_misaligned_tags(self):
        wire = CODEC.encode(qwen())
        cols = {"pixel_values": wire.columns["pixel_values"]}
        with pytest.raises(ValueError, match="wire column 'pixel_values' has 4 rows but there "
                                             "are 3 tags"):
            CODEC.decode(WireBatch(cols, wire.tags[:3]))
        with pytest.raises(ValueError, match="wire column 'pixel_values' has 4 rows but there "
                                             "are 5 tags"):
            CODEC.decode(WireBatch(cols, [*wire.tags, dict(wire.tags[0])]))

    def test_decode_tag_lacks_field(self):
        wire = CODEC.encode(qwen())
        del wire.tags[2]["image_grid_thw"]
        with pytest.raises(KeyError, match="row 2's tag lacks 'image_grid_thw'"):
            CODEC.decode(wire)

    def test_decode_tags_shuffled_against_rows(self):
        wire = CODEC.encode(qwen())
        tags = [wire.tags[1], wire.tags[0], *wire.tags[2:]]
        with pytest.raises(ValueError, match=r"(field|column) '(pixel_values|input_ids)'"):
            CODEC.decode(WireBatch(wire.columns, tags))

    def test_decode_tag_shapes_disagree_with_row(self):
        wire = CODEC.encode(qwen())
        wire.tags[0]["pixel_values"]["shapes"][0][0] += 1
        with pytest.raises(ValueError, match="field 'pixel_values' row 0: tag shapes"):
            CODEC.decode(wire)

    def test_decode_none_tag_with_values(self):
        wire = CODEC.encode(qwen())
        wire.tags[0]["pixel_values"]["shapes"] = None
        with pytest.raises(ValueError, match="field 'pixel_values' row 0: tag says None"):
            CODEC.decode(wire)

    def test_decode_per_token_length_disagrees_with_seq_len(self):
        wire = CODEC.encode(qwen())
        wire.tags[1][SEQ_LEN_TAG] += 1
        with pytest.raises(ValueError, match="per-token column '\\w+' row 1 has"):
            CODEC.decode(wire)

    @pytest.mark.parametrize(
        "name, dense, message",
        [
            ("pixel_values", True, "packed column 'pixel_values' arrived dense"),
            ("input_ids", True, "per-token column 'input_ids' arrived dense"),
            ("advantages", False, "per-sample column 'advantages' arrived jagged"),
        ],
    )
    def test_decode_wrong_layout(self, name, dense, message):
        b = qwen()
        wire = CODEC.encode(b)
        if dense:
            col = torch.zeros(4, 3, dtype=wire.columns[name].dtype)
        else:
            col = jagged([torch.zeros(2) for _ in range(4)], torch.float32)
        wire.columns[name] = col
        with pytest.raises(TypeError, match=message):
            CODEC.decode(wire)

    def test_ragged_dense_column_to_transport(self):
        """A ragged column must be jagged: a list or a strided nested tensor is refused."""
        wire = CODEC.encode(qwen())
        rows = list(wire.columns["pixel_values"].unbind())
        dp = InMemoryDataPlane()
        keys = [f"k{i}" for i in range(4)]
        with pytest.raises(TypeError, match="column 'pixel_values' is a list"):
            dp.put("p", keys, {"pixel_values": rows})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # the strided layout is "prototype"
            strided = torch.nested.nested_tensor(rows)
        with pytest.raises(TypeError, match="column 'pixel_values' is a strided nested tensor"):
            dp.put("p", keys, {"pixel_values": strided})
        assert dp.list("p") == []  # nothing was stored

    def test_decode_zero_tags(self):
        with pytest.raises(ValueError, match="empty wire batch"):
            CODEC.decode(WireBatch({}, []))
        with pytest.raises(ValueError, match="empty batch.*pixel_values"):
            CODEC.encode(build_batch("qwen2_vl", [RowPlan(2, images=[1])]).slice(0, 0))

    def test_decode_zero_tags_names_the_columns(self):
        wire = CODEC.encode(build_batch("qwen2_vl", [RowPlan(2, images=[1])]))
        with pytest.raises(ValueError, match="pixel_values"):
            CODEC.decode(WireBatch(dict(wire.columns), []))

    def test_decode_wrong_dtype_column(self):
        wire = CODEC.encode(qwen())
        wire.columns["input_ids"] = wire.columns["input_ids"].to(torch.float32)
        with pytest.raises(TypeError, match="'input_ids'"):
            CODEC.decode(wire)


class TestCodecObjects:
    @pytest.mark.parametrize("into", ["multi_modal_inputs", "mm_train_inputs"])
    def test_round_trip_keeps_empty_dict_and_none(self, into):
        o = qwen().to_row_dicts(into)
        wire = CODEC.encode(o)
        assert f"{into}.pixel_values" in wire.columns
        assert wire.columns[into].tolist() == [1, 1, 0 if into == "mm_train_inputs" else 1, 1]
        assert wire.tags[2][into] == ({} if into == "multi_modal_inputs" else None)
        assert wire.tags[0][into]["pixel_values"] == {"shape": [12, 1176]}
        assert wire.columns[f"{into}.pixel_values"].unbind()[2].numel() == 0
        assert CODEC.decode(wire) == o
        assert CODEC.decode(through_transport(wire)) == o
        free = build_batch("qwen2_vl", [RowPlan(3), RowPlan(4)]).to_row_dicts(into)
        wire = CODEC.encode(free)
        assert [c for c in wire.columns if c.startswith(into)] == [into]  # no key columns
        assert CODEC.decode(wire) == free
        partial = {k: v for k, v in wire.columns.items() if k != into}  # field not fetched
        assert into not in CODEC.decode(WireBatch(partial, wire.tags))

    def test_list_values_and_bits(self):
        rows = [{"pixel_values": [torch.tensor([[float("nan"), -0.0]]), torch.ones(2, 3)]},
                None, {"pixel_values": [], "image_sizes": torch.tensor([[4, 5]])}]
        b = Batch({"input_lengths": torch.tensor([1, 2, 1]),
                   "input_ids": torch.tensor([[5, 0], [6, 7], [8, 0]]),
                   "mm_train_inputs": ObjectColumn(rows)}, "llava_next")
        wire = CODEC.encode(b)
        assert wire.tags[0]["mm_train_inputs"] == {"pixel_values": {"list": [[1, 2], [2, 3]]}}
        back = CODEC.decode(through_transport(wire))
        assert back == b and back["mm_train_inputs"][2]["pixel_values"] == []

    def test_policy_cast_reaches_dict_media_not_geometry(self):
        o = qwen().to_row_dicts()
        back = ReferenceCodec(torch.bfloat16).decode(ReferenceCodec(torch.bfloat16).encode(o))
        row = back["multi_modal_inputs"][0]
        assert row["pixel_values"].dtype == torch.bfloat16
        assert row["image_grid_thw"].dtype == torch.int64
        nemo = build_batch("nemotron_omni", default_plan("nemotron_omni")).to_row_dicts()
        kept = ReferenceCodec(torch.bfloat16).decode(ReferenceCodec(torch.bfloat16).encode(nemo))
        assert kept == nemo  # Nemotron-Omni keeps its pixels fp32 on purpose

    def test_bad_wire_input_names_field_row_and_key(self):
        o = qwen().to_row_dicts()
        wire = CODEC.encode(o)
        col = "multi_modal_inputs.pixel_values"

        def decode(columns=None, tags=None):
            CODEC.decode(WireBatch(columns or dict(wire.columns),
                                   tags if tags is not None else [dict(t) for t in wire.tags]))

        tags = [dict(t) for t in wire.tags]
        del tags[1]["multi_modal_inputs"]
        with pytest.raises(KeyError, match="row 1's tag lacks 'multi_modal_inputs'"):
            decode(tags=tags)
        with pytest.raises(KeyError, match=r"row 0's tag names keys \['pixel_values'\]"):
            decode(columns={k: v for k, v in wire.columns.items() if k != col})
        tags = [dict(t) for t in wire.tags]
        tags[0]["multi_modal_inputs"] = {"image_grid_thw": tags[0]["multi_modal_inputs"][
            "image_grid_thw"]}
        with pytest.raises(ValueError, match=rf"'{re.escape(col)}' row 0 has \d+ values but "
                                             r"row 0's tag has no key 'pixel_values'"):
            decode(tags=tags)
        dense = dict(wire.columns)
        dense["multi_modal_inputs.image_grid_thw"] = torch.zeros(4, 3, dtype=torch.long)
        with pytest.raises(TypeError, match="'multi_modal_inputs.image_grid_thw' arrived dense"):
            decode(columns=dense)
        with pytest.raises(KeyError, match="came without object field 'multi_modal_inputs'"):
            decode(columns={k: v for k, v in wire.columns.items() if k != "multi_modal_inputs"})
        with pytest.raises(ValueError, match="row 2: its column says None, its tag a dict"):
            decode(columns={**wire.columns, "multi_modal_inputs": torch.tensor(
                [1, 1, 0, 1], dtype=torch.int8)})
        with pytest.raises(TypeError, match="own column must be dense"):
            decode(columns={**wire.columns, "multi_modal_inputs": wire.columns[col]})
        with pytest.raises(KeyError, match="'bogus.pixel_values' is not registered"):
            decode(columns={**wire.columns, "bogus.pixel_values": wire.columns[col]})
        mixed = ObjectColumn([{"pixel_values": torch.ones(1, 2)},
                              {"pixel_values": torch.ones(1, 2, dtype=torch.bfloat16)}])
        b = Batch({"input_lengths": torch.tensor([1, 1]), "input_ids": torch.ones(2, 1).long(),
                   "mm_train_inputs": mixed}, "llava")
        with pytest.raises(TypeError, match="'mm_train_inputs' key 'pixel_values' mixes dtypes"):
            CODEC.encode(b)

    def test_column_field(self):
        from rlconform.reference_impl.codec import column_field

        assert column_field("multi_modal_inputs.pixel_values") == "multi_modal_inputs"
        assert column_field("mm_train_inputs.image_grid_thw") == "mm_train_inputs"
        assert column_field("pixel_values") == "pixel_values"
        assert column_field("input_ids.x") == "input_ids.x"
