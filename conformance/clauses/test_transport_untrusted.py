"""Transport clauses for untrusted input: names, tags, layouts, empty calls, order, arguments,
other processes and clean-up.

The other transport modules put identifier-like names and JSON-safe tags; a store written the
obvious way (one record per `partition:key`, JSON tags, a key set per partition) passes them
and still mixes partitions, turns tuples into lists and keeps stale tags. What names and tags
may hold is the contract's (docs/ARCHITECTURE.md "Transport surface";
`reference_impl.dataplane.check_name` / `check_tags` are its executable form).
"""

from __future__ import annotations

import copy
import math
import pickle
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlconform.reference_impl.codec import jagged
from rlconform.reference_impl.dataplane import MAX_NAME_BYTES, jagged_rows
from rlconform.reference_impl.objects import ObjectColumn
from rlconform.reference_impl.served import pack_columns, unpack_columns

from ._check import (
    ArgumentsWatch,
    SoftChecks,
    assert_columns_equal,
    assert_tags_equal,
    column_difference,
)

# -- names ----------------------------------------------------------------------------------
SEPARATORS = (":", "/", ".", "|")
# names a store is likely to use for its own records (key sets, tag and layout hashes, object
# attributes of a dict-backed index, JSON / JS specials)
BOOKKEEPING = ("__keys__", "__tags__", "__layout__", "__rlconform_layout__:x", "_index",
               "keys", "tags", "meta", "fields", "partitions", "None", "null", "__proto__",
               "__class__", "__dict__", "constructor")
# glob and format characters (a key scan by pattern), whitespace, path parts, quotes
ODD = ("a b", " lead", "trail ", "tab\there", "new\nline", "*", "p*", "?", "[ab]", "{x}",
       "%s", "..", ".", "/", "\\", "'", '"', "#", "a:b", "a/b", "a.b", "a|b", ":", "|")
# the same letter composed and decomposed, scripts, astral planes, invisible and wide forms
UNICODE = ("\u00e9", "e\u0301", "\u03a9\u03bc\u03ad\u03b3\u03b1", "\u540d\u524d", "\U0001f642",
           "\U0010fffd", "a\u200bb", "\uff21\uff22")
# as long as a name may be: 1024 bytes of 1-, 2- and 4-byte characters
LONG = ("x" * MAX_NAME_BYTES, "\u00e9" * (MAX_NAME_BYTES // 2),
        "\U0001f642" * (MAX_NAME_BYTES // 4))
ALLOWED = (*BOOKKEEPING, *ODD, *UNICODE, *LONG)
FIELD_NAMES = ("__tags__", "a:b", "a.b", "a/b", "a|b", "\u00e9", "keys")
# names the contract refuses: TypeError for a non-str, ValueError for the rest
REFUSED = ("", "a\x00b", "\ud800x", "x" * (MAX_NAME_BYTES + 1), "\u00e9" * (MAX_NAME_BYTES // 2 + 1),
           1, None, b"bytes")


def _partition(tag: str = "p") -> str:
    return f"{tag}-{uuid.uuid4().hex[:8]}"


def _dense(values: list[float]) -> torch.Tensor:
    """One (n, 2) row per value: [v, -v]."""
    v = torch.tensor(values, dtype=torch.float32)
    return torch.stack([v, -v], 1)


def _jagged_named(values: list[float]) -> torch.Tensor:
    """Row i holds 1 + i % 3 copies of values[i]: rows of unequal length that name their row."""
    return jagged([torch.full((1 + i % 3,), float(v)) for i, v in enumerate(values)],
                  torch.float32)


def _pick(col: torch.Tensor, idx: list[int]) -> torch.Tensor:
    if col.is_nested:
        rows = jagged_rows(col)
        return torch.nested.nested_tensor([rows[i] for i in idx], layout=torch.jagged) \
            if idx else _empty_like(col)
    return col[idx]


def _empty_like(col: torch.Tensor) -> torch.Tensor:
    values = col.values()[:0]
    return torch.nested.nested_tensor_from_jagged(values, offsets=torch.zeros(1, dtype=torch.long))


def _gone(transport, partition: str) -> list[str]:
    """The keys `partition` still lists: [] when it lists none or no longer exists."""
    try:
        return list(transport.list(partition))
    except KeyError:
        return []


def _get(transport, partition, keys, fields, what: str):
    """get, where an exception is the defect: a clause assertion names it."""
    try:
        return transport.get(partition, keys, fields)
    except Exception as exc:  # noqa: BLE001 - any error here is what the clause reports
        raise AssertionError(f"{what}: get raised {type(exc).__name__}: {exc}") from None


def _call(what: str, fn, *args):
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - any error here is what the clause reports
        raise AssertionError(f"{what}: raised {type(exc).__name__}: {exc}") from None


@pytest.mark.clause("DP-NAMES")
def test_every_allowed_name_is_a_key(transport):
    """Every name the contract allows, as keys of one partition: each lists, gets and clears
    as itself."""
    keys = list(ALLOWED)
    assert len(set(keys)) == len(keys) and any(len(k.encode()) == MAX_NAME_BYTES for k in keys), \
        "fixture lost its distinct or its longest names"
    part = _partition()
    n = len(keys)
    cols = {"x": _dense(list(range(n))), "j": _jagged_named(list(range(n)))}
    tags = [{"name": k} for k in keys]
    _call(f"put of {n} adversarial keys", transport.put, part, keys, cols, tags)
    listed = _call("list", transport.list, part)
    lost, extra = sorted(set(keys) - set(listed)), sorted(set(listed) - set(keys))
    assert not lost and not extra, f"list lost keys {lost[:6]} and added {extra[:6]}"
    assert len(listed) == n, f"list returned {len(listed)} names for {n} keys"
    order = list(range(n))[::-1]
    got, got_tags = _get(transport, part, [keys[i] for i in order], ["x", "j"], "adversarial keys")
    assert_columns_equal({name: _pick(c, order) for name, c in cols.items()}, got)
    assert_tags_equal([tags[i] for i in order], got_tags, "adversarial keys")
    half = keys[::2]
    _call("clear of half the keys", transport.clear, part, half)
    left = sorted(_call("list", transport.list, part))
    assert left == sorted(keys[1::2]), \
        f"clear of {len(half)} keys left {len(left)}: {sorted(set(left) - set(keys[1::2]))[:6]}"


@pytest.mark.clause("DP-NAMES")
def test_every_allowed_name_is_a_partition_and_a_field(transport):
    names = [*BOOKKEEPING, *ODD[:12], *UNICODE, LONG[2]]
    # each partition name on its own: one refused or mixed-up name hides none of the others
    checks = SoftChecks("allowed partition and field names")
    stored = []
    for i, part in enumerate(names):
        with checks.each():
            _call(f"put to partition {part[:30]!r}", transport.put, part, ["k"],
                  {"x": _dense([i])}, [{"partition": part}])
            stored.append((i, part))
    for i, part in stored:
        with checks.each():
            assert _call("list", transport.list, part) == ["k"], \
                f"partition {part[:30]!r} lists {transport.list(part)}"
            got, tags = _get(transport, part, ["k"], ["x"], f"partition {part[:30]!r}")
            assert_columns_equal({"x": _dense([i])}, got)
            assert_tags_equal([{"partition": part}], tags, f"partition {part[:30]!r}")
    for _, part in stored:
        with checks.each():
            _call(f"clear of partition {part[:30]!r}", transport.clear, part)
    with checks.each():
        left = {p[:30]: _gone(transport, p) for _, p in stored if _gone(transport, p)}
        assert not left, f"partitions still listing keys after clear: {left}"
    with checks.each():
        part = _partition()
        fields = {f: _dense([float(i)]) for i, f in enumerate(FIELD_NAMES)}
        _call("put of adversarial field names", transport.put, part, ["k"], fields, [{}])
        got, _ = _get(transport, part, ["k"], list(FIELD_NAMES), "adversarial field names")
        assert_columns_equal(fields, got)
    checks.done()


@pytest.mark.clause("DP-NAMES")
def test_names_the_contract_refuses_raise_a_clear_error(transport):
    part = _partition()
    cols = {"x": _dense([1.0])}
    transport.put(part, ["k"], cols, [{"ok": 1}])
    assert REFUSED and any(isinstance(b, str) and len(b.encode("utf-8", "surrogatepass"))
                           > MAX_NAME_BYTES for b in REFUSED), "fixture lost its refused names"

    def refused(what: str, word: str, fn, *args) -> None:
        try:
            fn(*args)
        except (TypeError, ValueError) as exc:
            assert word in str(exc), f"{what}: the error does not say which {word} is wrong: " \
                                     f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # noqa: BLE001 - any other error is not the contract's
            raise AssertionError(f"{what}: raised {type(exc).__name__}: {exc}; the contract "
                                 "asks TypeError or ValueError naming the argument") from None
        else:
            raise AssertionError(f"{what}: accepted; the contract refuses it")

    # each name and call on its own: one accepted name (waived or not) hides none of the others
    checks = SoftChecks("refused names")
    for bad in REFUSED:
        b = repr(bad)[:30]
        for what, word, fn, args in [
                (f"put to partition {b}", "partition", transport.put, (bad, ["k"], cols)),
                (f"put of key {b}", "key", transport.put, (part, [bad], cols)),
                (f"put of field {b}", "field", transport.put,
                 (part, ["k2"], {bad: _dense([2.0])})),
                (f"get from partition {b}", "partition", transport.get, (bad, ["k"], ["x"])),
                (f"get of key {b}", "key", transport.get, (part, [bad], ["x"])),
                (f"list of partition {b}", "partition", transport.list, (bad,)),
                (f"clear of partition {b}", "partition", transport.clear, (bad,)),
                (f"clear of key {b}", "key", transport.clear, (part, [bad]))]:
            with checks.each():
                refused(what, word, fn, *args)
    with checks.each():
        assert sorted(_call("list", transport.list, part)) == ["k"], \
            f"refused calls changed the partition: it lists {transport.list(part)}"
        got, tags = _get(transport, part, ["k"], ["x"], "after the refused calls")
        assert_columns_equal(cols, got)
        assert_tags_equal([{"ok": 1}], tags, "after the refused calls")
    checks.done()


# -- isolation of names that share prefixes and separators ------------------------------------
def _colliding(base: str) -> list[tuple[str, str]]:
    """(partition, key) pairs that a store joining names with a separator, or scanning by
    prefix, or folding case or Unicode forms, stores as one record."""
    out = []
    for sep in (*SEPARATORS, ""):
        out += [(f"{base}p{sep}a", "b"), (f"{base}p", f"a{sep}b")]
    out += [(f"{base}pp", "k"), (f"{base}p*", "k"), (f"{base}P", "k"), (f"{base}p", "k"),
            (f"{base}p ", "k"), (f"{base}\u00e9", "k"), (f"{base}e\u0301", "k")]
    return list(dict.fromkeys(out))


@pytest.mark.clause("DP-NAME-ISOLATION")
def test_partitions_sharing_prefixes_and_separators_are_isolated(transport):
    base = f"n{uuid.uuid4().hex[:6]}-"
    pairs = _colliding(base)
    parts: dict[str, list[str]] = {}
    for p, k in pairs:
        parts.setdefault(p, []).append(k)
    assert len(parts) >= 10 and f"{base}p" in parts and len(parts[f"{base}p"]) >= 5, \
        "fixture lost its colliding names"
    value = {pk: float(i) for i, pk in enumerate(pairs)}
    for (p, k), v in value.items():
        _call(f"put ({p!r}, {k!r})", transport.put, p, [k], {"x": _dense([v])},
              [{"at": [p, k]}])

    def check(alive: dict[str, list[str]], when: str) -> None:
        for p, ks in alive.items():
            listed = _call(f"list({p!r})", transport.list, p)
            assert sorted(listed) == sorted(ks), \
                f"{when}: partition {p!r} lists {sorted(listed)}, holds {sorted(ks)}"
            got, tags = _get(transport, p, ks, ["x"], f"{when}: partition {p!r}")
            want = _dense([value[p, k] for k in ks])
            why = column_difference("x", want, got["x"])
            assert why is None, f"{when}: partition {p!r} keys {ks}: {why} (another " \
                                "partition's rows?)"
            assert_tags_equal([{"at": [p, k]} for k in ks], tags, f"{when}: partition {p!r}")

    check(parts, "after every put")
    for victim in (f"{base}p", f"{base}p:a", f"{base}\u00e9"):
        _call(f"clear({victim!r})", transport.clear, victim)
        parts.pop(victim)
        check(parts, f"after clear({victim!r})")


# -- tags -----------------------------------------------------------------------------------
def _every_tag_value() -> dict:
    """One tag holding every kind of value the contract allows."""
    return {
        "none": None, "true": True, "false": False, "zero": 0, "one_float": 1.0,
        "int64": [-(2**63), 2**63 - 1, 2**53 + 1], "floats": [0.1, -0.0, 5e-324, 1e308],
        "specials": (float("nan"), float("inf"), float("-inf")),
        "tuple": (1, "a", (2.5, None)), "empty": ([], (), {}, ""),
        "list_of_tuples": [(1, 2), (3, 4)], "shape": [[3, 1176], [2, 1176]],
        7: "int key", -1: {0: [1], 1: (2,)}, "unicode \u540d\U0001f642": "\u00e9\x00 end",
        "nested": {"a": {"b": {"c": [{"d": (None, 1.5)}]}}},
        "a:b/c.d|e": "separators in a key",
    }


REFUSED_TAGS = (
    ("a set", {"s": {1, 2}}), ("bytes", {"b": b"raw"}), ("a tensor", {"t": torch.ones(2)}),
    ("a float key", {1.5: "x"}), ("a tuple key", {(1, 2): "x"}), ("a bool key", {True: "x"}),
    ("a None key", {None: "x"}), ("an int beyond int64", {"i": 2**64}),
    ("an object", {"o": object()}), ("a lone surrogate", {"s": "\ud800"}),
)


@pytest.mark.clause("DP-TAG-VALUES")
def test_every_allowed_tag_value_round_trips_exactly(transport):
    tag = _every_tag_value()
    kinds = {type(k) for k in tag} | {type(v) for v in tag.values()}
    assert {int, str, type(None), bool, float, list, tuple, dict} <= kinds, \
        f"fixture lost a kind of tag value: {kinds}"
    assert any(isinstance(v, float) and math.isnan(v) for v in tag["specials"]), "no NaN"
    tags = [tag, {"only": (1,)}, {}]
    keys = ["k0", "k1", "k2"]
    part = _partition()
    _call("put of every tag value", transport.put, part, keys, {"x": _dense([0, 1, 2])},
          copy.deepcopy(tags))
    _, got = _get(transport, part, keys[::-1], ["x"], "every tag value")
    assert_tags_equal(tags[::-1], got, "every tag value")
    transport.put(part, keys[:1], {"y": _dense([5])}, [{7: ("replaced",), "extra": [()]}])
    _, got = _get(transport, part, keys[:1], ["x", "y"], "after a merging put")
    assert_tags_equal([{**tag, 7: ("replaced",), "extra": [()]}], got, "after a merging put")


@pytest.mark.clause("DP-TAG-VALUES")
def test_tag_values_the_contract_refuses_raise_at_put(transport):
    assert len(REFUSED_TAGS) >= 8, "fixture lost its refused tags"
    part = _partition()
    transport.put(part, ["k"], {"x": _dense([1])}, [{"ok": [1]}])
    for what, bad in REFUSED_TAGS:
        try:
            transport.put(part, ["k", "k2"], {"x": _dense([2, 3])}, [{"fine": 1}, bad])
        except (TypeError, ValueError):
            pass
        except Exception as exc:  # noqa: BLE001 - any other error is not the contract's
            raise AssertionError(f"a tag holding {what}: put raised {type(exc).__name__}: "
                                 f"{exc}; the contract asks TypeError or ValueError") from None
        else:
            raise AssertionError(f"a tag holding {what} was accepted at put; the contract "
                                 "refuses it (it could not come back exactly from every store)")
        listed = sorted(_call("list", transport.list, part))
        assert listed == ["k"], f"the refused put ({what}) stored keys: {listed}"
        got, tags = _get(transport, part, ["k"], ["x"], f"after the refused put ({what})")
        assert_columns_equal({"x": _dense([1])}, got)
        assert_tags_equal([{"ok": [1]}], tags, f"after the refused put ({what})")


# -- a field re-put in another layout -------------------------------------------------------
def _layouts(n: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """name -> (the layout first written, another layout of the same field)."""
    g = torch.Generator().manual_seed(n)
    rows = [torch.randn(1 + i, generator=g) for i in range(n)]
    return {
        "dense_then_jagged": (torch.randn(n, 2, generator=g), jagged(rows, torch.float32)),
        "jagged_then_dense": (jagged(rows, torch.float32), torch.randn(n, 2, generator=g)),
        "float32_then_bfloat16": (torch.randn(n, 2, generator=g),
                                  torch.randn(n, 2, generator=g).to(torch.bfloat16)),
        "row_shape_2_then_3": (torch.randn(n, 2, generator=g), torch.randn(n, 3, generator=g)),
        "1d_then_n_by_1": (torch.arange(n, dtype=torch.long),
                           torch.arange(n, dtype=torch.long)[:, None]),
        "jagged_trailing_4_then_3": (
            torch.nested.nested_tensor([torch.randn(1 + i, 4, generator=g) for i in range(n)],
                                       layout=torch.jagged),
            torch.nested.nested_tensor([torch.randn(1 + i, 3, generator=g) for i in range(n)],
                                       layout=torch.jagged)),
    }


@pytest.mark.clause("DP-LAYOUT-CONFLICT")
@pytest.mark.parametrize("case", list(_layouts(3)))
@pytest.mark.parametrize("keys_of_reput", ["new_keys", "same_keys"])
def test_a_field_re_put_in_another_layout_raises(transport, case, keys_of_reput):
    n = 3
    first, other = _layouts(n)[case]
    assert column_difference("f", first, other) is not None, "fixture lost its second layout"
    part = _partition()
    keys = [f"k{i}" for i in range(n)]
    tags = [{"row": i} for i in range(n)]
    transport.put(part, keys, {"f": first, "g": _dense([0, 1, 2])}, tags)
    again = keys if keys_of_reput == "same_keys" else [f"new{i}" for i in range(n)]
    # "a" sorts and iterates before "f": a store that writes field by field and checks as it
    # goes has stored "a" when "f" fails
    try:
        transport.put(part, again, {"a": _dense([7, 8, 9]), "f": other},
                      [{"reput": True}] * n)
    except (TypeError, ValueError) as exc:
        assert "f" in str(exc), f"the error does not name the field: {exc}"
    except Exception as exc:  # noqa: BLE001 - any other error is not the contract's
        raise AssertionError(f"re-put of field 'f' ({case}) raised {type(exc).__name__}: {exc}; "
                             "the contract asks ValueError naming the field") from None
    else:
        raise AssertionError(f"re-put of field 'f' in another layout ({case}) was accepted")
    listed = sorted(_call("list", transport.list, part))
    assert listed == keys, f"the refused put stored keys: {listed}"
    got, got_tags = _get(transport, part, keys, ["f", "g"], f"after the refused put ({case})")
    assert_columns_equal({"f": first, "g": _dense([0, 1, 2])}, got)
    assert_tags_equal(tags, got_tags, f"after the refused put ({case})")
    try:
        transport.get(part, keys, ["a"])
    except KeyError:
        pass
    else:
        raise AssertionError("the refused put stored field 'a' it carried beside 'f'")


# -- empty key lists ------------------------------------------------------------------------
def _stored_layouts() -> dict[str, torch.Tensor]:
    return {
        "dense": torch.arange(6, dtype=torch.float64).reshape(3, 2),
        "ids": torch.arange(3, dtype=torch.long)[:, None],  # (N, 1): 1-D is DP-LAYOUT's
        "bf16_jagged": torch.nested.nested_tensor(
            [torch.ones(1 + i, 2, dtype=torch.bfloat16) for i in range(3)], layout=torch.jagged),
    }


def _no_rows(cols: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: _empty_like(c) if c.is_nested else c[:0] for n, c in cols.items()}


@pytest.mark.clause("DP-EMPTY")
def test_get_of_no_keys_returns_empty_columns_in_their_layouts(transport):
    cols = _stored_layouts()
    assert {c.dtype for c in cols.values()} >= {torch.float64, torch.long, torch.bfloat16}
    part = _partition()
    keys = ["a", "b", "c"]
    transport.put(part, keys, cols, [{"i": i} for i in range(3)])
    got, tags = _get(transport, part, [], list(cols), "get of no keys")
    assert tags == [], f"get of no keys returned tags {tags!r}"
    assert_columns_equal(_no_rows(cols), got)
    for what, args in (("a field never written", (part, [], ["nope"])),
                       ("a partition never written", (_partition("never"), [], ["dense"]))):
        try:
            transport.get(*args)
        except KeyError:
            continue
        except Exception as exc:  # noqa: BLE001
            raise AssertionError(f"get of no keys from {what} raised {type(exc).__name__}: "
                                 f"{exc}; the contract asks KeyError naming it") from None
        raise AssertionError(f"get of no keys from {what} did not raise KeyError")


@pytest.mark.clause("DP-EMPTY")
def test_put_clear_and_list_of_no_keys(transport):
    cols = _stored_layouts()
    part = _partition()
    keys = ["a", "b", "c"]
    transport.put(part, keys, cols, [{"i": i} for i in range(3)])
    _call("put of no keys", transport.put, part, [], _no_rows(cols), [])
    _call("clear of no keys", transport.clear, part, [])
    assert sorted(_call("list", transport.list, part)) == keys, \
        f"put or clear of no keys changed the partition: {transport.list(part)}"
    got, _ = _get(transport, part, keys, list(cols), "after put and clear of no keys")
    assert_columns_equal(cols, got)
    fresh = _partition("empty")
    _call("put of no keys to a new partition", transport.put, fresh, [], _no_rows(cols), None)
    try:
        listed = transport.list(fresh)
    except KeyError:
        listed = []
    assert listed == [], f"put of no keys stored keys {listed} in partition {fresh!r}"
    for k in keys:
        _call(f"clear of key {k!r}", transport.clear, part, [k])
    assert _call("list of an emptied partition", transport.list, part) == [], \
        "a partition whose keys were all cleared must list []"


# -- order ----------------------------------------------------------------------------------
def _two_puts(transport, part: str, n1: int, n2: int):
    """Two puts into one partition; every value and tag names its row."""
    keys = [f"first{i}" for i in range(n1)] + [f"second{i}" for i in range(n2)]
    # dense (n, 2) and non-empty jagged rows: a 1-D column's layout is DP-LAYOUT's question
    allcols = {"d": _dense(list(range(n1 + n2))), "j": _jagged_named(list(range(n1 + n2))),
               "s": (torch.arange(n1 + n2, dtype=torch.long) * 10)[:, None]}
    tags = [{"row": i, "name": k} for i, k in enumerate(keys)]
    for lo, hi in ((0, n1), (n1, n1 + n2)):
        _call(f"put of rows {lo}..{hi - 1}", transport.put, part, keys[lo:hi],
              {n: _pick(c, list(range(lo, hi))) for n, c in allcols.items()}, tags[lo:hi])
    return keys, allcols, tags


def _check_order(transport, part, keys, cols, tags, idx, what):
    got, got_tags = _get(transport, part, [keys[i] for i in idx], list(cols), what)
    assert_columns_equal({n: _pick(c, idx) for n, c in cols.items()}, got)
    assert_tags_equal([tags[i] for i in idx], got_tags, what)


ORDERS = {
    "reversed": lambda n1, n2: list(range(n1 + n2))[::-1],
    # first and last in place, the middle shuffled
    "ends_fixed": lambda n1, n2: [0, 2, 1, 4, 3, *range(5, n1 + n2)],
    "interleaved_puts": lambda n1, n2: [i for p in zip(range(n1), range(n1, n1 + n2))
                                        for i in p],
    "second_put_first": lambda n1, n2: [*range(n1, n1 + n2), *range(n1)],
}


@pytest.mark.clause("DP-ORDER")
@pytest.mark.parametrize("order", list(ORDERS))
def test_get_in_any_order_returns_each_rows_own_data(transport, order):
    part = _partition()
    keys, cols, tags = _two_puts(transport, part, 6, 6)
    idx = ORDERS[order](6, 6)
    assert sorted(idx) == list(range(12)) and idx != list(range(12)), "not a reordering"
    _check_order(transport, part, keys, cols, tags, idx, f"keys {order}")


@pytest.mark.clause("DP-ORDER")
@given(data=st.data())
def test_property_get_in_any_order(transport, data):
    # two non-empty puts: a put of no keys is DP-EMPTY's question
    n1, n2 = data.draw(st.integers(1, 6), "n1"), data.draw(st.integers(1, 6), "n2")
    part = _partition()
    keys, cols, tags = _two_puts(transport, part, n1, n2)
    idx = data.draw(st.permutations(range(n1 + n2)), "order")
    idx = idx[:data.draw(st.integers(1, n1 + n2), "take")]
    _check_order(transport, part, keys, cols, tags, list(idx), f"keys {idx}")


# -- arguments are never modified -----------------------------------------------------------
def _object_rows() -> ObjectColumn:
    """Dict rows (tensor and per-image list values), a None and an empty row: what verl's and
    OpenRLHF's per-row media columns hold."""
    return ObjectColumn([{"pixel_values": torch.arange(6.0).reshape(3, 2),
                          "image_sizes": [torch.tensor([1, 3]), torch.tensor([2, 2])]},
                         None, {}, {"pixel_values": torch.ones(1, 2, dtype=torch.bfloat16)}])


@pytest.mark.clause("DP-ARGS-INTACT")
def test_put_and_get_leave_their_arguments_as_they_were(backend, transport):
    """Every argument of every call (named from the call's signature, so none is left out):
    put's keys, columns (an object column's rows where the store takes them) and tags, get's
    keys and select_fields, list's and clear's."""
    keys = ["k3", "k1", "k2", "k0"]  # unsorted: a store that sorts the caller's list shows
    cols = {"z": _dense([3, 1, 2, 0]), "b": _jagged_named([3, 1, 2, 0]),
            "a": torch.ones(4, 2, dtype=torch.bfloat16) * torch.arange(4)[:, None],
            "s": torch.arange(4)}
    if "object_columns" in backend.capabilities:
        cols["o"] = _object_rows()
    tags = [{"shape": [[i + 1, 2]], "t": (i, [i]), 5: {"n": None}} for i in range(4)]
    select = ["z", "s", "b"] + (["o"] if "o" in cols else [])  # unsorted too
    assert keys != sorted(keys) and select != sorted(select), "fixture lost its unsorted lists"
    part = _partition()

    def call(what: str, fn, *args):
        watch = ArgumentsWatch(fn, args, {})
        out = _call(what, fn, *args)
        watch.assert_unchanged(what)
        return out

    call("put", transport.put, part, keys, cols, tags)
    call("get", transport.get, part, keys, select)
    call("get of a subset", transport.get, part, keys[1:3], select)
    call("list", transport.list, part)
    call("clear of two keys", transport.clear, part, keys[2:])


# -- a second client process ----------------------------------------------------------------
def _cross_columns() -> dict[str, torch.Tensor]:
    return {
        "pixel_values": jagged([torch.randn(3), torch.empty(0), torch.randn(5)], torch.float32),
        "bf16": torch.randn(3, 2).to(torch.bfloat16),
        "seq_len": torch.tensor([3, 0, 5]),
    }


# what crosses the process boundary: int keys, -0.0, nan, None, unicode; whether tuples stay
# tuples is DP-TAG-VALUES' question (asked of the same store in one process)
CROSS_TAGS = [{"shapes": [[3]], 1: -0.0, "n": float("nan")}, {"none": None},
              {"t": [1, [2, [3]]], "\u00e9": "\U0001f642", -2: {3: "x"}}]


@pytest.mark.clause("DP-MULTIPROCESS")
def test_put_in_one_process_get_in_another(transport, request):
    """The test's store, reopened by its address in a second process: each side reads exactly
    what the other put, names and tags included."""
    spec = request.config.getoption("--backend")
    mine, theirs = _partition("here:\u00e9/"), _partition("there|\U0001f642.")
    keys = ["a:b", "\u00e9", "__keys__"]
    cols = _cross_columns()
    assert any(r.numel() == 0 for r in jagged_rows(cols["pixel_values"])), "no empty row"
    _call("put", transport.put, mine, keys, cols, CROSS_TAGS)
    address = _call("address()", transport.address)
    their_keys = ["k|1", "k 2"]
    their_cols = {"x": _dense([4.0, -0.0]), "j": _jagged_named([1, 2])}
    their_tags = [{"from": "peer", "i": [0]}, {"from": "peer", 2: [None]}]
    order = [2, 0, 1]
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "answers.pickle"
        job = {"address": address, "result": str(result), "steps": [
            ("get", (mine, [keys[i] for i in order], list(cols))),
            ("put", (theirs, their_keys, pack_columns(their_cols), their_tags)),
        ]}
        proc = subprocess.run([sys.executable, "-m", "rlconform.conformance.clauses._peer",
                               spec], input=pickle.dumps(job), capture_output=True, timeout=300)
        assert result.is_file(), f"the second process wrote no answer (exit " \
            f"{proc.returncode}): {proc.stderr.decode(errors='replace')[-1500:]}"
        answers = pickle.loads(result.read_bytes())
    assert answers[0][0] == "ok", f"the second process could not get what this one put: " \
                                  f"{answers[0][1]}"
    got = unpack_columns(answers[0][1])
    assert_columns_equal({n: _pick(c, order) for n, c in cols.items()}, got)
    assert_tags_equal([CROSS_TAGS[i] for i in order], answers[0][2],
                      "tags read by the second process")
    assert len(answers) > 1 and answers[1][0] == "ok", \
        f"the second process could not put: {answers[-1][1]}"
    got, tags = _get(transport, theirs, their_keys[::-1], ["x", "j"],
                     "what the second process put")
    assert_columns_equal({n: _pick(c, [1, 0]) for n, c in their_cols.items()}, got)
    assert_tags_equal(their_tags[::-1], tags, "tags the second process put")
    _call("clear", transport.clear, theirs)


# -- clean-up -------------------------------------------------------------------------------
@pytest.mark.clause("DP-CLEAN-SLATE")
def test_clear_of_a_partition_leaves_nothing_behind(transport):
    part = _partition()
    keys = ["a", "b"]
    transport.put(part, keys, {"x": _dense([1, 2])}, [{"stale": 1, "shape": [2]}] * 2)
    _call("clear", transport.clear, part)
    assert _gone(transport, part) == [], f"clear left keys {transport.list(part)}"
    try:
        transport.get(part, keys, ["x"])
    except KeyError:
        pass
    else:
        raise AssertionError("get after clear of the partition returned data")
    fresh = {"x": jagged([torch.ones(3), torch.ones(1)], torch.float32)}
    try:
        transport.put(part, keys, fresh, [{"fresh": 1}] * 2)
    except (TypeError, ValueError) as exc:
        raise AssertionError(f"after clear, a put in another layout was refused: {exc} (the "
                             "partition's old layout survived its clear)") from None
    got, tags = _get(transport, part, keys, ["x"], "after clear and a fresh put")
    assert_columns_equal(fresh, got)
    assert_tags_equal([{"fresh": 1}] * 2, tags, "after clear and a fresh put (stale tags?)")


@pytest.mark.clause("DP-CLEAN-SLATE")
def test_the_suites_clean_up_leaves_the_store_as_found(transport, backend):
    """What a test wrote is cleared even when it fails (the transport fixture's clean-up):
    afterwards every partition it wrote lists nothing, seen by this client and, for a
    multiprocess store, by a second client of the same store."""
    from rlconform.conformance.engine.fixtures import clear_written, track_writes

    written = track_writes(transport)
    parts = [_partition("a"), _partition("a:b"), f"{_partition()}/\u00e9"]
    try:
        for i, p in enumerate(parts):
            transport.put(p, ["k", "k:2"], {"x": _dense([i, i])}, [{"i": i}] * 2)
        raise RuntimeError("the test failed halfway")
    except RuntimeError:
        pass
    assert set(parts) <= written, f"the clean-up did not see every partition written: {written}"
    assert all(_gone(transport, p) for p in parts), "fixture wrote nothing"
    clear_written(transport, written)
    left = {p: _gone(transport, p) for p in parts if _gone(transport, p)}
    assert not left, f"partitions still listing keys after the clean-up: {left}"
    if "multiprocess" in backend.capabilities:
        other = backend.transport(address=transport.address())
        try:
            left = {p: _gone(other, p) for p in parts if _gone(other, p)}
        finally:
            other.close()
        assert not left, f"a second client of the store still sees keys: {left}"
