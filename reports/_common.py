"""Formatting shared by the Markdown, HTML and JUnit renderers, so they agree on every number."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from .model import STATUS_SEVERITY

STATUS_LABEL = {
    "passed": "passed",
    "passed_with_waivers": "passed with waivers",
    "waived": "waived",
    "failed": "failed",
    "error": "error",
    "xpass": "unexpected pass",
    "skipped": "skipped",
    "incomplete": "incomplete",
    "not_applicable": "not applicable",
}
# Plain-text marks: they render in any font (emoji turn into empty boxes in a headless browser
# without an emoji font) and read the same in a terminal, Markdown and HTML.
STATUS_MARK = {
    "passed": "PASS",
    "passed_with_waivers": "pass+w",
    "waived": "waived",
    "failed": "FAIL",
    "error": "ERROR",
    "xpass": "XPASS",
    "skipped": "SKIP",
    "incomplete": "partial",
    "not_applicable": "n/a",
}


def first_line(text: str | None, limit: int = 200) -> str:
    """The first non-blank line, cut to `limit`: a one-line reason from a traceback-sized text."""
    lines = [line for line in (text or "").strip().splitlines() if line.strip()]
    line = lines[0].strip() if lines else ""
    return line if len(line) <= limit else line[: limit - 1] + "…"


def not_tested_lines(report: Mapping[str, Any], limit: int = 6) -> list[str]:
    """One line per surface or capability the backend left out: its clauses, and why."""
    out = []
    for e in report.get("not_tested") or ():
        ids = e["clauses"]
        shown = ", ".join(ids[:limit]) + (f", … ({len(ids)} in all)" if len(ids) > limit else "")
        out.append(f"{e['kind']} {e['name']}: {shown}: {first_line(e['why'])}")
    return out


def data_path_summary(report: Mapping[str, Any]) -> dict | None:
    """The backend's declared data path for a report (Backend.data_path): a counts line, the
    steps (function, status, why) and the adapter's normalisations per clause; None when the
    backend declares no path."""
    info = report.get("backend_info") or {}
    steps = info.get("data_path") or []
    norms = info.get("normalisations") or {}
    if not steps and not norms:
        return None
    counts = {s: sum(p["status"] == s for p in steps) for s in ("entered", "stubbed", "rebuilt")}
    return {"counts": " · ".join(f"{n} {s}" for s, n in counts.items()),
            "steps": [(p["function"], p["status"], p.get("why") or "") for p in steps],
            "normalisations": sorted(norms.items())}


def fmt_num(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    return f"{seconds / 60:.1f} min"


def fmt_score(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def untested(report: Mapping[str, Any]) -> dict[str, int]:
    """Applicable-or-not clauses that were not judged, by why: `by_choice` (a surface the
    backend left out), `by_capability` (a capability it does not declare), `deselected` (left
    out of this run by -k, --surfaces or the model size)."""
    out = {"by_choice": 0, "by_capability": 0, "deselected": len(report.get("deselected") or ())}
    for e in report.get("not_tested") or ():
        out["by_choice" if e["kind"] == "surface" else "by_capability"] += len(e["clauses"])
    return out


def is_partial(report: Mapping[str, Any]) -> bool:
    """The run left cells of applicable clauses out: clauses deselected whole, a shard's report,
    or (schema 2.1) cells dropped inside clauses by -k, the model size, a surface selection."""
    shard = (report.get("provenance") or {}).get("shard")
    return bool(report.get("deselected") or shard or (report.get("cells") or {}).get("partial"))


def verdict_word(report: Mapping[str, Any]) -> str:
    """PASS only when nothing fails, nothing is partial and the run recorded no problem;
    PARTIAL when nothing failed but cells or clauses were left out of the run (the gate fails
    it, yet "FAIL: 24 of 24 pass" would misread it); else FAIL."""
    from .model import FAILING

    if any(c["status"] in FAILING for c in report["clauses"]) or report.get("problems"):
        return "FAIL"
    return "PARTIAL" if is_partial(report) else "PASS"


def cells_line(report: Mapping[str, Any]) -> str:
    """What the run judged, in cells (one collected parametrisation of a clause test): "cells:
    217 of 257 in scope judged; 40 dropped (40 by -k 'not llava_next')"; a report that predates
    cells says they were not recorded, and never a number it does not hold."""
    cells = report.get("cells")
    if not cells:
        return "cells not recorded"
    text = f"cells: {cells['judged']} of {cells['in_scope']} in scope judged"
    if cells.get("dropped"):
        why = "; ".join(f"{r['cells']} by {r['why']}" for r in cells.get("dropped_by") or ())
        text += f"; {cells['dropped']} dropped ({why})"
    if cells.get("unreported"):
        text += f"; {cells['unreported']} did not report"
    if cells.get("skipped"):
        text += f"; {cells['skipped']} skipped"
    if cells.get("not_applicable"):
        text += f"; {cells['not_applicable']} not applicable"
    if cells.get("partial") and cells.get("partial_ok"):
        text += " (partial run intended: --partial-ok)"
    return text


def partial_clauses(report: Mapping[str, Any], cells_shown: int = 3
                    ) -> list[tuple[str, str, list[str], int]]:
    """Clauses whose cells were dropped: (id, "judged/in scope", the first dropped cells' names,
    how many more), in report order."""
    out = []
    for c in report["clauses"]:
        cells = c.get("cells") or {}
        if not cells.get("dropped"):
            continue
        names = [d["cell"].rsplit("::", 1)[-1] for d in cells.get("dropped_cells") or ()]
        out.append((c["id"], f"{cells['judged']}/{cells['in_scope']}", names[:cells_shown],
                    cells["dropped"] - len(names[:cells_shown])))
    return out


def clause_cells_cell(clause: Mapping[str, Any]) -> str:
    """A clause table's cells column: `12/14` (judged / in scope), `12/14 (2 n/a)`; `—` for a
    report that did not record cells."""
    cells = clause.get("cells")
    if not cells:
        return "—"
    text = f"{cells['judged']}/{cells['in_scope']}"
    if cells.get("not_applicable"):
        text += f" ({cells['not_applicable']} n/a)"
    return text


def headline(report: Mapping[str, Any]) -> str:
    """The one line every renderer leads with: the verdict, the clauses that pass without a
    waiver over the applicable ones (the score), and beside it what is waived, failing and not
    tested, and the cells judged of those in scope. An incomplete run says so instead of a
    score; a partial run's score is a lower bound (reports/model.score)."""
    s = report["summary"]
    n_app = s["total"] - s.get("not_applicable", 0) + s.get("not_run", 0)
    incomplete = s.get("incomplete", 0) or any(
        p.startswith("run interrupted") or p.startswith("run stopped") or "no clause test ran" in p
        for p in report.get("problems") or ())
    passed = s.get("passed", 0) - s.get("passed_partial", 0)
    lower = "not_run" in s and is_partial(report)
    score = "score n/a: run incomplete" if incomplete else \
        f"score {fmt_score(s['score'])}, a lower bound: partial run" if lower else \
        f"score {fmt_score(s['score'])}"
    every = " on every cell in scope" if lower else ""
    parts = [f"{verdict_word(report)}: {passed} of {n_app} applicable clauses pass "
             f"without a waiver{every} ({score})"]
    beside = [f"{s[k]} {STATUS_LABEL[k]}" for k in
              ("passed_with_waivers", "waived", "failed", "error", "xpass", "skipped",
               "incomplete") if s.get(k)]
    if s.get("passed_partial"):
        beside.insert(0, f"{s['passed_partial']} passed on the cells judged only (not scored)")
    if beside:
        parts.append(", ".join(beside))
    u = untested(report)
    gaps = [f"{u['by_choice']} by a surface left out" if u["by_choice"] else "",
            f"{u['by_capability']} by a capability not declared" if u["by_capability"] else "",
            f"{u['deselected']} deselected" if u["deselected"] else ""]
    gaps = [g for g in gaps if g]
    if gaps:
        parts.append("not tested: " + ", ".join(gaps))
    if report.get("problems"):
        parts.append(f"{len(report['problems'])} run problem(s)")
    shard = (report.get("provenance") or {}).get("shard")
    if shard:
        parts.append(f"shard {shard['k']}/{shard['n']} of a run (its clauses judged on this "
                     "shard's tests; `rlconform merge` joins the shards)")
    parts.append(cells_line(report))
    return "; ".join(parts)


def sorted_clauses(clauses: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Worst news first (required before advisory), then by ID: the eye lands on what to do."""
    return sorted(
        clauses,
        key=lambda c: (STATUS_SEVERITY[c["status"]], not c.get("required", True), c["id"]),
    )


def metric_overview(metric: Mapping[str, Any]) -> dict[str, Any]:
    """min/mean/max (and count) of any metric kind; a series is pooled over its steps."""
    kind = metric["kind"]
    if kind == "scalar":
        v = metric["value"]
        return {"count": 1 if v is not None else 0, "min": v, "mean": v, "max": v, "steps": None}
    entries = metric["values"] if kind == "series" else [metric]
    present = [e for e in entries if e.get("count") and e.get("min") is not None]
    count = sum(e["count"] for e in present)
    return {
        "count": count,
        "min": min((e["min"] for e in present), default=None),
        "max": max((e["max"] for e in present), default=None),
        "mean": sum(e["mean"] * e["count"] for e in present) / count if count else None,
        "steps": len(metric["steps"]) if kind == "series" else None,
    }


def iter_metrics(report: Mapping[str, Any]) -> Iterator[tuple[Mapping[str, Any], str, Mapping]]:
    """(clause, metric name, metric) in clause-ID order, then metric name."""
    for clause in sorted(report["clauses"], key=lambda c: c["id"]):
        for name in sorted(clause.get("metrics") or {}):
            yield clause, name, clause["metrics"][name]


def flatten(obj: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """Nested provenance as dotted key/value rows (packages.torch, device.name, ...). The
    content fingerprint's per-file hashes (~150) read as their count: report.json has them."""
    if prefix == "content." and isinstance(obj, Mapping) and "files" in obj:
        return [("content.digest", obj.get("digest")),
                ("content.files", f"{len(obj['files'])} files (each one's hash: report.json)")]
    if isinstance(obj, Mapping):
        rows: list[tuple[str, Any]] = []
        for key, value in obj.items():
            rows.extend(flatten(value, f"{prefix}{key}."))
        return rows
    if isinstance(obj, list):
        return [(prefix[:-1], ", ".join(str(v) for v in obj))]
    return [(prefix[:-1], obj)]


def kill_matrix_columns(kill_matrix: Mapping[str, Any]) -> list[str]:
    cols: set[str] = set()
    for m in kill_matrix["mutants"]:
        cols.update(m["expected"])
        cols.update(m["failed"])
    return sorted(cols)


def kill_cell(mutant: Mapping[str, Any], clause_id: str) -> str:
    """'killed' (expected and failed), 'missed' (expected, passed), 'extra' (failed unasked)."""
    expected, failed = clause_id in mutant["expected"], clause_id in mutant["failed"]
    if expected and failed:
        return "killed"
    if expected:
        return "missed"
    if failed:
        return "extra"
    return ""


# A distribution whose spread is below float32 resolution carries no shape worth a plot (KL
# errors of 1e-13, ratios of exactly 1): its table row says it all.
FLAT_RTOL = 1e-6


def is_flat(metric: Mapping[str, Any]) -> bool:
    if metric.get("kind") != "distribution" or metric.get("min") is None:
        return False
    lo, hi = float(metric["min"]), float(metric["max"])
    return hi - lo <= FLAT_RTOL * max(1.0, abs(hi), abs(lo))


EFFECT_HEADER = ["Family", "Mutant", "probs_ratio min", "max", "mean", "tmpe mean", "tmpe max",
                 "SIR mean", "Peak GiB", "Numeric gate alone", "Killed by (kill matrix run)"]


def mutant_effect_rows(effects: Mapping[str, Any]) -> list[list[str]]:
    """The mutants' numeric effect (conformance/mutants/effects.py) as table rows of plain text."""

    def num(d: Mapping[str, Any] | None, key: str) -> str:
        return "—" if not d or key not in d else f"{d[key]:.6g}"

    rows = []
    for r in effects["rows"]:
        ratio, tmpe, sir = (r.get(k) or {} for k in ("probs_ratio", "token_mult_prob_error",
                                                     "sampling_importance_ratio"))
        verdict = {True: "catches", False: "misses", None: "crash"}.get(
            r.get("numeric_gate_catches"), "—")
        if r["mutant"] == "reference":
            verdict = "—"
        if r.get("error"):
            verdict = "crash: " + first_line(r["error"], 80)
        rows.append([r["family"], r["mutant"], num(ratio, "min"), num(ratio, "max"),
                     num(ratio, "mean"), num(tmpe, "mean"), num(tmpe, "max"), num(sir, "mean"),
                     num(r, "peak_gib"), verdict, _killed_by(r)])
    return rows


def _killed_by(row: Mapping[str, Any]) -> str:
    """The clauses a kill matrix run saw kill the mutant on this family's tests; "no kill
    matrix run" when the table was measured without one (never the catalogue's claims)."""
    if row["mutant"] == "reference":
        return "—"
    if "killed_by" not in row:
        return "no kill matrix run"
    return ", ".join(row["killed_by"]) or "none on this family"


def mutant_effect_caption(effects: Mapping[str, Any]) -> str:
    gates = "; ".join(f"{k} {v}" for k, v in (effects.get("gates") or {}).items())
    return (f"One data-plane GRPO step per mutant and family at model size "
            f"{effects.get('model_size', '?')} ({effects.get('device', '?')}, "
            f"{effects.get('dtype', '?')}). Numeric gates: {gates}. A mutant the gates miss is "
            "caught only by the exact clauses in the last column; mutants that need their own "
            "settings (truncation, dynamic micro-batches, several steps) show no effect in a "
            "plain step.")


def scope_text(waiver: Mapping[str, Any]) -> str:
    """A waiver's scope in one line: `tests test_a, test_b; family llava; match /regex/`."""
    scope = waiver.get("scope") or {}
    parts = []
    if scope.get("tests"):
        parts.append("tests " + ", ".join(scope["tests"]))
    for key, values in (scope.get("params") or {}).items():
        parts.append(f"{key} " + ", ".join(values))
    if scope.get("match"):
        parts.append(f"match /{scope['match']}/")  # the pattern as written, not repr()'d
    return "; ".join(parts) or "whole clause"


def family_cell(counts: Mapping[str, int]) -> str:
    """`3/3`, `2/3 w1`, `1/3 F2`: tests passed over tests run for one clause and family (w
    waived, F failed or error, X passed where a waiver expected a failure, S skipped)."""
    run = sum(n for k, n in counts.items() if k != "not_applicable")
    if not run:
        return "n/a"
    marks = {"w": counts.get("waived", 0), "F": counts.get("failed", 0) + counts.get("error", 0),
             "X": counts.get("xpass", 0), "S": counts.get("skipped", 0)}
    return f"{counts.get('passed', 0)}/{run}" + "".join(f" {m}{n}" for m, n in marks.items() if n)


def family_matrix(report: Mapping[str, Any]) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """Families tested, and per clause tested on families one cell per family (family_cell;
    "" where the clause has no test on that family)."""
    families = sorted({f for c in report["clauses"] for f in (c.get("by_family") or {})})
    rows = []
    for c in sorted(report["clauses"], key=lambda c: c["id"]):
        by = c.get("by_family") or {}
        if not by or c["status"] == "not_applicable":
            continue
        rows.append((c["id"], [family_cell(by[f]) if f in by else "" for f in families]))
    return families, rows
