"""Inputs are never modified: every operation leaves every argument bit for bit as it was.

Frameworks reach into what they are handed: a dtype cast written back into the caller's media,
a pad or a shuffle applied to the caller's batch, tag entries popped as they are read, the
driver's meta reordered or annotated by its own DP balancing, extras merged into the first of
the metas being joined. The caller (the in-memory path, another rank, a retry, the next stage)
then holds something other than what it put in, and nothing raises. Each test snapshots every
argument (tensors by their bits, dicts and lists by content, metas by partition, keys, fields,
seq_lens, tags and extra), runs one operation and compares. Batch sizes that do not divide the
world size or the micro-batch count are among the inputs on purpose.

An operation that raises is still held to the property (it must not have changed its input
before raising); whether it should have raised is other clauses' business. An example on which
every operation raised exercised nothing and is dropped (a run with no exercised example fails
as unsatisfiable); the fixed cases require that an operation ran.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, example, given
from hypothesis import strategies as st

from rlconform.fixtures.strategies import given_batches, hetero_cases
from rlconform.reference_impl.registry import Stage

from ._check import ArgumentsWatch, Attempts, sample_meta


class _Ops(Attempts):
    """Runs operations, checking after each that every argument it was given is unchanged."""

    def call(self, what: str, fn, *args, **kwargs):
        """`fn(*args, **kwargs)` with every argument (named from fn's signature, the meta or
        batch a method is bound to included) snapshotted before and compared after; returns
        fn's result, or None when it raised."""
        watch = ArgumentsWatch(fn, args, kwargs)
        out = self.attempt(what, lambda: fn(*args, **kwargs))
        watch.assert_unchanged(what)
        return out

    def op(self, what: str, owner, name: str, *args, **kwargs):
        """`call` of `owner.name`; an operation the backend does not offer (no such attribute)
        is an attempt that raised, as when it is called."""
        fn = getattr(owner, name, None)
        if fn is None:
            self.raised.append(f"{what}: {type(owner).__name__} has no {name!r}")
            return None
        return self.call(what, fn, *args, **kwargs)

    def assert_something_ran(self) -> None:
        assert self.ran, f"no operation ran (each raised): {self.raised}"

    def assume_something_ran(self) -> None:
        """Drop an example on which every operation raised (nothing was exercised); a run in
        which no example exercised anything fails as unsatisfiable."""
        assume(self.ran)


# -- codec ------------------------------------------------------------------------------------
def _codecs(backend, codec_factory):
    out = [("encode", codec_factory())]
    if "bfloat16" in backend.capabilities:  # where a cast can be written back into the batch
        out.append(("encode with pixel_dtype bfloat16", codec_factory(pixel_dtype=torch.bfloat16)))
    return out


def _check_codec(backend, codec_factory, batch) -> _Ops:
    ops = _Ops()
    for what, codec in _codecs(backend, codec_factory):
        wire = ops.call(what, codec.encode, batch)
        if wire is not None:
            ops.call(f"decode after {what}", codec.decode, wire)
    return ops


@pytest.mark.clause("WIRE-INPUT-INTACT")
@given_batches()
def test_encode_and_decode_leave_their_inputs_intact(backend, codec_factory, batch):
    _check_codec(backend, codec_factory, batch).assume_something_ran()


@pytest.mark.clause("WIRE-INPUT-INTACT")
@pytest.mark.parametrize("case", hetero_cases(), ids=lambda c: f"{c.family}-{c.form}")
def test_codec_leaves_heterogeneous_dict_rows_intact(backend, codec_factory, case):
    _check_codec(backend, codec_factory, case.build()).assert_something_ran()


# -- meta -------------------------------------------------------------------------------------
@pytest.mark.clause("META-INPUT-INTACT")
# always run: world sizes that do not divide the rows, one row, more ranks than rows
@example(n=7, world=3, raw=[6, 0, 3], cut=2)
@example(n=1, world=2, raw=[0], cut=1)
@example(n=5, world=8, raw=[4, 2], cut=5)
@example(n=10, world=4, raw=[9, 8, 1], cut=3)
@given(n=st.integers(1, 12), world=st.integers(1, 6),
       raw=st.lists(st.integers(0, 99), min_size=1, max_size=6), cut=st.integers(0, 12))
def test_meta_operations_leave_their_inputs_intact(backend, meta_cls, n, world, raw, cut):
    m = sample_meta(meta_cls, n)
    idx = list(dict.fromkeys(i % n for i in raw))  # keys of a meta are unique
    cut %= n + 1
    ops = _Ops()
    ops.op(f"subset({idx})", m, "subset", idx)
    ops.op(f"slice(0, {cut})", m, "slice", 0, cut)
    # two ranks' metas as a DP collect joins them: disjoint rows, each with its own extras
    head = sample_meta(meta_cls, cut, extra={"step": 3, "dp_rank": 0, "ranks": [0]})
    tail = sample_meta(meta_cls, n - cut, extra={"step": 3, "dp_rank": 1, "ranks": [1]},
                       first=cut)
    ops.op("concat of two ranks' metas", meta_cls, "concat", [head, tail])
    ops.op("drop", m, "drop", "pixel_values")
    ops.op("with_fields", m, "with_fields", "advantages")
    per_row = [{"adv": float(i), "shapes": [[i, 2]]} for i in range(n)]
    ops.op("stamp_tags (one per row)", m, "stamp_tags", per_row)
    shared = {"adv": 0.5, "nested": {"k": [1, 2]}}
    ops.op("stamp_tags (one for all)", m, "stamp_tags", shared)
    if "dp" in backend.capabilities:
        ops.op(f"shard_for_dp({world}) of {n} rows", m, "shard_for_dp", world)
    ops.assume_something_ran()


# -- batch operations -------------------------------------------------------------------------
def _micro_batch_count(b: int, k: int) -> int:
    """A count that does not divide the batch where one exists, else one drawn from 1..b."""
    uneven = [n for n in range(2, b + 1) if b % n]
    return uneven[k % len(uneven)] if uneven else 1 + k % max(b, 1)


@pytest.mark.clause("BATCH-INPUT-INTACT")
@given_batches(also={"k": (st.integers(0, 2**16), lambda i: 3 + 7 * i)})
def test_batch_operations_leave_their_inputs_intact(backend, batch_ops, batch, k):
    b, s = len(batch), batch.seq_len()
    ops = _Ops()
    cut = k % (s + 1)
    ops.op(f"truncate({cut})", batch_ops, "truncate", batch, cut)
    ops.op(f"pad_to({s + 1 + k % 5})", batch_ops, "pad_to", batch, s + 1 + k % 5)
    ops.op("validate", batch_ops, "validate", batch)
    for stage in Stage:
        for dtype in (None, torch.bfloat16):
            ops.op(f"multimodal_inputs({stage.value}, {dtype})",
                   batch_ops, "multimodal_inputs", batch, stage, dtype)
    if "batch_algebra" in backend.capabilities:
        idx = [(k * (j + 3) + j) % b for j in range(1 + k % 5)]  # repeats, out of order
        ops.op(f"select({idx})", batch_ops, "select", batch, idx)
        first = 1 + k % b if b > 1 else b
        sizes = [first, b - first] if b > 1 else [b]
        ops.op(f"split({sizes})", batch_ops, "split", batch, sizes)
        parts = batch.split(sizes)
        ops.op("concat of the split parts and the batch", batch_ops, "concat", [*parts, batch])
    if "micro_batching" in backend.capabilities:
        for n in sorted({1, _micro_batch_count(b, k)}):
            for seed in (None, k):
                ops.op(f"micro_batches({n} of {b} rows, shuffle_seed={seed})",
                       batch_ops, "micro_batches", batch, n, shuffle_seed=seed)
    ops.assume_something_ran()
