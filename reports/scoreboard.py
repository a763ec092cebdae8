"""The scoreboard: every backend against every clause, on one page (Markdown and HTML).

It reads report.json files (each validated by `reports.model.load_report`): from the files named,
and from directories (every `report.json` below one, and every `*.json` directly in it, as the
committed reports in docs/backend-reports/ are named `<backend>-<version>.json`). A column per
report: the backend, the version of the system under test (`backend_info.version`), where and
how it ran, and its score (clauses passed *without* a waiver over applicable clauses; what is
waived or untested stands beside it); a row per clause, in catalogue order, then any clause only
an older or newer report knows. A cell is the clause's status in that report; a waived clause
names its waivers' categories, and their reasons are a footnote (Markdown) or a tooltip (HTML),
as is a failure's message. A clause a report does not have (it predates the clause) shows as
absent. A report made under another clause catalogue than the current one is marked stale.
Columns are ordered by the score, the reference first.

`rlconform scoreboard docs/backend-reports --md docs/scoreboard.md --html scoreboard.html`
"""

from __future__ import annotations

import html
import os
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._common import (
    STATUS_LABEL,
    STATUS_MARK,
    cells_line,
    family_cell,
    fmt_score,
    is_partial,
    untested,
)
from .model import STATUSES, ReportValidationError, load_report
from .surfaces import score_text, surface_scores

ABSENT = "absent"
ABSENT_MARK = "-"
ABSENT_NOTE = "the report has no such clause (it predates it, or the catalogue dropped it)"
TITLE = "rlconform scoreboard"


@dataclass
class Entry:
    """One report, as a scoreboard column."""

    path: Path
    report: dict[str, Any]
    md_report: Path | None = None  # the Markdown report beside the JSON, when there is one
    label: str = ""  # the column's name: the backend, or its report's stem where it has several

    def __post_init__(self) -> None:
        self.label = self.label or self.backend

    @property
    def backend(self) -> str:
        return self.report["backend"]

    @property
    def version(self) -> str:
        return self.report["backend_info"].get("version") or ""

    @property
    def clauses(self) -> dict[str, Mapping[str, Any]]:
        return {c["id"]: c for c in self.report["clauses"]}

    @property
    def score(self) -> float:
        s = self.report["summary"]["score"]
        return -1.0 if s is None else s

    def stale(self, current: str | None) -> bool:
        """Made under another clause catalogue (or before reports recorded one), or a file its
        verdicts rest on has changed since (its content fingerprint)."""
        if current is None:
            return False
        if self.report["provenance"].get("catalogue") != current:
            return True
        from rlconform.conformance.catalogue.content import changed

        return changed(self.report["provenance"].get("content")) != []


@dataclass
class Scoreboard:
    entries: list[Entry]
    clause_ids: list[str]
    titles: dict[str, str] = field(default_factory=dict)
    surfaces: dict[str, str] = field(default_factory=dict)
    catalogue: str | None = None  # the current catalogue's fingerprint

    def families(self) -> list[str]:
        return sorted({f for e in self.entries for c in e.report["clauses"]
                       for f in (c.get("by_family") or {})})


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
    """Columns: the reference first (the baseline), then by score (clauses passed without a
    waiver over applicable), best first; rows in catalogue order, then clauses that only a
    report knows (sorted)."""
    from rlconform.conformance.catalogue import CLAUSES, fingerprint

    entries = sorted(entries, key=lambda e: (e.backend != "reference", -e.score, e.backend,
                                             e.version, str(e.path)))
    seen: dict[str, Mapping[str, Any]] = {}
    for e in entries:
        for c in e.report["clauses"]:
            seen.setdefault(c["id"], c)
    ids = [c.id for c in CLAUSES if c.id in seen]
    ids += sorted(set(seen) - set(ids))
    runs = Counter(e.backend for e in entries)
    for e in entries:  # two versions of one backend (a framework before and after a fix)
        if runs[e.backend] > 1 and e.path.stem not in (e.backend, "report"):
            e.label = e.path.stem
        elif runs[e.backend] > 1:
            e.label = f"{e.backend} {e.version}"
    titles = {c.id: c.must for c in CLAUSES}
    surfaces = {c.id: c.surface for c in CLAUSES}
    for cid, c in seen.items():
        titles.setdefault(cid, c.get("title", ""))
        surfaces.setdefault(cid, c.get("surface", ""))
    return Scoreboard(list(entries), ids, titles, surfaces, fingerprint())


# -- cells --------------------------------------------------------------------------------------
def cell(entry: Entry, clause_id: str) -> tuple[str, str, str]:
    """(status, short label, note) of a clause in one report; the note is the waiver's reason
    (with its link and expiry) or the failure's message, "" when there is nothing to say."""
    c = entry.clauses.get(clause_id)
    if c is None:
        return ABSENT, ABSENT, ABSENT_NOTE
    status = c["status"]
    label = STATUS_MARK[status]
    waivers = c.get("waivers") or []
    if status in ("waived", "passed_with_waivers", "xpass") and waivers:
        n_w = sum(t["outcome"] == "waived" for t in c["tests"])
        label = f"{label} ({n_w}/{len(c['tests'])} tests)" if status != "xpass" else label
        notes = []
        for w in waivers:
            note = f"#{w['index']} {w['category']}: {w['reason']}"
            if w.get("function"):
                note += f" [{w['function']}]"
            if w.get("link"):
                note += f" ({w['link']})"
            note += f" [expires {w['expires']}]"
            notes.append(note)
        note = " ".join(" / ".join(notes).split())
        if status == "xpass":
            note = f"{c.get('message') or 'a waiver no longer holds'}. " + note
        return status, label, note
    if status in ("failed", "error", "skipped", "incomplete"):
        return status, label, " ".join((c.get("message") or "").split())
    return status, label, ""


def family_summary(entry: Entry, family: str) -> str:
    """One backend on one family: clauses all of whose tests on it pass without a waiver, over
    clauses tested on it; the tests' waived and failed counts beside."""
    tested = passing = 0
    total: dict[str, int] = {}
    for c in entry.report["clauses"]:
        counts = (c.get("by_family") or {}).get(family)
        if not counts or c["status"] == "not_applicable":
            continue
        tested += 1
        run = sum(n for k, n in counts.items() if k != "not_applicable")
        passing += counts.get("passed", 0) == run
        for k, n in counts.items():
            total[k] = total.get(k, 0) + n
    if not tested:
        return ""
    tests = family_cell(total)
    return f"{passing}/{tested} ({tests.split(' ', 1)[1] if ' ' in tests else 'all pass'})"


def score_cells(entry: Entry) -> list[str]:
    """score | passed with waivers | waived | failing | not tested (by choice / capability)."""
    s = entry.report["summary"]
    n_app = s["total"] - s.get("not_applicable", 0) + s.get("not_run", 0)
    failing = sum(s.get(k, 0) for k in ("failed", "error", "xpass", "skipped", "incomplete"))
    u = untested(entry.report)
    passed = s.get("passed", 0) - s.get("passed_partial", 0)
    # a partial run's score is a lower bound (reports/model.score); a report that recorded no
    # cells (schema 2.0) is shown as it was written
    partial = f", a lower bound: partial run, {cells_line(entry.report)}" \
        if "not_run" in s and is_partial(entry.report) else ""
    return [f"{fmt_score(s['score'])} ({passed}/{n_app}{partial})",
            str(s.get("passed_with_waivers", 0)), str(s.get("waived", 0)), str(failing),
            f"{u['by_choice']} / {u['by_capability']}"]


SURFACE_NOTE = ("Per surface: each surface a backend implements, scored on the applicable "
                "clauses whose tests touch it (passed without a waiver / applicable; a lower "
                "bound where cells or clauses were left out), with how many of them ran jointly "
                "with parts the reference lent; - where the backend does not implement the "
                "surface (lent: it takes the reference's).")


def surface_rows(board: Scoreboard) -> list[tuple[str, list[str]]]:
    """(surface, one cell per entry) for every surface some backend implements, in SURFACES
    order: `100.0% (24/24)`, `50.0% (6/12); 2 waived, 4 failing, 4 joint`, `lent`, `-`."""
    from rlconform.conformance.backend import SURFACES

    scores = [surface_scores(e.report) for e in board.entries]
    shown = [s for s in SURFACES if any(s in sc["implemented"] for sc in scores)]
    shown += sorted({s for sc in scores for s in sc["implemented"]} - set(shown))
    rows = []
    for surface in shown:
        cells = []
        for e, sc in zip(board.entries, scores):
            entry = next((x for x in sc["surfaces"] if x["surface"] == surface), None)
            if entry is None:
                lent = surface in (e.report["backend_info"].get("lent_surfaces") or ())
                cells.append("lent" if lent else ABSENT_MARK)
                continue
            beside = [f"{entry[k]} {label}" for k, label in (
                ("waived", "waived"), ("failed", "failing"), ("not_run", "not run"))
                if entry[k]]
            if entry["joint"]:
                beside.append(f"{len(entry['joint'])} joint")
            cells.append(score_text(entry) + (f"; {', '.join(beside)}" if beside else ""))
        rows.append((surface, cells))
    return rows


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
             "edit. Each column is one backend's run of the suite. The score is the clauses "
             "that pass **without a waiver** over the clauses that apply; clauses that pass "
             "only with waivers, waived clauses (dated waivers name the failures they accept: "
             "footnotes), failing clauses and clauses not tested (a surface left out / a "
             "capability not declared) stand beside it. Backends are ordered by score.", ""]
    if not board.entries:
        return "\n".join(lines + ["No reports.", ""])
    lines += ["| backend | system under test | run | score (passed/applicable) | passed with "
              "waivers | waived | failing | not tested (surface / capability) | report |",
              "|---|---|---|---|---|---|---|---|---|"]
    for e in board.entries:
        link = e.md_report or e.path
        ref = f"[{link.name}]({_rel(link, out)})" if out is not None else link.name
        stale = " **stale: made under another clause catalogue; regenerate**" \
            if e.stale(board.catalogue) else ""
        lines.append(f"| `{e.label}` | {_md_escape(e.version) or '—'} | "
                     f"{_md_escape(provenance_line(e.report))}{stale} | "
                     + " | ".join(score_cells(e)) + f" | {ref} |")
    lines += ["", SURFACE_NOTE, "",
              "| surface | " + " | ".join(f"`{e.label}`" for e in board.entries) + " |",
              "|---|" + "---|" * len(board.entries)]
    lines += [f"| {surface} | " + " | ".join(_md_escape(c) for c in cells) + " |"
              for surface, cells in surface_rows(board)]
    families = board.families()
    if families:
        lines += ["", "Per model family: clauses whose tests on the family all pass without a "
                  "waiver / clauses tested on it (w: waived tests, F: failed, X: unexpected "
                  "passes).", "",
                  "| family | " + " | ".join(f"`{e.label}`" for e in board.entries) + " |",
                  "|---|" + "---|" * len(board.entries)]
        for f in families:
            lines.append(f"| {f} | " + " | ".join(family_summary(e, f) or "-"
                                                  for e in board.entries) + " |")
    lines += ["", "| clause | surface | " + " | ".join(f"`{e.label}`" for e in board.entries)
              + " |", "|---|---|" + "---|" * len(board.entries)]
    notes: list[str] = []
    index: dict[str, int] = {}
    for cid in board.clause_ids:
        row = [f"{cid}", board.surfaces.get(cid, "")]
        for e in board.entries:
            status, label, note = cell(e, cid)
            text = label
            if note and status != ABSENT:
                key = f"{e.label}|{note}"
                if key not in index:
                    notes.append(f"[^{len(notes) + 1}]: `{e.label}` {cid}: {_md_escape(note)}")
                    index[key] = len(notes)
                text += f" [^{index[key]}]"
            row.append(text)
        lines.append("| " + " | ".join(row) + " |")
    legend = ", ".join(f"{STATUS_MARK[s]} {STATUS_LABEL[s]}" for s in STATUSES)
    lines += ["", f"Statuses: {legend}, {ABSENT_MARK} {ABSENT} ({ABSENT_NOTE}).", ""]
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
.passed{background:#dafbe1}.passed_with_waivers{background:#eef7d6}
.failed,.error,.xpass{background:#ffebe9}
.waived{background:#fff8c5}.skipped,.incomplete{background:#fbefff}
.stale{color:#cf222e;font-weight:600}
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
             "<p>Each column is one backend's run of the suite, ordered by score: clauses that "
             "pass <b>without a waiver</b> over the clauses that apply. Passed with waivers, "
             "waived, failing and not tested (surface left out / capability not declared) "
             "stand beside it. Hover a cell for the waivers' reasons or the failure's message."
             "</p>"]
    if not board.entries:
        return "".join(parts + ["<p>No reports.</p></body></html>"])
    parts.append("<table><thead><tr><th>clause</th><th>surface</th>")
    for e in board.entries:
        s = e.report["summary"]
        link = e.md_report or e.path
        href = _rel(link, out) if out is not None else link.as_posix()
        sc = score_cells(e)
        stale = "<br><span class='stale'>stale: another clause catalogue</span>" \
            if e.stale(board.catalogue) else ""
        parts.append(
            f"<th><code>{e_(e.label)}</code><br>{e_(e.version) or '—'}<br>"
            f"<small>{e_(provenance_line(e.report))}</small>{stale}<br>"
            f"score <b>{e_(sc[0])}</b><br><small>with waivers {e_(sc[1])}, waived {e_(sc[2])}"
            f", failing {e_(sc[3])}, not tested {e_(sc[4])}</small><br>"
            f"<small>{e_(counts_line(s))}</small>"
            f"<br><a href='{e_(href)}'>{e_(link.name)}</a></th>")
    parts.append("</tr></thead><tbody>")
    for cid in board.clause_ids:
        parts.append(f"<tr><td title='{e_(board.titles.get(cid, ''))}'>{e_(cid)}</td>"
                     f"<td>{e_(board.surfaces.get(cid, ''))}</td>")
        for e in board.entries:
            status, label, note = cell(e, cid)
            title = f" title='{e_(note)}'" if note else ""
            parts.append(f"<td class='s {status}'{title}>{e_(label)}</td>")
        parts.append("</tr>")
    parts.append("</tbody></table>")
    parts.append(f"<h2>Per surface</h2><p><small>{e_(SURFACE_NOTE)}</small></p>"
                 "<table id='surfaces'><thead><tr><th>surface</th>")
    parts += [f"<th><code>{e_(e.label)}</code></th>" for e in board.entries]
    parts.append("</tr></thead><tbody>")
    for surface, cells in surface_rows(board):
        parts.append(f"<tr><td>{e_(surface)}</td>"
                     + "".join(f"<td>{e_(c)}</td>" for c in cells) + "</tr>")
    parts.append("</tbody></table>")
    families = board.families()
    if families:
        parts.append("<h2>Per model family</h2><p><small>Clauses whose tests on the family all "
                     "pass without a waiver / clauses tested on it (w: waived tests, F: failed, "
                     "X: unexpected passes).</small></p><table><thead><tr><th>family</th>")
        parts += [f"<th><code>{e_(e.label)}</code></th>" for e in board.entries]
        parts.append("</tr></thead><tbody>")
        for f in families:
            parts.append(f"<tr><td>{e_(f)}</td>" + "".join(
                f"<td>{e_(family_summary(e, f) or '-')}</td>" for e in board.entries) + "</tr>")
        parts.append("</tbody></table>")
    legend = ", ".join(f"{STATUS_MARK[s]} {STATUS_LABEL[s]}" for s in STATUSES)
    parts.append(f"<p><small>{e_(legend)}, {ABSENT_MARK} {ABSENT}: {e_(ABSENT_NOTE)}"
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
