"""Outcomes: each test's verdict (the waivers it matched, how it failed) and hypothesis' notes
are put on its reports in the process that ran it; on the controller each report is folded into
the run's results (`logreport`), a test's outcome only ever moving towards the worse."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import pytest

from rlconform.conformance.engine import verdicts
from rlconform.conformance.engine.items import (
    CLAUSE_PROP,
    GPU_PEAK_PROP,
    HYPOTHESIS_PROP,
    METRIC_PROP,
    NA_PREFIX,
    plain_nodeid,
    tied_clauses,
)

if TYPE_CHECKING:
    from rlconform.conformance.engine.session import RlconformState


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """Property tests' examples see the waivers covering their test (verdicts.py)."""
    with verdicts.example_waivers(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Keep hypothesis' notes (the shrunk example and the replay blob) and the test's verdict
    (waivers matched, how it failed) on the report."""
    outcome = yield
    rep = outcome.get_result()
    exc = call.excinfo.value if call.excinfo is not None else None
    notes = getattr(exc, "__notes__", None)
    if notes:
        rep.user_properties.append((HYPOTHESIS_PROP, [str(n) for n in notes]))
    if tied_clauses(item) is not None:
        v = verdicts.verdict(item, call, rep)
        if v is not None:
            rep.user_properties.append((verdicts.VERDICT_PROP, v))


_BLOB = re.compile(r"@reproduce_failure\('([^']+)', b'([^']+)'\)")


# a test's outcome only moves towards the worse: a failed call stays failed whatever its
# teardown does; a waived setup error is not turned into a pass by a later phase
_OUTCOME_RANK = {"passed": 0, "xpass": 1, "waived": 2, "skipped": 3, "failed": 4, "error": 5}


def logreport(st: RlconformState, report: pytest.TestReport) -> None:
    props = dict(report.user_properties)
    nodeid = plain_nodeid(report.nodeid)
    clauses = props.get(CLAUSE_PROP)
    if clauses is None:
        # xdist reports a test whose worker died (when "???") without the item's properties
        worker = getattr(getattr(report, "node", None), "gateway", None)
        if worker is not None and worker.id in st.interrupted_workers:
            return  # interrupted, not crashed: the test did not report
        known = st.results.get(nodeid) or {}
        clauses = known.get("clauses") or (st.selected or {}).get(nodeid)
        if not clauses:
            return
    if report.when in ("call", "teardown") or not report.passed:
        st.reported.add(nodeid)
    r = st.results.setdefault(nodeid, {
        "nodeid": nodeid, "outcome": "passed", "duration_s": 0.0, "message": "",
        "clauses": clauses, "params": props.get(verdicts.PARAMS_PROP) or {}, "metrics": [],
        "hypothesis": None, "kind": None, "waivers": {}, "waived_messages": {},
        "waived_distinct": {}, "waived_sites": {},
        "unimplemented": None,
    })
    r["duration_s"] += report.duration
    if report.when == "call":
        r["metrics"] = [v for k, v in report.user_properties if k == METRIC_PROP]
    if props.get(GPU_PEAK_PROP) is not None:
        r["gpu_peak_gib"] = props[GPU_PEAK_PROP]
    v = props.get(verdicts.VERDICT_PROP) or {}
    for index, n in (v.get("waivers") or {}).items():
        r["waivers"][index] = max(n, r["waivers"].get(index, 0))
    for index, msg in (v.get("waived_messages") or {}).items():
        r["waived_messages"].setdefault(index, msg)
    for key in ("waived_distinct", "waived_sites"):
        for index, texts in (v.get(key) or {}).items():
            seen = r[key].setdefault(index, {})
            for text, n in texts.items():  # each phase reports the test's running counts
                seen[text] = max(n, seen.get(text, 0))
    if v.get("unimplemented"):
        r["unimplemented"] = v["unimplemented"]
    wasxfail = getattr(report, "wasxfail", None)
    outcome = None
    if report.skipped and wasxfail is None:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        outcome = "not_applicable" if reason.startswith(NA_PREFIX) else "skipped"
        r["message"] = reason.removeprefix(NA_PREFIX)
    elif report.skipped:  # a failure (or failing examples) that covering waivers matched
        outcome = "waived"
        r["message"] = next(iter(r["waived_messages"].values()), wasxfail)
    elif report.passed and wasxfail is not None:
        outcome = "xpass"
        r["message"] = f"{wasxfail}: remove or narrow the waiver"
    elif report.failed:
        text = report.longreprtext or str(report.longrepr)
        outcome = "error" if report.when != "call" else "failed"
        # an exception group (several failures of one test) in words, each member named
        r["message"] = v["failure"] if v.get("group") else _first_error_line(text)
        r["kind"] = v.get("kind")
        notes = dict(report.user_properties).get(HYPOTHESIS_PROP) or []
        examples = [n.strip() for n in notes if not _BLOB.search(n)]
        blob = _BLOB.search("\n".join(notes)) or _BLOB.search(text)
        if blob or examples:
            r["hypothesis"] = {
                "example": "\n".join(examples)[:4000],
                "blob": f"{blob.group(1)}:{blob.group(2)}" if blob else "",
            }
    if outcome in ("not_applicable",) or (
            outcome is not None and _OUTCOME_RANK[outcome] >= _OUTCOME_RANK.get(r["outcome"], 0)):
        r["outcome"] = outcome


def _first_error_line(text: str) -> str:
    lines = [ln[2:].strip() for ln in text.splitlines() if ln.startswith("E ")]
    # an exception group (hypothesis found several failures) draws boxes: keep the words
    lines = [ln.lstrip("|").strip() for ln in lines]
    lines = [ln for ln in lines if ln and not ln.startswith("+-")]
    msg = " ".join(lines) if lines else text.strip().splitlines()[-1] if text.strip() else ""
    return msg[:2000]
