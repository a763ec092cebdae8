"""Meta clauses: tags stay 1:1 with keys through every meta operation and DP sharding."""

from __future__ import annotations

import copy

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from ._check import sample_meta


def _meta(meta_cls, n: int, seed: int = 0):
    return sample_meta(meta_cls, n, seed)


def _rows(meta) -> list:
    return [(k, s, t["row"]) for k, s, t in zip(meta.keys, meta.seq_lens, meta.tags)]


@pytest.mark.clause("META-TAGS")
@given(n=st.integers(1, 12), data=st.data())
def test_operations_keep_tags_aligned(meta_cls, n, data):
    m = _meta(meta_cls, n)
    full = _rows(m)
    idx = data.draw(st.lists(st.integers(0, n - 1), unique=True), label="indices")
    assert _rows(m.subset(idx)) == [full[i] for i in idx]
    assert m.subset(idx).tags == [m.tags[i] for i in idx], "subset changed tag contents"
    a, b = sorted(data.draw(st.tuples(st.integers(0, n), st.integers(0, n)), label="slice"))
    assert _rows(m.slice(a, b)) == full[a:b]
    assert m.slice(a, b).tags == m.tags[a:b], "slice changed tag contents"
    cut = data.draw(st.integers(0, n), label="cut")
    joined = meta_cls.concat([m.slice(0, cut), m.slice(cut, n)])
    assert _rows(joined) == full, "concat of two halves is not the whole"
    assert joined.tags == m.tags, "concat changed tag contents (None / {} entries included)"
    assert _rows(m.drop("pixel_values")) == full
    assert "pixel_values" not in m.drop("pixel_values").fields
    added = m.with_fields("advantages")
    assert _rows(added) == full and "advantages" in added.fields
    stamped = m.stamp_tags([{"adv": i} for i in range(n)])
    assert [t["adv"] for t in stamped.tags] == list(range(n))
    assert _rows(stamped) == full
    assert all("adv" not in t for t in m.tags), "stamp_tags changed the original meta's tags"


@pytest.mark.clause("META-TAGS")
def test_none_and_empty_object_tags_survive(meta_cls):
    """A text-only row's object-column tag is None (OpenRLHF) or {} (verl): both are values."""
    m = _meta(meta_cls, 6)
    for what, got, want in [("subset", m.subset([3, 0, 1]), [m.tags[i] for i in (3, 0, 1)]),
                            ("slice", m.slice(0, 3), m.tags[:3]),
                            ("concat", meta_cls.concat([m.slice(0, 2), m.slice(2, 6)]), m.tags),
                            ("stamp_tags", m.stamp_tags({}), m.tags)]:
        assert [t.get("multi_modal_inputs", "<missing>") for t in got.tags] == \
            [t["multi_modal_inputs"] for t in want], f"{what} changed None / {{}} tag entries"


@pytest.mark.clause("META-TAGS")
def test_metas_do_not_share_tag_objects(meta_cls):
    m = _meta(meta_cls, 4)
    sub = m.subset([0, 1])
    sub.tags[0]["pixel_values"]["shapes"].append([1, 1])
    assert m.tags[0]["pixel_values"]["shapes"] == [[4, 1176]], \
        "a subset's tag is the same object as the parent's"


@pytest.mark.clause("META-DP-SHARD")
# always run: one row, an uneven split, two ranks, more ranks than rows
@example(n=1, world=1, seed=0)
@example(n=7, world=3, seed=0)
@example(n=9, world=2, seed=5)
@example(n=3, world=5, seed=1)
@given(n=st.integers(1, 40), world=st.integers(1, 8), seed=st.integers(0, 1000))
def test_dp_shards(meta_cls, n, world, seed):
    m = _meta(meta_cls, n, seed)
    shards, inverse = m.shard_for_dp(world)
    assert len(shards) == world
    flat = [k for s in shards for k in s.keys]
    assert sorted(flat) == sorted(m.keys), "shards do not cover every key exactly once"
    assert len(flat) == len(set(flat)), "a key is in two shards"
    by_key = {k: (s, t) for k, s, t in zip(m.keys, m.seq_lens, m.tags)}
    for s in shards:
        assert len(s.tags) == len(s.keys), f"shard has {len(s.tags)} tags for {len(s.keys)} keys"
        for k, sl, t in zip(s.keys, s.seq_lens, s.tags):
            assert (sl, t) == by_key[k], f"key {k} lost its seq_len or tag in its shard"
        assert s.extra.get("step") == 3, "shard lost the meta's extras"
    restored = meta_cls.concat(shards).subset(inverse)
    assert restored.keys == m.keys, "the inverse permutation does not restore the order"
    assert restored.tags == m.tags, "concatenating the shards (a DP collect) lost or changed tags"
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1, f"shard sizes {sizes} are unbalanced"
    tokens = [sum(s.seq_lens) for s in shards]
    assert max(tokens) - min(tokens) <= max(m.seq_lens), \
        f"shard token counts {tokens} differ by more than the longest row"


# -- explicit cases: what the search above finds only through one example, always run ---------------
@pytest.mark.clause("META-TAGS")
@pytest.mark.parametrize("n, idx, cut", [(1, [0], 1), (5, [4, 0, 2], 2), (6, [5, 4, 3, 2, 1, 0], 3)],
                         ids=["one-row", "reordered-subset", "reversed"])
def test_operations_keep_tags_aligned_cases(meta_cls, n, idx, cut):
    m = _meta(meta_cls, n)
    full = _rows(m)
    assert _rows(m.subset(idx)) == [full[i] for i in idx], f"subset {idx} misaligned its tags"
    assert _rows(meta_cls.concat([m.slice(0, cut), m.slice(cut, n)])) == full, \
        f"concat of [0:{cut}] and [{cut}:{n}] is not the whole"
    assert _rows(m.slice(1, n)) == full[1:], "slice misaligned its tags"


@pytest.mark.clause("META-TAGS")
def test_parent_unchanged_after_its_subset_is_stamped(meta_cls):
    """A rank stamps its subset (e.g. with advantages); the driver's meta must not change."""
    m = _meta(meta_cls, 5)
    before = [copy.deepcopy(t) for t in m.tags]
    sub = m.subset([3, 1])
    stamped = sub.stamp_tags([{"adv": 1.5}, {"adv": -0.5}])
    assert [t["adv"] for t in stamped.tags] == [1.5, -0.5]
    assert m.tags == before, "stamping a subset changed the parent meta's tags"
    assert all("adv" not in t for t in sub.tags), "stamp_tags changed the subset it was called on"
    m.stamp_tags({"adv": 2.0})
    assert m.tags == before, "stamp_tags changed the meta it was called on"
    part = m.slice(0, 2)
    part.stamp_tags({"adv": 0.0}).tags[0]["pixel_values"]["shapes"].append([9, 9])
    assert m.tags == before and part.tags == before[:2], \
        "a stamped slice shares tag objects with its parent"
