"""No aliasing: what a merge or a subset returns shares no tag or media container with its source.

A stage that stamps its subset's tags, pops a key from its micro-batch's media dict or appends
to a row's per-image list must not reach the batch or meta it came from, nor a sibling chunk.
Each test takes every result of one operation, checks that no container is reached from two
places of it (two rows' tags, two chunks' extras, a dict row handed out twice for a repeated
index), mutates every container reachable from it (tag dicts at every depth, key and length
lists, extras, a batch's field dict, a packed field's row and segment lists, dict rows and their
list values; tensors are left alone: operations share them by design) and checks that every
source is still bit for bit what it was. Operations
whose result could be the source itself (every row, in order; one chunk; one micro-batch) are
among the cases on purpose.
"""

from __future__ import annotations

import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st

from rlconform.fixtures.strategies import hetero_cases
from rlconform.fixtures.synthetic import MEDIA_FORMS, build_batch, regime_plan

from ._check import assert_unchanged, sample_meta, scribble, shared_container, snapshot


class _Results:
    """Runs operations and checks that mutating everything they return leaves their sources
    as they were; an operation that raises returns nothing to check (whether it should have
    raised is other clauses' business), but one of them must return something."""

    def __init__(self):
        self.checked: list[str] = []
        self.raised: list[str] = []

    def check(self, what: str, run, *sources) -> None:
        try:
            results = run()
        except Exception as exc:  # noqa: BLE001 - refusals are judged elsewhere
            self.raised.append(f"{what}: {type(exc).__name__}: {exc}")
            return
        # two places of one result holding one container: a stage that stamps one row's tag or
        # one chunk's extras changes its sibling too
        why = shared_container(results, what)
        assert why is None, f"{what}: its result shares a container between two places: {why}"
        # the sources as the operation left them: only what mutating its results does is judged
        # here (what the operation itself does to them is *-INPUT-INTACT's business)
        before = [snapshot(s) for s in sources]
        touched = scribble(results)
        assert touched, f"{what}: the result holds no container to mutate"
        for k, (snap, src) in enumerate(zip(before, sources)):
            assert_unchanged(snap, src, f"source {k} of {what}, after its result was mutated")
        self.checked.append(what)

    def assert_something_checked(self) -> None:
        assert self.checked, f"no operation returned a result (each raised): {self.raised}"


# -- meta -------------------------------------------------------------------------------------
@pytest.mark.clause("META-NO-ALIAS")
@example(n=7, world=3, cut=2)
@example(n=1, world=1, cut=1)
@example(n=4, world=4, cut=0)
@given(n=st.integers(1, 10), world=st.integers(1, 5), cut=st.integers(0, 10))
def test_meta_results_share_nothing_with_their_sources(backend, meta_cls, n, world, cut):
    cut %= n + 1
    m = sample_meta(meta_cls, n)
    ops = _Results()
    every = list(range(n))
    ops.check("subset of every row", lambda: m.subset(every), m)
    ops.check("subset reversed", lambda: m.subset(every[::-1]), m)
    ops.check(f"slice(0, {cut})", lambda: m.slice(0, cut), m)
    head = sample_meta(meta_cls, cut, extra={"step": 3, "ranks": [0, 1]})
    tail = sample_meta(meta_cls, n - cut, extra={"step": 3, "ranks": [0, 1]}, first=cut)
    ops.check("concat of two metas",
                                 lambda: meta_cls.concat([head, tail]), head, tail)
    ops.check("concat of one meta", lambda: meta_cls.concat([m]), m)
    ops.check("drop", lambda: m.drop("pixel_values"), m)
    ops.check("with_fields", lambda: m.with_fields("advantages"), m)
    stamp = [{"adv": float(i), "shapes": [[i, 2]]} for i in range(n)]
    ops.check("stamp_tags", lambda: m.stamp_tags(stamp), m, stamp)
    if "dp" in backend.capabilities:
        ops.check(f"shard_for_dp({world})", lambda: m.shard_for_dp(world), m)
    assume(ops.checked)  # an example on which every operation refused exercised nothing


# -- batch algebra ----------------------------------------------------------------------------
def _batches():
    """Packed and dict media (per-image list values included), de-duplicated rows, and rows of
    different key sets."""
    out = []
    for k, form in enumerate(MEDIA_FORMS):
        for family in ("qwen2_5_vl", "idefics3", "nemotron_omni"):
            out.append((f"{family}-{form}", lambda f=family, m=form, s=k:
                        build_batch(f, regime_plan(f, "ragged", "ragged", 5), seed=s,
                                    media_form=m)))
    for case in hetero_cases(families=("qwen2_vl", "llava_next", "nemotron_omni")):
        out.append((f"{case.family}-{case.form}-heterogeneous", case.build))
    return out


BATCHES = _batches()


@pytest.mark.clause("BATCH-NO-ALIAS")
@pytest.mark.parametrize("name, make", BATCHES, ids=[n for n, _ in BATCHES])
def test_batch_results_share_nothing_with_their_sources(backend, batch_ops, name, make):
    batch = make()
    b = len(batch)
    ops = _Results()
    every = list(range(b))
    ops.check(f"{name}: select(every row, in order)",
                                 lambda: batch_ops.select(batch, every), batch)
    ops.check(f"{name}: select with a repeat",
                                 lambda: batch_ops.select(batch, [2, 0, 2]), batch)
    ops.check(f"{name}: split into one chunk",
                                 lambda: batch_ops.split(batch, [b]), batch)
    ops.check(f"{name}: split into chunks",
                                 lambda: batch_ops.split(batch, [2, b - 2]), batch)
    parts = [batch.slice(0, 2), batch.slice(2, b)]
    ops.check(f"{name}: concat of two chunks",
                                 lambda: batch_ops.concat(parts), *parts)
    ops.check(f"{name}: concat of one batch",
                                 lambda: batch_ops.concat([batch]), batch)
    if "micro_batching" in backend.capabilities:
        for n, seed in ((1, None), (2, None), (3, 4)):
            ops.check(
                f"{name}: micro_batches({n}, shuffle_seed={seed})",
                lambda m=n, s=seed: [mb for _, mb in batch_ops.micro_batches(batch, m, s)],
                batch)
    ops.assert_something_checked()
