"""Turn a finished run (the plugin's state) into the report dict of reports/schema.json."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

from rlconform.conformance import catalogue
from rlconform.conformance.engine.provenance import provenance
from rlconform.conformance.engine.verdicts import KEPT  # the kept length of a waived text
from rlconform.reports.model import SCHEMA_VERSION


def clause_status(tests: list[dict], waivers: list[dict] | None = None,
                  partial: bool = False) -> str:
    """A clause's status from its tests' outcomes and its waivers' use.

    error / failed: a test failed and no waiver matched it; xpass: a waiver no longer holds (a
    test it names passed, or it matched nothing); skipped: a declared clause did not run;
    incomplete: its tests did not all report (an interrupted run); waived: every test's
    failure was waived; passed_with_waivers: some tests waived, the rest passed; passed: every
    test passed and no waiver was needed."""
    outcomes = {t["outcome"] for t in tests}
    if not tests or outcomes == {"not_applicable"}:
        return "not_applicable"
    for status in ("error", "failed", "xpass"):
        if status in outcomes:
            return status
    if any(w.get("unused") for w in waivers or ()):
        return "xpass"
    if "skipped" in outcomes:
        return "skipped"  # a declared clause that did not run counts as a failure
    if partial:
        return "incomplete"
    if "waived" in outcomes:
        return "passed_with_waivers" if "passed" in outcomes else "waived"
    return "passed"


_QUOTED = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"")
# a quoted name cut off by the end of a kept text (KEPT), spaces and all: it becomes one token,
# the one _message_kinds drops from a cut text's kind
_CUT = re.compile(r"(?<![\w…])'[^'\n]{16,}$")
_CUT_MARK = "'…⋯"
_HEX = re.compile(r"\b0x[0-9a-fA-F]+")
_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
# a name written without quotes (a family, a test case, a dtype, a config point): a word with a
# digit, `_` or `-` in it; plain words are the check's own wording and stay
_NAME = re.compile(r"(?<![\w…])[A-Za-z]\w*(?:-\w+)*")
_LIST = re.compile(r"\[(?:(?:N|'…'|\[…\]|\(…\))(?:, )?)+\]|\((?:(?:N|'…')(?:, )?)+\)")


def message_kind(text: str) -> str:
    """A failure text's first line with its quoted names, names written without quotes (words
    with a digit, `_` or `-`: `gemma3-mm_train_inputs`, `torch.bfloat16`), hex, numbers and
    lists of them blanked: messages of one kind (one check failing on other names, shapes,
    values or rows) read the same; another check does not. Only the first line: what follows
    it is detail (the store machine's shortest failing program, pytest's comparison)."""
    line = text.split("\n", 1)[0]
    out = _HEX.sub("0x…", _CUT.sub(_CUT_MARK, _QUOTED.sub("'…'", line)))
    out = _NUMBER.sub("N", _NAME.sub(lambda m: "‹…›" if re.search(r"[\d_-]", m.group(0))
                                     else m.group(0), out))
    prev = None
    while prev != out:  # lists of lists, innermost first; an empty list stays `[]`
        prev, out = out, _LIST.sub(lambda m: "[…]" if m.group(0)[0] == "[" else "(…)", out)
    return out


def _message_kinds(per_test) -> list[dict]:
    """The kinds of the failure texts a waiver matched (dicts text -> count, one per test): one
    example of each kind (its most frequent text), the failures of that kind and how many
    distinct texts it holds; most frequent kind first. A text kept at its limit with no line
    break may be cut anywhere in its first line: its kind, without the token the cut fell in,
    joins a kind that begins with it (a longer message of the same check)."""
    kinds: dict[str, dict] = {}
    cut: dict[str, dict] = {}
    for texts in per_test:
        for text, n in texts.items():
            kind = message_kind(text)
            into = kinds
            if len(text) >= KEPT and "\n" not in text:
                kind, into = re.sub(r"\S*$", "", kind), cut
            k = into.setdefault(kind, {"texts": {}, "count": 0})
            k["texts"][text] = k["texts"].get(text, 0) + n
            k["count"] += n
    for stem in sorted(cut, key=len):  # shortest first: it may join a longer cut one
        group = cut.pop(stem)
        into = next((kinds[k] for k in kinds if k.startswith(stem)), None) or next(
            (cut[k] for k in sorted(cut, key=len) if k.startswith(stem)), None) or \
            kinds.setdefault(stem, {"texts": {}, "count": 0})
        for text, n in group["texts"].items():
            into["texts"][text] = into["texts"].get(text, 0) + n
        into["count"] += group["count"]
    out = []
    for k in kinds.values():
        example = min(k["texts"], key=lambda x: (-k["texts"][x], x))
        out.append({"message": example, "count": k["count"], "variants": len(k["texts"])})
    return sorted(out, key=lambda m: (-m["count"], m["message"]))


def _waiver_use(waivers, tests: list[dict], ran_whole: bool) -> list[dict]:
    """Each waiver of a clause with what it did in this run: tests covered, failures matched,
    tests it names that passed (xpass); `unused` when it matched no failure at all."""
    out = []
    for w in waivers:
        key = str(w.index)
        covered = [t for t in tests if key in t.get("waivers", {})]
        matched = [t for t in covered if t["waivers"][key] > 0]
        entry = w.to_json()
        entry.update(covered=len(covered), matched=len(matched),
                     xpass_tests=[t["nodeid"] for t in covered if t["outcome"] == "xpass"])
        first = next((t["waived_messages"][key] for t in matched
                      if key in t.get("waived_messages", {})), None)
        if first:
            entry["first_failure"] = first
        kinds = _message_kinds(t.get("waived_distinct", {}).get(key, {}) for t in matched)
        if kinds:
            # every kind of failure it waived (most frequent first): one waiver that takes
            # messages of two causes reads as such, and is split
            entry["distinct_messages"] = len(kinds)
            entry["messages"] = kinds[:20]
        sites: dict[str, int] = {}
        for t in matched:
            for site, n in t.get("waived_sites", {}).get(key, {}).items():
                sites[site] = sites.get(site, 0) + n
        if sites:
            # the checks its failures were raised by (verdicts.check_site): one cause may fail
            # several checks, but a waiver over two checks is where a second cause hides
            entry["checks"] = [{"site": s, "count": n} for s, n in
                               sorted(sites.items(), key=lambda x: (-x[1], x[0]))]
        if w.expired:
            entry["unused"] = False  # an expired waiver waives nothing; a problem says so
        elif covered and not matched:
            entry["unused"] = True
        elif not covered:
            # a scope that selects nothing is a stale waiver, unless this run left tests out
            entry["unused"] = ran_whole
            entry["note"] = "covered no test of this run"
        else:
            entry["unused"] = False
        out.append(entry)
    return out


def _by_family(tests: list[dict]) -> dict[str, dict[str, int]]:
    """Per model family (tests parametrised by `family`): outcome counts, so a fix for five
    families and a gap in two shows as such."""
    out: dict[str, dict[str, int]] = {}
    for t in tests:
        family = (t.get("params") or {}).get("family")
        if family is None:
            continue
        counts = out.setdefault(family, {})
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    return dict(sorted(out.items()))


def _param(nodeid: str) -> str:
    """`test_x[qwen2_vl-2]` -> `qwen2_vl-2`; '' for an unparametrized test."""
    name = nodeid.rsplit("::", 1)[-1]
    return name[name.index("[") + 1:-1] if name.endswith("]") and "[" in name else ""


def _metrics(tests: list[dict]) -> dict:
    """Metrics by name; a name that several tests record is kept per test (`name[param]`),
    never overwritten or pooled across families."""
    out: dict = {}
    series: dict = defaultdict(list)
    recorders: dict = defaultdict(set)
    for t in tests:
        for m in t["metrics"]:
            recorders[m["name"]].add(t["nodeid"])
    for t in tests:
        for m in t["metrics"]:
            name = m["name"]
            if len(recorders[name]) > 1:
                name = f"{name}[{_param(t['nodeid']) or t['nodeid'].rsplit('::', 1)[-1]}]"
            if m["step"] is None:
                out[name] = m["summary"]
            else:
                series[name].append((m["step"], m["summary"]))
    for name, pts in series.items():
        pts.sort(key=lambda p: p[0])
        vals = [{k: v for k, v in s.items() if k != "histogram"} for _, s in pts]
        out[name] = {"kind": "series", "steps": [p[0] for p in pts], "values": vals}
    return out


def build_report(st, config) -> dict:
    from rlconform.conformance.catalogue.content import fingerprint as content_fingerprint
    from rlconform.conformance.engine import shards

    shard = shards.provenance_entry(st, config)
    prov = provenance(st, config)
    prov["content"] = content_fingerprint(st.backend.source, st.expectations.path)
    if shard is not None:
        prov["shard"] = shard
    if getattr(st, "stopped_by", None):
        prov["stopped_by"] = st.stopped_by
    subset = bool(config.getoption("keyword", "") or config.getoption("markexpr", "")
                  or config.getoption("--surfaces"))
    return assemble(st, prov, subset=subset or shard is not None,
                    collectonly=bool(config.getoption("collectonly", False)),
                    partial_ok=bool(config.getoption("--partial-ok")),
                    kill_matrix=_kill_matrix(config, st.backend.name),
                    mutant_effects=_beside_mutants(config, st.backend.name,
                                                   "mutant_effects.json"))


def assemble(st, prov: dict, subset: bool, collectonly: bool = False,
             kill_matrix: dict | None = None, mutant_effects: dict | None = None,
             partial_ok: bool = False) -> dict:
    """The report of a run from its state: `st` holds the backend, its expectations, the
    per-test results, the tests that reported, the selection, the cells collection produced
    and those filters dropped (cells.py), the exit status and the run's problems (a live run's
    RlconformState, or the shards of one run joined: merge.py).
    `subset`: the run left tests out on purpose (-k, --surfaces, one shard), so a waiver that
    covers no test of it is not stale. A shard run keeps, per test, what a merge needs to
    rebuild the verdicts (shards.record_fields), and leaves clauses whose tests all went to
    other shards out of `deselected` (provenance.shard names them). `partial_ok`: the user
    said a partial run is intended (`--partial-ok`), recorded in the report's cells."""
    from rlconform.conformance.engine import cells
    from rlconform.conformance.engine.shards import record_fields

    shard = prov.get("shard")
    by_clause: dict[str, list[dict]] = defaultdict(list)
    # a test counts once its run is over; one stopped inside its call (Ctrl-C, a timeout's
    # SIGINT) has a passed setup only, and is counted among the tests that did not report
    done = [r for nodeid, r in st.results.items() if nodeid in st.reported]
    unreported = Unreported(st, collectonly)
    for r in done:
        for cid in r["clauses"]:
            by_clause[cid].append(r)
    clauses = []
    deselected = []
    problems = list(st.problems)
    from rlconform.conformance.engine.collection import applicability

    elsewhere = []
    in_scope = {cid for e in ((shard or {}).get("scope") or {}).values() for cid in e["clauses"]}
    ledger = cells.ledger_of(st)
    cells_by_clause = ledger.by_clause() if ledger is not None else {}
    for c in catalogue.CLAUSES:
        tests = by_clause.get(c.id, [])
        na = applicability(st.backend, c)
        partial = unreported.clause_note(c.id)
        if not tests and na is None and not partial:
            (elsewhere if c.id in in_scope else deselected).append(c.id)
            continue
        counted = None if ledger is None else cells.clause_cells(
            c.id, na, tests, ledger, cells_by_clause.get(c.id, []),
            unreported.by_clause.get(c.id, [0, 0])[1])
        dropped = bool(counted and counted["dropped"])
        waivers = _waiver_use(st.expectations.for_clause(c.id), tests,
                              ran_whole=not subset and not partial and not dropped)
        # a selected clause none of whose tests reported is incomplete, not deselected
        status = "not_applicable" if na else "incomplete" if partial and not tests else \
            clause_status(tests, waivers, bool(partial))
        message = _clause_message(status, na, tests, waivers)
        note = "; ".join(n for n in (partial, cells.clause_note(counted or {})) if n)
        if note and status != "not_applicable":
            message = f"{note}; {message}" if message else note
        clauses.append({
            "id": c.id, "title": c.must, "surface": c.surface,
            "capabilities": list(c.capabilities), "required": c.required,
            "status": status, "message": message, "defect": c.defect,
            "mutants": list(c.mutants), "regime": c.regime,
            "duration_s": round(sum(t["duration_s"] for t in tests), 4),
            "tests": [_test_entry(t) | ({"record": record_fields(t)} if shard else {})
                      for t in tests],
            "waivers": waivers,
            **({"adapter_normalisation": st.backend.normalisations[c.id]}
               if c.id in st.backend.normalisations else {}),
            "by_family": _by_family(tests),
            "metrics": _metrics(tests),
            **({"cells": counted} if counted is not None else {}),
        })
        for t in tests:
            if t.get("unimplemented"):
                problems.append(
                    f"{c.id}: {t['nodeid']} reached a part of backend {st.backend.name!r} that "
                    f"raises {t['unimplemented']}: a declared surface must work. Leave the "
                    f"surface out and say why (Backend(..., notes={{{c.surface!r}: '...'}})) "
                    "instead of declaring it")
                break
    from rlconform.reports.model import summarize_clauses

    summary = summarize_clauses(clauses, not_run=len(deselected) + len(elsewhere))
    if not done:
        problems.append("no clause test ran")
    unfinished = unreported.problem()
    if unfinished:
        problems.append(unfinished)
    if shard is not None:
        shard["clauses_elsewhere"] = elsewhere
    run_cells = None if ledger is None else cells.run_cells(
        clauses, {cid: cells_by_clause.get(cid, []) for cid in deselected + elsewhere}, ledger,
        partial_ok)
    report = {
        "schema_version": SCHEMA_VERSION,
        "backend": st.backend.name,
        "backend_info": st.backend.describe(),
        "provenance": prov,
        "summary": summary,
        "clauses": clauses,
        "deselected": deselected,
        **({"cells": run_cells} if run_cells is not None else {}),
        "not_tested": not_tested(st.backend),
        "coverage_drops_allowed": [{"clause": k, "reason": v}
                                   for k, v in st.expectations.allow_drop.items()],
        "kill_matrix": kill_matrix,
        "mutant_effects": mutant_effects,
        "problems": problems,
    }
    from rlconform.reports.surfaces import derive

    report["surface_scores"] = derive(report)  # after the clauses, from them
    return report


def _test_entry(t: dict) -> dict:
    out = {"nodeid": t["nodeid"], "outcome": t["outcome"],
           "duration_s": round(t["duration_s"], 4), "message": t["message"],
           "hypothesis": t["hypothesis"]}
    if t.get("params"):
        out["params"] = t["params"]
    if t.get("kind"):
        out["failure_kind"] = t["kind"]
    if t.get("gpu_peak_gib") is not None:
        out["gpu_peak_gib"] = t["gpu_peak_gib"]
    matched = [int(i) for i, n in (t.get("waivers") or {}).items() if n > 0]
    if matched:
        out["waived_by"] = sorted(matched)
    return out


def _clause_message(status: str, na: str | None, tests: list[dict], waivers: list[dict]) -> str:
    if status == "not_applicable":
        return na or (tests[0]["message"] if tests else "")
    failing = [t for t in tests if t["outcome"] in ("failed", "error", "skipped")]
    if failing:
        return f"{failing[0]['nodeid'].split('::')[-1]}: {failing[0]['message']}"
    stale = [w for w in waivers if w.get("xpass_tests")]
    if stale:
        w = stale[0]
        return (f"waiver #{w['index']} expects {len(w['xpass_tests'])} test(s) to fail that "
                f"passed ({w['xpass_tests'][0].split('::')[-1]}, ...): remove or narrow it")
    unused = [w for w in waivers if w.get("unused")]
    if unused:
        w = unused[0]
        why = w.get("note") or f"matched no failure of the {w['covered']} test(s) it covers"
        return f"waiver #{w['index']} {why}: remove or narrow it ({first_line(w['reason'])})"
    if status in ("waived", "passed_with_waivers"):
        n = sum(t["outcome"] == "waived" for t in tests)
        return f"{n} of {len(tests)} tests waived"
    return ""


def first_line(text: str) -> str:
    line = (text or "").strip().splitlines()[0] if (text or "").strip() else ""
    return line[:160]


INTERRUPTED = 2  # pytest.ExitCode.INTERRUPTED (this module does not import pytest)
CLAUSES_LISTED = 20  # clause ids named in the problem; the rest are counted


class Unreported:
    """The selected tests of a run that did not report (the run was interrupted: Ctrl-C,
    `timeout -s INT`; or stopped early: -x, --maxfail), with their clauses."""

    def __init__(self, st, collectonly: bool = False):
        self.interrupted = st.exitstatus == INTERRUPTED
        self.exit_name = _exit_name(st.exitstatus)
        signal = getattr(st, "stopped_by", None)
        self.how = f"interrupted by {signal}" if signal else "interrupted"
        # why tests did not report, where the exit status does not say (a merge: a shard
        # report not given)
        self.why = getattr(st, "unreported_why", None)
        self.reported = len({n for n in st.reported if n in st.results})
        self.selected = None if st.selected is None else len(st.selected)
        self.missing: list[str] = []
        if st.selected is not None and not collectonly:
            self.missing = [n for n in st.selected if n not in st.reported]
        # clause -> (selected tests, of them not reported), for clauses with a missing test
        self.by_clause: dict[str, list[int]] = {}
        self.unknown: list[str] = []  # test functions whose clauses are not known
        if self.missing:
            clauses = _clause_lookup(st)
            missing = set(self.missing)
            for nodeid in st.selected:
                ids = clauses(nodeid)
                if not ids and nodeid in missing:
                    function = nodeid.split("[", 1)[0]
                    if function not in self.unknown:
                        self.unknown.append(function)
                for cid in ids:
                    counts = self.by_clause.setdefault(cid, [0, 0])
                    counts[0] += 1
                    counts[1] += nodeid in missing
            self.by_clause = {c: n for c, n in self.by_clause.items() if n[1]}

    def clause_note(self, clause_id: str) -> str:
        """'' or what a clause's status rests on, e.g. "partial: 1 of 2 selected tests
        reported (run interrupted)"."""
        if clause_id not in self.by_clause:
            return ""
        selected, missing = self.by_clause[clause_id]
        why = self.why or (f"run {self.how}" if self.interrupted
                           else f"run stopped: {self.exit_name}")
        return f"partial: {selected - missing} of {selected} selected tests reported ({why})"

    def problem(self) -> str | None:
        if self.selected is None:
            if not self.interrupted:
                return None
            return (f"run {self.how} before every selected test reported: {self.reported} "
                    "tests reported, the selection is unknown (interrupted before collection "
                    "ended); clause results are partial")
        if not self.missing:
            return None
        how = self.how if self.interrupted else \
            f"stopped early (exit status {self.exit_name}: -x, --maxfail, ...)"
        text = (f"run {how} before every selected test reported: " if not self.why else
                f"{self.why}: ") + (f"{self.selected - len(self.missing)} of {self.selected} "
                                    "tests reported; clause results are partial")
        order = {c.id: i for i, c in enumerate(catalogue.CLAUSES)}
        ids = sorted(self.by_clause, key=lambda i: (order.get(i, len(order)), i))
        if ids:
            text += f"; clauses whose tests did not all report: {_some(ids)}"
        if self.unknown:
            text += f"; tests of unknown clauses that did not report: {_some(self.unknown)}"
        return text


def _some(names: list[str]) -> str:
    more = len(names) - CLAUSES_LISTED
    return ", ".join(names[:CLAUSES_LISTED]) + (f" and {more} more" if more > 0 else "")


def _exit_name(code) -> str:
    names = {0: "OK", 1: "TESTS_FAILED", 2: "INTERRUPTED", 3: "INTERNAL_ERROR",
             4: "USAGE_ERROR", 5: "NO_TESTS_COLLECTED"}
    return "unknown" if code is None else names.get(int(code), str(code))


def _clause_lookup(st):
    """nodeid -> its clause ids. A plain run knows every selected item's clauses; under xdist
    the controller has the node ids only: a test takes the clauses its function's
    `@pytest.mark.clause` marks name (`docs.tests_by_clause`, keyed by module file and name)."""
    from rlconform.conformance.catalogue.docs import tests_by_clause

    by_function: dict[str, list[str]] = defaultdict(list)
    for cid, functions in tests_by_clause().items():
        for function in functions:
            by_function[function].append(cid)

    def lookup(nodeid: str) -> list[str]:
        path, _, name = nodeid.split("[", 1)[0].partition("::")
        return ((st.selected or {}).get(nodeid)
                or by_function.get(f"{Path(path).name}::{name.rsplit('::', 1)[-1]}", []))

    return lookup


NOT_DECLARED = "not declared by the backend (it gave no reason)"


def not_tested(backend) -> list[dict]:
    """Clauses that did not apply, grouped by the surface (or capabilities) the backend left
    out, with the backend's note saying why: a gate that passes must not hide what it never
    looked at."""
    groups: dict[tuple[str, str], list[str]] = {}
    for c in catalogue.CLAUSES:
        if not any(backend.provides(s) for s in c.surfaces):
            key = ("surface", c.surface)
        else:
            lacking = [cap for cap in c.capabilities if cap not in backend.capabilities]
            if not lacking:
                continue
            key = ("capability", ", ".join(lacking))
        groups.setdefault(key, []).append(c.id)
    out = []
    for (kind, name), ids in groups.items():
        why = [backend.notes[n] for n in name.split(", ") if n in backend.notes]
        out.append({"kind": kind, "name": name, "clauses": ids,
                    "why": "; ".join(why) or NOT_DECLARED})
    return out


def _kill_matrix(config, backend_name: str) -> dict | None:
    """The last mutant run's matrix, shown in the reference backend's report."""
    return _beside_mutants(config, backend_name, "mutants/kill_matrix.json")


def _beside_mutants(config, backend_name: str, name: str) -> dict | None:
    """A mutant measurement of the last run under the report dir (the kill matrix, the
    mutants' numeric effects), shown in the reference backend's report."""
    if backend_name != "reference":
        return None
    p = Path(config.getoption("--report-dir")) / name
    if not p.is_file():
        return None
    import json

    return json.loads(p.read_text())


def write(report: dict, out_dir: Path, formats: list[str] | None = None) -> None:
    from rlconform.reports.write import write_reports

    out_dir.mkdir(parents=True, exist_ok=True)
    write_reports(report, out_dir, formats)
