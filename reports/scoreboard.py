"""The scoreboard: every backend against every clause, on one page (Markdown and HTML).

It reads report.json files (each validated by `reports.model.load_report`): from the files named,
and from directories (every `report.json` below one, and every `*.json` directly in it, as the
committed reports in docs/backend-reports/ are named `<backend>-<version>.json`). A column per
report: the backend, the version of the system under test (`backend_info.version`), where and
how it ran, and its score; a row per clause, in catalogue order, then any clause only an older
or newer report knows. A cell is the clause's status in that report; a waived clause names its
waiver's category, and the reason is a footnote (Markdown) or a tooltip (HTML), as is a failure's
message. A clause a report does not have (it predates the clause) shows as absent.

`rlconform scoreboard docs/backend-reports --md docs/scoreboard.md --html scoreboard.html`
"""

from __future__ import annotations

import html
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._common import STATUS_EMOJI, STATUS_LABEL, fmt_score
from .model import STATUSES, ReportValidationError, load_report

ABSENT = "absent"
ABSENT_EMOJI = "·"
ABSENT_NOTE = "the report has no such clause (it predates it, or the catalogue dropped it)"
TITLE = "rlconform scoreboard"


@dataclass
class Entry:
    """One report, as a scoreboard column."""

    path: Path
    report: dict[str, Any]
    md_report: Path | None = None  # the Markdown report beside the JSON, when there is one

    @property
    def backend(self) -> str:
        return self.report["backend"]

    @property
    def version(self) -> str:
        return self.report["backend_info"].get("version") or ""

    @property
    def clauses(self) -> dict[str, Mapping[str, Any]]:
        return {c["id"]: c for c in self.report["clauses"]}


@dataclass
class Scoreboard:
    entries: list[Entry]
    clause_ids: list[str]
    titles: dict[str, str] = field(default_factory=dict)
    surfaces: dict[str, str] = field(default_factory=dict)


# -- reading ------------------------------------------------------------------------------------
def report_paths(inputs: Iterable[str | Path]) -> list[tuple[Path, bool]]:
    """The report files the inputs name, each with whether it was named itself: a file as given;
    a directory's `report.json` files at any depth and its top-level `*.json` files. A missing
    input or a directory without one is an error naming it."""
    found: list[tuple[Path, bool]] = []
    for raw in inputs:
        p = Path(raw)
        if p.is_file():
            found.append((p, True))
        elif p.is_dir():
            here = sorted(set(p.rglob("report.json")) | set(p.glob("*.json")))
            if not here:
                raise ValueError(f"{p}: no report.json below it and no *.json in it")
            found.extend((f, False) for f in here)
        else:
            raise ValueError(f"{p}: no such file or directory")
    first: dict[Path, Path] = {}  # resolved -> as first given; named if any input names it
    named_any: dict[Path, bool] = {}
    for f, named in found:
        key = f.resolve()
        first.setdefault(key, f)
        named_any[key] = named_any.get(key, False) or named
    return [(f, named_any[key]) for key, f in first.items()]


def load_entries(inputs: Iterable[str | Path]) -> list[Entry]:
    """Every report the inputs name, validated; two reports of one backend at one version are
    an error naming both files (the scoreboard shows each backend version once). A mutant's
    report (`rlconform mutants` writes them under reports/out/mutants/) found in a directory is
    left out: mutants are the suite's own known-bad backends; name its file to show it."""
    entries: list[Entry] = []
    by_key: dict[tuple[str, str], Path] = {}
    for path, named in report_paths(inputs):
        try:
            report = load_report(path)
        except ReportValidationError as exc:
            raise ValueError(str(exc)) from exc
        if not named and report["backend_info"].get("source", "").startswith("mutant:"):
            continue
        entry = Entry(path, report)
        key = (entry.backend, entry.version)
        if key in by_key:
            raise ValueError(f"two reports of backend {entry.backend!r} "
                             f"{entry.version or '(no version)'}: {by_key[key]} and {path}")
        by_key[key] = path
        md = path.with_suffix(".md") if path.name != "report.json" else path.with_name("report.md")
        entry.md_report = md if md.is_file() else None
        entries.append(entry)
    return entries


def build(entries: Sequence[Entry]) -> Scoreboard:
    """Columns: the reference first (the baseline), then by backend and version; rows in
    catalogue order, then clauses that only a report knows (sorted)."""
    from rlconform.conformance.catalogue import CLAUSES

    entries = sorted(entries, key=lambda e: (e.backend != "reference", e.backend, e.version,
                                             str(e.path)))
    seen: dict[str, Mapping[str, Any]] = {}
    for e in entries:
        for c in e.report["clauses"]:
            seen.setdefault(c["id"], c)
    ids = [c.id for c in CLAUSES if c.id in seen]
    ids += sorted(set(seen) - set(ids))
    titles = {c.id: c.must for c in CLAUSES}
    surfaces = {c.id: c.surface for c in CLAUSES}
    for cid, c in seen.items():
        titles.setdefault(cid, c.get("title", ""))
        surfaces.setdefault(cid, c.get("surface", ""))
    return Scoreboard(list(entries), ids, titles, surfaces)


# -- cells --------------------------------------------------------------------------------------
def cell(entry: Entry, clause_id: str) -> tuple[str, str, str]:
    """(status, short label, note) of a clause in one report; the note is the waiver's reason
    (with its link and expiry) or the failure's message, "" when there is nothing to say."""
    c = entry.clauses.get(clause_id)
    if c is None:
        return ABSENT, ABSENT, ABSENT_NOTE
    status = c["status"]
    label = STATUS_LABEL[status]
    w = c.get("waiver")
    if status in ("waived", "xpass") and w:
        label = f"{label} ({w['category']})"
        note = f"{w['category']}: {w['reason']}"
        if w.get("link"):
            note += f" ({w['link']})"
        note += f" [expires {w['expires']}]"
        if status == "xpass":
            note = "passed although waived: remove the waiver. " + note
        return status, label, " ".join(note.split())
    if status in ("failed", "error", "skipped"):
        return status, label, " ".join((c.get("message") or "").split())
    return status, label, ""


def provenance_line(report: Mapping[str, Any]) -> str:
    """Where and how a report was made: profile, device, dtype, date, rlconform commit."""
    p = report["provenance"]
    dev = p["device"]
    device = dev.get("type", "?") + (f" ({dev['name']})" if dev.get("type") == "cuda"
                                     and dev.get("name") else "")
    parts = [f"profile {p.get('profile') or '?'}", device, p.get("dtype") or "?"]
    if p.get("finished_at"):
        parts.append(str(p["finished_at"])[:10])
    commit = p.get("git_commit")
    parts.append(f"rlconform {p['rlconform_version']}" + (f" @ {commit[:7]}" if commit else ""))
    return ", ".join(parts)


def counts_line(summary: Mapping[str, Any]) -> str:
    shown = [f"{summary[s]} {STATUS_LABEL[s]}" for s in STATUSES if summary.get(s)]
    return ", ".join(shown) or "no clauses"


def _rel(target: Path, start: Path) -> str:
    return Path(os.path.relpath(target.resolve(), start.resolve())).as_posix()


# -- Markdown -----------------------------------------------------------------------------------
def _md_escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(board: Scoreboard, out_dir: str | Path | None = None) -> str:
    """The scoreboard as GitHub Markdown; links to reports are relative to `out_dir` (where the
    page is written), absent when it is None."""
    out = Path(out_dir) if out_dir is not None else None
    lines = [f"# {TITLE}", "",
             "Generated by `rlconform scoreboard` from the report.json files named below; do not "
             "edit. Each column is one backend's run of the suite; a waived clause failed and a "
             "dated waiver (category and reason in the footnote) covers it; the score is "
             "(passed + waived) / applicable clauses.", ""]
    if not board.entries:
        return "\n".join(lines + ["No reports.", ""])
    lines += ["| backend | system under test | run | score | clauses | report |",
              "|---|---|---|---|---|---|"]
    for e in board.entries:
        s = e.report["summary"]
        link = e.md_report or e.path
        ref = f"[{link.name}]({_rel(link, out)})" if out is not None else link.name
        lines.append(f"| `{e.backend}` | {_md_escape(e.version) or '—'} | "
                     f"{_md_escape(provenance_line(e.report))} | {fmt_score(s['score'])} | "
                     f"{counts_line(s)} | {ref} |")
    lines += ["", "| clause | surface | " + " | ".join(f"`{e.backend}`" for e in board.entries)
              + " |", "|---|---|" + "---|" * len(board.entries)]
    notes: list[str] = []
    index: dict[str, int] = {}
    for cid in board.clause_ids:
        row = [f"{cid}", board.surfaces.get(cid, "")]
        for e in board.entries:
            status, label, note = cell(e, cid)
            emoji = ABSENT_EMOJI if status == ABSENT else STATUS_EMOJI[status]
            text = f"{emoji} {label}"
            if note and status != ABSENT:
                key = f"{e.backend}|{note}"
                if key not in index:
                    notes.append(f"[^{len(notes) + 1}]: `{e.backend}` {cid}: {_md_escape(note)}")
                    index[key] = len(notes)
                text += f" [^{index[key]}]"
            row.append(text)
        lines.append("| " + " | ".join(row) + " |")
    legend = ", ".join(f"{STATUS_EMOJI[s]} {STATUS_LABEL[s]}" for s in STATUSES)
    lines += ["", f"Statuses: {legend}, {ABSENT_EMOJI} {ABSENT} ({ABSENT_NOTE}).", ""]
    if notes:
        lines += notes + [""]
    return "\n".join(lines)


# -- HTML ---------------------------------------------------------------------------------------
_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#1f2328}
table{border-collapse:collapse;margin:1em 0}
th,td{border:1px solid #d0d7de;padding:4px 8px;vertical-align:top;text-align:left}
thead th{position:sticky;top:0;background:#f6f8fa}
td.s{white-space:nowrap}
.passed{background:#dafbe1}.failed,.error,.xpass{background:#ffebe9}
.waived{background:#fff8c5}.skipped{background:#fbefff}
.not_applicable{color:#656d76}.absent{color:#8c959f;background:#f6f8fa}
td[title]{cursor:help;text-decoration:underline dotted}
small{color:#656d76}
"""


def render_html(board: Scoreboard, out_dir: str | Path | None = None) -> str:
    """The scoreboard as one self-contained HTML page; every report string is escaped."""
    e_ = html.escape
    out = Path(out_dir) if out_dir is not None else None
    parts = ["<!doctype html><html><head><meta charset='utf-8'>",
             f"<title>{TITLE}</title><style>{_CSS}</style></head><body>",
             f"<h1>{TITLE}</h1>",
             "<p>Each column is one backend's run of the suite. Hover a cell for the waiver's "
             "reason or the failure's message. Score: (passed + waived) / applicable clauses."
             "</p>"]
    if not board.entries:
        return "".join(parts + ["<p>No reports.</p></body></html>"])
    parts.append("<table><thead><tr><th>clause</th><th>surface</th>")
    for e in board.entries:
        s = e.report["summary"]
        link = e.md_report or e.path
        href = _rel(link, out) if out is not None else link.as_posix()
        parts.append(
            f"<th><code>{e_(e.backend)}</code><br>{e_(e.version) or '—'}<br>"
            f"<small>{e_(provenance_line(e.report))}</small><br>"
            f"score <b>{e_(fmt_score(s['score']))}</b><br><small>{e_(counts_line(s))}</small>"
            f"<br><a href='{e_(href)}'>{e_(link.name)}</a></th>")
    parts.append("</tr></thead><tbody>")
    for cid in board.clause_ids:
        parts.append(f"<tr><td title='{e_(board.titles.get(cid, ''))}'>{e_(cid)}</td>"
                     f"<td>{e_(board.surfaces.get(cid, ''))}</td>")
        for e in board.entries:
            status, label, note = cell(e, cid)
            emoji = ABSENT_EMOJI if status == ABSENT else STATUS_EMOJI[status]
            title = f" title='{e_(note)}'" if note else ""
            parts.append(f"<td class='s {status}'{title}>{emoji} {e_(label)}</td>")
        parts.append("</tr>")
    parts.append("</tbody></table>")
    legend = ", ".join(f"{STATUS_EMOJI[s]} {STATUS_LABEL[s]}" for s in STATUSES)
    parts.append(f"<p><small>{e_(legend)}, {ABSENT_EMOJI} {ABSENT}: {e_(ABSENT_NOTE)}"
                 "</small></p></body></html>")
    return "".join(parts)


def write(inputs: Iterable[str | Path], md: str | Path | None, html_path: str | Path | None
          ) -> Scoreboard:
    """Load the reports, write the pages asked for, return the board."""
    board = build(load_entries(inputs))
    for path, render in ((md, render_markdown), (html_path, render_html)):
        if path is None:
            continue
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(render(board, path.parent), encoding="utf-8")
    return board
