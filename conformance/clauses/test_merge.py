"""Merges compare by value, never by identity.

What a merge receives has often crossed a process boundary (a rank's meta or chunk coming back,
a stage's output joined to the rollout's batch): equal to the driver's objects, never the same
objects. A merge whose verdict depends on identity (`is`, `id()`, the identity shortcut of
`dict.__eq__` before tensor comparison) accepts the driver's own objects and refuses, or
silently mishandles, their equal copies. Each test runs the merge on views sharing objects and
on views holding equal copies (serialised, or rebuilt from new objects) and requires the same
verdict and, where it succeeds, the same rows.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch

from rlconform.fixtures.strategies import hetero_cases
from rlconform.fixtures.synthetic import MEDIA_FORMS, build_batch, regime_plan

from ._check import assert_rows, assert_unchanged, batch_rows, sample_meta, snapshot


def _serialised(obj):
    """`obj` after torch.save / torch.load: equal to it, sharing no object with it."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _new_str(s: str) -> str:
    return "".join(list(s))  # an equal string that is not the same object


def _rebuilt(meta_cls, m, partition: str | None = None):
    """A meta equal to `m` whose partition, keys, fields, tags and extra are new objects."""
    return meta_cls(_new_str(partition or m.partition), [_new_str(k) for k in m.keys],
                    [_new_str(f) for f in m.fields], list(m.seq_lens), copy.deepcopy(m.tags),
                    copy.deepcopy(m.extra))


def _outcome(fn):
    """("ok", result) or ("refused", the exception's text)."""
    try:
        return "ok", fn()
    except Exception as exc:  # noqa: BLE001 - a refusal is one of the two verdicts
        return "refused", f"{type(exc).__name__}: {exc}"


def _meta_view(m) -> tuple:
    return (m.partition, list(m.keys), list(m.fields), list(m.seq_lens), m.tags, m.extra)


# -- meta -------------------------------------------------------------------------------------
@pytest.mark.clause("META-MERGE-BY-VALUE")
@pytest.mark.parametrize("n, cut", [(1, 1), (5, 2), (8, 4)], ids=["one-row", "uneven", "halves"])
def test_meta_concat_decides_by_value(meta_cls, n, cut):
    head = sample_meta(meta_cls, cut, extra={"step": 3})
    tail = sample_meta(meta_cls, n - cut, extra={"step": 3}, first=cut)
    copy_of_tail = _rebuilt(meta_cls, tail)
    assert copy_of_tail.partition is not tail.partition and copy_of_tail.tags == tail.tags, \
        "test setup: the rebuilt meta must be equal and hold new objects"
    same, equal = (_outcome(lambda t=t: meta_cls.concat([head, t])) for t in (tail, copy_of_tail))
    assert same[0] == "ok", f"concat of two metas over disjoint rows was refused: {same[1]}"
    assert equal[0] == "ok", \
        f"concat refused a meta equal to one it accepts (new objects, equal values): {equal[1]}"
    assert _meta_view(equal[1]) == _meta_view(same[1]), \
        "concat with an equal copy gave another meta than with the original"
    # overlapping views of the same rows: a duplicated key, shared objects or not
    whole = sample_meta(meta_cls, n + 1)
    left, right = whole.slice(0, cut + 1), whole.slice(cut, n + 1)
    for what, other in (("the same", right), ("an equal copy of the", _rebuilt(meta_cls, right))):
        verdict = _outcome(lambda o=other: meta_cls.concat([left, o]))
        assert verdict[0] == "refused", \
            f"concat of two views sharing key {whole.keys[cut]!r} ({what} meta) was accepted"
    other_partition = _rebuilt(meta_cls, sample_meta(meta_cls, 2, first=n),
                               partition="another-partition")
    verdict = _outcome(lambda: meta_cls.concat([head, other_partition]))
    assert verdict[0] == "refused", "concat of metas of two partitions was accepted"


# -- batch concat ------------------------------------------------------------------------------
def _views():
    out = []
    for k, form in enumerate(MEDIA_FORMS):
        for family in ("qwen2_vl", "llava_next", "nemotron_omni"):
            out.append((f"{family}-{form}", lambda f=family, m=form, s=k: build_batch(
                f, regime_plan(f, "ragged", "ragged", 5), seed=s, media_form=m,
                specials=True)))
    for case in hetero_cases(families=("qwen2_5_vl", "gemma3")):
        out.append((f"{case.family}-{case.form}-heterogeneous", case.build))
    return out


VIEWS = _views()


@pytest.mark.clause("BATCH-MERGE-BY-VALUE")
@pytest.mark.parametrize("name, make", VIEWS, ids=[n for n, _ in VIEWS])
def test_concat_decides_by_value(batch_ops, name, make):
    batch = make()
    view = batch.slice(1, len(batch))
    copy_of_view = _serialised(view)
    assert copy_of_view.family is not view.family or view.family is None, \
        "test setup: the serialised view must hold new objects"
    rows = batch_rows(view)
    same = _outcome(lambda: batch_ops.concat([view, view]))
    equal = _outcome(lambda: batch_ops.concat([view, copy_of_view]))
    assert same[0] == equal[0], (f"{name}: concat of a view with itself was {same[0]}, with an "
                                 f"equal copy {equal[0]} ({same[1] if same[0] != 'ok' else equal[1]})")
    assert equal[0] == "ok", f"{name}: concat of two views of the same rows refused: {equal[1]}"
    assert_rows(rows + rows, equal[1], f"{name}: concat of a view and its equal copy")


# -- union -------------------------------------------------------------------------------------
@pytest.mark.clause("BATCH-UNION")
@pytest.mark.parametrize("name, make", VIEWS, ids=[n for n, _ in VIEWS])
def test_union_decides_by_value(batch_ops, name, make):
    batch = make()
    rows = batch_rows(batch)
    a = batch.without("advantages", "token_mask")
    b = batch.without("generation_logprobs")  # shares input_ids, lengths and media with a
    copy_of_b = _serialised(b)
    shared = sorted(set(a.fields) & set(b.fields))
    assert len(shared) >= 3 and any(n in shared for n in ("pixel_values", "multi_modal_inputs",
                                                          "mm_train_inputs")), \
        f"test setup: the views overlap only in {shared}"
    before = [snapshot(x) for x in (a, b, copy_of_b)]
    same = _outcome(lambda: batch_ops.union(a, b))
    equal = _outcome(lambda: batch_ops.union(a, copy_of_b))
    for k, (snap, x) in enumerate(zip(before, (a, b, copy_of_b))):
        assert_unchanged(snap, x, f"{name}: union input {k}")
    assert same[0] == equal[0], (f"{name}: union with shared objects was {same[0]}, with equal "
                                 f"copies {equal[0]} ({same[1] if same[0] != 'ok' else equal[1]})")
    assert equal[0] == "ok", f"{name}: union of two views of the same rows refused: {equal[1]}"
    assert_rows(rows, equal[1], f"{name}: union of two views of the same rows")
    # refused by value: one overlapping value differs; another row count
    other = _serialised(b)
    ids = other.fields["input_ids"].clone()
    ids[-1, 0] += 1
    other.fields["input_ids"] = ids
    verdict = _outcome(lambda: batch_ops.union(a, other))
    assert verdict[0] == "refused", f"{name}: union accepted views whose input_ids differ"
    verdict = _outcome(lambda: batch_ops.union(a, b.slice(0, len(b) - 1)))
    assert verdict[0] == "refused", f"{name}: union accepted views of {len(a)} and " \
        f"{len(b) - 1} rows"
