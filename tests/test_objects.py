"""Unit tests of ObjectColumn (reference_impl/objects.py): per-sample columns of per-row dicts."""

from __future__ import annotations

import re

import pytest
import torch
from _helpers import f32

from rlconform.reference_impl.objects import ObjectColumn


def _obj_rows() -> list:
    return [
        {"pixel_values": f32(6, 4), "image_grid_thw": torch.tensor([[1, 2, 3]])},
        {},
        None,
        {"pixel_values": [f32(2, 3), f32(1, 5)]},  # list value: images of differing widths
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
        (lambda r: r[0].__setitem__("pixel_values", f32(4, 6)),
         r"row 0 key 'pixel_values' shape \[4, 6\], expected \[6, 4\]"),
        (lambda r: r[0].__setitem__("pixel_values", -f32(6, 4)),
         r"row 0 key 'pixel_values' 24 values differ at the bit level, first at index \(0, 0\): "
         r"expected 1.0 \(0x3f800000\), got -1.0 \(0xbf800000\)"),
        (lambda r: r[3].__setitem__("pixel_values", torch.cat([f32(2, 3).reshape(-1)])),
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
