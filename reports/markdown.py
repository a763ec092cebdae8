"""report.md: the compact view for a CI step summary (GitHub's `$GITHUB_STEP_SUMMARY`).

A reader of a red job wants the reason in the first screen, so the order is: verdict, why the
gate fails, failing clauses with their messages, waivers, then the full clause table, metrics,
the mutant kill matrix and provenance (folded).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ._common import (
    EFFECT_HEADER,
    STATUS_LABEL,
    STATUS_MARK,
    cells_line,
    clause_cells_cell,
    data_path_summary,
    family_matrix,
    flatten,
    fmt_duration,
    fmt_num,
    headline,
    iter_metrics,
    kill_matrix_columns,
    metric_overview,
    mutant_effect_caption,
    mutant_effect_rows,
    not_tested_lines,
    partial_clauses,
    scope_text,
    sorted_clauses,
)
from .gate import gate
from .model import FAILING, STATUSES
from .surfaces import joint_groups, score_text, surface_scores
from .surfaces import verdict_word as surface_word

MESSAGE_LIMIT = 1500  # per failure message: a traceback-sized message must not bury the rest
TESTS_LIMIT = 5  # failing tests listed per clause; a parametrized clause can fail dozens
NOTE_LIMIT = 120  # the clause table's note column stays one line wide
PARTIAL_LIMIT = 20  # clauses with dropped cells listed under "Not run in this report"
CELLS_SHOWN = 5  # ... each with its first dropped cells


def escape(text: Any, limit: int | None = None) -> str:
    """Text made safe for a Markdown table cell or list item: no pipes, newlines or raw HTML."""
    text = "" if text is None else str(text)
    if limit is not None and len(text) > limit:
        text = text[: limit - 1] + "…"
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    text = text.replace("\\", "\\\\").replace("|", "\\|")
    return text.replace("\r\n", "\n").replace("\r", "\n").strip().replace("\n", "<br>")


def _code(text: str) -> str:
    """An inline code span (outside tables) that survives backticks inside `text`."""
    text = " ".join(text.split())
    run = 1
    while "`" * run in text:
        run += 1
    ticks = "`" * run
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{ticks}{pad}{text}{pad}{ticks}"


def _fence(text: str, info: str = "text") -> list[str]:
    run = 3
    while "`" * run in text:
        run += 1
    fence = "`" * run
    return [f"{fence}{info}", text.rstrip("\n"), fence]


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out.extend("| " + " | ".join(row) + " |" for row in rows)
    return out


def _surface_table(report: Mapping[str, Any]) -> list[str]:
    """The verdict on each surface the backend implements (reports/surfaces.py), the clauses
    that judged it jointly with parts the reference lent, and the surfaces not scored."""
    scores = surface_scores(report)
    if not scores["surfaces"]:
        return []
    rows = []
    for e in scores["surfaces"]:
        lent = list(dict.fromkeys(s for _, group in sorted(
            ((len(j["lent"]), j["lent"]) for j in e["joint"]), reverse=True) for s in group))
        joint = f"{len(e['joint'])} (lent: {', '.join(lent)})" if e["joint"] else "—"
        passed = str(e["passed"]) + (f" (+{e['passed_partial']} on judged cells only)"
                                     if e["passed_partial"] else "")
        rows.append([escape(e["surface"]), surface_word(e), escape(score_text(e)), passed,
                     str(e["waived"]), str(e["failed"]), str(e["not_run"]), joint])
    out = ["### Surfaces judged", "",
           *_table(["Surface", "Verdict", "Score", "Passed", "Waived", "Failing", "Not run",
                    "Jointly with lent parts"], rows), ""]
    for e in scores["surfaces"]:
        for lent, ids in joint_groups(e):
            out.append(f"- {escape(e['surface'])} jointly with the reference's "
                       f"{escape(', '.join(lent))}: {escape(', '.join(ids))}")
    if scores["not_scored"]:
        out.append(f"- not scored (not implemented by the backend; the reference's where a clause "
                   "needs them): "
                   f"{escape(', '.join(scores['not_scored']))}")
    out.append("")
    return out


def _by_waiver(lines: list[str], intro: str, shown: int, entries: list) -> None:
    """A paragraph, then one bullet per waiver (clause, waiver, items, how many in all): its
    first `shown` items and how many more there are; nothing when no waiver has any."""
    if not entries:
        return
    lines.extend([intro, ""])
    for c, w, items, total in entries:
        lines.append(f"- {escape(c['id'])} #{w['index']}: " + "; ".join(items[:shown])
                     + (f"; and {total - shown} more" if total > shown else ""))
    lines.append("")


def render_markdown(report: Mapping[str, Any]) -> str:
    verdict = gate(report)
    summary = report["summary"]
    lines: list[str] = []
    badge = verdict.word
    lines.append(f"## rlconform · {_code(report['backend'])} · {badge}")
    lines.append("")
    lines.append(f"**{escape(headline(report))}**")
    lines.append("")
    counts = " · ".join(
        f"{summary[s]} {STATUS_LABEL[s]}"
        for s in STATUSES
        if summary[s] or s in ("passed", "failed")
    )
    lines.append(f"{counts} · {summary['total']} clauses")
    lines.append("")
    lines.extend(_surface_table(report))
    info = report.get("backend_info") or {}
    if info.get("version"):
        lines.append(f"System under test: {escape(info['version'])}")
        lines.append("")
    if info.get("description"):
        lines.append(f"Backend: {escape(info['description'])}")
        lines.append("")
    shown = {e["name"] for e in report.get("not_tested") or ()}
    notes = {k: v for k, v in (info.get("notes") or {}).items() if k not in shown}
    if notes:  # notes on what the backend left out that no clause listed below names
        lines.append("Not declared: " + "; ".join(f"{escape(k)}: {escape(v)}"
                                                 for k, v in notes.items()))
        lines.append("")

    if not verdict.ok:
        lines.append("### Why the gate fails")
        lines.extend(f"- {escape(r)}" for r in verdict.reasons)
        lines.append("")

    failing = [c for c in sorted_clauses(report["clauses"]) if c["status"] in FAILING]
    if failing:
        lines.append("### Failures")
        lines.append("")
        fences: list[str] = []
        for c in failing:
            req = "" if c.get("required", True) else " · advisory"
            lines.append(
                f"- {STATUS_MARK[c['status']]} **{escape(c['id'])}** "
                f"({STATUS_LABEL[c['status']]} · {escape(c.get('surface') or '—')}{req}): "
                f"{escape(c.get('title', ''))}"
            )
            if c["message"]:
                lines.append(f"  <br>{escape(c['message'], MESSAGE_LIMIT)}")
            bad = [t for t in c["tests"] if t["outcome"] in ("failed", "error", "xpass")]
            for t in bad[:TESTS_LIMIT]:
                same = (t.get("message") or "").strip() == c["message"].strip()
                msg = "" if same else escape(t.get("message"), MESSAGE_LIMIT)
                how = f" ({t['failure_kind']})" if t.get("failure_kind") else ""
                lines.append(
                    f"  - {_code(t['nodeid'])} {t['outcome']}{how}" + (f": {msg}" if msg else "")
                )
                hyp = t.get("hypothesis") or {}
                if hyp.get("example") or hyp.get("blob"):
                    body = (hyp.get("example") or "").rstrip()
                    if hyp.get("blob"):
                        body += ("\n\n" if body else "") + hyp["blob"]
                    fences.append(f"**{escape(t['nodeid'])}** (shrunk example, replay blob)")
                    fences.extend(_fence(body))
            if len(bad) > TESTS_LIMIT:
                lines.append(f"  - … and {len(bad) - TESTS_LIMIT} more failing tests")
        lines.append("")
        if fences:
            lines.extend(fences)
            lines.append("")

    untested = not_tested_lines(report)
    if untested:
        lines.append("### Not tested (not applicable to this backend)")
        lines.extend(f"- {escape(n)}" for n in untested)
        lines.append("")
    path = data_path_summary(report)
    if path:
        lines.append(f"### Framework data path ({path['counts']})")
        lines.append("")
        if path["steps"]:
            lines.extend(_table(["Function", "Status", "Why"],
                                [[_code(f), s, escape(w, NOTE_LIMIT)] for f, s, w in path["steps"]]))
            lines.append("")
        for cid, text in path["normalisations"]:
            lines.append(f"- adapter normalisation, {escape(cid)}: {escape(text)}")
        if path["normalisations"]:
            lines.append("")
    dropped_in = partial_clauses(report, CELLS_SHOWN)
    if report.get("deselected") or dropped_in:
        lines.append("### Not run in this report")
        lines.append(f"- {escape(cells_line(report))}")
        if report.get("deselected"):
            lines.append("- partial run; clauses not run: "
                         f"{escape(', '.join(report['deselected']))}")
        for cid, judged, names, more in dropped_in[:PARTIAL_LIMIT]:
            lost = ", ".join(_code(n) for n in names) + (f" and {more} more" if more else "")
            lines.append(f"- partial clause {escape(cid)}: cells {judged} judged; dropped {lost}")
        if len(dropped_in) > PARTIAL_LIMIT:
            lines.append(f"- … and {len(dropped_in) - PARTIAL_LIMIT} more clauses judged on "
                         "fewer cells than in scope (report.json names their cells)")
        lines.append("")
    if report.get("problems"):
        lines.append("### Run problems")
        lines.extend(f"- {escape(p)}" for p in report["problems"])
        lines.append("")

    waived = [(c, w) for c in sorted_clauses(report["clauses"]) for w in c.get("waivers") or ()]
    if waived:
        lines.append("### Waivers")
        lines.append("Each waiver covers the tests its scope selects and, where it gives a "
                     "pattern, only failures that match it; any other failure of the clause "
                     "still fails.")
        lines.append("")
        rows = []
        for c, w in waived:
            expires = escape(w["expires"]) + (" **(expired)**" if w.get("expired") else "")
            reason = escape(w["reason"], 300)
            for key in ("function", "input"):
                if w.get(key):
                    reason += f"<br>*{key}:* {escape(w[key], 200)}"
            if w.get("link"):
                reason += f" ([link]({w['link'].replace(')', '%29').replace(' ', '%20')}))"
            use = f"{w.get('matched', 0)}/{w.get('covered', 0)} tests"
            if w.get("distinct_messages", 0) > 1:
                use += f", {w['distinct_messages']} kinds of message"
            if len(w.get("checks") or ()) > 1:
                use += f", **{len(w['checks'])} checks**"
            if w.get("unused"):
                use += " **(matched nothing)**"
            if w.get("xpass_tests"):
                use += f" **({len(w['xpass_tests'])} passed)**"
            rows.append([escape(c["id"]), f"#{w['index']}", escape(w["category"]),
                         escape(scope_text(w), 200), use, expires, reason])
        lines.extend(_table(["Clause", "#", "Category", "Scope", "Matched", "Expires",
                             "Reason"], rows))
        lines.append("")
        _by_waiver(lines, "Waivers that matched more than one kind of message (first lines alike "
                   "up to names, hex, numbers and lists are one kind; a waiver should describe "
                   "one cause, which may show in several checks): an example of each of the "
                   "first five kinds, with how often it failed:", 5, [
                       (c, w, [f"{escape(m['message'], 160)} (x{m['count']}"
                               + (f", {m['variants']} variants)" if m.get("variants", 1) > 1
                                  else ")") for m in w["messages"]], w["distinct_messages"])
                       for c, w in waived if w.get("distinct_messages", 0) > 1])
        _by_waiver(lines, "Waivers whose failures were raised by more than one check (the clause "
                   "line that asserted, or that called the backend when it raised, and the "
                   "exception type): one cause can fail several checks, and a second cause "
                   "hides nowhere else, so each should say why its checks share a cause, or be "
                   "split:", 8, [
                       (c, w, [f"`{escape(k['site'], 80)}` (x{k['count']})" for k in w["checks"]],
                        len(w["checks"]))
                       for c, w in waived if len(w.get("checks") or ()) > 1])

    lines.append("### Clauses")
    rows = []
    for c in sorted_clauses(report["clauses"]):
        n_pass = sum(t["outcome"] == "passed" for t in c["tests"])
        n_waived = sum(t["outcome"] == "waived" for t in c["tests"])
        tests = f"{n_pass}/{len(c['tests'])}" + (f" (+{n_waived} waived)" if n_waived else "")
        rows.append(
            [
                STATUS_MARK[c["status"]],
                escape(c["id"]),
                escape(c.get("surface") or "—"),
                STATUS_LABEL[c["status"]] + ("" if c.get("required", True) else " (advisory)"),
                tests,
                clause_cells_cell(c),
                fmt_duration(c.get("duration_s")),
                escape(c["message"], NOTE_LIMIT),
            ]
        )
    lines.extend(_table(["", "Clause", "Surface", "Status", "Passed tests", "Cells judged",
                         "Time", "Note"], rows))
    lines.append("")

    families, matrix = family_matrix(report)
    if families:
        lines.append("### Per model family")
        lines.append("Tests passed / run per clause and family (w: waived, F: failed or "
                     "error, X: passed where a waiver expected a failure).")
        lines.append("")
        lines.extend(_table(["Clause", *families],
                            [[escape(cid), *cells] for cid, cells in matrix]))
        lines.append("")

    metric_rows = []
    for clause, name, metric in iter_metrics(report):
        o = metric_overview(metric)
        kind = metric["kind"] + (f" ({o['steps']} steps)" if o["steps"] is not None else "")
        metric_rows.append(
            [
                escape(clause["id"]),
                escape(name),
                kind,
                fmt_num(o["count"]),
                fmt_num(o["min"]),
                fmt_num(o["mean"]),
                fmt_num(o["max"]),
            ]
        )
    if metric_rows:
        lines.append("### Metrics")
        lines.extend(_table(["Clause", "Metric", "Kind", "n", "min", "mean", "max"], metric_rows))
        lines.append("")

    effects = report.get("mutant_effects")
    if effects and effects["rows"]:
        lines.append("### Mutants' effect on the numeric metrics")
        lines.append(escape(mutant_effect_caption(effects)))
        lines.append("")
        lines.extend(_table(EFFECT_HEADER, [[escape(x) for x in row]
                                            for row in mutant_effect_rows(effects)]))
        lines.append("")

    km = report.get("kill_matrix")
    if km and km["mutants"]:
        mutants = km["mutants"]
        killed = sum(m["killed"] for m in mutants)
        lines.append("### Mutant kill matrix")
        lines.append(
            f"{killed}/{len(mutants)} mutants killed by a clause assertion across "
            f"{len(kill_matrix_columns(km))} clauses."
        )
        lines.append("")
        rows = []
        for m in sorted(mutants, key=lambda m: (m["killed"], m["name"])):
            missed = [x for x in m["expected"] if x not in m["failed"]]
            extra = [x for x in m["failed"] if x not in m["expected"]]
            rows.append(
                [
                    escape(m["name"]),
                    "killed" if m["killed"] else
                    f"ERROR: {escape(m['error'], NOTE_LIMIT)}" if m.get("error") else
                    "only exceptions, no assertion" if m.get("failed") else
                    "SURVIVED",
                    escape(", ".join(m["expected"]) or "—"),
                    escape(", ".join(missed) or "—"),
                    escape(", ".join(extra) or "—"),
                ]
            )
        lines.extend(
            _table(["Mutant", "Result", "Expected to fail", "Missed", "Also failed"], rows)
        )
        lines.append("")

    prov = report["provenance"]
    lines.append("<details><summary>Provenance</summary>")
    lines.append("")
    rows = [[escape(k), escape(fmt_num(v))] for k, v in flatten(prov)]
    info = report["backend_info"]
    rows.insert(0, ["backend.surfaces", escape(", ".join(info["surfaces"]))])
    rows.insert(1, ["backend.capabilities", escape(", ".join(info["capabilities"]) or "—")])
    if info.get("source"):
        rows.insert(2, ["backend.source", escape(info["source"])])
    lines.extend(_table(["Key", "Value"], rows))
    lines.append("")
    lines.append("</details>")
    lines.append("")
    return "\n".join(lines)
