"""Comparisons the clause tests share; each failure message names the field and what differs."""

from __future__ import annotations

import pytest
from torch import Tensor

from rlconform.reference_impl.batch import Batch
from rlconform.reference_impl.bitexact import tensor_difference
from rlconform.reference_impl.packed import PackedTensor


def column_difference(name: str, want: Tensor, got: Tensor) -> str | None:
    """Why column `got` is not exactly `want` (layout, dtype, shape, rows, bits), or None."""
    if not isinstance(got, Tensor):
        return f"column {name!r} came back as {type(got).__name__}, not a tensor"
    if want.is_nested != got.is_nested:
        lay = "jagged" if got.is_nested else f"dense {list(got.shape)}"
        return f"column {name!r} came back {lay}; it was written " \
               f"{'jagged' if want.is_nested else 'dense ' + str(list(want.shape))}"
    if want.dtype != got.dtype:
        return f"column {name!r} came back {got.dtype}, written {want.dtype}"
    if want.is_nested:
        tw, tg = tuple(want.values().shape[1:]), tuple(got.values().shape[1:])
        if tw != tg:  # seen even with zero rows, where no row shape says it
            return f"column {name!r} came back with rows (j, *{list(tg)}), written " \
                   f"(j, *{list(tw)})"
        a, b = want.unbind(), got.unbind()
        if len(a) != len(b):
            return f"column {name!r} has {len(b)} rows, written {len(a)}"
        for i, (x, y) in enumerate(zip(a, b)):
            if x.shape != y.shape:
                return f"column {name!r} row {i} has shape {list(y.shape)}, written {list(x.shape)}"
            why = tensor_difference(x, y)
            if why:
                return f"column {name!r} row {i}: {why}"
        return None
    if want.shape != got.shape:
        return f"column {name!r} came back with shape {list(got.shape)}, written {list(want.shape)}"
    why = tensor_difference(want, got)
    return f"column {name!r}: {why}" if why else None


def assert_bit_equal(want: Tensor, got: Tensor, what: str) -> None:
    """`got` is bit for bit `want` (dtype, shape, raw bits); the message says what differs."""
    why = tensor_difference(want, got)
    assert why is None, f"{what}: {why}"


def assert_columns_equal(want: dict[str, Tensor], got: dict[str, Tensor]) -> None:
    missing = sorted(set(want) - set(got))
    assert not missing, f"columns {missing} missing from the result"
    extra = sorted(set(got) - set(want))
    assert not extra, f"unexpected columns {extra} in the result"
    for name in want:
        why = column_difference(name, want[name], got[name])
        assert why is None, why


def _extent(v: PackedTensor, i: int) -> int | None:
    """Row i's size on the packing dim: how many entries of the model input are sample i's."""
    segs = v.row_segments(i)
    return None if segs is None else sum(int(s.shape[0]) for s in segs)


def media_difference(name: str, want: PackedTensor, got: object) -> str | None:
    """Why packed field `got` does not give the model what `want` gives, or None.

    Judged as a consumer of the batch observes it: which rows have media (None vs present),
    how many entries of the model input each row owns on the packing dim (so every sample's
    patches, images or tiles stay with that sample), and the model-input tensor itself
    (`as_tensor()`: dtype, shape, bits, padding where trailing dims differ). How a row's media
    are cut into segments, and which segments rows share, is the encoder's business: a row's
    images returned as one segment give the same model input. A field missing from the result
    reads as every row None (no media tensor reaches the model, as for a text-only batch).
    """
    if got is None:
        present = [i for i in range(len(want)) if not want.is_none(i)]
        return None if not present else \
            f"field {name!r} is missing; rows {present[:8]} have media"
    if not isinstance(got, PackedTensor):
        return f"field {name!r}: {type(got).__name__}, expected jagged media (PackedTensor)"
    if len(got) != len(want):
        return f"field {name!r}: {len(got)} rows, expected {len(want)}"
    for i in range(len(want)):
        if want.is_none(i) != got.is_none(i):
            return f"field {name!r}: row {i} is {'None' if got.is_none(i) else 'present'}, " \
                   "expected the opposite"
        a, b = _extent(want, i), _extent(got, i)
        if a != b:
            return f"field {name!r}: row {i} holds {b} entries on the packing dim, expected {a}"
    try:
        model_in = got.as_tensor()
    except (RuntimeError, ValueError) as exc:
        return f"field {name!r}: no model input can be built from it ({exc})"
    expected = want.as_tensor()
    if expected is None or model_in is None:
        return None if expected is None and model_in is None else \
            f"field {name!r}: model input {'None' if model_in is None else 'present'}, " \
            "expected the opposite"
    why = tensor_difference(expected, model_in)
    return f"field {name!r} model input: {why}" if why else None


def batch_difference(want: Batch, got: Batch) -> str | None:
    """Why `got` is not `want` as its consumers observe it, or None: every non-media field exactly
    (`Batch.first_difference`), packed media by `media_difference`, no field gained."""
    media = [n for n, v in want.fields.items() if isinstance(v, PackedTensor)]
    others = [n for n in want.fields if n not in media]
    why = want.first_difference(got, others)
    if why:
        return why
    for n in media:
        why = media_difference(n, want.fields[n], got.fields.get(n))
        if why:
            return why
    extra = sorted(set(got.fields) - set(want.fields))
    return f"unexpected fields {extra}" if extra else None


def assert_batch_equal(want: Batch, got: Batch, context: str = "") -> None:
    """`got` holds `want` as its consumers observe it (see `batch_difference`)."""
    why = batch_difference(want, got)
    assert why is None, f"{context}{': ' if context else ''}{why}"


def keys_for(n: int, prefix: str = "uid") -> list[str]:
    """Per-sample keys as a rollout mints them: `<uid>_g<i>`."""
    return [f"{prefix}{i // 4}_g{i % 4}" for i in range(n)]


def tag_difference(want, got, path: str = "tag") -> str | None:
    """Why tag value `got` is not exactly `want`, or None. Exact means the same type at every
    level (a tuple is not a list, an int key not a str key, 1 not 1.0, True not 1), the same
    dict keys, and floats equal with NaN equal to NaN and the sign of zero kept."""
    import math

    if type(want) is not type(got):
        return f"{path} came back as {type(got).__name__} {got!r}, put as " \
               f"{type(want).__name__} {want!r}"
    if isinstance(want, float):
        same = (math.isnan(want) and math.isnan(got)) or (
            want == got and math.copysign(1.0, want) == math.copysign(1.0, got))
        return None if same else f"{path} came back {got!r}, put {want!r}"
    if isinstance(want, dict):
        lost = [k for k in want if k not in got]
        extra = [k for k in got if k not in want]
        if lost or extra:
            return f"{path} lost keys {lost!r} and has extra keys {extra!r}" \
                   f" (key types put: {sorted({type(k).__name__ for k in want})})"
        for k in want:
            why = tag_difference(want[k], got[k], f"{path}[{k!r}]")
            if why:
                return why
        return None
    if isinstance(want, (list, tuple)):
        if len(want) != len(got):
            return f"{path} has {len(got)} items, put {len(want)}"
        for i, (a, b) in enumerate(zip(want, got)):
            why = tag_difference(a, b, f"{path}[{i}]")
            if why:
                return why
        return None
    return None if want == got else f"{path} came back {got!r}, put {want!r}"


def assert_tags_equal(want: list, got: list, what: str) -> None:
    assert isinstance(got, list), f"{what}: tags came back as {type(got).__name__}, not a list"
    assert len(got) == len(want), f"{what}: {len(got)} tags for {len(want)} keys"
    for i, (a, b) in enumerate(zip(want, got)):
        why = tag_difference(a, b, f"tags[{i}]")
        assert why is None, f"{what}: {why}"


def expect_stored(read, what: str):
    """`read()` where the clause says the data must be there: a KeyError (the transport
    contract's "missing") is then the clause's violation, reported as such, not a crash."""
    try:
        return read()
    except KeyError as exc:
        pytest.fail(f"{what}: the store says {exc}")


# What rejecting valid input looks like: a validator's ValueError or assert, a shape error
# (RuntimeError, IndexError), a missing key. A TypeError, AttributeError or ImportError is a
# broken backend (or mutant), not the clause's finding: those stay exceptions.
REJECTIONS = (ValueError, AssertionError, RuntimeError, IndexError, KeyError)


def expect_accepted(call, what: str):
    """`call()` on input the clause says is valid: a rejection of it (REJECTIONS: a validator
    refusing an aligned batch, a truncation failing on a valid length) is the clause's
    violation, reported as such."""
    try:
        return call()
    except REJECTIONS as exc:
        pytest.fail(f"{what}: {type(exc).__name__}: {exc}")
