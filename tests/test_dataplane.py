"""Unit tests of the in-memory data plane (reference_impl/dataplane.py), the reference transport."""

from __future__ import annotations

import pytest
import torch
from _helpers import f32

from rlconform.reference_impl.codec import jagged
from rlconform.reference_impl.dataplane import InMemoryDataPlane

KEYS = ["a", "b", "c"]


def _cols() -> dict[str, torch.Tensor]:
    return {
        "dense": f32(3, 2, 4),
        "scalar": torch.tensor([1.5, 2.5, 3.5]),
        "ids": jagged([torch.arange(4), torch.arange(0), torch.arange(2)], torch.int64),
        "media": torch.nested.nested_tensor_from_jagged(
            f32(5, 6).to(torch.bfloat16), offsets=torch.tensor([0, 2, 2, 5])),
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
        # a partition holding no keys is one with no keys: the keys asked for are named
        with pytest.raises(KeyError, match="keys \\['a'\\] not in partition 'other'"):
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


