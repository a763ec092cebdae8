"""junit.xml: the report in the format every CI test viewer reads.

One testsuite per backend; one testcase per test node (a test tied to several clauses appears
once, with one `clause` property per clause), or per clause when the clause has no tests (not
applicable clauses, clauses that errored before collecting). A waived test is a skipped testcase
naming the waiver that matched it (CI viewers have no "waived" state; skipped keeps it apart
from the passes), and a test a waiver names that passed is a failure. Run-level problems become
failing testcases of their own so they are not lost.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from typing import Any

from ._common import first_line, fmt_num

# XML 1.0 cannot carry most control characters (ANSI colour codes from pytest, NUL bytes from a
# repr); a raw one makes the whole file unparseable, so they are written as \xNN.
_INVALID_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
_SEVERITY = {"pass": 0, "skipped": 1, "failure": 2, "error": 3}


def _clean(text: Any) -> str:
    return _INVALID_XML.sub(lambda m: f"\\x{ord(m.group()):02x}", "" if text is None else str(text))


def _result(clause: Mapping[str, Any], test: Mapping[str, Any] | None) -> tuple[str, str, str]:
    """(kind, type, text) of one clause/test pair; kind is pass, skipped, failure or error."""
    status = clause["status"]
    expired = [w for w in clause.get("waivers") or () if w.get("expired")]
    if expired:
        w = expired[0]
        return ("failure", "waiver-expired",
                f"waiver #{w['index']} of {clause['id']} expired on {w['expires']}")
    if test is not None and test["outcome"] == "waived":
        by = ", ".join(f"#{i}" for i in test.get("waived_by") or ()) or "a waiver"
        return "skipped", "waived", f"waived by {by}: {test.get('message') or ''}"
    if test is not None and test["outcome"] == "xpass":
        return "failure", "xpass", test.get("message") or "passed although a waiver expects a " \
            "failure: remove or narrow the waiver"
    unused = status == "xpass" and not any(t["outcome"] == "xpass" for t in clause["tests"])
    if unused and (test is None or test is clause["tests"][0]):
        # a waiver that matched nothing: one failing testcase says so
        return "failure", "xpass", clause["message"]
    if status == "not_applicable":
        return "skipped", "not-applicable", clause["message"] or "not applicable to this backend"
    if test is None:
        kind = {"failed": "failure", "error": "error", "skipped": "skipped",
                "incomplete": "skipped"}.get(status, "pass")
        return kind, f"clause-{status}", clause["message"]
    outcome = test["outcome"]
    text = test.get("message") or clause["message"]
    hyp = test.get("hypothesis") or {}
    if hyp.get("example"):
        text += f"\n\nFalsifying example:\n{hyp['example']}"
    if hyp.get("blob"):
        text += f"\n\nReplay with:\n{hyp['blob']}"
    kind = {"failed": "failure", "error": "error", "skipped": "skipped"}.get(outcome, "pass")
    if status == "skipped" and kind == "pass":
        # the clause applied and was skipped as a whole: no testcase of it may read as a pass
        return "skipped", "clause-skipped", clause["message"] or "skipped"
    return kind, f"test-{outcome}", text


def _names(nodeid: str) -> tuple[str, str]:
    """(classname, name) the way pytest's own junitxml spells a node id."""
    parts = nodeid.split("::")
    module = parts[0].removesuffix(".py").replace("/", ".").replace("\\", ".")
    return ".".join([module, *parts[1:-1]]), parts[-1] if len(parts) > 1 else parts[0]


def render_junit(report: Mapping[str, Any]) -> str:
    backend = report["backend"]
    cases: dict[str, dict[str, Any]] = {}
    for clause in report["clauses"]:
        tests = clause["tests"] or [None]
        for test in tests:
            key = test["nodeid"] if test else f"clause::{clause['id']}"
            entry = cases.setdefault(key, {"clauses": [], "results": [], "time": 0.0, "test": test})
            entry["clauses"].append(clause)
            entry["results"].append(_result(clause, test))
            duration = (test or {}).get("duration_s") if test else clause.get("duration_s")
            entry["time"] = max(entry["time"], duration or 0.0)

    root = ET.Element("testsuites", name="rlconform")
    suite = ET.SubElement(root, "testsuite", name=f"rlconform.{backend}")
    props = ET.SubElement(suite, "properties")
    prov = report["provenance"]
    for name, value in (
        ("backend", backend),
        ("schema_version", report["schema_version"]),
        ("rlconform_version", prov.get("rlconform_version")),
        ("git_commit", prov.get("git_commit")),
        ("profile", prov.get("profile")),
        (
            "device",
            (prov.get("device") or {}).get("name") or (prov.get("device") or {}).get("type"),
        ),
        ("score", fmt_num(report["summary"]["score"])),
    ):
        if value is not None:
            ET.SubElement(props, "property", name=name, value=_clean(value))

    totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    total_time = 0.0
    for key, entry in cases.items():
        test = entry["test"]
        if test is None:
            clause = entry["clauses"][0]
            classname, name = f"rlconform.clause.{clause.get('surface') or 'none'}", clause["id"]
        else:
            classname, name = _names(key)
        case = ET.SubElement(
            suite,
            "testcase",
            classname=_clean(classname),
            name=_clean(name),
            time=f"{entry['time']:.3f}",
        )
        cprops = ET.SubElement(case, "properties")
        for clause in entry["clauses"]:
            ET.SubElement(cprops, "property", name="clause", value=_clean(clause["id"]))
        for clause in entry["clauses"]:
            ET.SubElement(cprops, "property", name="status", value=clause["status"])
            for w in clause.get("waivers") or ():
                ET.SubElement(
                    cprops,
                    "property",
                    name="waiver",
                    value=_clean(
                        f"{clause['id']} #{w['index']}: {w['category']}: {w['reason']} "
                        f"(expires {w['expires']})"
                    ),
                )
        kind, typ, text = max(entry["results"], key=lambda r: _SEVERITY[r[0]])
        totals["tests"] += 1
        total_time += entry["time"]
        if kind == "pass":
            continue
        tag = {"failure": "failure", "error": "error", "skipped": "skipped"}[kind]
        totals[{"failure": "failures", "error": "errors", "skipped": "skipped"}[kind]] += 1
        el = ET.SubElement(case, tag, message=_clean(first_line(text, 500)), type=typ)
        if text and kind != "skipped":
            el.text = _clean(text)

    for i, problem in enumerate(report.get("problems") or ()):
        case = ET.SubElement(
            suite, "testcase", classname="rlconform.run", name=f"problem[{i}]", time="0.000"
        )
        ET.SubElement(
            case, "failure", message=_clean(first_line(problem, 500)), type="run-problem"
        ).text = _clean(problem)
        totals["tests"] += 1
        totals["failures"] += 1

    for name, value in totals.items():
        suite.set(name, str(value))
    suite.set("time", f"{total_time:.3f}")
    if prov.get("started_at"):
        suite.set("timestamp", _clean(prov["started_at"]))
    for name in ("tests", "failures", "errors", "skipped"):
        root.set(name, str(totals[name]))
    root.set("time", f"{total_time:.3f}")
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"
