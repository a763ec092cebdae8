"""The store machine's counterexample is a runnable test: the snippet a failure prints fails
against the store it came from, by its own assertion, and passes against the reference."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test

from rlconform.conformance.backend import load_backend
from rlconform.conformance.clauses.test_store_machine import StoreMachine, machine_for
from rlconform.fixtures import names as alphabet

SEARCH = settings(max_examples=60, stateful_step_count=20, derandomize=True, database=None,
                  deadline=None, report_multiple_bugs=False)
# the same search without hypothesis's shrinking: the printed sequence is then the failing one
# as found (up to 20 calls), which tests the printing as well; shrinking some of these took
# 60-250 s on the 2-core machine, most of the test command's longest tests
UNSHRUNK = settings(SEARCH, phases=[Phase.explicit, Phase.reuse, Phase.generate])


def _snippet(mutant: str, names: str, shrink: bool = True) -> str:
    spec = f"mutant:{mutant}"
    machine = machine_for(StoreMachine, load_backend(spec), spec, names)
    with pytest.raises(AssertionError) as failure:
        run_state_machine_as_test(machine, settings=SEARCH if shrink else UNSHRUNK)
    text = str(failure.value)
    assert "runnable:\n" in text, f"no snippet in the failure: {text[:500]}"
    return textwrap.dedent(text.split("runnable:\n", 1)[1])


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("mutant, names, shrink", [
    ("reput_keeps_old_value", "case", False),  # a row's bits: tensor_difference vs its source
    ("repeated_key_returns_one_row", "case", False),  # a column's shape
    ("key_trailing_spaces_ignored", "whitespace", False),  # list
    ("list_of_unknown_partition_raises", "case", True),  # a call that raises; shrunk (~15 s)
])
def test_the_printed_sequence_fails_on_its_store_and_passes_on_the_reference(mutant, names,
                                                                             shrink):
    code = _snippet(mutant, names, shrink)
    assert f"load_backend('mutant:{mutant}')" in code and "t = backend.transport()" in code
    bad = _run(code)
    assert bad.returncode != 0, f"the snippet passed on mutant {mutant}:\n{code}"
    # by the snippet's own assertion, or by a call the contract says succeeds raising
    assert any(e in bad.stderr for e in ("AssertionError", "KeyError", "ValueError")), \
        bad.stderr[-2000:]
    good = _run(code.replace(f"'mutant:{mutant}'", "'reference'"))
    assert good.returncode == 0, f"the snippet fails on the reference:\n{code}\n" \
                                 f"{good.stderr[-2000:]}"


@pytest.mark.parametrize("cls", (*alphabet.CLASSES, "mixed"))
@settings(max_examples=10, derandomize=True, database=None, deadline=None)
@given(data=st.data())
def test_every_world_holds_confusable_pairs_the_contract_allows(cls, data):
    from rlconform.reference_impl.dataplane import check_name

    world = data.draw(alphabet.worlds(cls), label="world")
    for role in (world.partitions, world.keys, world.fields):
        assert len(set(role)) == len(role) >= 2, f"{cls}: {role}"
        for name in role:
            check_name("name", name)
            assert eval(alphabet.source(name)) == name  # noqa: S307 - our own source


def test_a_snippet_writes_look_alike_names_apart():
    from rlconform.fixtures.values import py_source

    pairs = [("\u00e9", "e\u0301"), ("a", "\u0430"), ("k", "\u212a"),
             ("x" * 60 + "\u00e9", "x" * 60 + "e\u0301")]
    for a, b in pairs:
        for write in (alphabet.source, py_source):
            sa, sb = write(a), write(b)
            assert sa.isascii() and sb.isascii() and sa != sb, (sa, sb)
            assert eval(sa) == a and eval(sb) == b  # noqa: S307 - our own source


# -- a waiver's input is replayed before the search --------------------------------------------
WAIVER = """
[[waiver]]
clause = "DP-STORE-MODEL"
category = "backend-bug"
reason = "list of a partition never written raises KeyError"
input = "t.put('p', [], {{}}, None); t.list('P')  # KeyError, [] expected"
tests = ["test_call_sequences_equal_the_model"]
match = "list raised KeyError: .*; the contract says it succeeds"
expires = {expires}
"""


def test_parse_input_reads_the_calls_a_waiver_names():
    from rlconform.conformance.clauses.test_store_machine import parse_input

    calls = parse_input("t.put('p', ['k'], {'f': seeded(torch.bfloat16, (2,), 0)[::2]}, None); "
                        "cols, tags = t.get('p', ['k', 'k'], [])  # a comment")
    assert [m for m, _ in calls] == ["put", "get"]
    put = calls[0][1]
    assert put[2].value["f"].source == "seeded(torch.bfloat16, (2,), 0)[::2]"
    assert tuple(put[2].value["f"].value.shape) == (1,)
    with pytest.raises(ValueError, match="is not a call t.{put, get, list, clear}"):
        parse_input("backend.transport().list('p')")


@pytest.mark.parametrize("backend, outcome", [
    ("mutant:list_of_unknown_partition_raises", "waived"),  # the input shows the defect
    ("reference", "xpass"),  # the defect is gone: the waiver reads fixed, whatever the search did
])
def test_a_waivers_input_confirms_it_or_reads_fixed(tmp_path, backend, outcome):
    import datetime
    import json

    waivers = tmp_path / "w.toml"
    waivers.write_text(WAIVER.format(expires=datetime.date.today() + datetime.timedelta(days=30)))
    out = subprocess.run(
        [sys.executable, "-m", "rlconform.conformance.cli", "run", "--backend", backend,
         "--workers", "0", "--report-dir", str(tmp_path / "r"), "-q", "--partial-ok",
         "--expectations", str(waivers), "-k", "test_call_sequences_equal_the_model and case"],
        capture_output=True, text=True, timeout=600)
    report = json.loads(next((tmp_path / "r").glob("*/report.json")).read_text())
    tests = [t for c in report["clauses"] for t in c.get("tests", ())
             if "test_call_sequences_equal_the_model" in t["nodeid"]]
    assert [t["outcome"] for t in tests] == [outcome], (tests, out.stdout[-3000:])
    assert (out.returncode == 0) == (outcome == "waived"), out.stdout[-3000:]


# -- each rule finds a defect no other rule finds ----------------------------------------------
def _without(machine: type, part: str) -> type:
    """`machine` with one rule (or invariant) never drawn: hypothesis reads a machine's rules
    from `setup_state`, which the subclass answers without it."""
    state = machine.setup_state()
    kept = type(state)(rules=[r for r in state.rules if r.function.__name__ != part],
                       initializers=state.initializers,
                       invariants=[i for i in state.invariants if i.function.__name__ != part])
    assert kept.rules != state.rules or kept.invariants != state.invariants, part

    class Without(machine):
        @classmethod
        def setup_state(cls):
            return kept

    Without.__name__ = f"{machine.__name__}_without_{part}"
    return Without


# (machine, name class, rule or invariant, a mutant of its clause that the same search no
# longer finds without it), chosen by leaving each rule out in turn against each of the clause's
# mutants: without `put` 5 of DP-STORE-MODEL's 21 survive, `get` 4, `clear` 4, the whole-state
# invariant 6; each of the other machines' rules leaves one of its clause's two
RULE_ONLY = [
    ("StoreMachine", "case", "put", "reput_keeps_old_value"),
    ("StoreMachine", "case", "get", "repeated_key_returns_one_row"),
    ("StoreMachine", "case", "clear", "cleared_values_come_back"),
    ("StoreMachine", "case", "store_equals_model", "views_read_from_storage"),
    ("RefusedCalls", "mixed", "put_refused", "half_failed_put_keeps_first_columns"),
    ("RefusedCalls", "mixed", "name_refused", "clear_checks_names_as_it_deletes"),
    ("RefusedCalls", "mixed", "store_equals_model", "half_failed_put_keeps_first_columns"),
    ("Clients", "mixed", "open_client", "client_caches_key_index"),
    ("Clients", "mixed", "close_client", "client_close_clears_its_writes"),
    ("Clients", "mixed", "store_equals_model", "client_caches_key_index"),
]


def test_every_rule_of_every_machine_has_a_defect_only_it_finds():
    from rlconform.conformance.clauses import test_store_machine as sm

    named = {(b, p) for b, _, p, _ in RULE_ONLY}
    for base in ("StoreMachine", "RefusedCalls", "Clients"):
        state = getattr(sm, base).setup_state()
        own = {r.function.__name__ for r in state.rules} | \
            {i.function.__name__ for i in state.invariants}
        if base != "StoreMachine":  # what it adds to the machine it extends
            own -= {r.function.__name__ for r in sm.StoreMachine.setup_state().rules}
        missing = own - {p for b, p in named if b == base}
        assert not missing, f"{base}: rules without a defect only they find: {sorted(missing)}"


@pytest.mark.parametrize("base, names, part, mutant", RULE_ONLY,
                         ids=[f"{b}-{p}" for b, _, p, _ in RULE_ONLY])
def test_each_rule_finds_a_defect_only_it_finds(base, names, part, mutant):
    """Issue 30's bar for the machine: leave one rule (or the whole-state invariant) out and a
    mutant its clause kills survives the same search. (The name classes have theirs: one
    mutant per class, killed in its class's test only; the kill matrix shows it.)"""
    from rlconform.conformance.clauses import test_store_machine as sm

    machine = machine_for(getattr(sm, base), load_backend(f"mutant:{mutant}"),
                          f"mutant:{mutant}", names)
    scale = 1 if base == "StoreMachine" else sm.SINGLE
    search = settings(UNSHRUNK, max_examples=sm.STEPS["ci"][0] * scale,
                      stateful_step_count=sm.STEPS["ci"][1])
    with pytest.raises(AssertionError):
        run_state_machine_as_test(machine, settings=search)
    run_state_machine_as_test(_without(machine, part), settings=search)  # survives


# -- a store that answers with bytes it does not hold, after a waived failure ------------------
class _TornStore:
    """The reference store refusing a put that holds a zero-size row (as a store of no
    zero-byte values does) after it wrote the put's other rows, each under the shape its key
    held before: a read of such a row gives its new values, then memory past them (other bits
    each time)."""

    def __new__(cls):
        import torch

        from rlconform.reference_impl.dataplane import InMemoryDataPlane

        class Torn(InMemoryDataPlane):
            def put(self, partition, keys, columns, tags=None):
                rows = {n: c.unbind() for n, c in columns.items()
                        if isinstance(c, torch.Tensor) and c.is_nested}
                if not any(r.numel() == 0 for rs in rows.values() for r in rs):
                    return super().put(partition, keys, columns, tags)
                held = self._rows.get(partition, {})
                for name, rs in rows.items():
                    for k, r in zip(keys, rs):
                        old = held.get(k, {}).get(name)
                        if r.numel() and old is not None and old.numel() > r.numel():
                            self.__dict__.setdefault("torn", {})[(partition, k, name)] = \
                                (r.clone(), old.shape)
                raise RuntimeError("zero-byte value refused after the other rows were written")

            def get(self, partition, keys, select_fields=None):
                for (p, k, name), (new, shape) in self.__dict__.get("torn", {}).items():
                    if p == partition and name in self._rows.get(p, {}).get(k, {}):
                        row = torch.randn(shape).to(new.dtype)  # what the buffer held before
                        row.view(-1)[:new.numel()] = new.reshape(-1)
                        self._rows[p][k][name] = row
                return super().get(partition, keys, select_fields)

        return Torn()


def test_a_store_that_reads_back_other_bits_after_a_waived_failure_fails_on_that():
    """After a waived failure the model adopts what the store holds (`_adopt`); a field that
    reads back with other bits each time is then a finding of its own (not a false alarm on
    a later read, not silence): its message names the key and field, a waiver can take it,
    and the field is no longer judged."""
    source = (
        "t.put('p', ['k'], {'f': jagged_of(seeded(torch.float32, (3, 1), 0), [3])}, None); "
        "t.put('p', ['k', 'z'], {'f': jagged_of(seeded(torch.float32, (2, 1), 1), [2, 0])}, None)")

    def replay(*matches: str) -> None:
        _replay_waived(_TornStore, source, *matches)

    put_refused = "put raised RuntimeError: zero-byte value refused"
    with pytest.raises(AssertionError, match="two reads of field 'f' differ") as failure:
        replay(put_refused)
    assert "together, _ = t.get('p', ['k'], ['f'])" in failure.value.reproduction
    # the finding stands alone: chained to the waived failure, hypothesis would take the two for
    # one bug and pytest would report the waived one (a Mooncake run showed the waived clear)
    assert failure.value.__context__ is None
    replay(put_refused, r"after a waived failure \(put raised RuntimeError\), two reads of field")


class _DriftingStore:
    """`_TornStore` whose torn rows read back the same bits until the store's next put (the
    memory past a row is reused then): steady while the model adopts them, other bits later."""

    def __new__(cls):
        import torch

        torn = _TornStore()
        base = type(torn)

        class Drifting(base):
            epoch = 0

            def put(self, partition, keys, columns, tags=None):
                self.epoch += 1
                return super().put(partition, keys, columns, tags)

            def get(self, partition, keys, select_fields=None):
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(self.epoch)
                    return super().get(partition, keys, select_fields)

        return Drifting()


def test_a_row_taken_from_the_store_that_changes_later_fails_on_that():
    """A row the model took from the store after a waived failure, steady then, that reads back
    other bits after a later call that did not write it: a finding of its own that names the
    waived failure (not a plain value difference no waiver can take for one cause), and the
    field is no longer judged."""
    source = (
        "t.put('p', ['k'], {'f': jagged_of(seeded(torch.float32, (3, 1), 0), [3])}, None); "
        "t.put('p', ['k', 'z'], {'f': jagged_of(seeded(torch.float32, (2, 1), 1), [2, 0])}, None); "
        "t.put('q', ['a'], {'g': jagged_of(seeded(torch.float32, (1, 1), 2), [1])}, None)")

    def replay(*matches: str) -> None:
        _replay_waived(_DriftingStore, source, *matches)

    put_refused = "put raised RuntimeError: zero-byte value refused"
    with pytest.raises(AssertionError, match=r"after a waived failure \(put raised "
                       r"RuntimeError\), field 'f' of a row the model took from the store then "
                       r"reads back other bits \(the sequence's waived writes: put raised "
                       r"RuntimeError\): column 'f' row 0") as failure:
        replay(put_refused)
    assert "two reads" not in str(failure.value)  # steady while adopted
    replay(put_refused, r"after a waived failure \(put raised RuntimeError\), field 'f' of a row")


class _DanglingStore:
    """The reference store refusing a put that holds a zero-size row, writing nothing; the
    rows that put named keep their values until the store's next put, then read back other bits
    (a refused put that released their memory, reused by the next one): right while the model
    adopts them, other bits later."""

    def __new__(cls):
        import torch

        from rlconform.reference_impl.dataplane import InMemoryDataPlane

        class Dangling(InMemoryDataPlane):
            dangling: set = set()

            def put(self, partition, keys, columns, tags=None):
                for p, k, name in self.dangling:  # the released memory is reused now
                    row = self._rows.get(p, {}).get(k, {}).get(name)
                    if row is not None:
                        self._rows[p][k][name] = torch.randn(row.shape).to(row.dtype)
                self.dangling = set()
                if any(r.numel() == 0 for c in columns.values()
                       if isinstance(c, torch.Tensor) and c.is_nested for r in c.unbind()):
                    self.dangling = {(partition, k, n) for k in keys for n in columns}
                    raise RuntimeError("zero-byte value refused")
                return super().put(partition, keys, columns, tags)

        return Dangling()


def test_a_row_a_waived_put_named_that_changes_later_is_named_after_that_put():
    """A row that reads right when the model adopts the store's state after a waived put that
    named it, and other bits after a later put of other keys: the finding names the waived put
    (the call that wrote the row), not a plain value difference, nor a later waived failure
    that merely noticed it."""
    with pytest.raises(AssertionError, match=r"after a waived failure \(put raised "
                       r"RuntimeError\), field 'f' of a row the model took from the store "
                       r"then reads back other bits \(the sequence's waived writes: put "
                       r"raised RuntimeError\)"):
        _replay_waived(
            _DanglingStore,
            "t.put('p', ['k'], {'f': jagged_of(seeded(torch.float32, (3, 1), 0), [3])}, None); "
            "t.put('p', ['k', 'z'], {'f': jagged_of(seeded(torch.float32, (2, 1), 1), [2, 0])}, "
            "None); t.put('q', ['a'], {'g': jagged_of(seeded(torch.float32, (1, 1), 2), [1])}, "
            "None)", "put raised RuntimeError: zero-byte value refused")


class _DanglingTwiceStore:
    """`_DanglingStore` whose get of a key named twice also answers zeros for the first copy
    (as a store that fills one buffer per key does): a difference only such a get shows."""

    def __new__(cls):
        import torch

        base = type(_DanglingStore())

        class Twice(base):
            def get(self, partition, keys, select_fields=None):
                cols, tags = super().get(partition, keys, select_fields)
                if len(set(keys)) == len(keys):
                    return cols, tags
                out = {}
                for name, col in cols.items():
                    rows = list(col.unbind())
                    for i, k in enumerate(keys):
                        if k in keys[i + 1:]:
                            rows[i] = torch.zeros_like(rows[i])
                    out[name] = torch.nested.nested_tensor(rows, layout=torch.jagged)
                return out, tags

        return Twice()


def test_a_remembered_row_that_reads_right_alone_is_a_plain_difference_of_the_get():
    """A row the model remembers from a waived put, read by a get that names its key twice and
    answers zeros for one copy: the row itself did not drift (it reads right alone), so the
    finding is the get's plain difference, which names the repeated key (and a waiver of that
    defect takes it), not a drift named after the put."""
    with pytest.raises(AssertionError, match=r"^get: column 'f' row 0: .* \(the get names "
                       r"\['k'\] more than once\)") as failure:
        _replay_waived(
            _DanglingTwiceStore,
            "t.put('p', ['k'], {'f': jagged_of(seeded(torch.float32, (3, 1), 0), [3])}, None); "
            "t.put('p', ['k', 'z'], {'f': jagged_of(seeded(torch.float32, (2, 1), 1), [2, 0])}, "
            "None); t.get('p', ['k', 'k'], ['f'])",
            "put raised RuntimeError: zero-byte value refused")
    assert "reads back other bits" not in str(failure.value)


class _DanglingBatchStore:
    """`_DanglingStore` whose rows a refused put named read right alone and in a get of the
    whole partition, and as zeros in a get of some of its keys (as a store that sizes a batch's
    buffers from the records the refused put left behind): steady while the model adopts them,
    other bits in a later get of several keys, each named once."""

    def __new__(cls):
        import torch

        base = type(_DanglingStore())

        class Batch(base):
            torn: set = set()

            def put(self, partition, keys, columns, tags=None):
                try:
                    return super().put(partition, keys, columns, tags)
                except RuntimeError:
                    self.torn = set(self.dangling)
                    self.dangling = set()  # the bytes stay: only a batched read differs
                    raise

            def get(self, partition, keys, select_fields=None):
                cols, tags = super().get(partition, keys, select_fields)
                if not 2 <= len(keys) < len(self.list(partition)):
                    return cols, tags  # alone, or the whole partition, reads right
                out = {}
                for name, col in cols.items():
                    if not col.is_nested:
                        out[name] = col
                        continue
                    rows = [torch.zeros_like(r) if (partition, k, name) in self.torn else r
                            for k, r in zip(keys, col.unbind())]
                    out[name] = torch.nested.nested_tensor(rows, layout=torch.jagged)
                return out, tags

        return Batch()


def test_a_row_a_waived_put_named_that_reads_otherwise_beside_other_keys_is_drift():
    """A row a waived put named that reads right alone and other bits in a get of several keys,
    each named once: the store answers for the row by what it is read with, a consequence of
    the torn write, so the finding is the drift named after the waived put (which a waiver of
    that put's tearing takes), not a plain difference of the get."""
    with pytest.raises(AssertionError, match=r"after a waived failure \(put raised "
                       r"RuntimeError\), field 'f' of a row the model took from the store "
                       r"then reads back other bits \(the sequence's waived writes: put "
                       r"raised RuntimeError"):
        _replay_waived(
            _DanglingBatchStore,
            "t.put('p', ['k', 'a', 'b'], {'f': jagged_of(seeded(torch.float32, (4, 1), 0), "
            "[2, 1, 1])}, None); "
            "t.put('p', ['k', 'z'], {'f': jagged_of(seeded(torch.float32, (2, 1), 1), "
            "[2, 0])}, None); t.get('p', ['a', 'k'], ['f'])",
            "put raised RuntimeError: zero-byte value refused")


def _replay_waived(transport, source: str, *matches: str) -> None:
    """Replay the calls of `source` (a waiver's `input` form) on a machine over `transport`,
    with one DP-STORE-MODEL waiver per pattern in `matches` covering the run."""
    import datetime as dt

    from rlconform.conformance.backend import Backend
    from rlconform.conformance.clauses.test_store_machine import _input_world, parse_input
    from rlconform.conformance.engine import verdicts
    from rlconform.conformance.engine.waivers import Waiver

    machine = machine_for(StoreMachine, Backend.from_reference("store", transport=transport),
                          "store", "case")
    calls = parse_input(source)
    waivers = [Waiver("DP-STORE-MODEL", "backend-bug", "r", dt.date(2099, 1, 1), match=m,
                      index=i) for i, m in enumerate(matches, 1)]
    token = verdicts._CURRENT.set(verdicts.CoveringWaivers(waivers))
    m = machine()
    m.world = _input_world(calls)
    try:
        m.replay(calls)
    finally:
        m.teardown()
        verdicts._CURRENT.reset(token)
