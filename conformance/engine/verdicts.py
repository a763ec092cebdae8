"""A clause test's verdict: how it failed (a clause assertion or another exception), which waivers
cover it, and whether its failures are the ones they describe.

The plugin calls `scope_item` at collection, `example_waivers` around each test call (property
tests: a failing example that a covering waiver matches is recorded and the search goes on, so
one waived failure never ends the exploration of a clause) and `verdict` when the call's report
is made. The verdict travels to the xdist controller in the report's user_properties.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import sys
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import _pytest
import pytest

from rlconform.conformance.engine.waivers import Waiver

if sys.version_info < (3, 11):  # pragma: no cover - hypothesis brings the backport there
    from exceptiongroup import BaseExceptionGroup

VERDICT_PROP = "rlconform_verdict"
MAX_DISTINCT = 200  # distinct failure texts kept per waiver and test
KEPT = 300  # characters kept of each waived failure text (the report reads its kinds)
PARAMS_PROP = "rlconform_params"

# Where a clause's own checks live: a failure raised from here (an `assert`, an assertion
# helper, `pytest.fail`, `pytest.raises`' "DID NOT RAISE") is the clause judging the backend.
CONFORMANCE_DIR = Path(__file__).resolve().parents[1]
CLAUSES_DIR = CONFORMANCE_DIR / "clauses"
RLCONFORM_DIR = CONFORMANCE_DIR.parent
# pytest.fail / pytest.raises live in _pytest: their frames are skipped to find the caller
_PYTEST_DIRS = tuple(str(Path(m.__file__).resolve().parent) for m in (pytest, _pytest))

ASSERTION = "assertion"
EXCEPTION = "exception"


def item_params(item) -> dict[str, str]:
    """A test's parametrisation as strings (what waivers' `params` patterns match)."""
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return {}
    out = {}
    for key, value in callspec.params.items():
        text = value if isinstance(value, str) else str(value)
        out[key] = text if len(text) <= 120 else text[:117] + "..."
    return out


def _frames(tb) -> list[str]:
    files = []
    while tb is not None:
        files.append(str(Path(tb.tb_frame.f_code.co_filename).resolve()))
        tb = tb.tb_next
    return files


def _in_clauses(path: str) -> bool:
    return path.startswith(str(CLAUSES_DIR))


def _in_pytest(path: str) -> bool:
    return path.startswith(_PYTEST_DIRS)


def failure_kind(exc: BaseException) -> str:
    """`assertion` when the clause's own check failed: an AssertionError or pytest.fail raised in
    the clause package (directly, or through pytest.fail/raises called from there); anything
    else (a TypeError in a mutant, a backend's own assert, an import error) is `exception`.
    An exception group (hypothesis found several failures) is an assertion if any member is."""
    if isinstance(exc, BaseExceptionGroup):
        kinds = {failure_kind(e) for e in exc.exceptions}
        return ASSERTION if ASSERTION in kinds else EXCEPTION
    if not isinstance(exc, (AssertionError, pytest.fail.Exception)):
        return EXCEPTION
    files = [f for f in _frames(exc.__traceback__) if not _in_pytest(f)]
    return ASSERTION if files and _in_clauses(files[-1]) else EXCEPTION


def failure_text(exc: BaseException) -> str:
    """"ExcType: message" (what a waiver's `match` is searched in)."""
    if isinstance(exc, BaseExceptionGroup):
        return " | ".join(failure_text(e) for e in exc.exceptions)
    return f"{type(exc).__name__}: {exc}"


def matched_text(exc: BaseException) -> str:
    """What a waiver's `match` is searched in: `failure_text` without the failure's
    `reproduction` (the text it ends with that says how to reproduce it, such as the store
    machine's runnable sequence). A reproduction repeats earlier steps, waived ones included
    with their messages, so a waiver matched there would take a new failure for an old one."""
    if isinstance(exc, BaseExceptionGroup):
        return " | ".join(matched_text(e) for e in exc.exceptions)
    text = failure_text(exc)
    tail = getattr(exc, "reproduction", None)
    return text[:-len(tail)] if isinstance(tail, str) and tail and text.endswith(tail) else text


# clause helpers that raise what their caller composed (`_check.fail_each`, `SoftChecks`, the
# store machine's `_fail`): the check is the caller's line, not theirs
_RAISING_HELPERS = frozenset({"fail_each", "done", "each", "_fail"})


def check_site(exc: BaseException, outer: tuple = ()) -> str:
    """Which check raised `exc`: `file:line` of the innermost frame of a clause test module
    (`test_*.py`) that is not a raising helper (an assertion's line, a call of a shared check
    of `_check.py`, or the clause's call into the backend that raised), with the exception's
    type. `outer`: the frames of the exception groups that carried `exc` (a soft check's
    failure holds only the frames below its `each` block). Failures of one site and type are
    one check failing on other values; a waiver that matches failures of two sites takes two
    checks."""
    site = "outside the clauses"
    for f in [*outer, *traceback.extract_tb(exc.__traceback__)]:
        path = Path(f.filename)
        if path.name.startswith("test_") and _in_clauses(str(path.resolve())) \
                and f.name not in _RAISING_HELPERS:
            site = f"{path.name}:{f.lineno}"
    return f"{site} {type(exc).__name__}"


def raised_where(exc: BaseException) -> str:
    """`file:line in function` of the innermost frame, for messages."""
    tb = traceback.extract_tb(exc.__traceback__)
    if not tb:
        return "unknown"
    f = tb[-1]
    return f"{Path(f.filename).name}:{f.lineno} in {f.name}"


# Where an adapter's own code lives (rlconform's package, and the module an out-of-tree backend
# was loaded from: `set_adapter_source`). A NotImplementedError raised there is a stub of a
# declared surface; one raised inside the system under test is that system's answer to the
# input (a result the clause judges, waivable like any failure).
_ADAPTER_FILES: set[str] = {str(RLCONFORM_DIR)}


def set_adapter_source(source: str) -> None:
    """Record the file of the backend's `module:attr` source as adapter code."""
    import importlib.util

    module = source.partition(":")[0]
    if not module or module.startswith("mutant"):
        return
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return
    if spec is not None and spec.origin:
        _ADAPTER_FILES.add(str(Path(spec.origin).resolve()))


def _raised_in_adapter(exc: BaseException) -> bool:
    files = _frames(exc.__traceback__)
    return bool(files) and files[-1].startswith(tuple(_ADAPTER_FILES))


def unimplemented(exc: BaseException) -> BaseException | None:
    """The NotImplementedError at the root of `exc` raised by adapter code, if any (a declared
    surface that is not implemented: a run error, not a clause result)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, NotImplementedError) and _raised_in_adapter(exc):
            return exc
        if isinstance(exc, BaseExceptionGroup):
            for e in exc.exceptions:
                found = unimplemented(e)
                if found is not None:
                    return found
        exc = exc.__cause__ or exc.__context__
    return None


# -- waivers per test ---------------------------------------------------------------------------
@dataclass
class CoveringWaivers:
    """The active waivers covering one test, and what they matched while it ran."""

    waivers: list[Waiver]
    matched: dict[int, int] = field(default_factory=dict)  # waiver index -> failures matched
    first_message: dict[int, str] = field(default_factory=dict)
    # waiver index -> each distinct failure text it matched -> how many times (the first
    # MAX_DISTINCT texts): the report lists them, so a waiver that took two causes shows it
    messages: dict[int, dict[str, int]] = field(default_factory=dict)
    # waiver index -> the check (check_site) of each failure it matched -> how many
    sites: dict[int, dict[str, int]] = field(default_factory=dict)
    kinds: set[str] = field(default_factory=set)

    def find(self, exc: BaseException) -> list[tuple[Waiver, BaseException]] | None:
        """The covering waiver of every failure in `exc` (each member of an exception group:
        hypothesis found several distinct failures), or None when any one is not waived."""
        if unimplemented(exc) is not None:
            return None  # never waivable: the run reports it as an error
        found = []
        for leaf, outer in _leaves_in(exc):
            text = matched_text(leaf)
            w = next((w for w in self.waivers if w.matches(text)), None)
            if w is None:
                return None
            found.append((w, leaf, check_site(leaf, outer)))
        return found

    def record(self, found: list[tuple[Waiver, BaseException, str]]) -> None:
        for w, exc, site in found:
            self.matched[w.index] = self.matched.get(w.index, 0) + 1
            self.first_message.setdefault(w.index, failure_text(exc)[:500])
            seen = self.messages.setdefault(w.index, {})
            text = failure_text(exc)[:KEPT]
            if text in seen or len(seen) < MAX_DISTINCT:
                seen[text] = seen.get(text, 0) + 1
            sites = self.sites.setdefault(w.index, {})
            sites[site] = sites.get(site, 0) + 1
            self.kinds.add(failure_kind(exc))

    @staticmethod
    def label(found: list[tuple[Waiver, BaseException, str]]) -> str:
        return ", ".join(dict.fromkeys(w.label for w, *_ in found))


def _leaves(exc: BaseException) -> list[BaseException]:
    return [leaf for leaf, _ in _leaves_in(exc)]


def _leaves_in(exc: BaseException, outer: tuple = ()) -> list[tuple[BaseException, tuple]]:
    """Each failure of `exc` (the members of exception groups, nested or not) with the frames
    of the groups above it, outermost first."""
    if isinstance(exc, BaseExceptionGroup):
        here = (*outer, *traceback.extract_tb(exc.__traceback__))
        return [leaf for e in exc.exceptions for leaf in _leaves_in(e, here)]
    return [(exc, outer)]


_STASH = pytest.StashKey[CoveringWaivers]()
_CURRENT: contextvars.ContextVar[CoveringWaivers | None] = contextvars.ContextVar(
    "rlconform_test_waivers", default=None)

# What a waived example may raise: any failure, never pytest's or hypothesis' control flow
# (a skip, an exit, hypothesis.assume)
_NOT_FAILURES: tuple[type[BaseException], ...] = (pytest.skip.Exception, pytest.exit.Exception)


def _is_failure(exc: BaseException) -> bool:
    from hypothesis.errors import UnsatisfiedAssumption

    if isinstance(exc, (*_NOT_FAILURES, UnsatisfiedAssumption)):
        return False
    return isinstance(exc, (Exception, pytest.fail.Exception))


def scope_item(item, waivers: list[Waiver], clause_ids: list[str]) -> list[Waiver]:
    """The active waivers that cover `item`; sets up example-level waiving for property tests."""
    params = item_params(item)
    item.user_properties.append((PARAMS_PROP, params))
    covering = [w for w in waivers if not w.expired and w.covers(clause_ids, item.name, params)]
    if covering:
        item.stash[_STASH] = CoveringWaivers(covering)
        _wrap_property_test(getattr(item, "obj", None))
    return covering


def _wrap_property_test(fn) -> None:
    """Let a covering waiver take a failing example of a hypothesis test (hypothesis calls
    `fn.hypothesis.inner_test` for every example and lets plugins replace it): the example
    counts as waived and the search continues. Installed once per function; a test without
    covering waivers runs the original unchanged."""
    handle = getattr(fn, "hypothesis", None)
    if handle is None or getattr(handle.inner_test, "_rlconform_waivable", False):
        return
    inner = handle.inner_test

    @functools.wraps(inner)
    def waivable(*args, **kwargs):
        ctx = _CURRENT.get()
        if ctx is None:
            return inner(*args, **kwargs)
        try:
            return inner(*args, **kwargs)
        except BaseException as exc:
            if not _is_failure(exc):
                raise
            found = ctx.find(exc)
            if found is None:
                raise
            ctx.record(found)
            return None

    waivable._rlconform_waivable = True
    handle.inner_test = waivable


def waive_step(failure: BaseException) -> bool:
    """Whether a covering waiver of the running test takes `failure`, one step of a stateful
    check (the store machine): then it is recorded like a waived example, and the check goes
    on past the known failure instead of ending at it."""
    ctx = _CURRENT.get()
    found = ctx.find(failure) if ctx is not None else None
    if found is None:
        return False
    ctx.record(found)
    return True


def waiver_inputs() -> list[tuple[str, str]]:
    """(label, input) of each covering waiver of the running test that names its input. A
    stateful check replays them before it explores: what a search reaches depends on the path
    it takes, so a known defect is confirmed (or found fixed) on its own input every run."""
    ctx = _CURRENT.get()
    return [(w.label, w.input) for w in ctx.waivers if w.input] if ctx is not None else []


@contextlib.contextmanager
def example_waivers(item) -> Iterator[None]:
    """Around a test's call: property-test examples see the test's covering waivers."""
    ctx = item.stash.get(_STASH, None)
    token = _CURRENT.set(ctx)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def verdict(item, call, rep) -> dict | None:
    """The test's verdict for one phase (setup/call/teardown) and the report's display.

    outcome: passed | failed | error | waived | xpass (only phases that decide it report one);
    kind: how the unwaived failure was raised (assertion / exception); waivers: what each
    covering waiver matched. A waived failure shows as xfailed in pytest's terminal, a covered
    test that passed although a waiver names it as XPASS."""
    ctx: CoveringWaivers | None = item.stash.get(_STASH, None)
    exc = call.excinfo.value if call.excinfo is not None else None
    out: dict = {}
    if exc is not None and _is_failure(exc):
        missing = unimplemented(exc)
        if missing is not None:
            out["unimplemented"] = f"{type(missing).__name__}: {missing} ({raised_where(missing)})"
        found = ctx.find(exc) if ctx is not None else None
        if found is not None:
            ctx.record(found)
            rep.outcome = "skipped"
            rep.wasxfail = f"waived by {ctx.label(found)}: {found[0][0].reason[:200]}"
        else:
            out["kind"] = failure_kind(exc)
            out["failure"] = failure_text(exc)[:2000]
            if isinstance(exc, BaseExceptionGroup):  # pytest draws it as boxes: say it in words
                leaves = _leaves(exc)
                out["group"] = len(leaves)
                out["failure"] = f"{len(leaves)} failures: " + " | ".join(
                    failure_text(e) for e in leaves)[:4000]
    if call.when != "call" and not out:
        return None
    if ctx is not None:
        out["waivers"] = {str(w.index): ctx.matched.get(w.index, 0) for w in ctx.waivers}
        out["waived_messages"] = {str(i): m for i, m in ctx.first_message.items()}
        out["waived_distinct"] = {str(i): dict(m) for i, m in ctx.messages.items()}
        out["waived_sites"] = {str(i): dict(m) for i, m in ctx.sites.items()}
        out["waived_kinds"] = sorted(ctx.kinds)
        if call.when == "call" and rep.passed:
            if ctx.matched:
                rep.outcome = "skipped"  # examples failed and were waived: the test is waived
                rep.wasxfail = "waived examples: " + ", ".join(
                    f"#{i} x{n}" for i, n in sorted(ctx.matched.items()))
            elif any(w.selects_tests for w in ctx.waivers):
                rep.wasxfail = "covered by " + ", ".join(
                    w.label for w in ctx.waivers if w.selects_tests) + " but passed"
    return out
