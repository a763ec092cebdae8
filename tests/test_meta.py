"""Unit tests of BatchMeta (reference_impl/meta.py): keys, seqlens, tags, subsets and DP shards."""

from __future__ import annotations

import pytest
from _helpers import PROPS
from hypothesis import given
from hypothesis import strategies as st

from rlconform.reference_impl.meta import BatchMeta


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


