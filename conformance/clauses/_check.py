"""Comparisons the clause tests share; each failure message names the field and what differs."""

from __future__ import annotations

import pytest
from torch import Tensor

from rlconform.reference_impl.batch import Batch
from rlconform.reference_impl.bitexact import tensor_difference


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


def assert_batch_equal(want: Batch, got: Batch, context: str = "") -> None:
    why = want.first_difference(got)
    if why is None and set(want.fields) != set(got.fields):
        why = f"fields {sorted(got.fields)}, expected {sorted(want.fields)}"
    assert why is None, f"{context}{': ' if context else ''}{why}"


def keys_for(n: int, prefix: str = "uid") -> list[str]:
    """Per-sample keys as a rollout mints them: `<uid>_g<i>`."""
    return [f"{prefix}{i // 4}_g{i % 4}" for i in range(n)]


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
