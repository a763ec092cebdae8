"""Comparisons the clause tests share; each failure message names the field and what differs."""

from __future__ import annotations

import contextlib
import sys

import pytest
import torch
from torch import Tensor

from rlconform.reference_impl.batch import Batch
from rlconform.reference_impl.bitexact import tensor_difference
from rlconform.reference_impl.objects import ObjectColumn, row_difference, value_difference
from rlconform.reference_impl.packed import PackedTensor
from rlconform.reference_impl.registry import Kind, spec

if sys.version_info < (3, 11):  # pragma: no cover - hypothesis brings the backport there
    from exceptiongroup import ExceptionGroup


class SoftChecks:
    """The independent checks of one test, each judged on its own, so that one failure (waived
    or not) does not hide the checks after it: `with checks.each():` keeps what its block
    raised and goes on; `checks.done()` raises the one failure as it was, or every failure as
    one ExceptionGroup, whose members a waiver must each match on its own (a second defect
    beside a waived one fails the test)."""

    def __init__(self, what: str):
        self.what = what
        self.failures: list[Exception] = []

    @contextlib.contextmanager
    def each(self):
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - every failure is kept, none is judged here
            self.failures.append(exc)

    def done(self) -> None:
        if len(self.failures) == 1:
            raise self.failures[0]
        if self.failures:
            raise ExceptionGroup(f"{self.what}: {len(self.failures)} checks failed",
                                 self.failures)


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


def fail_each(whys: list[str], what: str = "differences") -> None:
    """Raise nothing for no difference, an AssertionError for one, and an ExceptionGroup of one
    AssertionError per difference for several (`SoftChecks`): a waiver must match each of them
    on its own, so a waived difference hides no other (each is raised here, so its traceback
    shows it is the clause's own assertion)."""
    checks = SoftChecks(what)
    for why in whys:
        with checks.each():
            raise AssertionError(why)
    checks.done()


def assert_columns_equal(want: dict[str, Tensor], got: dict[str, Tensor]) -> None:
    """Every column of `got` is exactly `want`'s; every difference is reported (`fail_each`)."""
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    whys = [f"columns {missing} missing from the result"] if missing else []
    whys += [f"unexpected columns {extra} in the result"] if extra else []
    whys += [why for name in want if name in got
             if (why := column_difference(name, want[name], got[name]))]
    fail_each(whys, "columns differ")


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


def batch_differences(want: Batch, got: Batch) -> list[str]:
    """Why `got` is not `want` as its consumers observe it, field by field (empty when it is):
    every non-media field exactly (`Batch.first_difference`), packed media by
    `media_difference`, no field gained."""
    media = [n for n, v in want.fields.items() if isinstance(v, PackedTensor)]
    others = [n for n in want.fields if n not in media]
    missing = [n for n in others if n not in got.fields]
    whys = [f"fields {missing} missing"] if missing else []
    whys += [why for n in others if n in got.fields
             if (why := want.first_difference(got, [n]))]
    whys += [why for n in media if (why := media_difference(n, want.fields[n], got.fields.get(n)))]
    extra = sorted(set(got.fields) - set(want.fields))
    return whys + ([f"unexpected fields {extra}"] if extra else [])


def batch_difference(want: Batch, got: Batch) -> str | None:
    """The first of `batch_differences`, or None."""
    return next(iter(batch_differences(want, got)), None)


def assert_batch_equal(want: Batch, got: Batch, context: str = "") -> None:
    """`got` holds `want` as its consumers observe it; every differing field is reported."""
    prefix = f"{context}: " if context else ""
    fail_each([prefix + why for why in batch_differences(want, got)], "fields differ")


def keys_for(n: int, prefix: str = "uid") -> list[str]:
    """Per-sample keys as a rollout mints them: `<uid>_g<i>`."""
    return [f"{prefix}{i // 4}_g{i % 4}" for i in range(n)]


def object_tag(i: int):
    """A per-row dict column's tag as the reference codec writes it: None / {} / keys."""
    return [None, {}, {"pixel_values": {"shape": [4 * i + 4, 1176]},
                       "image_grid_thw": {"shape": [1, 3]}}][i % 3]


def sample_meta(meta_cls, n: int, seed: int = 0, partition: str = "rollout",
                extra: dict | None = None, first: int = 0):
    """A meta of `n` rows (keys from row `first` on) with the tags a rollout write gives:
    seq_len, packed-media shapes (nested lists), an object column's None / {} / per-key tag,
    and an extra (default `{"step": 3}`)."""
    rows = range(first, first + n)
    lens = [((i * 7919 + seed) % 23) + 1 for i in rows]
    tags = [{"row": i, "seq_len": n_i, "pixel_values": {"shapes": [[4 * (i % 3 + 1), 1176]],
                                                          "pack_dim": 0},
             "multi_modal_inputs": object_tag(i)}
            for i, n_i in zip(rows, lens)]
    return meta_cls(partition, keys_for(first + n)[first:], ["input_ids", "pixel_values"], lens,
                    tags, {"step": 3} if extra is None else extra)


# -- rows of a batch, whatever its padding width --------------------------------------------------
def seq_slice(name: str, v: Tensor, start: int, length: int) -> Tensor:
    """Positions start..start+length of per-token field `name` on its registered sequence dim."""
    return v.narrow(spec(name).seq_axis(v.dim()), start, length)


def batch_rows(batch) -> list[dict]:
    """Every field of every row, independent of padding width: per-token fields cut at the
    row's length on their sequence dim, packed rows as (pack_dim, segments), dict rows as is."""
    lens = batch.seq_lens.tolist()
    out: list[dict] = [{} for _ in lens]
    for name, v in batch.fields.items():
        for i, n in enumerate(lens):
            if isinstance(v, PackedTensor):
                out[i][name] = ("packed", v.pack_dim, v.row_segments(i))
            elif isinstance(v, ObjectColumn):
                out[i][name] = ("object", v[i])
            elif spec(name).kind is Kind.PER_TOKEN:
                out[i][name] = seq_slice(name, v[i:i + 1], 0, n)
            else:
                out[i][name] = v[i]
    return out


def assert_rows(want: list[dict], got_batch, what: str) -> None:
    assert isinstance(got_batch, Batch), f"{what} returned a {type(got_batch).__name__}"
    got = batch_rows(got_batch)
    assert len(got) == len(want), f"{what}: {len(got)} rows, expected {len(want)}"
    for i, (w, g) in enumerate(zip(want, got)):
        # a packed field with no media in any row may be left out (the model gets None either
        # way), as batch_difference reads it
        absent = {n for n, v in w.items() if n not in g and isinstance(v, tuple)
                  and v[0] == "packed" and n not in got_batch.fields
                  and all(r[n][2] is None for r in want)}
        assert set(g) == set(w) - absent, \
            f"{what}: row {i} has fields {sorted(g)}, expected {sorted(set(w) - absent)}"
        for name in set(w) - absent:
            a, b = w[name], g[name]
            where = f"{what}: row {i} field {name!r}"
            if isinstance(a, tuple) and a[0] == "object":
                assert isinstance(b, tuple) and b[0] == "object", f"{where} is no longer a dict row"
                why = row_difference(i, a[1], b[1])
                why = why and f"{where}: {why}"
            elif isinstance(a, tuple):
                assert isinstance(b, tuple) and b[0] == "packed", f"{where} is no longer packed"
                assert b[1] == a[1], f"{where} pack_dim {b[1]}, expected {a[1]}"
                if a[2] is None or b[2] is None:
                    why = None if a[2] is None and b[2] is None else \
                        f"{where} is {'None' if b[2] is None else 'present'}, expected the opposite"
                else:
                    # the row's media as the model takes them: how they are cut into segments
                    # is the backend's business (media_difference)
                    why = media_difference(name, PackedTensor.from_rows([a[2]], a[1]),
                                           PackedTensor.from_rows([b[2]], b[1]))
                    why = why and f"{where}: {why}"
            else:
                why = value_difference(where, a, b)
            assert why is None, why
    got_batch.validate()


def assert_own_dicts(source, out, what: str) -> None:
    """Mutating a result's dict rows must not reach the source batch."""
    for name, col in out.fields.items():
        if not isinstance(col, ObjectColumn):
            continue
        before = [None if r is None else dict(r) for r in source[name].rows]
        for row in col.rows:
            if row is not None:
                row["__probe__"] = torch.zeros(1)
                row.pop(next(iter(row)), None)
        for i, (b, r) in enumerate(zip(before, source[name].rows)):
            assert (b is None and r is None) or (r is not None and set(r) == set(b)), \
                f"{what}: row {i} of {name!r} is shared with the result (keys now {sorted(r)})"


# -- snapshots: inputs never modified, outputs never aliased ------------------------------------
# A snapshot is a tree of plain values and tensor copies, built through the public surface of
# what it records (a Batch's fields, a PackedTensor's segments and rows, an ObjectColumn's rows,
# a wire batch's columns and tags, a meta's partition, keys, fields, seq_lens, tags and extra),
# so any backend's objects can be snapshotted and compared bit for bit.
_META_ATTRS = ("partition", "keys", "fields", "seq_lens", "tags", "extra")


def _is_meta(obj) -> bool:
    return all(hasattr(obj, a) for a in _META_ATTRS) and not isinstance(obj, type)


class Attempts:
    """The operations a clause test runs for their side effects (arguments intact, global state
    unchanged): one that raises is recorded, not raised (raising is judged by other clauses),
    and the test can then require that something ran."""

    def __init__(self):
        self.ran: list[str] = []
        self.raised: list[str] = []

    def attempt(self, what: str, fn):
        """`fn()`'s result, or None when it raised."""
        try:
            out = fn()
        except Exception as exc:  # noqa: BLE001 - raising is judged by other clauses
            self.raised.append(f"{what}: {type(exc).__name__}: {exc}")
            return None
        self.ran.append(what)
        return out


def call_arguments(fn, args: tuple, kwargs: dict) -> list[tuple[str, object]]:
    """Every argument of the call `fn(*args, **kwargs)`, named from fn's signature: the object a
    method is bound to first when it is data (a meta, a batch), then each parameter as bound
    (`*args` one entry each, `name[k]`; `**kwargs` as one dict). Derived from the call itself,
    so a check built on it cannot leave an argument out."""
    import inspect

    named: list[tuple[str, object]] = []
    owner = getattr(fn, "__self__", None)
    if owner is not None and (isinstance(owner, Batch) or _is_meta(owner)):
        named.append(("self", owner))
    try:
        sig = inspect.signature(fn)
        bound = sig.bind(*args, **kwargs)
    except (TypeError, ValueError):  # no signature, or one the call does not fit: by position
        return named + [(f"#{k}", a) for k, a in enumerate(args)] + list(kwargs.items())
    for name, value in bound.arguments.items():
        if sig.parameters[name].kind is inspect.Parameter.VAR_POSITIONAL:  # one entry each
            named += [(f"{name}[{k}]", v) for k, v in enumerate(value)]
        else:
            named.append((name, value))
    return named


class ArgumentsWatch:
    """Every argument of one call (`call_arguments`), snapshotted when made; `assert_unchanged`
    then names the first one the call changed."""

    def __init__(self, fn, args: tuple, kwargs: dict):
        self.taken = [(name, a, snapshot(a)) for name, a in call_arguments(fn, args, kwargs)]

    def assert_unchanged(self, what: str) -> None:
        for name, arg, before in self.taken:
            why = snapshot_difference(name, before, snapshot(arg))
            assert why is None, f"{what} changed its argument {name!r}: {why}"


def call_intact(what: str, fn, *args, **kwargs):
    """`fn(*args, **kwargs)`, asserting afterwards that it left every argument as it was."""
    watch = ArgumentsWatch(fn, args, kwargs)
    out = fn(*args, **kwargs)
    watch.assert_unchanged(what)
    return out


_CONTAINERS = (dict, list, set, bytearray)


def shared_container(obj, path: str = "result") -> str | None:
    """Where two places inside `obj` hold one and the same mutable container (a dict, list, set
    or bytearray reached twice: two rows' tags, two chunks' extras, a dict row handed out twice),
    or None. Mutating one place then changes the other. Reaches what `scribble` reaches;
    tensors are not looked at (operations share them by design)."""
    # id -> (place, the object): holding it keeps its id from going to a new object (a meta's
    # attribute may be a property that builds a fresh list each time it is read)
    seen: dict[int, tuple[str, object]] = {}

    def go(x, where: str) -> str | None:
        if isinstance(x, (Tensor, str, bytes, int, float, type(None))):
            return None
        if isinstance(x, _CONTAINERS):
            if id(x) in seen:
                return f"{where} is the same {type(x).__name__} object as {seen[id(x)][0]}"
            seen[id(x)] = (where, x)
        if isinstance(x, Batch):
            return go(x.fields, f"{where}.fields") or go(x.extra, f"{where}.extra")
        if isinstance(x, PackedTensor):
            return go(x.rows, f"{where}.rows")
        if isinstance(x, ObjectColumn):
            return go(x.rows, where)
        if isinstance(x, dict):
            return next((why for k, v in x.items() if (why := go(v, _where(where, k)))), None)
        if isinstance(x, (list, tuple)):
            return next((why for i, v in enumerate(x) if (why := go(v, f"{where}[{i}]"))), None)
        if _is_meta(x):
            return next((why for a in _META_ATTRS if (why := go(getattr(x, a), f"{where}.{a}"))),
                        None)
        return None

    return go(obj, path)


def snapshot(obj):
    """A deep, bit-exact record of `obj` (see `assert_unchanged`)."""
    import math

    from rlconform.reference_impl.codec import WireBatch

    if isinstance(obj, Tensor):
        if obj.is_nested:
            return ("jagged", obj.dtype, [r.detach().clone() for r in obj.unbind()])
        return ("tensor", obj.detach().clone())
    if isinstance(obj, PackedTensor):
        return ("packed", obj.pack_dim, [snapshot(s) for s in obj.segments], list(obj.rows))
    if isinstance(obj, ObjectColumn):
        return ("objects", [snapshot(r) for r in obj.rows])
    if isinstance(obj, Batch):
        return ("batch", obj.family, snapshot(obj.fields), snapshot(obj.extra))
    if isinstance(obj, WireBatch):
        return ("wire", snapshot(obj.columns), snapshot(obj.tags))
    if isinstance(obj, dict):
        return ("dict", {k: snapshot(v) for k, v in obj.items()})
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, [snapshot(v) for v in obj])
    if isinstance(obj, float) and math.isnan(obj):
        return ("nan", math.copysign(1.0, obj))
    if obj is None or isinstance(obj, (str, int, float, bool, torch.dtype)):
        return ("value", obj)
    if _is_meta(obj):
        return ("meta", type(obj).__name__, {a: snapshot(getattr(obj, a)) for a in _META_ATTRS})
    if callable(getattr(obj, "tolist", None)):  # numpy arrays, tensordict's non-tensor stacks
        return snapshot(obj.tolist())
    import pickle

    try:
        return ("pickled", type(obj).__name__, pickle.dumps(obj))
    except Exception:  # noqa: BLE001 - an unpicklable object is recorded by its repr
        return ("repr", type(obj).__name__, repr(obj))


def _where(path: str, key) -> str:
    return f"{path}[{key!r}]"


def snapshot_difference(path: str, want, got) -> str | None:
    """Why snapshot `got` differs from snapshot `want`, naming the place, or None."""
    if want[0] != got[0]:
        return f"{path} was a {want[0]}, is now a {got[0]}"
    kind = want[0]
    if kind == "tensor":
        why = tensor_difference(want[1], got[1])
        return f"{path}: {why}" if why else None
    if kind == "jagged":
        if want[1] != got[1]:
            return f"{path} was jagged {want[1]}, is now {got[1]}"
        if len(want[2]) != len(got[2]):
            return f"{path} had {len(want[2])} rows, now {len(got[2])}"
        for i, (a, b) in enumerate(zip(want[2], got[2])):
            why = tensor_difference(a, b)
            if why:
                return f"{path} row {i}: {why}"
        return None
    if kind == "packed":
        if want[1] != got[1]:
            return f"{path} pack_dim was {want[1]}, now {got[1]}"
        if want[3] != got[3]:
            return f"{path} rows (segment indices) were {want[3]}, now {got[3]}"
        return snapshot_difference(f"{path}.segments", ("list", want[2]), ("list", got[2]))
    if kind in ("objects", "list", "tuple"):
        a, b = want[-1], got[-1]
        if len(a) != len(b):
            return f"{path} had {len(a)} entries, now {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            why = snapshot_difference(f"{path}[{i}]", x, y)
            if why:
                return why
        return None
    if kind == "batch":
        if want[1] != got[1]:
            return f"{path}.family was {want[1]!r}, now {got[1]!r}"
        return (snapshot_difference(f"{path}.fields", want[2], got[2])
                or snapshot_difference(f"{path}.extra", want[3], got[3]))
    if kind == "wire":
        return (snapshot_difference(f"{path}.columns", want[1], got[1])
                or snapshot_difference(f"{path}.tags", want[2], got[2]))
    if kind == "meta":
        for a in _META_ATTRS:
            why = snapshot_difference(f"{path}.{a}", want[2][a], got[2][a])
            if why:
                return why
        return None
    if kind == "dict":
        a, b = want[1], got[1]
        gone, new = [k for k in a if k not in b], [k for k in b if k not in a]
        if gone or new:
            return f"{path} lost keys {gone} and gained {new}" if gone and new else \
                f"{path} lost keys {gone}" if gone else f"{path} gained keys {new}"
        for k in a:
            why = snapshot_difference(_where(path, k), a[k], b[k])
            if why:
                return why
        return None
    if want[1:] != got[1:]:
        return f"{path} was {want[-1]!r}, now {got[-1]!r}"
    return None


def assert_unchanged(before, obj, what: str) -> None:
    """`obj` is still exactly what `before = snapshot(obj)` recorded."""
    why = snapshot_difference(what, before, snapshot(obj))
    assert why is None, f"{what} was changed: {why}"


def scribble(obj) -> int:
    """Mutate every container reachable from `obj` in place (dicts gain a key, lists an entry,
    a PackedTensor's row and segment lists an entry, a meta's keys, fields, seq_lens, tags and
    extra likewise); tensors are left alone (operations may share them by design). Returns how
    many containers were touched, so a caller can check it touched something."""
    seen: dict[int, object] = {}  # holding each object keeps its id from being reused
    probe = "__scribbled__"

    def go(x) -> int:
        if id(x) in seen or isinstance(x, (Tensor, str, bytes, int, float, type(None))):
            return 0
        seen[id(x)] = x
        if isinstance(x, Batch):
            return go(x.fields) + go(x.extra)
        if isinstance(x, PackedTensor):
            n = go(x.rows) + go(x.segments)
            return n
        if isinstance(x, ObjectColumn):
            return go(x.rows)
        if isinstance(x, dict):
            n = sum(go(v) for v in list(x.values()))
            x[probe] = [probe]
            return n + 1
        if isinstance(x, list):
            n = sum(go(v) for v in list(x))
            x.append(None)
            return n + 1
        if isinstance(x, tuple):
            return sum(go(v) for v in x)
        if _is_meta(x):
            return sum(go(getattr(x, a)) for a in _META_ATTRS)
        return 0

    return go(obj)


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
    if isinstance(want, Tensor):  # outside the tag kinds, yet a store may keep one
        same = want.dtype == got.dtype and want.shape == got.shape and torch.equal(want, got)
    else:
        try:
            same = bool(want == got)
        except (RuntimeError, TypeError, ValueError):  # another object with no plain ==
            same = want is got
    return None if same else f"{path} came back {got!r}, put {want!r}"


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


# The batch operation each capability declares (backend.CAPABILITIES)
_OPERATION_CAPABILITY = {"truncate": "truncation", "pad_to": "padding"}


def offered(backend, op: str) -> bool:
    """Whether the backend declares batch operation `op` ("truncate", "pad_to"): a framework
    without one leaves its capability out and says why in `notes`; one that declares it must do
    it in every regime, so any failure is judged, never read as "not offered"."""
    return _OPERATION_CAPABILITY[op] in backend.capabilities
