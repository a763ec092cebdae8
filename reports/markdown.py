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
    STATUS_EMOJI,
    STATUS_LABEL,
    flatten,
    fmt_duration,
    fmt_num,
    fmt_score,
    iter_metrics,
    kill_matrix_columns,
    metric_overview,
    mutant_effect_caption,
    mutant_effect_rows,
    not_tested_lines,
    score_note,
    sorted_clauses,
)
from .gate import gate
from .model import STATUSES

MESSAGE_LIMIT = 1500  # per failure message: a traceback-sized message must not bury the rest
TESTS_LIMIT = 5  # failing tests listed per clause; a parametrized clause can fail dozens
NOTE_LIMIT = 120  # the clause table's note column stays one line wide


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


def render_markdown(report: Mapping[str, Any]) -> str:
    verdict = gate(report)
    summary = report["summary"]
    lines: list[str] = []
    badge = "✅ PASS" if verdict.ok else "❌ FAIL"
    lines.append(f"## rlconform · {_code(report['backend'])} · {badge}")
    lines.append("")
    counts = " · ".join(
        f"{summary[s]} {STATUS_LABEL[s]}"
        for s in STATUSES
        if summary[s] or s in ("passed", "failed")
    )
    note = score_note(summary)
    lines.append(f"**score {fmt_score(summary['score'])}**{f' ({note})' if note else ''} · "
                 f"{counts} · {summary['total']} clauses")
    lines.append("")
    info = report.get("backend_info") or {}
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

    failing = [
        c for c in sorted_clauses(report["clauses"]) if c["status"] in ("failed", "error", "xpass")
    ]
    if failing:
        lines.append("### Failures")
        lines.append("")
        fences: list[str] = []
        for c in failing:
            req = "" if c.get("required", True) else " · advisory"
            lines.append(
                f"- {STATUS_EMOJI[c['status']]} **{escape(c['id'])}** "
                f"({STATUS_LABEL[c['status']]} · {escape(c.get('surface') or '—')}{req}): "
                f"{escape(c.get('title', ''))}"
            )
            if c["message"]:
                lines.append(f"  <br>{escape(c['message'], MESSAGE_LIMIT)}")
            bad = [t for t in c["tests"] if t["outcome"] in ("failed", "error")]
            for t in bad[:TESTS_LIMIT]:
                same = (t.get("message") or "").strip() == c["message"].strip()
                msg = "" if same else escape(t.get("message"), MESSAGE_LIMIT)
                lines.append(
                    f"  - {_code(t['nodeid'])} {t['outcome']}" + (f": {msg}" if msg else "")
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
    if report.get("deselected"):
        lines.append("### Not run in this report")
        lines.append(f"- partial run; clauses not run: {escape(', '.join(report['deselected']))}")
        lines.append("")
    if report.get("problems"):
        lines.append("### Run problems")
        lines.extend(f"- {escape(p)}" for p in report["problems"])
        lines.append("")

    waived = [c for c in sorted_clauses(report["clauses"]) if c.get("waiver")]
    if waived:
        lines.append("### Waivers")
        rows = []
        for c in waived:
            w = c["waiver"]
            expires = escape(w["expires"]) + (" **(expired)**" if w.get("expired") else "")
            reason = escape(w["reason"], 300)
            if w.get("link"):
                reason += f" ([link]({w['link'].replace(')', '%29').replace(' ', '%20')}))"
            rows.append(
                [escape(c["id"]), STATUS_LABEL[c["status"]], escape(w["category"]), expires, reason]
            )
        lines.extend(_table(["Clause", "Status", "Category", "Expires", "Reason"], rows))
        lines.append("")

    lines.append("### Clauses")
    rows = []
    for c in sorted_clauses(report["clauses"]):
        n_pass = sum(t["outcome"] == "passed" for t in c["tests"])
        rows.append(
            [
                STATUS_EMOJI[c["status"]],
                escape(c["id"]),
                escape(c.get("surface") or "—"),
                STATUS_LABEL[c["status"]] + ("" if c.get("required", True) else " (advisory)"),
                f"{n_pass}/{len(c['tests'])}",
                fmt_duration(c.get("duration_s")),
                escape(c["message"], NOTE_LIMIT),
            ]
        )
    lines.extend(_table(["", "Clause", "Surface", "Status", "Tests", "Time", "Note"], rows))
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
            f"{killed}/{len(mutants)} mutants killed across {len(kill_matrix_columns(km))} clauses."
        )
        lines.append("")
        rows = []
        for m in sorted(mutants, key=lambda m: (m["killed"], m["name"])):
            missed = [x for x in m["expected"] if x not in m["failed"]]
            extra = [x for x in m["failed"] if x not in m["expected"]]
            rows.append(
                [
                    escape(m["name"]),
                    "✅ killed" if m["killed"] else
                    f"💥 error: {escape(m['error'], NOTE_LIMIT)}" if m.get("error") else
                    "❌ survived",
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
