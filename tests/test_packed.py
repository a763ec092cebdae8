"""Unit tests of the reference PackedTensor (reference_impl/packed.py): jagged media rows, segments,
slicing, selection, concatenation and logical equality."""

from __future__ import annotations

import re

import pytest
import torch
from _helpers import f32

from rlconform.reference_impl.packed import PackedTensor


class TestPackedTensor:
    def test_from_rows_bare_tensor_list_and_none(self):
        a, b, c = f32(2, 3), f32(1, 3, start=10), f32(4, 3, start=20)
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
        pt = PackedTensor.from_rows([None, f32(2, 3), None])
        assert [pt.is_none(i) for i in range(3)] == [True, False, True]
        assert pt.row(0) is None and pt.row_segments(2) is None
        assert torch.equal(pt.row(1), f32(2, 3))
        media_free = PackedTensor.from_rows([None, None])
        assert media_free.as_tensor() is None
        assert media_free.dtype is None and media_free.nbytes() == 0

    def test_several_segments_concatenate_in_order(self):
        a, b = f32(2, 3), f32(3, 3, start=100)
        pt = PackedTensor.from_rows([[a, b]])
        assert torch.equal(pt.row(0), torch.cat([a, b]))
        assert pt.row(0).shape == (5, 3)

    def test_empty_segment_list_is_not_none(self):
        pt = PackedTensor.from_rows([[]])
        assert not pt.is_none(0)
        with pytest.raises(ValueError, match="row 0 has an empty segment list"):
            pt.row(0)

    def test_dedup_select_keeps_sharing_and_nbytes_counts_logical_rows(self):
        a, b = f32(4, 3), f32(2, 3, start=50)
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
        pt = PackedTensor.from_rows([f32(1, 2), f32(2, 2), f32(3, 2)])
        sel = pt.select([2])
        assert len(sel.segments) == 1 and sel.rows == [(0,)]
        assert torch.equal(sel.row(0), f32(3, 2))

    def test_as_tensor_pack_dim0_concatenates_present_rows(self):
        a, b, c = f32(2, 3), f32(1, 3, start=10), f32(4, 3, start=20)
        pt = PackedTensor.from_rows([[a, b], None, c], pack_dim=0)
        out = pt.as_tensor()
        assert out.shape == (7, 3)
        assert torch.equal(out, torch.cat([a, b, c]))

    def test_as_tensor_pack_dim1_pads_rows_and_stacks(self):
        r0 = f32(2, 3, 2, 2)
        r2 = f32(3, 3, 2, 2, start=1000)
        pt = PackedTensor.from_rows([r0, None, r2], pack_dim=1)
        out = pt.as_tensor()
        assert out.shape == (3, 3, 3, 2, 2)
        assert torch.equal(out[0, :2], r0)
        assert torch.count_nonzero(out[0, 2:]) == 0  # zero padding up to the batch max
        assert torch.count_nonzero(out[1]) == 0  # a None row is all zeros
        assert torch.equal(out[2], r2)

    def test_as_tensor_pack_dim1_several_segments_in_a_row(self):
        pt = PackedTensor.from_rows([[f32(1, 2), f32(2, 2, start=5)], f32(1, 2, start=9)],
                                    pack_dim=1)
        out = pt.as_tensor()
        assert out.shape == (2, 3, 2)
        assert torch.equal(out[0], torch.cat([f32(1, 2), f32(2, 2, start=5)]))
        assert torch.equal(out[1, :1], f32(1, 2, start=9))
        assert torch.count_nonzero(out[1, 1:]) == 0

    def test_pad_to_max_shape_differing_trailing_dims(self):
        a = f32(1, 3, 4, 5)
        b = f32(2, 3, 6, 2, start=500)
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
        a = f32(2, 3)
        pt = PackedTensor.from_rows([a, f32(1, 3)])
        assert pt.pad_to_max_shape().segments[0] is a

    def test_row_with_differing_trailing_dims_raises(self):
        pt = PackedTensor.from_rows([[f32(1, 3), f32(1, 4)]])
        with pytest.raises(RuntimeError):
            pt.row(0)

    def test_slice_select_concat(self):
        segs = [f32(i + 1, 2, start=10 * i) for i in range(4)]
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
        a = f32(2, 2)
        pt = PackedTensor([a], [(0,), (0,)])
        cat = PackedTensor.concat([pt, pt])
        assert len(cat.segments) == 2 and cat.rows == [(0,), (0,), (1,), (1,)]
        assert cat.nbytes() == 4 * a.numel() * a.element_size()

    def test_to_dtype_casts_floating_only(self):
        pt = PackedTensor.from_rows([f32(2, 3), None])
        cast = pt.to_dtype(torch.bfloat16)
        assert cast.dtype == torch.bfloat16
        assert cast.rows == pt.rows
        assert torch.equal(cast.row(0), f32(2, 3).to(torch.bfloat16))
        grid = torch.tensor([[1, 2, 4]])
        ints = PackedTensor.from_rows([grid, None])
        kept = ints.to_dtype(torch.bfloat16)
        assert kept.dtype == torch.int64
        assert kept.segments[0] is grid
        assert kept == ints

    def test_clone_does_not_alias(self):
        pt = PackedTensor.from_rows([f32(2, 2)])
        cl = pt.clone()
        cl.segments[0].zero_()
        assert torch.equal(pt.row(0), f32(2, 2))

    def test_equality_is_logical_not_physical(self):
        a = f32(2, 3)
        shared = PackedTensor([a], [(0,), (0,)])
        copied = PackedTensor.from_rows([a.clone(), a.clone()])
        assert shared == copied
        assert shared.first_difference(copied) is None
        assert shared != PackedTensor.from_rows([a, a + 1])

    @pytest.mark.parametrize(
        "other, message",
        [
            (lambda: PackedTensor.from_rows([f32(2, 3), None]), r"^2 rows, expected 1$"),
            (lambda: PackedTensor.from_rows([f32(2, 3)], pack_dim=1),
             r"^pack_dim 1, expected 0$"),
            (lambda: PackedTensor.from_rows([f32(2, 3).to(torch.bfloat16)]),
             r"^dtype torch.bfloat16, expected torch.float32$"),
            (lambda: PackedTensor.from_rows([None]), r"^row 0 is None, expected the opposite$"),
            (lambda: PackedTensor.from_rows([f32(3, 3)]),
             r"^row 0 segment shapes \[\[3, 3\]\], expected \[\[2, 3\]\]$"),
            (lambda: PackedTensor.from_rows([[f32(1, 3), f32(1, 3)]]),
             r"^row 0 segment shapes \[\[1, 3\], \[1, 3\]\], expected \[\[2, 3\]\]$"),
            (lambda: PackedTensor.from_rows([f32(2, 3) * 2]),
             r"^row 0 segment 0: 6 values differ at the bit level, first at index \(0, 0\): "
             r"expected 1.0 \(0x3f800000\), got 2.0 \(0x40000000\)$"),
        ],
        ids=["rows", "pack_dim", "dtype", "none", "shape", "split", "values"],
    )
    def test_first_difference_messages(self, other, message):
        ref = PackedTensor.from_rows([f32(2, 3)])
        why = ref.first_difference(other())
        assert why is not None
        assert re.search(message, why), why
        assert ref != other()

    def test_constructor_errors(self):
        with pytest.raises(TypeError, match="mix dtypes"):
            PackedTensor.from_rows([f32(1, 2), torch.ones(1, 2, dtype=torch.int64)])
        with pytest.raises(ValueError, match="rank"):
            PackedTensor.from_rows([f32(1, 2), f32(1, 2, 2)])
        with pytest.raises(ValueError, match="rank"):
            PackedTensor([torch.tensor(1.0)], [(0,)])
        with pytest.raises(IndexError, match="row 1 names segment indices"):
            PackedTensor([f32(1, 2)], [(0,), (1,)])
        with pytest.raises(ValueError, match="pack_dim must be 0 or 1"):
            PackedTensor([], [], pack_dim=2)


