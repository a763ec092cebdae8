"""Formatting shared by the Markdown, HTML and JUnit renderers, so they agree on every number."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from .model import STATUS_SEVERITY

STATUS_LABEL = {
    "passed": "passed",
    "failed": "failed",
    "waived": "waived",
    "xpass": "unexpected pass",
    "skipped": "skipped",
    "not_applicable": "not applicable",
    "error": "error",
}
STATUS_EMOJI = {
    "passed": "✅",
    "failed": "❌",
    "waived": "🟡",
    "xpass": "⚠️",
    "skipped": "⏭️",
    "not_applicable": "➖",
    "error": "💥",
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


def score_note(summary: Mapping[str, Any]) -> str:
    """What the score leaves implicit when waivers count in it: how many applicable clauses
    pass without one ("" when none is waived)."""
    waived = summary.get("waived", 0)
    if not waived:
        return ""
    applicable = summary["total"] - summary.get("not_applicable", 0)
    return (f"waivers included: {summary.get('passed', 0)} of {applicable} applicable clauses "
            f"pass without one")


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
    """Nested provenance as dotted key/value rows (packages.torch, device.name, ...)."""
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
                 "SIR mean", "Peak GiB", "Numeric gate alone", "Killed by (exact clauses)"]


def mutant_effect_rows(effects: Mapping[str, Any]) -> list[list[str]]:
    """The mutants' numeric effect (e2e/mutant_effects.py) as table rows of plain text."""

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
                     num(r, "peak_gib"), verdict, ", ".join(r.get("killed_by") or []) or "—"])
    return rows


def mutant_effect_caption(effects: Mapping[str, Any]) -> str:
    gates = "; ".join(f"{k} {v}" for k, v in (effects.get("gates") or {}).items())
    return (f"One data-plane GRPO step per mutant and family at model size "
            f"{effects.get('model_size', '?')} ({effects.get('device', '?')}, "
            f"{effects.get('dtype', '?')}). Numeric gates: {gates}. A mutant the gates miss is "
            "caught only by the exact clauses in the last column; mutants that need their own "
            "settings (truncation, dynamic micro-batches, several steps) show no effect in a "
            "plain step.")
