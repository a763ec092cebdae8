"""Cells: what a verdict counts, and what a run left out of it.

A cell is one collected parametrisation of a clause test, named by its plain test id
(`test_codec.py::test_roundtrip[llava_next]`): a clause x a model family x a regime or config
point x any other axis the test declares. A clause's cells *in scope* are the tests collection
produced for it for the backend's declared surfaces, before any filter; a report shows, per
clause, the cells judged of those in scope.

Every filter that removes a collected test goes through this module's record: `-k`, `-m`,
`--deselect` (pytest's own, attributed from the options), `--surfaces`, the model size's
family drop, `--placement`, `--shard` and a kill-matrix run's claimed clauses (each calls `drop`
with its reason). A hook wrapper around `pytest_collection_modifyitems` takes the collection
before any of them ran and compares it with what is left, so nothing leaves unnoticed (a test
removed by a plugin nobody told us about is "deselected by a plugin").

A run that drops a cell of an applicable clause is partial: the clause shows what it lost and
why, the report reads PARTIAL, and `rlconform run` exits non-zero unless `--partial-ok` says a
partial run is intended. A shard or a placement part is partial by design (its merge is what is
judged), so those drops alone do not change the exit status.

Under xdist the controller collects nothing: each worker writes the record to a file in a
folder the controller names through the environment (written once collection ends, so an
interrupted run still has it).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pytest

from rlconform.conformance.engine.items import clause_ids, plain_nodeid

LEDGER_ENV = "RLCONFORM_CELLS_LEDGER"
# cells named per clause in a report (every dropped cell is counted); the rest are counted
CELLS_LISTED = 40
# filters whose drops are partial by design: the merge of every shard and part is judged
BY_DESIGN = frozenset({"shard", "placement", "kill_matrix"})
# when a cell is dropped in several parts of one run, the reason a merge keeps: a user's filter
# before the split's own
_KIND_ORDER = ("deselect", "keyword", "mark", "surfaces", "model_size", "plugin", "kill_matrix",
               "placement", "shard")


class Ledger:
    """The cells collection produced (plain test id -> its clauses) and those a filter dropped
    (plain test id -> (kind, why))."""

    def __init__(self, scope: dict[str, list[str]], dropped: dict[str, tuple[str, str]]):
        self.scope = scope
        self.dropped = dropped

    def to_json(self) -> dict:
        return {"scope": self.scope, "dropped": {n: list(d) for n, d in self.dropped.items()}}

    @classmethod
    def from_json(cls, doc: dict) -> Ledger:
        return cls(dict(doc["scope"]), {n: (d[0], d[1]) for n, d in doc["dropped"].items()})

    def by_clause(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for nodeid, ids in self.scope.items():
            for cid in ids:
                out.setdefault(cid, []).append(nodeid)
        return out


_REASONS = pytest.StashKey[dict]()


def drop(config: pytest.Config, items: list, dropped: list, kind: str, why) -> None:
    """Deselect `dropped` from `items` (in place), recording why: `why` is a sentence, or a
    function of the item giving one."""
    if not dropped:
        return
    reasons = config.stash.setdefault(_REASONS, {})
    for item in dropped:
        reasons[plain_nodeid(item.nodeid)] = (kind, why(item) if callable(why) else why)
    config.hook.pytest_deselected(items=dropped)
    gone = {id(i) for i in dropped}
    items[:] = [i for i in items if id(i) not in gone]


def _pytest_reason(config: pytest.Config, item) -> tuple[str, str]:
    """Why pytest's own filters dropped `item`: `--deselect`, `-k`, `-m`."""
    for prefix in config.getoption("deselect", None) or ():
        if item.nodeid.startswith(prefix):
            return "deselect", f"--deselect {plain_nodeid(prefix)}"
    keyword = config.getoption("keyword", "") or ""
    mark = config.getoption("markexpr", "") or ""
    if keyword and mark:
        return "keyword", f"-k {keyword!r} / -m {mark!r}"
    if keyword:
        return "keyword", f"-k {keyword!r}"
    if mark:
        return "mark", f"-m {mark!r}"
    return "plugin", "deselected by a plugin (pytest_collection_modifyitems)"


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(session, config: pytest.Config, items):
    before = [i for i in items if clause_ids(i)]
    config.stash[_REASONS] = {}
    result = yield
    kept = {plain_nodeid(i.nodeid) for i in items}
    reasons = config.stash[_REASONS]
    scope, dropped = {}, {}
    for item in before:
        nodeid = plain_nodeid(item.nodeid)
        scope[nodeid] = clause_ids(item)
        if nodeid not in kept:
            dropped[nodeid] = reasons.get(nodeid) or _pytest_reason(config, item)
    ledger = Ledger(scope, dropped)
    from rlconform.conformance.engine.session import state

    state(config).cells = ledger
    folder = os.environ.get(LEDGER_ENV)
    if hasattr(config, "workerinput") and folder:
        _write(Path(folder) / f"{config.workerinput['workerid']}.json", ledger.to_json())
    return result


def _write(path: Path, doc: dict) -> None:
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_text(json.dumps(doc))
        tmp.replace(path)
    except OSError:
        pass  # the controller then says the cells were not recorded


def pytest_configure(config: pytest.Config) -> None:
    """On the controller of an xdist run: the folder the workers write the record to (through
    the environment they inherit, so before they start); a nested run gets its own."""
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        return
    import tempfile

    os.environ[LEDGER_ENV] = tempfile.mkdtemp(prefix="rlconform-cells-")
    config.stash[_FOLDER] = os.environ[LEDGER_ENV]


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = config.stash.get(_FOLDER, None)
    if folder is None:
        return
    import shutil

    shutil.rmtree(folder, ignore_errors=True)
    if os.environ.get(LEDGER_ENV) == folder:
        del os.environ[LEDGER_ENV]


_FOLDER = pytest.StashKey[str]()


def ledger_of(st) -> Ledger | None:
    """The run's record: this process's (a run in one process, a merge), else a worker's."""
    if getattr(st, "cells", None) is not None:
        return st.cells
    folder = os.environ.get(LEDGER_ENV)
    if not folder or not hasattr(st, "config") or _FOLDER not in st.config.stash:
        return None
    for path in sorted(Path(folder).glob("*.json")):
        try:
            return Ledger.from_json(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError):
            continue
    return None


# --- counting, for the report -------------------------------------------------------------------

def clause_cells(cid: str, na: str | None, tests: list[dict], ledger: Ledger,
                 cells_of: list[str], unreported: int) -> dict:
    """A clause's `cells` block: in scope, judged, skipped, not applicable (with why), dropped
    (counted by reason, the first CELLS_LISTED named) and unreported (an interrupted run)."""
    if na is not None:
        return {"in_scope": 0, "judged": 0, "skipped": 0, "dropped": 0, "unreported": 0,
                "not_applicable": max(len(cells_of), len(tests)),
                "not_applicable_why": {na: max(len(cells_of), len(tests))}}
    outcomes = Counter(t["outcome"] for t in tests)
    na_why = Counter(t.get("message") or "not applicable" for t in tests
                     if t["outcome"] == "not_applicable")
    lost = sorted(n for n in cells_of if n in ledger.dropped)
    judged = sum(n for o, n in outcomes.items() if o not in ("not_applicable", "skipped"))
    out = {"in_scope": judged + outcomes["skipped"] + len(lost) + unreported,
           "judged": judged, "skipped": outcomes["skipped"], "dropped": len(lost),
           "unreported": unreported, "not_applicable": outcomes["not_applicable"]}
    if na_why:
        out["not_applicable_why"] = dict(na_why)
    if lost:
        out["dropped_by"] = _by_reason(ledger.dropped[n] for n in lost)
        out["dropped_cells"] = [{"cell": n, "by": ledger.dropped[n][0],
                                 "why": ledger.dropped[n][1]} for n in lost[:CELLS_LISTED]]
    return out


def _by_reason(reasons) -> list[dict]:
    counts = Counter(reasons)
    return [{"by": kind, "why": why, "cells": n}
            for (kind, why), n in sorted(counts.items(), key=lambda x: (-x[1], x[0]))]


def clause_note(cells: dict) -> str:
    """'' or the clause message's note on its dropped cells: "cells: 12 of 14 judged; 2 dropped
    by -k 'not llava_next' (test_x[llava_next], ...)"."""
    if not cells.get("dropped"):
        return ""
    names = [c["cell"].rsplit("::", 1)[-1] for c in cells.get("dropped_cells") or ()]
    shown = ", ".join(names[:3]) + (", ..." if cells["dropped"] > 3 else "")
    why = "; ".join(f"{r['cells']} by {r['why']}" for r in cells.get("dropped_by") or ())
    return (f"cells: {cells['judged']} of {cells['in_scope']} judged; {cells['dropped']} "
            f"dropped ({why}: {shown})")


def run_cells(clauses: list[dict], deselected: dict[str, list[str]], ledger: Ledger,
              partial_ok: bool) -> dict:
    """The report's top-level `cells`: the clauses' counts summed, plus the cells of applicable
    clauses none of whose tests ran (`deselected`: clause -> its cells), and whether the run
    was partial (a cell of an applicable clause dropped) and told so."""
    keys = ("in_scope", "judged", "skipped", "dropped", "unreported", "not_applicable")
    total = {k: sum((c.get("cells") or {}).get(k, 0) for c in clauses) for k in keys}
    reasons: Counter = Counter()
    clauses_by: dict[tuple[str, str], set[str]] = {}
    by_clause = ledger.by_clause()
    for c in clauses:
        if not (c.get("cells") or {}).get("dropped"):
            continue
        for n in by_clause.get(c["id"], ()):
            if n in ledger.dropped:
                reasons[ledger.dropped[n]] += 1
                clauses_by.setdefault(ledger.dropped[n], set()).add(c["id"])
    for cid, cells_of in deselected.items():
        total["in_scope"] += len(cells_of)
        total["dropped"] += len(cells_of)
        for n in cells_of:
            why = ledger.dropped.get(n, ("plugin", "not collected for this run"))
            reasons[why] += 1
            clauses_by.setdefault(why, set()).add(cid)
    order = {c: i for i, c in enumerate(_clause_order())}
    dropped_by = [{"by": kind, "why": why, "cells": n,
                   "clauses": sorted(clauses_by[(kind, why)], key=lambda x: (order.get(x, 0), x))}
                  for (kind, why), n in sorted(reasons.items(), key=lambda x: (-x[1], x[0]))]
    unintended = sorted({r["by"] for r in dropped_by if r["by"] not in BY_DESIGN})
    return {**total, "dropped_by": dropped_by, "partial": bool(total["dropped"]),
            "partial_by": unintended, "partial_ok": partial_ok}


def _clause_order() -> list[str]:
    from rlconform.conformance import catalogue

    return [c.id for c in catalogue.CLAUSES]


def needs_consent(cells: dict | None) -> bool:
    """Whether a run's drops make it exit non-zero unless `--partial-ok`: a cell dropped by
    anything but the split of a run into shards and parts."""
    return bool(cells and cells.get("partial_by") and not cells.get("partial_ok"))


def merged(ledgers: list[tuple[Ledger, set[str]]]) -> Ledger:
    """One run's record from its parts' and shards' (each with the tests its part selected):
    a cell is dropped when no part selected it, for the reason a user's filter gave before
    the split's own."""
    scope: dict[str, list[str]] = {}
    selected: set[str] = set()
    reasons: dict[str, tuple[str, str]] = {}
    rank = {k: i for i, k in enumerate(_KIND_ORDER)}
    for ledger, chosen in ledgers:
        scope.update(ledger.scope)
        selected |= chosen
        for n, (kind, why) in ledger.dropped.items():
            old = reasons.get(n)
            if old is None or rank.get(kind, 0) < rank.get(old[0], 0):
                reasons[n] = (kind, why)
    return Ledger(scope, {n: r for n, r in reasons.items() if n not in selected})
