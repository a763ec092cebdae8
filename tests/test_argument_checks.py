"""The clauses' argument and aliasing checks (conformance/clauses/_check.py): every argument of
a call is named from its signature, a change to any of them is found, and a container reached
from two places of one result is named with both places."""

from __future__ import annotations

import pytest
import torch

from rlconform.conformance.clauses._check import (
    ArgumentsWatch,
    call_arguments,
    call_intact,
    sample_meta,
    shared_container,
)
from rlconform.reference_impl.batch import BatchOps
from rlconform.reference_impl.meta import BatchMeta
from rlconform.reference_impl.objects import ObjectColumn


def test_arguments_are_named_from_the_signature_with_the_bound_meta_first():
    m = sample_meta(BatchMeta, 3)
    idx = [2, 0]
    assert call_arguments(m.subset, (idx,), {}) == [("self", m), ("indices", idx)]
    ops = BatchOps()  # the operations object is not data: not an argument to watch
    named = call_arguments(ops.micro_batches, ("b", 2), {"shuffle_seed": 1})
    assert named == [("batch", "b"), ("n", 2), ("shuffle_seed", 1)]


def test_star_args_are_one_entry_each():
    def put(*args, **kwargs):
        return None

    named = call_arguments(put, ("p", ["k"]), {"tags": None})
    assert named == [("args[0]", "p"), ("args[1]", ["k"]), ("kwargs", {"tags": None})]


def test_a_change_to_any_argument_is_named():
    def consume(batches, sizes):
        batches.pop()

    parts, sizes = [1, 2], [3]
    want = "concat changed its argument 'batches': batches had 2 entries, now 1"
    with pytest.raises(AssertionError, match=want):
        call_intact("concat", consume, parts, sizes)
    rows = ObjectColumn([{"v": [torch.ones(1)]}, None])
    watch = ArgumentsWatch(lambda columns: None, ({"o": rows},), {})
    rows.rows[0]["v"] = tuple(rows.rows[0]["v"])
    want = r"put changed its argument 'columns': columns\['o'\]\[0\]\['v'\] was a list"
    with pytest.raises(AssertionError, match=want):
        watch.assert_unchanged("put")


def test_a_container_reached_twice_is_named_with_both_places():
    shared = {"ids": [1]}
    why = shared_container(([{"a": shared}, {"a": shared}],), "get")
    assert why == "get[0][1]['a'] is the same dict object as get[0][0]['a']"
    inner = [1]
    assert "is the same list object" in shared_container([{"x": inner}, {"y": [inner]}])
    m = sample_meta(BatchMeta, 4)
    a, b = m.subset([0, 1]), m.subset([2, 3])
    assert shared_container([a, b]) is None
    b.extra = a.extra
    assert shared_container([a, b]) == "result[1].extra is the same dict object as result[0].extra"


def test_tensors_and_equal_copies_are_not_shared_containers():
    t = torch.ones(2)
    assert shared_container([{"t": t}, {"t": t}]) is None  # tensors are shared by design
    assert shared_container([{"k": [1]}, {"k": [1]}]) is None  # equal is not the same
    rows = ObjectColumn([{"v": [t]}, {"v": [t]}])
    assert shared_container(rows) is None
    rows.rows[1] = rows.rows[0]
    assert "result[1] is the same dict object as result[0]" == shared_container(rows)


def test_fresh_objects_built_on_each_read_are_not_taken_for_one():
    """A meta whose attributes are properties building a new list on each read: an object gone
    after its read must not be taken for a later one that got its id."""
    class Meta:
        def __init__(self):
            self.partition, self.keys, self.tags, self.extra = "p", ["a"], [{}], {}

        @property
        def fields(self):
            return ["x"]

        @property
        def seq_lens(self):
            return [1]

    assert shared_container([Meta(), Meta()]) is None
