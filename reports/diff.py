"""What changed between two reports of one backend: statuses, waivers, tests, metrics and
run-level problems (an interrupted run, a waiver naming no clause, ...).

`diff` is descriptive (the gate decides); it puts every change in exactly one clause category so
that nothing a reader should see is folded away. Metrics are compared only where a tolerance is
named in `METRIC_TOLERANCES`: an unnamed metric has no agreed meaning of "worse".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._common import family_cell, first_line
from .model import FAILING, as_report

NOT_TESTED = ("not_applicable", None)

# probs_ratio = exp(logp_train - logp_prev). Where the suite asserts it (one inner step, same
# weights, same micro-batch and code path) it is exactly 1.0, so the baseline deviation is
# normally 0. 1e-6 is about 8 float32 ulps at 1.0 (ulp = 2**-23 = 1.19e-7): more than that is a
# changed computation, not round-off.
PROBS_RATIO_DEVIATION = 1e-6
# token_mult_prob_error: mean over tokens of exp(|logp_gen - logp_train|), 1.0 when rollout and
# trainer agree. Run-to-run kernel noise on one build moves the mean in the 4th decimal; a rise
# of 0.01 (a percent of per-token probability) is a real generation/training mismatch.
TOKEN_MULT_PROB_ERROR_MEAN_INCREASE = 0.01
# Same metric, worst token: tails move more between runs than the mean, so allow ten times more.
TOKEN_MULT_PROB_ERROR_MAX_INCREASE = 0.1


@dataclass(frozen=True)
class Tolerance:
    """`stat` of a metric may grow by at most `limit`; with `target`, its distance from it may.

    For a series the statistic is taken at its worst step; for a scalar, `stat` is "value".
    """

    stat: str
    limit: float
    target: float | None = None

    def measure(self, entry: Mapping[str, Any]) -> float | None:
        value = entry.get(self.stat)
        if value is None:
            value = (entry.get("quantiles") or {}).get(self.stat)
        if value is None:
            return None
        return abs(value - self.target) if self.target is not None else float(value)

    def describe(self) -> str:
        return f"|{self.stat} - {self.target:g}|" if self.target is not None else self.stat


METRIC_TOLERANCES: dict[str, tuple[Tolerance, ...]] = {
    "probs_ratio": (
        Tolerance("max", PROBS_RATIO_DEVIATION, target=1.0),
        Tolerance("min", PROBS_RATIO_DEVIATION, target=1.0),
    ),
    "token_mult_prob_error": (
        Tolerance("mean", TOKEN_MULT_PROB_ERROR_MEAN_INCREASE),
        Tolerance("max", TOKEN_MULT_PROB_ERROR_MAX_INCREASE),
    ),
}


@dataclass(frozen=True)
class ClauseChange:
    id: str
    old: str | None  # status in the old report; None when the clause is new
    new: str | None  # status in the new report; None when the clause is gone
    message: str = ""
    cells: str = ""  # cells judged before -> after, e.g. "14 -> 12 of 14"


@dataclass(frozen=True)
class TestChange:
    nodeid: str
    clauses: tuple[str, ...]
    old: str | None  # outcome; None when the test is new
    new: str | None
    message: str = ""

    @property
    def kind(self) -> str:
        if self.old is None:
            return "added"
        if self.new is None:
            return "removed"
        if self.old == "not_applicable":
            return "coverage gained"  # newly tested, not newly fixed
        if self.new == "not_applicable":
            return "coverage lost"
        if self.old in ("passed", "waived") and self.new in ("failed", "error"):
            return "regressed"
        if self.new == "passed":
            return "fixed"
        return "changed"


@dataclass(frozen=True)
class MetricRegression:
    clause: str
    metric: str
    measure: str  # what was compared, e.g. "|max - 1|"
    old: float
    new: float
    limit: float


@dataclass(frozen=True)
class FamilyChange:
    """One clause on one model family: tests passed / run before and after."""

    clause: str
    family: str
    old: str  # family_cell text, "" when the family was not tested
    new: str
    kind: str  # "fixed" | "broke" | "changed"


@dataclass
class DiffResult:
    backend: str
    old_commit: str | None = None
    new_commit: str | None = None
    old_score: float | None = None
    new_score: float | None = None
    newly_failing: list[ClauseChange] = field(default_factory=list)
    newly_passing: list[ClauseChange] = field(default_factory=list)
    newly_waived: list[ClauseChange] = field(default_factory=list)
    # waived -> passed_with_waivers: some of its tests pass now (a fix the waiver no longer hides)
    less_waived: list[ClauseChange] = field(default_factory=list)
    waivers_expired: list[ClauseChange] = field(default_factory=list)
    clauses_added: list[ClauseChange] = field(default_factory=list)
    clauses_removed: list[ClauseChange] = field(default_factory=list)
    other_status_changes: list[ClauseChange] = field(default_factory=list)
    coverage_gained: list[ClauseChange] = field(default_factory=list)
    coverage_lost: list[ClauseChange] = field(default_factory=list)
    # judged on fewer cells than before (a filter dropped some, or they no longer apply): a pass
    # here is not a fix
    cells_lost: list[ClauseChange] = field(default_factory=list)
    # cells judged in the whole run, before and after ("257 of 257", "cells not recorded")
    old_cells: str = ""
    new_cells: str = ""
    family_changes: list[FamilyChange] = field(default_factory=list)
    test_changes: list[TestChange] = field(default_factory=list)
    metric_regressions: list[MetricRegression] = field(default_factory=list)
    problems_new: list[str] = field(default_factory=list)  # run-level, absent from the old run
    problems_gone: list[str] = field(default_factory=list)

    @property
    def regressed(self) -> bool:
        """Anything a release engineer must look at before shipping."""
        return bool(
            self.newly_failing
            or self.coverage_lost
            or self.cells_lost
            or self.waivers_expired
            or self.metric_regressions
            or self.problems_new
            or any(t.kind == "regressed" for t in self.test_changes)
        )

    @property
    def unchanged(self) -> bool:
        return not any(
            (
                self.newly_failing,
                self.newly_passing,
                self.newly_waived,
                self.less_waived,
                self.waivers_expired,
                self.clauses_added,
                self.clauses_removed,
                self.other_status_changes,
                self.coverage_gained,
                self.coverage_lost,
                self.cells_lost,
                self.family_changes,
                self.test_changes,
                self.metric_regressions,
                self.problems_new,
                self.problems_gone,
            )
        )


def _tests(report: Mapping[str, Any], skip: set[str]) -> dict[str, tuple[str, tuple, str]]:
    out: dict[str, tuple[str, tuple, str]] = {}
    for c in report["clauses"]:
        if c["id"] in skip:
            continue
        for t in c["tests"]:
            prev = out.get(t["nodeid"])
            clauses = (*prev[1], c["id"]) if prev else (c["id"],)
            out[t["nodeid"]] = (t["outcome"], clauses, t.get("message") or "")
    return out


def _worst(metric: Mapping[str, Any], tol: Tolerance) -> float | None:
    entries = metric["values"] if metric["kind"] == "series" else [metric]
    measured = [m for m in (tol.measure(e) for e in entries) if m is not None]
    return max(measured) if measured else None


def diff_reports(
    old: Mapping[str, Any] | str | Path,
    new: Mapping[str, Any] | str | Path,
    tolerances: Mapping[str, Sequence[Tolerance]] | None = None,
) -> DiffResult:
    """Compare two reports (dicts or paths); `tolerances` replaces METRIC_TOLERANCES."""
    old, new = as_report(old), as_report(new)
    tolerances = METRIC_TOLERANCES if tolerances is None else tolerances
    backend = new["backend"]
    if old["backend"] != backend:  # allowed: comparing a candidate with the reference is useful
        backend = f"{old['backend']} -> {backend}"
    result = DiffResult(
        backend=backend,
        old_commit=old["provenance"].get("git_commit"),
        new_commit=new["provenance"].get("git_commit"),
        old_score=old["summary"]["score"],
        new_score=new["summary"]["score"],
        old_cells=_run_cells(old),
        new_cells=_run_cells(new),
    )
    old_by = {c["id"]: c for c in old["clauses"]}
    new_by = {c["id"]: c for c in new["clauses"]}
    for cid, c in new_by.items():
        o = old_by.get(cid)
        if o is None:
            result.clauses_added.append(ClauseChange(cid, None, c["status"], c["message"]))
            continue
        before, after = _judged(o), _judged(c)
        shrank = not before <= after  # a cell judged before is not judged now
        cells = "" if before == after else f"{len(before)} -> {len(after)}" + (
            f" of {c['cells']['in_scope']}" if c.get("cells") else "")
        change = ClauseChange(cid, o["status"], c["status"], c["message"], cells)
        if o["status"] == "not_applicable" and c["status"] != "not_applicable":
            result.coverage_gained.append(change)
        elif c["status"] == "not_applicable" and o["status"] != "not_applicable":
            result.coverage_lost.append(change)
        elif shrank and c["status"] not in FAILING:
            # judged on fewer cells: whatever its status, not newly passing nor a fix
            result.cells_lost.append(change)
        elif c["status"] in FAILING and o["status"] not in FAILING:
            result.newly_failing.append(change)
        elif c["status"] == "passed" and o["status"] != "passed":
            result.newly_passing.append(change)
        elif o["status"] == "waived" and c["status"] == "passed_with_waivers":
            result.less_waived.append(change)
        elif c["status"] in ("waived", "passed_with_waivers") and o["status"] != c["status"]:
            result.newly_waived.append(change)
        elif c["status"] != o["status"]:
            result.other_status_changes.append(change)
        was_expired = {w["index"] for w in o.get("waivers") or () if w.get("expired")}
        for w in c.get("waivers") or ():
            if w.get("expired") and w["index"] not in was_expired:
                result.waivers_expired.append(ClauseChange(
                    cid, o["status"], c["status"],
                    f"waiver #{w['index']} expired {w['expires']}: {w['reason']}"))
        result.family_changes += _family_changes(cid, o, c)
        for name, metric in (c.get("metrics") or {}).items():
            old_metric = (o.get("metrics") or {}).get(name)
            if old_metric is None or old_metric["kind"] != metric["kind"]:
                continue
            for tol in tolerances.get(name, ()):
                before, after = _worst(old_metric, tol), _worst(metric, tol)
                if before is not None and after is not None and after - before > tol.limit:
                    result.metric_regressions.append(
                        MetricRegression(cid, name, tol.describe(), before, after, tol.limit)
                    )
    for cid, o in old_by.items():
        if cid not in new_by:
            if o["status"] != "not_applicable" and cid in (new.get("deselected") or ()):
                result.coverage_lost.append(ClauseChange(cid, o["status"], "deselected", ""))
            else:
                result.clauses_removed.append(ClauseChange(cid, o["status"], None, ""))

    # Tests of added/removed clauses are already told by the clause entry.
    only = {c.id for c in result.clauses_added} | {c.id for c in result.clauses_removed}
    old_tests, new_tests = _tests(old, only), _tests(new, only)
    for nodeid in sorted(old_tests.keys() | new_tests.keys()):
        before, after = old_tests.get(nodeid), new_tests.get(nodeid)
        if before and after and before[0] == after[0]:
            continue
        clauses = (after or before)[1]
        result.test_changes.append(
            TestChange(
                nodeid,
                clauses,
                before[0] if before else None,
                after[0] if after else None,
                after[2] if after else "",
            )
        )
    old_problems, new_problems = old.get("problems") or [], new.get("problems") or []
    result.problems_new = [p for p in new_problems if p not in old_problems]
    result.problems_gone = [p for p in old_problems if p not in new_problems]
    return result


def _judged(clause: Mapping[str, Any]) -> set[str]:
    """The cells (test ids) a clause judged: its tests that reported a verdict, in any report."""
    return {t["nodeid"] for t in clause["tests"]
            if t["outcome"] not in ("not_applicable", "skipped")}


def _run_cells(report: Mapping[str, Any]) -> str:
    cells = report.get("cells")
    if not cells:
        return "not recorded"
    return f"{cells['judged']} of {cells['in_scope']}" + \
        (f" ({cells['dropped']} dropped)" if cells.get("dropped") else "")


def _family_changes(cid: str, old: Mapping[str, Any], new: Mapping[str, Any]
                    ) -> list[FamilyChange]:
    """Per family, what a newer run fixed (more tests pass without a waiver) or broke (fewer)."""
    out = []
    before, after = old.get("by_family") or {}, new.get("by_family") or {}
    for family in sorted(before.keys() | after.keys()):
        b, a = before.get(family) or {}, after.get(family) or {}
        if b == a:
            continue
        gained = a.get("passed", 0) - b.get("passed", 0)
        bad_a = sum(a.get(k, 0) for k in ("failed", "error", "xpass", "waived"))
        bad_b = sum(b.get(k, 0) for k in ("failed", "error", "xpass", "waived"))
        kind = "fixed" if gained > 0 and bad_a <= bad_b else \
            "broke" if gained < 0 or bad_a > bad_b else "changed"
        out.append(FamilyChange(cid, family, family_cell(b) if b else "",
                                family_cell(a) if a else "", kind))
    return out


def _fmt_score(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def render_diff(result: DiffResult) -> str:
    """Plain text for a terminal or a CI log, regressions first."""
    old_c, new_c = (c[:12] if c else "?" for c in (result.old_commit, result.new_commit))
    commits = ""
    if result.old_commit or result.new_commit:
        commits = f" (commit {new_c})" if old_c == new_c else f" ({old_c} -> {new_c})"
    lines = [
        f"rlconform diff: {result.backend}{commits}",
        f"score {_fmt_score(result.old_score)} -> {_fmt_score(result.new_score)}",
        f"cells judged (of those in scope) {result.old_cells} -> {result.new_cells}",
    ]
    if result.unchanged:
        lines.append("no changes")
        return "\n".join(lines) + "\n"

    def clause_block(title: str, changes: list[ClauseChange]) -> None:
        if not changes:
            return
        lines.append(f"{title} ({len(changes)}):")
        for ch in changes:
            arrow = f"{ch.old or '-'} -> {ch.new or '-'}"
            note = first_line(ch.message)
            cells = f"  cells judged {ch.cells}" if ch.cells else ""
            lines.append(f"  {ch.id}  {arrow}{cells}" + (f"  {note}" if note else ""))

    if result.problems_new:
        lines.append(f"new run problems ({len(result.problems_new)}):")
        lines.extend(f"  {first_line(p)}" for p in result.problems_new)
    clause_block("newly failing", result.newly_failing)
    clause_block("coverage lost (tested before, not now)", result.coverage_lost)
    clause_block("judged on fewer cells than before (a pass here is not a fix)",
                 result.cells_lost)
    clause_block("waivers expired", result.waivers_expired)
    if result.metric_regressions:
        lines.append(f"metric regressions ({len(result.metric_regressions)}):")
        for m in result.metric_regressions:
            lines.append(
                f"  {m.clause} {m.metric}: {m.measure} {m.old:.6g} -> {m.new:.6g} "
                f"(+{m.new - m.old:.3g}, tolerance {m.limit:g})"
            )
    by_kind: dict[str, list[TestChange]] = {}
    for t in result.test_changes:
        by_kind.setdefault(t.kind, []).append(t)
    for kind in ("fixed", "broke", "changed"):
        fams = [f for f in result.family_changes if f.kind == kind]
        if fams:
            lines.append(f"per family, {kind} ({len(fams)}; tests passed/run, w waived, "
                         "F failed):")
            for f in fams:
                lines.append(f"  {f.clause} [{f.family}]  {f.old or '-'} -> {f.new or '-'}")
    for kind in ("regressed", "fixed", "changed", "coverage gained", "coverage lost", "added",
                 "removed"):
        tests = by_kind.get(kind)
        if not tests:
            continue
        lines.append(f"tests {kind} ({len(tests)}):")
        for t in tests:
            note = first_line(t.message) if t.new in ("failed", "error") else ""
            lines.append(
                f"  {t.nodeid} [{', '.join(t.clauses)}]  {t.old or '-'} -> {t.new or '-'}"
                + (f"  {note}" if note else "")
            )
    clause_block("newly passing", result.newly_passing)
    clause_block("newly waived", result.newly_waived)
    clause_block("passing some tests now (were waived)", result.less_waived)
    clause_block("coverage gained (newly tested)", result.coverage_gained)
    clause_block("other status changes", result.other_status_changes)
    clause_block("clauses added", result.clauses_added)
    clause_block("clauses removed", result.clauses_removed)
    if result.problems_gone:
        lines.append(f"run problems gone ({len(result.problems_gone)}):")
        lines.extend(f"  {first_line(p)}" for p in result.problems_gone)
    return "\n".join(lines) + "\n"
