"""The release gate: one verdict per report, for CI to act on.

The gate fails (exit code 1) when
- a required clause failed or errored (a clause is required unless it says `"required": false`;
  IDs passed in `required` must moreover be in the report and pass or be waived);
- a waiver expired (by its `expired` flag, or because its date is before `today`: a waiver is a
  promise dated when it is written, and the gate keeps it even for an old report);
- a waiver no longer holds (`xpass`: a test it names passed, or it matched no failure): it is
  stale and would hide the next regression;
- a clause was skipped: the framework marks `skipped` only where the clause applied, so a
  declared capability went unchecked; or left `incomplete` (its tests did not all report);
- the run recorded `problems` (waivers naming no clause, ...);
- clauses were left out of the run (`deselected`, e.g. by `--surfaces` or `-k`), or cells of a
  clause (schema 2.1: a parametrisation dropped by `-k`, the model size, ...): a partial run
  cannot ship, `--partial-ok` or not; nor can one shard of a sharded run (`--shard K/N`): its
  merge is gated;
- against a baseline, a clause or test that passed there now fails or errors. A test whose
  failure a waiver matches now is excused: the waiver is the one reviewed, expiring way to
  accept a failure, and without this the first run after adding one could never go green;
- against a baseline, coverage shrank: a clause tested there is not tested now (a capability
  dropped, a surface left out, a clause deselected), unless the run names the drop as intended
  (`allow_coverage_drop`, `--allow-coverage-drop`, or `[coverage] allow_drop` in the backend's
  expectations file, recorded in the report with its reason); and, for a report that records
  its cells, a clause judged on fewer cells than in the baseline.

Exit codes: 0 the gate passed; 1 the gate failed; 2 usage error or an unreadable/invalid report
or baseline (a baseline for another backend included), so CI can tell "red" from "broken".
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._common import cells_line, first_line, headline, not_tested_lines, partial_clauses
from .model import ACCEPTED as _ACCEPTED
from .model import ReportValidationError, as_report
from .surfaces import lines as surface_lines

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
# clauses named in the gate's reason for a partial run (each with its first dropped cells)
CLAUSES_SHOWN = 8

@dataclass
class GateResult:
    ok: bool
    reasons: list[str] = field(default_factory=list)
    exit_code: int = EXIT_OK
    # what the report never tested (surfaces and capabilities the backend left out): shown on
    # a pass too, so a green gate does not read as "everything was checked"
    not_tested: list[str] = field(default_factory=list)
    # the report's headline (its honest score and what is waived): a green gate says how green
    summary: str = ""
    # failed only for being a partial run (clauses deselected, and the coverage that leaves out)
    partial_only: bool = False
    # the verdict on each surface the backend implements (reports/surfaces.py), one line each
    surfaces: list[str] = field(default_factory=list)

    @property
    def word(self) -> str:
        """The report's badge: PASS, PARTIAL (nothing failed, clauses were left out) or FAIL."""
        return "PASS" if self.ok else "PARTIAL" if self.partial_only else "FAIL"

    def render(self) -> str:
        if self.ok:
            head = "gate: PASS"
        else:
            head = "gate: FAIL" if self.exit_code == EXIT_FAILED else "gate: ERROR (usage)"
        lines = [head, *([f"  {self.summary}"] if self.summary else [])]
        if self.surfaces:
            lines.append("  surfaces judged (each scored on the clauses that touch it):")
            lines += [f"  · {n}" for n in self.surfaces]
        lines += [f"  - {r}" for r in self.reasons]
        if self.not_tested:
            lines.append("  not tested (not applicable to this backend):")
            lines += [f"  · {n}" for n in self.not_tested]
        return "\n".join(lines)


def _note(clause: Mapping[str, Any]) -> str:
    msg = first_line(clause.get("message"))
    return f": {msg}" if msg else ""


def waiver_expired(waiver: Mapping[str, Any] | None, today: _dt.date) -> bool:
    if not waiver:
        return False
    if waiver.get("expired"):
        return True
    try:
        return _dt.date.fromisoformat(waiver["expires"]) < today
    except (KeyError, ValueError):
        return True  # an unreadable expiry cannot be honoured: treat it as lapsed


def _passed_tests(report: Mapping[str, Any]) -> set[str]:
    return {t["nodeid"] for c in report["clauses"] for t in c["tests"] if t["outcome"] == "passed"}


def gate(
    report: Mapping[str, Any] | str | Path,
    baseline: Mapping[str, Any] | str | Path | None = None,
    required: Iterable[str] | None = None,
    *,
    today: _dt.date | None = None,
    allow_coverage_drop: Iterable[str] = (),
) -> GateResult:
    """Judge `report` (a dict or a path), optionally against `baseline`; never raises on bad
    input. `allow_coverage_drop`: clause IDs (or "all") that may be untested now although the
    baseline tested them."""
    try:
        report = as_report(report)
    except ReportValidationError as exc:
        return GateResult(False, [f"report: {exc}"], EXIT_USAGE)
    if baseline is not None:
        try:
            baseline = as_report(baseline)
        except ReportValidationError as exc:
            return GateResult(False, [f"baseline: {exc}"], EXIT_USAGE)
        if baseline["backend"] != report["backend"]:
            return GateResult(
                False,
                [
                    f"baseline is for backend {baseline['backend']!r}, "
                    f"the report for {report['backend']!r}"
                ],
                EXIT_USAGE,
            )
    today = today or _dt.date.today()
    reasons: list[str] = []
    partial: set[str] = set()  # the reasons that say only that the run left clauses out
    clauses = report["clauses"]
    by_id = {c["id"]: c for c in clauses}
    extra_required = list(dict.fromkeys(required or ()))

    for c in clauses:
        if c["status"] in ("failed", "error") and (
            c.get("required", True) or c["id"] in extra_required
        ):
            reasons.append(f"required clause {c['id']} {c['status']}{_note(c)}")
    for cid in extra_required:
        c = by_id.get(cid)
        if c is None:
            reasons.append(f"required clause {cid} is not in the report")
        elif c["status"] not in _ACCEPTED and c["status"] not in ("failed", "error"):
            reasons.append(f"required clause {cid} did not pass (status {c['status']}){_note(c)}")
    for c in clauses:
        for w in c.get("waivers") or ():
            if waiver_expired(w, today):
                reasons.append(
                    f"waiver #{w.get('index')} of {c['id']} expired on {w.get('expires')} "
                    f"({w.get('category')}: {first_line(w.get('reason'))})"
                )
    for c in clauses:
        if c["status"] == "xpass":
            reasons.append(f"clause {c['id']}: a waiver no longer holds (xpass){_note(c)}")
    for c in clauses:
        if c["status"] == "skipped":
            reasons.append(f"clause {c['id']} applies but was skipped{_note(c)}")
        elif c["status"] == "incomplete":
            reasons.append(f"clause {c['id']} was not fully run (incomplete){_note(c)}")
    for problem in report.get("problems") or ():
        reasons.append(f"problem: {problem}")
    if report.get("deselected"):
        ids = report["deselected"]
        more = f" and {len(ids) - CLAUSES_SHOWN} more (the report lists them)" \
            if len(ids) > CLAUSES_SHOWN else ""
        reason = (f"partial run: {len(ids)} applicable clause(s) not run: "
                  f"{', '.join(ids[:CLAUSES_SHOWN])}{more}")
        reasons.append(reason)
        partial.add(reason)
    dropped_in = partial_clauses(report)
    if dropped_in:
        shown = "; ".join(
            f"{cid} {judged} ({', '.join(names)}{f', and {more} more' if more else ''})"
            for cid, judged, names, more in dropped_in[:CLAUSES_SHOWN])
        if len(dropped_in) > CLAUSES_SHOWN:
            shown += f"; and {len(dropped_in) - CLAUSES_SHOWN} more clauses"
        reason = (f"partial run: {len(dropped_in)} clauses judged on fewer cells than in scope "
                  f"({cells_line(report)}): {shown}")
        reasons.append(reason)
        partial.add(reason)
    shard = (report.get("provenance") or {}).get("shard")
    if shard:
        reason = (f"partial run: the report of shard {shard['k']}/{shard['n']} of a sharded run; "
                  "join every shard's report with `rlconform merge` and gate the merged report")
        reasons.append(reason)
        partial.add(reason)
    reasons += kill_matrix_reasons(report.get("kill_matrix"))

    if baseline is not None:
        for reason, deselected in (_coverage_drops(report, baseline, allow_coverage_drop)
                                   + _cells_lost(report, baseline, allow_coverage_drop)):
            reasons.append(reason)
            if deselected:
                partial.add(reason)
        old_status = {c["id"]: c["status"] for c in baseline["clauses"]}
        regressed = set()
        for c in clauses:
            if old_status.get(c["id"]) in ("passed", "passed_with_waivers") and \
                    c["status"] in ("failed", "error"):
                regressed.add(c["id"])
                reasons.append(
                    f"regression: clause {c['id']} passed in the baseline, now {c['status']}"
                    f"{_note(c)}"
                )
        old_passed = _passed_tests(baseline)
        seen: set[str] = set()
        for c in clauses:
            if c["id"] in regressed:
                continue  # already told at clause level
            for t in c["tests"]:
                nodeid = t["nodeid"]
                if (
                    nodeid in old_passed
                    and t["outcome"] in ("failed", "error")
                    and (nodeid not in seen)
                ):
                    seen.add(nodeid)
                    msg = first_line(t.get("message"))
                    reasons.append(
                        f"regression: test {nodeid} passed in the baseline, now {t['outcome']}"
                        + (f": {msg}" if msg else "")
                    )

    untested = not_tested_lines(report)
    surfaces = surface_lines(report)
    if reasons:
        return GateResult(False, reasons, EXIT_FAILED, untested, headline(report),
                          partial_only=set(reasons) <= partial, surfaces=surfaces)
    return GateResult(True, [], EXIT_OK, untested, headline(report), surfaces=surfaces)


def tested(report: Mapping[str, Any]) -> set[str]:
    """Clauses this report judged (any status but not_applicable)."""
    return {c["id"] for c in report["clauses"] if c["status"] != "not_applicable"}


def _coverage_drops(report: Mapping[str, Any], baseline: Mapping[str, Any],
                    allowed: Iterable[str]) -> list[tuple[str, bool]]:
    """One reason per clause the baseline tested and this report does not, unless allowed, with
    whether the clause was only deselected from this run."""
    allowed = set(allowed)
    declared = {d["clause"]: d["reason"] for d in report.get("coverage_drops_allowed") or ()}
    by_id = {c["id"]: c for c in report["clauses"]}
    lost = sorted(tested(baseline) - tested(report))
    reasons = []
    for cid in lost:
        if "all" in allowed or cid in allowed or cid in declared:
            continue
        c = by_id.get(cid)
        deselected = cid in (report.get("deselected") or ())
        why = ("deselected from this run" if deselected
               else f"not applicable now: {first_line(c.get('message'))}" if c
               else "absent from this report")
        reasons.append((
            f"coverage lost: {cid} was tested in the baseline and is not now ({why}); if this "
            "is intended, pass --allow-coverage-drop " + cid + " or add it to the backend's "
            "expectations file ([coverage] allow_drop, with a reason)", deselected))
    return reasons


def judged_cells(clause: Mapping[str, Any]) -> set[str]:
    """The test ids a clause judged (ran, and reported a verdict): any report, cells recorded
    or not."""
    return {t["nodeid"] for t in clause["tests"]
            if t["outcome"] not in ("not_applicable", "skipped")}


def _cells_lost(report: Mapping[str, Any], baseline: Mapping[str, Any],
                allowed: Iterable[str]) -> list[tuple[str, bool]]:
    """One reason per clause tested in both reports that judged cells in the baseline it does
    not judge now (dropped by a filter, not applicable now, did not report), unless allowed,
    with whether filters' drops explain it (a partial run). Only a report that recorded its
    cells is judged so: a cell of an older report may have been renamed since."""
    if not report.get("cells"):
        return []
    allowed = set(allowed)
    declared = {d["clause"] for d in report.get("coverage_drops_allowed") or ()}
    old = {c["id"]: c for c in baseline["clauses"] if c["status"] != "not_applicable"}
    out = []
    for c in report["clauses"]:
        if c["id"] not in old or c["status"] == "not_applicable" or "all" in allowed \
                or c["id"] in allowed or c["id"] in declared:
            continue
        before, now = judged_cells(old[c["id"]]), judged_cells(c)
        if len(now) >= len(before):
            continue
        lost = sorted(before - now)
        names = ", ".join(n.rsplit("::", 1)[-1] for n in lost[:3]) + \
            (f", and {len(lost) - 3} more" if len(lost) > 3 else "")
        dropped = bool((c.get("cells") or {}).get("dropped"))
        out.append((f"coverage lost: {c['id']} judged {len(before)} cells in the baseline and "
                    f"{len(now)} now ({names}); if this is intended, pass --allow-coverage-drop "
                    f"{c['id']} or add it to the backend's expectations file ([coverage] "
                    "allow_drop, with a reason)", dropped))
    return out


def kill_matrix_reasons(km: Mapping[str, Any] | None) -> list[str]:
    """A report that carries a kill matrix (the reference's) fails the gate when a mutant
    survived its claimed clauses, a claim did not kill, or a mutant's run gave no verdict: the
    clauses were not shown able to fail in this regime. (`kill_matrix.failures`, which decides
    `rlconform mutants`' exit status, adds the matrix's own completeness rules to these.)"""
    if not km:
        return []
    regime = km.get("regime") or {}
    where = " in the kill matrix" + (f" ({regime.get('device')}, {regime.get('dtype')}, "
                                     f"{regime.get('model_size')})" if regime else "")
    out, told = [], set()
    for m in km.get("mutants") or ():
        if m.get("killed"):
            continue
        told.add(m["name"])
        if m.get("error"):
            out.append(f"mutant {m['name']}'s run gave no verdict{where}: {first_line(m['error'])}")
        else:
            out.append(f"mutant {m['name']} survived{where}: no clause assertion failed in "
                       f"{', '.join(m.get('expected') or ()) or 'its clauses'}")
    for c in km.get("claims_not_killed") or ():
        if c["mutant"] not in told:
            out.append(f"{c['clause']} claims to kill {c['mutant']} but did not{where}")
    return out
