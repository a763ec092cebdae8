"""Unit tests of the reference core: PackedTensor, the field registry, Batch, the codec,
BatchMeta and the in-memory data plane.

The codec properties run over every registered family with the hypothesis strategies of
fixtures/strategies.py, and again on fixed plans that are guaranteed to reach each shape the
field defects of BACKGROUND.md section 3 hid in (ragged counts, `None` rows, every row the same
shape, several and de-duplicated segments, differing trailing dims, every allowed dtype, one row
and many rows).
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlconform.fixtures.strategies import MEDIA_DTYPES, batches
from rlconform.fixtures.synthetic import RowPlan, build_batch, default_plan, media_families
from rlconform.reference_impl import registry
from rlconform.reference_impl.batch import Batch
from rlconform.reference_impl.bitexact import bit_equal
from rlconform.reference_impl.codec import SEQ_LEN_TAG, ReferenceCodec, WireBatch, jagged
from rlconform.reference_impl.dataplane import InMemoryDataPlane
from rlconform.reference_impl.meta import BatchMeta
from rlconform.reference_impl.objects import ObjectColumn
from rlconform.reference_impl.packed import PackedTensor
from rlconform.reference_impl.registry import (
    FAMILIES,
    DtypePolicy,
    FieldSpec,
    Kind,
    Stage,
    multimodal_fields,
    register_field,
    spec,
    stage_fields,
)

PROPS = settings(max_examples=25, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
ALL_FAMILIES = [*media_families(), "text"]
CODEC = ReferenceCodec()


def _f32(*shape, start: float = 0.0) -> torch.Tensor:
    n = 1
    for d in shape:
        n *= d
    return (torch.arange(n, dtype=torch.float32) + start + 1).reshape(shape)


def _packed_fields(batch: Batch) -> dict[str, PackedTensor]:
    return {n: v for n, v in batch.fields.items() if isinstance(v, PackedTensor)}


def _media_field(batch: Batch) -> str | None:
    """The family's main media field (images, else audio), or None for text."""
    for name in ("pixel_values", "input_features"):
        if name in batch.fields:
            return name
    return None


# =====================================================================================
# PackedTensor
# =====================================================================================
class TestPackedTensor:
    def test_from_rows_bare_tensor_list_and_none(self):
        a, b, c = _f32(2, 3), _f32(1, 3, start=10), _f32(4, 3, start=20)
        pt = PackedTensor.from_rows([a, None, [b, c]])
        assert len(pt) == 3
        assert len(pt.segments) == 3
        assert pt.rows == [(0,), None, (1, 2)]
        assert pt.segment_shapes(0) == [[2, 3]]
        assert pt.segment_shapes(1) is None
        assert pt.segment_shapes(2) == [[1, 3], [4, 3]]
        assert pt.dtype == torch.float32
        assert not pt.is_deduplicated()

    def test_none_rows(self):
        pt = PackedTensor.from_rows([None, _f32(2, 3), None])
        assert [pt.is_none(i) for i in range(3)] == [True, False, True]
        assert pt.row(0) is None and pt.row_segments(2) is None
        assert torch.equal(pt.row(1), _f32(2, 3))
        media_free = PackedTensor.from_rows([None, None])
        assert media_free.as_tensor() is None
        assert media_free.dtype is None and media_free.nbytes() == 0

    def test_several_segments_concatenate_in_order(self):
        a, b = _f32(2, 3), _f32(3, 3, start=100)
        pt = PackedTensor.from_rows([[a, b]])
        assert torch.equal(pt.row(0), torch.cat([a, b]))
        assert pt.row(0).shape == (5, 3)

    def test_empty_segment_list_is_not_none(self):
        pt = PackedTensor.from_rows([[]])
        assert not pt.is_none(0)
        with pytest.raises(ValueError, match="row 0 has an empty segment list"):
            pt.row(0)

    def test_dedup_select_keeps_sharing_and_nbytes_counts_logical_rows(self):
        a, b = _f32(4, 3), _f32(2, 3, start=50)
        pt = PackedTensor([a, b], [(0,), (0,), None, (1,)])
        assert pt.is_deduplicated()
        assert pt.nbytes() == 2 * a.numel() * a.element_size() + b.numel() * b.element_size()
        sel = pt.select([1, 3, 0])
        assert len(sel.segments) == 2  # the shared segment stays one physical segment
        assert sel.rows[0] == sel.rows[2]
        assert sel.segments[sel.rows[0][0]] is a  # shared, not copied
        assert sel.is_deduplicated()
        assert sel.nbytes() == pt.nbytes()
        # a selection that drops the partner is no longer de-duplicated
        assert not pt.select([0, 3]).is_deduplicated()

    def test_select_drops_unused_segments(self):
        pt = PackedTensor.from_rows([_f32(1, 2), _f32(2, 2), _f32(3, 2)])
        sel = pt.select([2])
        assert len(sel.segments) == 1 and sel.rows == [(0,)]
        assert torch.equal(sel.row(0), _f32(3, 2))

    def test_as_tensor_pack_dim0_concatenates_present_rows(self):
        a, b, c = _f32(2, 3), _f32(1, 3, start=10), _f32(4, 3, start=20)
        pt = PackedTensor.from_rows([[a, b], None, c], pack_dim=0)
        out = pt.as_tensor()
        assert out.shape == (7, 3)
        assert torch.equal(out, torch.cat([a, b, c]))

    def test_as_tensor_pack_dim1_pads_rows_and_stacks(self):
        r0 = _f32(2, 3, 2, 2)
        r2 = _f32(3, 3, 2, 2, start=1000)
        pt = PackedTensor.from_rows([r0, None, r2], pack_dim=1)
        out = pt.as_tensor()
        assert out.shape == (3, 3, 3, 2, 2)
        assert torch.equal(out[0, :2], r0)
        assert torch.count_nonzero(out[0, 2:]) == 0  # zero padding up to the batch max
        assert torch.count_nonzero(out[1]) == 0  # a None row is all zeros
        assert torch.equal(out[2], r2)

    def test_as_tensor_pack_dim1_several_segments_in_a_row(self):
        pt = PackedTensor.from_rows([[_f32(1, 2), _f32(2, 2, start=5)], _f32(1, 2, start=9)],
                                    pack_dim=1)
        out = pt.as_tensor()
        assert out.shape == (2, 3, 2)
        assert torch.equal(out[0], torch.cat([_f32(1, 2), _f32(2, 2, start=5)]))
        assert torch.equal(out[1, :1], _f32(1, 2, start=9))
        assert torch.count_nonzero(out[1, 1:]) == 0

    def test_pad_to_max_shape_differing_trailing_dims(self):
        a = _f32(1, 3, 4, 5)
        b = _f32(2, 3, 6, 2, start=500)
        pt = PackedTensor.from_rows([a, b])
        padded = pt.pad_to_max_shape()
        assert [list(s.shape) for s in padded.segments] == [[1, 3, 6, 5], [2, 3, 6, 5]]
        assert torch.equal(padded.segments[0][:, :, :4, :5], a)
        assert torch.count_nonzero(padded.segments[0][:, :, 4:, :]) == 0
        assert torch.equal(padded.segments[1][:, :, :6, :2], b)
        assert torch.count_nonzero(padded.segments[1][:, :, :, 2:]) == 0
        assert padded.rows == pt.rows
        # the original keeps its shapes: padding happens only for the model input
        assert pt.segment_shapes(0) == [[1, 3, 4, 5]]
        out = pt.as_tensor()
        assert out.shape == (3, 3, 6, 5)
        assert torch.equal(out, torch.cat(padded.segments))

    def test_pad_to_max_shape_same_shapes_is_identity(self):
        a = _f32(2, 3)
        pt = PackedTensor.from_rows([a, _f32(1, 3)])
        assert pt.pad_to_max_shape().segments[0] is a

    def test_row_with_differing_trailing_dims_raises(self):
        pt = PackedTensor.from_rows([[_f32(1, 3), _f32(1, 4)]])
        with pytest.raises(RuntimeError):
            pt.row(0)

    def test_slice_select_concat(self):
        segs = [_f32(i + 1, 2, start=10 * i) for i in range(4)]
        pt = PackedTensor.from_rows([segs[0], None, segs[1], [segs[2], segs[3]]])
        sl = pt.slice(1, 3)
        assert len(sl) == 2 and sl.is_none(0) and torch.equal(sl.row(1), segs[1])
        assert len(pt.slice(3, 100)) == 1
        sel = pt.select(torch.tensor([3, 0]))
        assert sel.segment_shapes(0) == [[3, 2], [4, 2]]
        assert torch.equal(sel.row(1), segs[0])
        with pytest.raises(IndexError, match="-1"):
            sel.select([-1])
        with pytest.raises(IndexError, match="row index 4 out of range for 4 rows"):
            pt.select([4])
        cat = PackedTensor.concat([pt.slice(0, 2), pt.slice(2, 4)])
        assert cat == pt
        assert cat.rows == [(0,), None, (1,), (2, 3)]
        with pytest.raises(ValueError, match="pack_dims"):
            PackedTensor.concat([pt, PackedTensor.from_rows([segs[0]], pack_dim=1)])
        with pytest.raises(ValueError, match="at least one"):
            PackedTensor.concat([])

    def test_concat_keeps_sharing_within_parts(self):
        a = _f32(2, 2)
        pt = PackedTensor([a], [(0,), (0,)])
        cat = PackedTensor.concat([pt, pt])
        assert len(cat.segments) == 2 and cat.rows == [(0,), (0,), (1,), (1,)]
        assert cat.nbytes() == 4 * a.numel() * a.element_size()

    def test_to_dtype_casts_floating_only(self):
        pt = PackedTensor.from_rows([_f32(2, 3), None])
        cast = pt.to_dtype(torch.bfloat16)
        assert cast.dtype == torch.bfloat16
        assert cast.rows == pt.rows
        assert torch.equal(cast.row(0), _f32(2, 3).to(torch.bfloat16))
        grid = torch.tensor([[1, 2, 4]])
        ints = PackedTensor.from_rows([grid, None])
        kept = ints.to_dtype(torch.bfloat16)
        assert kept.dtype == torch.int64
        assert kept.segments[0] is grid
        assert kept == ints

    def test_clone_does_not_alias(self):
        pt = PackedTensor.from_rows([_f32(2, 2)])
        cl = pt.clone()
        cl.segments[0].zero_()
        assert torch.equal(pt.row(0), _f32(2, 2))

    def test_equality_is_logical_not_physical(self):
        a = _f32(2, 3)
        shared = PackedTensor([a], [(0,), (0,)])
        copied = PackedTensor.from_rows([a.clone(), a.clone()])
        assert shared == copied
        assert shared.first_difference(copied) is None
        assert shared != PackedTensor.from_rows([a, a + 1])

    @pytest.mark.parametrize(
        "other, message",
        [
            (lambda: PackedTensor.from_rows([_f32(2, 3), None]), r"^2 rows, expected 1$"),
            (lambda: PackedTensor.from_rows([_f32(2, 3)], pack_dim=1),
             r"^pack_dim 1, expected 0$"),
            (lambda: PackedTensor.from_rows([_f32(2, 3).to(torch.bfloat16)]),
             r"^dtype torch.bfloat16, expected torch.float32$"),
            (lambda: PackedTensor.from_rows([None]), r"^row 0 is None, expected the opposite$"),
            (lambda: PackedTensor.from_rows([_f32(3, 3)]),
             r"^row 0 segment shapes \[\[3, 3\]\], expected \[\[2, 3\]\]$"),
            (lambda: PackedTensor.from_rows([[_f32(1, 3), _f32(1, 3)]]),
             r"^row 0 segment shapes \[\[1, 3\], \[1, 3\]\], expected \[\[2, 3\]\]$"),
            (lambda: PackedTensor.from_rows([_f32(2, 3) * 2]),
             r"^row 0 segment 0: 6 values differ at the bit level, first at index \(0, 0\): "
             r"expected 1.0 \(0x3f800000\), got 2.0 \(0x40000000\)$"),
        ],
        ids=["rows", "pack_dim", "dtype", "none", "shape", "split", "values"],
    )
    def test_first_difference_messages(self, other, message):
        ref = PackedTensor.from_rows([_f32(2, 3)])
        why = ref.first_difference(other())
        assert why is not None
        assert re.search(message, why), why
        assert ref != other()

    def test_constructor_errors(self):
        with pytest.raises(TypeError, match="mix dtypes"):
            PackedTensor.from_rows([_f32(1, 2), torch.ones(1, 2, dtype=torch.int64)])
        with pytest.raises(ValueError, match="rank"):
            PackedTensor.from_rows([_f32(1, 2), _f32(1, 2, 2)])
        with pytest.raises(ValueError, match="rank"):
            PackedTensor([torch.tensor(1.0)], [(0,)])
        with pytest.raises(IndexError, match="row 1 names segment indices"):
            PackedTensor([_f32(1, 2)], [(0,), (1,)])
        with pytest.raises(ValueError, match="pack_dim must be 0 or 1"):
            PackedTensor([], [], pack_dim=2)


# =====================================================================================
# registry
# =====================================================================================
class TestRegistry:
    @pytest.mark.parametrize("family", sorted(FAMILIES))
    def test_every_family_field_is_registered(self, family):
        fam = FAMILIES[family]
        for name in fam.fields:
            assert name in registry.FIELDS, f"{family}: {name} not registered"
            assert spec(name).name == name
        assert set(fam.pack_dims) <= set(fam.fields)
        assert all(d in (0, 1) for d in fam.pack_dims.values())
        assert set(fam.keep_dtype) <= set(fam.fields)
        assert set(fam.segment_shapes) <= set(fam.packed_fields())
        # every packed field says what one segment looks like
        assert set(fam.packed_fields()) == set(fam.segment_shapes)

    def test_spec_unknown_field_names_it(self):
        with pytest.raises(KeyError, match="'no_such_field' is not registered"):
            spec("no_such_field")

    def test_coupled_fields_exist_are_packed_and_symmetric(self):
        couplings = 0
        for name, fs in registry.FIELDS.items():
            for other in fs.coupled:
                couplings += 1
                assert other in registry.FIELDS, f"{name} couples unregistered {other}"
                assert spec(other).kind is Kind.PACKED and fs.kind is Kind.PACKED
                assert name in spec(other).coupled, f"{name} -> {other} is one-way"
        assert couplings >= 10

    def test_policy_media_allow_only_floating_dtypes(self):
        policy = [fs for fs in registry.FIELDS.values() if fs.dtype_policy is DtypePolicy.POLICY]
        assert {fs.name for fs in policy} >= {"pixel_values", "pixel_values_videos"}
        for fs in policy:
            assert fs.dtypes and all(d.is_floating_point for d in fs.dtypes)
            assert torch.bfloat16 in fs.dtypes

    @pytest.mark.parametrize("stage", list(Stage))
    def test_every_stage_fetches_every_media_field(self, stage):
        # the train fetch that used a static text-only field list (BACKGROUND.md section 3)
        packed = {n for n, f in registry.FIELDS.items() if f.kind is Kind.PACKED}
        assert packed <= set(stage_fields(stage))
        assert packed <= set(multimodal_fields(stage))
        assert {"mm_token_type_ids", "token_type_ids"} <= set(multimodal_fields(stage))
        assert "input_ids" not in multimodal_fields(stage)

    def test_stage_fields_follow_stages(self):
        assert "prev_logprobs" in stage_fields(Stage.TRAIN)
        assert "prev_logprobs" not in stage_fields(Stage.LOGPROB)
        assert "rewards" not in stage_fields(Stage.TRAIN)

    def test_register_field(self, monkeypatch):
        monkeypatch.setattr(registry, "FIELDS", dict(registry.FIELDS))
        new = FieldSpec("backend_col", Kind.PER_SAMPLE, dtypes=(torch.float32,))
        register_field(new)
        assert spec("backend_col") is new
        register_field(FieldSpec("backend_col", Kind.PER_SAMPLE, dtypes=(torch.float32,)))
        with pytest.raises(ValueError, match="'backend_col' is already registered"):
            register_field(FieldSpec("backend_col", Kind.PER_TOKEN))
        with pytest.raises(ValueError, match="'pixel_values' is already registered"):
            register_field(FieldSpec("pixel_values", Kind.PER_SAMPLE))
        assert spec("pixel_values").kind is Kind.PACKED


# =====================================================================================
# Batch
# =====================================================================================
def _seq(name: str, v: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """Positions start..start+length of a per-token field, on its registered sequence dim."""
    return v.narrow(spec(name).seq_axis(v.dim()), start, length)


def _qwen() -> Batch:
    return build_batch("qwen2_vl", default_plan("qwen2_vl"), seed=3)


class TestBatch:
    def test_requires_input_lengths_and_registered_fields(self):
        with pytest.raises(KeyError, match="'input_lengths' is required"):
            Batch({"input_ids": torch.zeros(2, 3, dtype=torch.long)})
        with pytest.raises(KeyError, match="'bogus' is not registered"):
            Batch({"input_lengths": torch.tensor([1]), "bogus": torch.zeros(1)})

    def test_canonical_batches_validate(self):
        for fam in ALL_FAMILIES:
            build_batch(fam, default_plan(fam)).validate()

    @pytest.mark.parametrize(
        "field, value, error, message",
        [
            ("input_ids", lambda b: b["input_ids"].float(), TypeError,
             r"field 'input_ids' has dtype torch.float32"),
            ("pixel_values",
             lambda b: PackedTensor([s.long() for s in b["pixel_values"].segments],
                                    b["pixel_values"].rows), TypeError,
             r"field 'pixel_values' has dtype torch.int64"),
            ("attention_mask", lambda b: b["attention_mask"][:, :-1], ValueError,
             r"per-token field 'attention_mask' has sequence dim"),
            ("mm_token_type_ids", lambda b: b["mm_token_type_ids"][:, 0], ValueError,
             r"per-token field 'mm_token_type_ids' must be \[B, S\]"),
            ("advantages", lambda b: b["advantages"][:3], ValueError,
             r"field 'advantages' has 3 rows, expected 4"),
            ("image_grid_thw", lambda b: b["image_grid_thw"].slice(0, 3), ValueError,
             r"field 'image_grid_thw' has 3 rows, expected 4"),
            ("token_mask", lambda b: b["token_mask"][:3], ValueError,
             r"field 'token_mask' has 3 rows, expected 4"),
        ],
        ids=["dtype", "packed-dtype", "misaligned", "per-token-1d", "rows", "packed-rows",
             "per-token-rows"],
    )
    def test_validate_errors_name_the_field(self, field, value, error, message):
        b = _qwen()
        bad = b.replace(**{field: value(b)})
        with pytest.raises(error, match=message):
            bad.validate()
        with pytest.raises(error, match=message):
            CODEC.encode(bad)

    def test_validate_input_lengths_beyond_sequence(self):
        b = _qwen()
        bad = b.replace(input_lengths=b.seq_lens + 100)
        with pytest.raises(ValueError, match="field 'input_lengths' has max"):
            bad.validate()

    def test_validate_coupled_none_ness_mismatch(self):
        b = _qwen()
        assert b["pixel_values"].is_none(2)
        grid = b["image_grid_thw"]
        rows = list(grid.rows)
        rows[2] = rows[1]  # row 2 has a grid but no pixels
        bad = b.replace(image_grid_thw=PackedTensor(grid.segments, rows))
        with pytest.raises(ValueError, match=r"row 2: field 'pixel_values' is None but coupled "
                                             r"field 'image_grid_thw' is present"):
            bad.validate()

    def test_truncate_narrows_only_per_token(self):
        b = _qwen()
        t = b.truncate(3)
        t.validate()
        for name in b.names(Kind.PER_TOKEN):
            assert torch.equal(t[name], _seq(name, b[name], 0, 3))
        assert t.seq_lens.tolist() == b.seq_lens.clamp(max=3).tolist()
        for name in b.names(Kind.PACKED):
            assert t[name] is b[name]  # media are never narrowed
        assert torch.equal(t["advantages"], b["advantages"])
        assert b.truncate(1000) == b
        with pytest.raises(ValueError, match="max_len must be >= 0"):
            b.truncate(-1)

    def test_pad_to_pads_per_token_only(self):
        b = _qwen()
        s = b.seq_len()
        p = b.pad_to(s + 5)
        p.validate()
        for name in b.names(Kind.PER_TOKEN):
            axis = spec(name).seq_axis(b[name].dim())
            assert p[name].shape[axis] == s + 5 and p[name].shape[0] == 4
            assert torch.equal(_seq(name, p[name], 0, s), b[name])
            assert torch.count_nonzero(_seq(name, p[name], s, 5)) == 0
        for name in b.names(Kind.PACKED):
            assert p[name] is b[name]
        assert p.truncate(s) == b
        assert b.pad_to(s - 1) == b  # never narrows

    def test_select_and_slice(self):
        b = _qwen()
        s = b.select([3, 0])
        assert s.batch_size == 2
        assert torch.equal(s["input_ids"], b["input_ids"][[3, 0]])
        assert s["pixel_values"] == b["pixel_values"].select([3, 0])
        assert s["pixel_values"].is_deduplicated()  # row 3 shares row 0's media
        assert b.slice(1, 3) == b.select([1, 2])

    def test_concat_of_slices_restores_and_pads(self):
        b = _qwen()
        assert Batch.concat([b.slice(0, 1), b.slice(1, 4)]) == b
        short = build_batch("qwen2_vl", [RowPlan(2, images=[1])], seed=1)
        cat = Batch.concat([b, short])
        cat.validate()
        assert cat.seq_len() == b.seq_len()
        assert cat.batch_size == 5
        assert cat.select([4])["input_ids"].shape == (1, b.seq_len())
        with pytest.raises(KeyError, match="cannot concat batches with fields"):
            Batch.concat([b, b.without("advantages")])
        with pytest.raises(ValueError, match="at least one"):
            Batch.concat([])

    @pytest.mark.parametrize("mb", [1, 3, 4, 10])
    def test_shard(self, mb):
        b = _qwen()
        shards = b.shard(mb)
        sizes = [s.batch_size for s in shards]
        assert sum(sizes) == 4 and all(n == mb for n in sizes[:-1]) and 0 < sizes[-1] <= mb
        assert Batch.concat(shards) == b

    def test_shard_rejects_non_positive(self):
        with pytest.raises(ValueError, match="micro_batch_size must be positive"):
            _qwen().shard(0)

    @pytest.mark.parametrize("stage", list(Stage))
    def test_multimodal_inputs_per_stage(self, stage):
        b = _qwen()
        out = b.multimodal_inputs(stage)
        expected = {n for n in b.fields if spec(n).multimodal and stage in spec(n).stages}
        expected -= {n for n, v in _packed_fields(b).items() if v.as_tensor() is None}
        assert set(out) == expected
        assert {"pixel_values", "image_grid_thw", "mm_token_type_ids"} <= set(out)
        assert "input_ids" not in out
        assert torch.equal(out["pixel_values"], b["pixel_values"].as_tensor())
        n_patches = sum(s.shape[0] for i in range(len(b)) for s in
                        (b["pixel_values"].row_segments(i) or []))
        assert out["pixel_values"].shape == (n_patches, 1176)

    def test_multimodal_inputs_stage_filter(self, monkeypatch):
        monkeypatch.setitem(registry.FIELDS, "train_only_map", FieldSpec(
            "train_only_map", Kind.PER_TOKEN, multimodal=True, dtypes=(torch.int64,),
            stages=frozenset({Stage.TRAIN})))
        b = _qwen()
        b = b.replace(train_only_map=torch.zeros_like(b["input_ids"]))
        assert "train_only_map" in b.multimodal_inputs(Stage.TRAIN)
        assert "train_only_map" not in b.multimodal_inputs(Stage.LOGPROB)
        assert "train_only_map" not in b.multimodal_inputs(Stage.REFERENCE_LOGPROB)

    def test_multimodal_inputs_dtype_policy(self):
        b = _qwen()
        out = b.multimodal_inputs(Stage.LOGPROB, dtype=torch.bfloat16)
        assert out["pixel_values"].dtype == torch.bfloat16
        assert out["pixel_values_videos"].dtype == torch.bfloat16
        assert out["image_grid_thw"].dtype == torch.int64
        assert out["mm_token_type_ids"].dtype == torch.int64
        nemo = build_batch("nemotron_omni", default_plan("nemotron_omni"))
        kept = nemo.multimodal_inputs(Stage.TRAIN, dtype=torch.bfloat16)
        assert kept["pixel_values"].dtype == torch.float32  # fp32 on purpose

    def test_multimodal_inputs_media_free_left_out(self):
        b = build_batch("qwen2_vl", [RowPlan(3), RowPlan(5)])
        out = b.multimodal_inputs(Stage.TRAIN)
        assert "pixel_values" not in out and "image_grid_thw" not in out
        assert "mm_token_type_ids" in out

    def test_multimodal_inputs_pack_dim1(self):
        b = build_batch("idefics3", [RowPlan(3, images=[2]), RowPlan(4), RowPlan(5, images=[1])])
        out = b.multimodal_inputs(Stage.TRAIN)
        assert out["pixel_values"].shape == (3, 2, 3, 4, 4)
        assert out["pixel_attention_mask"].shape == (3, 2, 4, 4)
        assert torch.count_nonzero(out["pixel_attention_mask"][1]) == 0
        assert torch.count_nonzero(out["pixel_attention_mask"][2, 1:]) == 0


# =====================================================================================
# codec
# =====================================================================================
def _check_round_trip(b: Batch, codec: ReferenceCodec = CODEC) -> WireBatch:
    wire = codec.encode(b)
    assert len(wire.tags) == b.batch_size
    for i, tag in enumerate(wire.tags):
        assert tag[SEQ_LEN_TAG] == int(b.seq_lens[i])
    for name, v in _packed_fields(b).items():
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
    for name, v in _packed_fields(back).items():
        for i in range(len(v)):
            if b[name].is_none(i):
                assert v.row_segments(i) is None  # None, never a (0, ...) tensor
        if all(b[name].is_none(i) for i in range(len(b))):
            assert v.as_tensor() is None
    return wire


def _through_transport(wire: WireBatch) -> WireBatch:
    dp = InMemoryDataPlane()
    keys = [f"s{i}" for i in range(len(wire))]
    dp.put("rollout", keys, wire.columns, wire.tags)
    cols, tags = dp.get("rollout", keys, list(wire.columns))
    return WireBatch(cols, tags)


@pytest.mark.parametrize("family", ALL_FAMILIES)
@PROPS
@given(data=st.data())
def test_codec_round_trip_property(family, data):
    b = data.draw(batches(family))
    wire = _check_round_trip(b)
    assert CODEC.decode(_through_transport(wire)) == b


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


def _ragged(n: int) -> list[RowPlan]:
    return [RowPlan(1 + (3 * i) % 9, images=[1 + i % 4] * (i % 3), videos=[1 + i % 2] * (i % 2))
            for i in range(n)]


# family -> plan; _assert_plan_reached checks each case reaches its shape, so none is vacuous
PLANS = {
    "default_mixed": default_plan,
    "ragged_many_rows": lambda fam: _ragged(24),
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
        assert CODEC.decode(_through_transport(wire)) == b


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
        b = _qwen()
        with pytest.raises(TypeError, match="field 'pixel_values' has dtype torch.int64"):
            CODEC.encode(b.replace(pixel_values=PackedTensor(
                [s.long() for s in b["pixel_values"].segments], b["pixel_values"].rows)))
        with pytest.raises(TypeError, match="field 'generation_logprobs' has dtype"):
            CODEC.encode(b.replace(generation_logprobs=b["generation_logprobs"].double()))

    def test_encode_packed_field_given_dense(self):
        b = _qwen()
        bad = b.replace(image_grid_thw=torch.zeros(4, 3, dtype=torch.long))
        with pytest.raises(TypeError, match="packed field 'image_grid_thw' must be a "
                                            "PackedTensor"):
            CODEC.encode(bad)

    def test_encode_unknown_field(self):
        b = _qwen()
        b.fields["not_a_field"] = torch.zeros(4)
        with pytest.raises(KeyError, match="'not_a_field' is not registered"):
            CODEC.encode(b)

    def test_decode_unknown_field(self):
        wire = CODEC.encode(_qwen())
        wire.columns["not_a_field"] = torch.zeros(4)
        with pytest.raises(KeyError, match="'not_a_field' is not registered"):
            CODEC.decode(wire)

    def test_decode_misaligned_tags(self):
        wire = CODEC.encode(_qwen())
        cols = {"pixel_values": wire.columns["pixel_values"]}
        with pytest.raises(ValueError, match="wire column 'pixel_values' has 4 rows but there "
                                             "are 3 tags"):
            CODEC.decode(WireBatch(cols, wire.tags[:3]))
        with pytest.raises(ValueError, match="wire column 'pixel_values' has 4 rows but there "
                                             "are 5 tags"):
            CODEC.decode(WireBatch(cols, [*wire.tags, dict(wire.tags[0])]))

    def test_decode_tag_lacks_field(self):
        wire = CODEC.encode(_qwen())
        del wire.tags[2]["image_grid_thw"]
        with pytest.raises(KeyError, match="row 2's tag lacks 'image_grid_thw'"):
            CODEC.decode(wire)

    def test_decode_tags_shuffled_against_rows(self):
        wire = CODEC.encode(_qwen())
        tags = [wire.tags[1], wire.tags[0], *wire.tags[2:]]
        with pytest.raises(ValueError, match=r"(field|column) '(pixel_values|input_ids)'"):
            CODEC.decode(WireBatch(wire.columns, tags))

    def test_decode_tag_shapes_disagree_with_row(self):
        wire = CODEC.encode(_qwen())
        wire.tags[0]["pixel_values"]["shapes"][0][0] += 1
        with pytest.raises(ValueError, match="field 'pixel_values' row 0: tag shapes"):
            CODEC.decode(wire)

    def test_decode_none_tag_with_values(self):
        wire = CODEC.encode(_qwen())
        wire.tags[0]["pixel_values"]["shapes"] = None
        with pytest.raises(ValueError, match="field 'pixel_values' row 0: tag says None"):
            CODEC.decode(wire)

    def test_decode_per_token_length_disagrees_with_seq_len(self):
        wire = CODEC.encode(_qwen())
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
        b = _qwen()
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
        wire = CODEC.encode(_qwen())
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
        wire = CODEC.encode(_qwen())
        wire.columns["input_ids"] = wire.columns["input_ids"].to(torch.float32)
        with pytest.raises(TypeError, match="'input_ids'"):
            CODEC.decode(wire)


# =====================================================================================
# BatchMeta
# =====================================================================================
def _meta(n: int = 5, lens=None) -> BatchMeta:
    lens = lens if lens is not None else [3 + (7 * i) % 11 for i in range(n)]
    return BatchMeta("p", [f"k{i}" for i in range(len(lens))], ["input_ids", "pixel_values"],
                     lens, [{"seq_len": s, "pixel_values": {"shapes": [[i + 1, 4]]}}
                            for i, s in enumerate(lens)], {"step": 1})


class TestBatchMeta:
    def test_subset_copies_tags(self):
        m = _meta()
        s = m.subset([4, 1])
        assert s.keys == ["k4", "k1"] and s.seq_lens == [m.seq_lens[4], m.seq_lens[1]]
        assert s.tags == [m.tags[4], m.tags[1]] and s.extra == m.extra
        s.tags[0]["pixel_values"]["shapes"][0][0] = 99
        assert m.tags[4]["pixel_values"]["shapes"] == [[5, 4]]
        with pytest.raises(IndexError, match="meta index 5 out of range for 5 keys"):
            m.subset([5])
        with pytest.raises(IndexError, match="meta index -1"):
            m.subset([-1])

    def test_slice_and_concat(self):
        m = _meta()
        assert m.slice(1, 3).keys == ["k1", "k2"]
        assert m.slice(3, 100).keys == ["k3", "k4"]
        back = BatchMeta.concat([m.slice(0, 2), m.slice(2, 5)])
        assert (back.keys, back.seq_lens, back.tags, back.fields) == \
            (m.keys, m.seq_lens, m.tags, m.fields)

    def test_concat_errors(self):
        m = _meta()
        with pytest.raises(ValueError, match="duplicated: \\['k0'\\]"):
            BatchMeta.concat([m.slice(0, 2), m.slice(0, 1)])
        other = BatchMeta("q", ["z"], m.fields, [1], [{}])
        with pytest.raises(ValueError, match="partitions 'p' and 'q'"):
            BatchMeta.concat([m, other])
        with pytest.raises(ValueError, match="fields"):
            BatchMeta.concat([m.slice(0, 1), m.slice(1, 2).drop("pixel_values")])
        with pytest.raises(ValueError, match="at least one"):
            BatchMeta.concat([])

    def test_drop_and_with_fields(self):
        m = _meta()
        d = m.drop("pixel_values")
        assert d.fields == ["input_ids"] and m.fields == ["input_ids", "pixel_values"]
        assert d.tags == m.tags and d.keys == m.keys
        with pytest.raises(KeyError, match="'advantages'"):
            m.drop("advantages")
        w = m.with_fields("advantages", "input_ids")
        assert w.fields == ["input_ids", "pixel_values", "advantages"]
        assert w.tags == m.tags

    def test_stamp_tags(self):
        m = _meta(3)
        one = m.stamp_tags({"policy_version": 2})
        assert all(t["policy_version"] == 2 for t in one.tags)
        assert all("policy_version" not in t for t in m.tags)
        assert all("seq_len" in t for t in one.tags)  # merged, not replaced
        per = m.stamp_tags([{"r": 0}, {"r": 1}, {"r": 2}])
        assert [t["r"] for t in per.tags] == [0, 1, 2]
        with pytest.raises(ValueError, match="stamp_tags got 2 tags for 3 keys"):
            m.stamp_tags([{}, {}])

    def test_constructor_errors(self):
        with pytest.raises(ValueError, match="duplicated: \\['a'\\]"):
            BatchMeta("p", ["a", "b", "a"], [], [1, 1, 1], [{}, {}, {}])
        with pytest.raises(ValueError, match="2 keys but 1 tags"):
            BatchMeta("p", ["a", "b"], [], [1, 1], [{}])
        with pytest.raises(ValueError, match="2 keys but 3 seq_lens"):
            BatchMeta("p", ["a", "b"], [], [1, 1, 1], [{}, {}])
        assert BatchMeta("p", ["a"], ["x", "x"], [1], [{}]).fields == ["x"]

    @PROPS
    @given(lens=st.lists(st.integers(1, 200), max_size=40), world=st.integers(1, 9))
    def test_shard_for_dp(self, lens, world):
        m = _meta(lens=lens)
        shards, inverse = m.shard_for_dp(world)
        assert len(shards) == world
        sizes = [len(s) for s in shards]
        assert max(sizes) - min(sizes) <= 1  # balanced by count
        keys = [k for s in shards for k in s.keys]
        assert sorted(keys) == sorted(m.keys) and len(set(keys)) == len(keys)  # cover, disjoint
        tokens = [sum(s.seq_lens) for s in shards]
        if len(lens) >= world:
            assert max(tokens) - min(tokens) <= max(lens)  # balanced by tokens
        for rank, s in enumerate(shards):
            assert s.extra["dp_rank"] == rank and s.extra["dp_world"] == world
            assert s.extra["step"] == 1
            for k, sl, t in zip(s.keys, s.seq_lens, s.tags):
                i = m.keys.index(k)
                assert sl == m.seq_lens[i] and t == m.tags[i]  # tags travel with their keys
            assert [m.keys.index(k) for k in s.keys] == sorted(m.keys.index(k) for k in s.keys)
        restored = BatchMeta.concat(shards).subset(inverse)
        assert (restored.keys, restored.seq_lens, restored.tags) == (m.keys, m.seq_lens, m.tags)

    def test_shard_for_dp_balances_tokens_example(self):
        m = _meta(lens=[100, 90, 10, 5, 50, 45])
        shards, _ = m.shard_for_dp(2)
        assert sorted(sum(s.seq_lens) for s in shards) == [150, 150]
        with pytest.raises(ValueError, match="world size must be positive"):
            m.shard_for_dp(0)


# =====================================================================================
# InMemoryDataPlane
# =====================================================================================
KEYS = ["a", "b", "c"]


def _cols() -> dict[str, torch.Tensor]:
    return {
        "dense": _f32(3, 2, 4),
        "scalar": torch.tensor([1.5, 2.5, 3.5]),
        "ids": jagged([torch.arange(4), torch.arange(0), torch.arange(2)], torch.int64),
        "media": torch.nested.nested_tensor_from_jagged(
            _f32(5, 6).to(torch.bfloat16), offsets=torch.tensor([0, 2, 2, 5])),
    }


def _rows(col: torch.Tensor) -> list[torch.Tensor]:
    return list(col.unbind())


class TestInMemoryDataPlane:
    def test_put_get_list_clear_close(self):
        dp = InMemoryDataPlane()
        dp.put("p", KEYS, _cols(), [{"i": i} for i in range(3)])
        assert dp.list("p") == KEYS
        assert sorted(dp.fields("p")) == sorted(_cols())
        cols, tags = dp.get("p", ["c", "a"], ["dense", "ids"])
        assert set(cols) == {"dense", "ids"}
        assert tags == [{"i": 2}, {"i": 0}]
        assert torch.equal(cols["dense"], _cols()["dense"][[2, 0]])
        assert [r.tolist() for r in _rows(cols["ids"])] == [[0, 1], [0, 1, 2, 3]]
        dp.clear("p", ["b"])
        assert dp.list("p") == ["a", "c"]
        with pytest.raises(KeyError, match="'b'"):
            dp.get("p", ["b"], ["dense"])
        with pytest.raises(KeyError, match="cannot clear keys \\['zz'\\]"):
            dp.clear("p", ["zz"])
        dp.clear("p")
        assert dp.list("p") == []  # a partition holding no keys lists []
        dp.clear("p")  # clearing it again: it holds nothing, as clear leaves it
        dp.close()
        for call in (lambda: dp.put("p", ["a"], {"scalar": torch.ones(1)}),
                     lambda: dp.get("p", ["a"], ["scalar"]),
                     lambda: dp.list("p"), lambda: dp.clear("p")):
            with pytest.raises(RuntimeError, match="closed"):
                call()

    def test_select_fields_required(self):
        dp = InMemoryDataPlane()
        dp.put("p", KEYS, _cols())
        with pytest.raises(TypeError, match="select_fields"):
            dp.get("p", KEYS)
        cols, tags = dp.get("p", KEYS, [])
        assert cols == {} and len(tags) == 3

    def test_missing_key_partition_field_named(self):
        dp = InMemoryDataPlane()
        dp.put("p", KEYS, _cols())
        with pytest.raises(KeyError, match="keys \\['nope'\\] not in partition 'p'"):
            dp.get("p", ["a", "nope"], ["dense"])
        with pytest.raises(KeyError, match="partition 'other' does not exist"):
            dp.get("other", ["a"], ["dense"])
        with pytest.raises(KeyError, match="field 'advantages' missing"):
            dp.get("p", ["a"], ["advantages"])
        dp.put("p", ["d"], {"scalar": torch.ones(1)})
        with pytest.raises(KeyError, match="field 'dense' missing for keys \\['d'\\]"):
            dp.get("p", ["a", "d"], ["dense"])

    def test_layout_preservation(self):
        dp = InMemoryDataPlane()
        src = _cols()
        dp.put("p", KEYS, src)
        cols, _ = dp.get("p", KEYS, list(src))
        assert not cols["dense"].is_nested
        assert cols["dense"].shape == (3, 2, 4) and torch.equal(cols["dense"], src["dense"])
        assert cols["scalar"].shape == (3,)  # 1-D stays (N,), not (N, 1) or jagged (1,) rows
        assert torch.equal(cols["scalar"], src["scalar"])
        for name in ("ids", "media"):
            assert cols[name].is_nested and cols[name].layout is torch.jagged
            assert cols[name].dtype == src[name].dtype
            got, want = _rows(cols[name]), _rows(src[name])
            assert [r.shape for r in got] == [r.shape for r in want]  # zero-length row kept
            assert all(torch.equal(g, w) for g, w in zip(got, want))
        assert _rows(cols["ids"])[1].shape == (0,)
        assert cols["media"].shape[2] == 6 and _rows(cols["media"])[1].shape == (0, 6)

    def test_single_key_round_trip(self):
        dp = InMemoryDataPlane()
        dp.put("p", ["x"], {"scalar": torch.tensor([7.0]), "ids": jagged([torch.arange(3)],
                                                                         torch.int64)})
        cols, _ = dp.get("p", ["x"], ["scalar", "ids"])
        assert cols["scalar"].shape == (1,) and cols["scalar"].item() == 7.0
        assert _rows(cols["ids"])[0].tolist() == [0, 1, 2]

    def test_no_aliasing_either_direction(self):
        dp = InMemoryDataPlane()
        src = _cols()
        dp.put("p", KEYS, src)
        for col in src.values():  # caller mutates after put
            (col.values() if col.is_nested else col).add_(100)
        cols, _ = dp.get("p", KEYS, list(src))
        fresh = _cols()
        for name in fresh:
            a = cols[name].values() if cols[name].is_nested else cols[name]
            b = fresh[name].values() if fresh[name].is_nested else fresh[name]
            assert torch.equal(a, b), name
            a.mul_(0)  # caller mutates what get returned
        again, _ = dp.get("p", KEYS, list(src))
        for name in fresh:
            a = again[name].values() if again[name].is_nested else again[name]
            b = fresh[name].values() if fresh[name].is_nested else fresh[name]
            assert torch.equal(a, b), name

    def test_tags_not_aliased(self):
        dp = InMemoryDataPlane()
        tags = [{"s": [1]}, {"s": [2]}, {"s": [3]}]
        dp.put("p", KEYS, {"scalar": torch.ones(3)}, tags)
        tags[0]["s"].append(9)
        _, got = dp.get("p", KEYS, [])
        got[1]["s"].append(9)
        _, again = dp.get("p", KEYS, [])
        assert again == [{"s": [1]}, {"s": [2]}, {"s": [3]}]

    def test_merge_of_later_put(self):
        dp = InMemoryDataPlane()
        dp.put("p", KEYS, {"ids": _cols()["ids"]}, [{"seq_len": i, "v": 0} for i in range(3)])
        dp.put("p", ["b", "c"], {"advantages": torch.tensor([0.5, -0.5])}, [{"v": 1}, {"v": 2}])
        cols, tags = dp.get("p", ["b", "c"], ["ids", "advantages"])
        assert cols["advantages"].tolist() == [0.5, -0.5]
        assert [r.tolist() for r in _rows(cols["ids"])] == [[], [0, 1]]
        assert tags == [{"seq_len": 1, "v": 1}, {"seq_len": 2, "v": 2}]
        assert dp.list("p") == KEYS
        # a re-put of an existing column replaces its rows
        dp.put("p", ["a"], {"advantages": torch.tensor([9.0])})
        assert dp.get("p", ["a", "c"], ["advantages"])[0]["advantages"].tolist() == [9.0, -0.5]
        dp.clear("p", ["a"])
        dp.put("p", ["a"], {"ids": jagged([torch.arange(1)], torch.int64)})
        with pytest.raises(KeyError, match="field 'advantages' missing for keys \\['a'\\]"):
            dp.get("p", ["a"], ["advantages"])

    @pytest.mark.parametrize(
        "first, second",
        [
            (torch.zeros(3, 4), torch.zeros(3, 5)),
            (torch.zeros(3, 4), torch.zeros(3, 4, dtype=torch.bfloat16)),
            (torch.zeros(3), torch.zeros(3, 1)),
            (torch.zeros(3, 4), jagged([torch.zeros(4)] * 3, torch.float32)),
            (jagged([torch.zeros(2)] * 3, torch.int64), jagged([torch.zeros(2)] * 3,
                                                                torch.int32)),
        ],
        ids=["trailing", "dtype", "rank", "dense-to-jagged", "jagged-dtype"],
    )
    def test_layout_conflict_on_reput(self, first, second):
        dp = InMemoryDataPlane()
        dp.put("p", KEYS, {"col": first})
        with pytest.raises(ValueError, match="column 'col' in partition 'p' was written as"):
            dp.put("p", KEYS, {"col": second})
        dp.put("q", KEYS, {"col": second})  # partitions record layouts independently

    def test_failed_put_stores_nothing(self):
        dp = InMemoryDataPlane()
        dp.put("p", KEYS, {"col": torch.zeros(3, 4)})
        with pytest.raises(ValueError, match="'col'"):
            dp.put("p", ["d"], {"new": torch.ones(1), "col": torch.zeros(1, 5)})
        assert dp.list("p") == KEYS
        assert "new" not in dp.fields("p")

    @pytest.mark.parametrize(
        "col",
        [torch.zeros(2, 4), jagged([torch.zeros(1)] * 4, torch.float32)],
        ids=["dense", "jagged"],
    )
    def test_put_wrong_row_count_names_column(self, col):
        dp = InMemoryDataPlane()
        with pytest.raises(ValueError, match=f"column 'bad' has {col.size(0)} rows for 3 keys"):
            dp.put("p", KEYS, {"ok": torch.zeros(3), "bad": col})
        assert dp.list("p") == []

    def test_put_argument_errors(self):
        dp = InMemoryDataPlane()
        with pytest.raises(ValueError, match="duplicated keys"):
            dp.put("p", ["a", "a"], {"x": torch.zeros(2)})
        with pytest.raises(ValueError, match="2 tags for 3 keys"):
            dp.put("p", KEYS, {"x": torch.zeros(3)}, [{}, {}])
        with pytest.raises(ValueError, match="column 'x' is 0-d"):
            dp.put("p", KEYS, {"x": torch.tensor(1.0)})

    def test_partitions_are_isolated(self):
        dp = InMemoryDataPlane()
        dp.put("p", KEYS, {"x": torch.zeros(3)})
        dp.put("q", KEYS, {"x": torch.ones(3)})
        assert dp.get("p", KEYS, ["x"])[0]["x"].tolist() == [0.0] * 3
        dp.clear("q")
        assert dp.get("p", KEYS, ["x"])[0]["x"].tolist() == [0.0] * 3

    def test_non_contiguous_jagged_column(self):
        col = torch.nested.nested_tensor_from_jagged(
            torch.arange(10.0), offsets=torch.tensor([0, 4, 8]), lengths=torch.tensor([2, 3]))
        want = [r.tolist() for r in col.unbind()]
        assert want == [[0.0, 1.0], [4.0, 5.0, 6.0]]
        dp = InMemoryDataPlane()
        dp.put("p", ["a", "b"], {"x": col})
        got = [r.tolist() for r in dp.get("p", ["a", "b"], ["x"])[0]["x"].unbind()]
        assert got == want



# =====================================================================================
# object columns, seq_dim, per-row dict form, batch algebra
# =====================================================================================
def _obj_rows() -> list:
    return [
        {"pixel_values": _f32(6, 4), "image_grid_thw": torch.tensor([[1, 2, 3]])},
        {},
        None,
        {"pixel_values": [_f32(2, 3), _f32(1, 5)]},  # list value: images of differing widths
    ]


class TestObjectColumn:
    def test_rows_and_views(self):
        col = ObjectColumn(_obj_rows())
        assert len(col) == 4 and col.is_none(2) and not col.is_none(1)
        assert col.keys() == ["pixel_values", "image_grid_thw"]
        assert col.nbytes() == (24 + 6 + 5) * 4 + 3 * 8
        assert [k for k, _ in col.tensors(3)] == ["pixel_values", "pixel_values"]

    @pytest.mark.parametrize("rows, message", [
        ([5], r"row 0 is a int; rows are dicts or None"),
        ([{"pixel_values": 1.0}], r"row 0 key 'pixel_values' is a float"),
        ([None, {"pixel_values": [torch.ones(1), "x"]}], r"row 1 key 'pixel_values'\[1\] is a str"),
        ([{3: torch.ones(1)}], r"row 0 has a non-string key 3"),
    ])
    def test_bad_rows_name_row_and_key(self, rows, message):
        with pytest.raises(TypeError, match=message):
            ObjectColumn(rows)
        with pytest.raises(TypeError, match="sequence of rows"):
            ObjectColumn({"pixel_values": torch.ones(1)})

    def test_select_slice_concat_copy_dicts_share_tensors(self):
        rows = _obj_rows()
        col = ObjectColumn(rows)
        rows[0]["extra"] = torch.ones(1)  # the caller's dicts are not the column's
        assert "extra" not in col[0]
        sel = col.select([3, 0, 0])
        assert sel[1] is not col[0] and sel[1] is not sel[2]
        assert sel[1]["pixel_values"] is col[0]["pixel_values"]  # tensors shared, like segments
        sel[1].pop("image_grid_thw")
        sel[0]["pixel_values"].append(torch.ones(1))
        assert "image_grid_thw" in col[0] and len(col[3]["pixel_values"]) == 2
        assert col.slice(1, 3) == ObjectColumn([{}, None])
        assert ObjectColumn.concat([col.slice(0, 2), col.slice(2, 4)]) == col
        with pytest.raises(IndexError, match="row index 4 out of range for 4 rows"):
            col.select([4])
        with pytest.raises(ValueError, match="at least one"):
            ObjectColumn.concat([])

    def test_clone_does_not_alias(self):
        col = ObjectColumn(_obj_rows())
        c = col.clone()
        c[0]["pixel_values"].fill_(-1)
        assert col[0]["pixel_values"][0, 0] == 1.0

    @pytest.mark.parametrize("change, message", [
        (lambda r: r.__setitem__(1, None), r"row 1 is None, expected \{\}"),
        (lambda r: r.__setitem__(2, {}), r"row 2 is \{\}, expected None"),
        (lambda r: r[0].pop("image_grid_thw"), r"row 0 has keys \['pixel_values'\], expected"),
        (lambda r: r[0].__setitem__("image_grid_thw", torch.tensor([[1, 2, 3]], dtype=torch.int32)),
         r"row 0 key 'image_grid_thw' dtype torch.int32, expected torch.int64"),
        (lambda r: r[0].__setitem__("pixel_values", _f32(4, 6)),
         r"row 0 key 'pixel_values' shape \[4, 6\], expected \[6, 4\]"),
        (lambda r: r[0].__setitem__("pixel_values", -_f32(6, 4)),
         r"row 0 key 'pixel_values' 24 values differ at the bit level, first at index \(0, 0\): "
         r"expected 1.0 \(0x3f800000\), got -1.0 \(0xbf800000\)"),
        (lambda r: r[3].__setitem__("pixel_values", torch.cat([_f32(2, 3).reshape(-1)])),
         r"row 3 key 'pixel_values' is a Tensor, expected a list of 2 tensors"),
        (lambda r: r[3]["pixel_values"].pop(), r"row 3 key 'pixel_values' has 1 tensors, expected 2"),
        (lambda r: r.pop(), r"3 rows, expected 4"),
    ])
    def test_first_difference(self, change, message):
        want = ObjectColumn(_obj_rows())
        rows = _obj_rows()
        change(rows)
        why = want.first_difference(ObjectColumn(rows))
        assert why is not None and re.search(message, why), why
        assert want != ObjectColumn(rows)

    def test_equality_is_bit_exact(self):
        a = ObjectColumn([{"pixel_values": torch.tensor([float("nan"), 0.0, 1e-42])}])
        assert a == a.clone()  # NaN == NaN bit for bit, subnormal kept
        b = ObjectColumn([{"pixel_values": torch.tensor([float("nan"), -0.0, 1e-42])}])
        assert a.first_difference(b) == ("row 0 key 'pixel_values' 1 value differs at the bit "
                                         "level, first at index 1: +0.0 came back -0.0")


class TestSeqDim:
    def test_seq_axis(self):
        pos = spec("position_ids")
        assert pos.seq_dim == -1 and pos.kind is Kind.PER_TOKEN and pos.dtypes == (torch.int64,)
        assert pos.seq_axis(2) == 1 and pos.seq_axis(3) == 2
        assert spec("input_ids").seq_axis(3) == 1  # [B, S, k]: default seq_dim 1
        with pytest.raises(ValueError, match="per-token field 'position_ids' needs a sequence dim"):
            pos.seq_axis(1)

    @pytest.mark.parametrize("channels", [0, 3, 4])
    def test_truncate_pad_select_concat(self, channels):
        b = build_batch("qwen2_vl", default_plan("qwen2_vl"), position_ids=channels)
        pos = b["position_ids"]
        s = b.seq_len()
        assert pos.shape == ((4, s) if not channels else (4, channels, s))
        assert torch.count_nonzero(pos[..., 6:][b.seq_lens <= 6]) == 0  # pad past each row
        t = b.truncate(3)
        assert torch.equal(t["position_ids"], pos[..., :3])
        p = b.pad_to(s + 2)
        assert torch.equal(p["position_ids"][..., :s], pos) and p["position_ids"].shape[-1] == s + 2
        assert b.select([2, 0])["position_ids"].shape[:-1] == (2, *pos.shape[1:-1])
        short = b.select([2]).truncate(int(b.seq_lens[2]))
        cat = Batch.concat([short, b.select([0])])
        cat.validate()
        assert torch.equal(cat["position_ids"][0], p["position_ids"][2, ..., :s])

    def test_validate_names_a_misaligned_position_ids(self):
        b = build_batch("qwen2_vl", default_plan("qwen2_vl"), position_ids=3)
        with pytest.raises(ValueError, match=r"'position_ids' has sequence dim 6 \(dim 2 of "
                                             r"\[4, 3, 6\]\)"):
            b.replace(position_ids=b["position_ids"][..., :-1]).validate()
        with pytest.raises(ValueError, match=r"per-token field 'position_ids' must be \[B, S\]"):
            b.replace(position_ids=b["position_ids"][:, 0, 0]).validate()
        with pytest.raises(TypeError, match="field 'position_ids' has dtype torch.int32"):
            b.replace(position_ids=b["position_ids"].int()).validate()

    @pytest.mark.parametrize("channels", [0, 3, 4])
    def test_codec_rows_are_len_by_other_dims(self, channels):
        b = build_batch("qwen3_vl", default_plan("qwen3_vl"), position_ids=channels)
        wire = CODEC.encode(b)
        rows = wire.columns["position_ids"].unbind()
        for i, r in enumerate(rows):
            n = int(b.seq_lens[i])
            want = b["position_ids"][i, ..., :n]
            assert r.shape == ((n,) if not channels else (n, channels))
            assert torch.equal(r, want.movedim(-1, 0))
        assert CODEC.decode(wire) == b
        assert CODEC.decode(_through_transport(wire)) == b

    def test_seq_dim_1_with_trailing_dims(self, monkeypatch):
        monkeypatch.setitem(registry.FIELDS, "routed_experts", FieldSpec(
            "routed_experts", Kind.PER_TOKEN, dtypes=(torch.int16,)))  # verl: [B, S, L, K]
        b = _qwen()
        s = b.seq_len()
        experts = torch.arange(4 * s * 6, dtype=torch.int16).reshape(4, s, 2, 3)
        experts[~b["attention_mask"].bool()] = 0
        b = b.replace(routed_experts=experts)
        wire = CODEC.encode(b)
        assert wire.columns["routed_experts"].unbind()[0].shape == (int(b.seq_lens[0]), 2, 3)
        assert CODEC.decode(wire) == b
        assert b.truncate(2)["routed_experts"].shape == (4, 2, 2, 3)


def _without_empty_media(b: Batch) -> Batch:
    return b.without(*[n for n, v in _packed_fields(b).items() if v.as_tensor() is None])


class TestRowDicts:
    def test_qwen_rows_hold_what_the_processor_emits_per_sample(self):
        b = _qwen()
        o = b.to_row_dicts()
        assert "pixel_values" not in o and "mm_token_type_ids" in o and "position_ids" in o
        rows = o["multi_modal_inputs"]
        pv = b["pixel_values"]
        r0 = rows[0]
        assert r0["pixel_values"].shape == (sum(s.shape[0] for s in pv.row_segments(0)), 1176)
        assert torch.equal(r0["pixel_values"], pv.row(0))
        assert r0["image_grid_thw"].shape == (2, 3)  # [n_images, 3]
        assert torch.equal(r0["image_grid_thw"], b["image_grid_thw"].row(0))
        assert int(r0["image_grid_thw"].prod(-1).sum()) == r0["pixel_values"].shape[0]
        assert set(rows[1]) == {"pixel_values", "image_grid_thw"}  # no video: key left out
        assert rows[2] == {}  # verl: {} for a text-only row
        assert b.to_row_dicts("mm_train_inputs")["mm_train_inputs"][2] is None  # OpenRLHF
        o.validate()

    @pytest.mark.parametrize("family", ALL_FAMILIES)
    @pytest.mark.parametrize("into", ["multi_modal_inputs", "mm_train_inputs"])
    def test_round_trip_and_model_inputs(self, family, into):
        for plan in (default_plan(family), _ragged(9), [RowPlan(3), RowPlan(2)]):
            b = build_batch(family, plan, seed=5)
            o = b.to_row_dicts(into)
            o.validate()
            assert set(o.names(Kind.PACKED)) == set()
            back = o.from_row_dicts(into)
            why = _without_empty_media(b).first_difference(back)
            assert why is None, why
            for stage in Stage:
                want, got = b.multimodal_inputs(stage), o.multimodal_inputs(stage)
                assert set(want) == set(got)
                for k in want:
                    assert want[k].dtype == got[k].dtype and torch.equal(want[k], got[k]), k

    def test_list_values_where_one_tensor_cannot_give_the_segments_back(self):
        nemo = build_batch("nemotron_omni", [RowPlan(3, images=[1, 2]), RowPlan(2, images=[3])])
        rows = nemo.to_row_dicts()["multi_modal_inputs"]
        assert isinstance(rows[0]["pixel_values"], list)  # H, W differ per image
        assert rows[1]["pixel_values"].shape == (1, 3, 12, 16)
        segs = [torch.ones(2, 3, 4, 4), torch.zeros(1, 3, 4, 4)]  # two segments on pack dim 1
        b = build_batch("idefics3", [RowPlan(3, images=[2]), RowPlan(3)])
        b = b.replace(pixel_values=PackedTensor.from_rows([segs, None], pack_dim=1)).without(
            "pixel_attention_mask")
        o = b.to_row_dicts()
        assert isinstance(o["multi_modal_inputs"][0]["pixel_values"], list)
        assert o.from_row_dicts() == b
        one = build_batch("idefics3", [RowPlan(3, images=[2])]).to_row_dicts()
        assert one["multi_modal_inputs"][0]["pixel_values"].shape == (1, 2, 3, 4, 4)

    def test_bad_row_dicts_name_field_row_and_key(self):
        o = _qwen().to_row_dicts()
        rows = o["multi_modal_inputs"].rows
        bad = [dict(r) if r else r for r in rows]
        bad[1] = {**bad[1], "image_grid_thw": torch.tensor([[1, 2, 5]])}
        with pytest.raises(ValueError, match=r"'multi_modal_inputs' row 1 key 'pixel_values': "
                                             r"grid \[\[1, 2, 5\]\] gives 10 rows"):
            o.replace(multi_modal_inputs=ObjectColumn(bad)).from_row_dicts()
        for row, error, message in [
            ({"bogus": torch.ones(1)}, KeyError, "row 2 has key 'bogus', which is not registered"),
            ({"mm_token_type_ids": torch.ones(1, 3, dtype=torch.long)}, ValueError,
             "row 2 has key 'mm_token_type_ids', a per_token field"),
            ({"image_grid_thw": torch.ones(1, 3)}, TypeError,
             "row 2 key 'image_grid_thw' has dtype torch.float32"),
        ]:
            with pytest.raises(error, match=message):
                o.replace(multi_modal_inputs=ObjectColumn(rows[:2] + [row] + rows[3:])).validate()
        both = o.replace(image_grid_thw=_qwen()["image_grid_thw"])
        with pytest.raises(ValueError, match="'image_grid_thw' is both a batch field and a key"):
            both.validate()
        with pytest.raises(ValueError, match="is a per_token field, not an object field"):
            _qwen().to_row_dicts("input_ids")
        with pytest.raises(ValueError, match="already has object field"):
            o.to_row_dicts()
        with pytest.raises(TypeError, match="object field 'multi_modal_inputs' must be an "
                                            "ObjectColumn, got list"):
            o.replace(multi_modal_inputs=list(rows)).validate()
        idefics = build_batch("idefics3", [RowPlan(3, images=[2])]).to_row_dicts()
        flat = ObjectColumn([{"pixel_values": torch.ones(2, 3, 4, 4)}])
        with pytest.raises(ValueError, match=r"a pack_dim 1 value is \[1, tiles, ...\]"):
            idefics.replace(multi_modal_inputs=flat).from_row_dicts()


class TestCodecObjects:
    @pytest.mark.parametrize("into", ["multi_modal_inputs", "mm_train_inputs"])
    def test_round_trip_keeps_empty_dict_and_none(self, into):
        o = _qwen().to_row_dicts(into)
        wire = CODEC.encode(o)
        assert f"{into}.pixel_values" in wire.columns
        assert wire.columns[into].tolist() == [1, 1, 0 if into == "mm_train_inputs" else 1, 1]
        assert wire.tags[2][into] == ({} if into == "multi_modal_inputs" else None)
        assert wire.tags[0][into]["pixel_values"] == {"shape": [12, 1176]}
        assert wire.columns[f"{into}.pixel_values"].unbind()[2].numel() == 0
        assert CODEC.decode(wire) == o
        assert CODEC.decode(_through_transport(wire)) == o
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
        back = CODEC.decode(_through_transport(wire))
        assert back == b and back["mm_train_inputs"][2]["pixel_values"] == []

    def test_policy_cast_reaches_dict_media_not_geometry(self):
        o = _qwen().to_row_dicts()
        back = ReferenceCodec(torch.bfloat16).decode(ReferenceCodec(torch.bfloat16).encode(o))
        row = back["multi_modal_inputs"][0]
        assert row["pixel_values"].dtype == torch.bfloat16
        assert row["image_grid_thw"].dtype == torch.int64
        nemo = build_batch("nemotron_omni", default_plan("nemotron_omni")).to_row_dicts()
        kept = ReferenceCodec(torch.bfloat16).decode(ReferenceCodec(torch.bfloat16).encode(nemo))
        assert kept == nemo  # Nemotron-Omni keeps its pixels fp32 on purpose

    def test_bad_wire_input_names_field_row_and_key(self):
        o = _qwen().to_row_dicts()
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


class TestBatchAlgebra:
    @pytest.mark.parametrize("sizes", [[4], [1, 3], [0, 2, 0, 2], [3, 1]])
    def test_split_restores(self, sizes):
        for b in (_qwen(), _qwen().to_row_dicts()):
            parts = b.split(sizes)
            assert [len(p) for p in parts] == sizes
            assert Batch.concat(parts) == b
            assert parts[-1] == b.slice(4 - sizes[-1], 4)

    def test_split_rejects_bad_sizes(self):
        for sizes in ([1, 2], [5, -1], [2, 3]):
            with pytest.raises(ValueError, match="must be >= 0 and sum to the batch size 4"):
                _qwen().split(sizes)

    @pytest.mark.parametrize("n", [1, 2, 3, 4])
    @pytest.mark.parametrize("seed", [None, 0, 7])
    def test_micro_batches(self, n, seed):
        b = build_batch("qwen2_vl", _ragged(7), position_ids=4).to_row_dicts()
        mbs = b.micro_batches(n, shuffle_seed=seed)
        sizes = [len(idx) for idx, _ in mbs]
        assert len(mbs) == n and max(sizes) - min(sizes) <= 1 and sorted(sizes, reverse=True) == sizes
        flat = [i for idx, _ in mbs for i in idx]
        assert sorted(flat) == list(range(7))
        if seed is None:
            assert flat == list(range(7))
        for idx, mb in mbs:
            assert mb == b.select(idx)
        inverse = sorted(range(7), key=flat.__getitem__)
        assert Batch.concat([mb for _, mb in mbs]).select(inverse) == b
        assert [i for i, _ in b.micro_batches(n, seed)] == [i for i, _ in mbs]  # deterministic

    def test_micro_batches_shuffle_depends_on_the_seed(self):
        b = build_batch("qwen2_vl", _ragged(8))
        orders = {tuple(i for idx, _ in b.micro_batches(2, s) for i in idx) for s in range(4)}
        assert len(orders) > 1 and tuple(range(8)) not in orders or len(orders) > 2
        for n in (0, 9):
            with pytest.raises(ValueError, match=f"micro-batch count n={n} must be in 1..8"):
                b.micro_batches(n)

    def test_concat_rejects_mixed_families_and_holders(self):
        q = _qwen()
        with pytest.raises(ValueError, match="cannot concat batches of families"):
            Batch.concat([q, build_batch("qwen2_5_vl", default_plan("qwen2_5_vl")).without(
                "second_per_grid_ts")])
        with pytest.raises(KeyError, match="cannot concat batches with fields"):
            Batch.concat([q, q.to_row_dicts()])


@pytest.mark.parametrize("family", ["qwen2_vl", "idefics3", "llava_next"])
def test_row_dicts_are_what_the_processor_emits_per_sample(family):
    """verl's multi_modal_inputs / OpenRLHF's mm_train_inputs hold the processor's output for one
    sample: our per-row dicts of a real processor batch equal exactly that, except where one
    tensor cannot give the images back (LLaVA-NeXT images of differing patch counts: a list)."""
    from rlconform.fixtures.families import build_family
    from rlconform.fixtures.images import make_prompts
    from rlconform.fixtures.processed import to_batch

    fam = build_family(family)
    prompts, images, _ = make_prompts(3, [2, 1, 0], seed=0)
    batch = to_batch(fam, dict(fam.process(prompts, images)), [len(i) for i in images])
    rows = batch.to_row_dicts("mm_train_inputs")["mm_train_inputs"]
    assert rows[2] is None
    for i in (0, 1):
        one = dict(fam.process([prompts[i]], [images[i]]))
        for key, value in rows[i].items():
            if isinstance(value, list):
                assert family == "llava_next" and i == 0, (family, i, key)
                assert torch.equal(PackedTensor.from_rows([value]).as_tensor(), one[key])
                continue
            assert value.shape == one[key].shape and torch.equal(value, one[key]), (i, key)


def test_data_plane_trainer_fetches_object_columns():
    """A stage's fetch list names the `<field>.<key>` wire columns of an object field it uses,
    so media written as per-row dicts are not left behind (the text-only train fetch)."""
    from types import SimpleNamespace

    from rlconform.reference_impl.trainer import DataPlaneTrainer

    wire = CODEC.encode(_qwen().to_row_dicts())
    meta = SimpleNamespace(fields=list(wire.columns))
    for stage in Stage:
        got = DataPlaneTrainer.stage_fields(None, meta, stage)
        assert {"multi_modal_inputs.pixel_values", "multi_modal_inputs.image_grid_thw",
                "input_ids", "position_ids"} <= set(got), (stage, got)


# -- bit-exact comparison ------------------------------------------------------------------------
def _from_bits(values: list[int], dtype=torch.float32) -> torch.Tensor:
    width = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
    return torch.tensor(values, dtype=torch.int64).to(width[dtype]).view(dtype)


class TestBitExact:
    @pytest.mark.parametrize("want, got, message", [
        (lambda: torch.tensor([1.0, -0.0]), lambda: torch.tensor([1.0, 0.0]),
         r"^1 value differs at the bit level, first at index 1: -0.0 came back \+0.0$"),
        (lambda: _from_bits([0x7FC00001]), lambda: _from_bits([0x7FC00000]),
         r"nan\(0x7fc00001\) came back nan\(0x7fc00000\) \(the NaN payload changed\)"),
        (lambda: torch.tensor([1e-40, 1.0]), lambda: torch.tensor([0.0, 1.0]),
         r"first at index 0: subnormal 9.99994610111476e-41 came back \+0.0 \(flushed to zero\)"),
        (lambda: torch.tensor([[1.0, 2.0], [3.0, 4.0]]), lambda: torch.tensor([[1.0, 2.0],
                                                                              [3.0, 5.0]]),
         r"first at index \(1, 1\): expected 4.0 \(0x40800000\), got 5.0 \(0x40a00000\)$"),
        (lambda: torch.ones(2), lambda: torch.ones(2, dtype=torch.float64),
         r"^dtype torch.float64, expected torch.float32$"),
        (lambda: torch.ones(2, 3), lambda: torch.ones(3, 2), r"^shape \[3, 2\], expected \[2, 3\]$"),
    ], ids=["neg-zero", "nan-payload", "subnormal", "value", "dtype", "shape"])
    def test_messages_say_what_differs(self, want, got, message):
        from rlconform.reference_impl.bitexact import tensor_difference

        why = tensor_difference(want(), got())
        assert why is not None and re.search(message, why), why

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
    def test_nan_equals_itself_and_every_payload_counts(self, dtype):
        from rlconform.fixtures.synthetic import special_values
        from rlconform.reference_impl.bitexact import tensor_difference

        v = special_values(dtype)
        assert tensor_difference(v, v.clone()) is None, "a NaN that came back as NaN differs"
        assert not torch.equal(v, v.clone()), "torch.equal would have called this a difference"
        for i in range(v.numel()):
            for j in range(v.numel()):
                if i != j:
                    assert tensor_difference(v[i:i + 1], v[j:j + 1]) is not None, (i, j)

    def test_packed_and_batch_comparisons_are_bit_exact(self):
        a = torch.tensor([[0.0, 1.0]])
        b = torch.tensor([[-0.0, 1.0]])
        why = PackedTensor.from_rows([a]).first_difference(PackedTensor.from_rows([b]))
        assert why and "+0.0 came back -0.0" in why, why
        nan = _from_bits([0x7FC00001, 0x7FC00001])
        batch = Batch({"input_lengths": torch.tensor([1, 1]), "advantages": nan})
        assert batch.first_difference(batch.replace(advantages=nan.clone())) is None
        why = batch.first_difference(batch.replace(advantages=_from_bits([0x7FC00001,
                                                                          0x7FC00000])))
        assert why and why.startswith("field 'advantages': 1 value differs"), why
