"""The report model: the versioned JSON schema, loading and validation, and metric summaries.

The report is a plain dict (it round-trips through JSON unchanged), checked against
`schema.json` and against the cross-field rules a schema cannot express (summary counts match the
clauses, clause IDs are unique, series steps match their values, numbers are finite). Every
renderer, `diff` and `gate` read only validated reports, so they can index without guarding.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable, Mapping
from functools import cache
from pathlib import Path
from typing import Any

SCHEMA_VERSION = "2.1"
SCHEMA_PATH = Path(__file__).with_name("schema.json")

# Clause statuses in schema order; renderers sort by STATUS_SEVERITY instead, worst first.
STATUSES = ("passed", "passed_with_waivers", "waived", "failed", "error", "xpass", "skipped",
            "incomplete", "not_applicable")
TEST_OUTCOMES = ("passed", "failed", "error", "waived", "xpass", "skipped", "not_applicable")
WAIVER_CATEGORIES = ("backend-bug", "unsupported", "future")
# Statuses that mean "the backend does not conform here, and nothing excuses it" (skipped and
# incomplete: a declared clause that was not fully judged).
FAILING = frozenset({"failed", "error", "xpass", "skipped", "incomplete"})
# Accepted by the gate: passed, or failing only where a dated waiver says how.
ACCEPTED = frozenset({"passed", "passed_with_waivers", "waived"})
# Lower is shown first: what needs a reader's attention leads.
STATUS_SEVERITY = {
    "error": 0,
    "failed": 1,
    "xpass": 2,
    "skipped": 3,
    "incomplete": 4,
    "waived": 5,
    "passed_with_waivers": 6,
    "passed": 7,
    "not_applicable": 8,
}
QUANTILES = (0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99)
SCORE_ROUNDING = 0.005


class ReportValidationError(ValueError):
    """A report that does not match the schema; `path` is the JSON path of the first fault."""

    def __init__(self, path: str, message: str, source: str | None = None):
        self.path = path
        self.source = source
        where = f"{source}: " if source else ""
        super().__init__(f"{where}invalid report at {path}: {message}")


@cache
def load_schema() -> dict[str, Any]:
    return json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))


@cache
def _validator():
    import jsonschema

    cls = jsonschema.Draft202012Validator
    return cls(load_schema(), format_checker=cls.FORMAT_CHECKER)


def _json_path(parts: Iterable[Any]) -> str:
    out = "$"
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


def validate_report(obj: Any, source: str | None = None) -> None:
    """Raise `ReportValidationError` naming the JSON path of a fault, else return None.

    The fault named is jsonschema's most relevant one (`best_match`), ties broken by path so the
    message is the same from run to run; the count of further faults follows it.
    """
    import jsonschema

    errors = sorted(_validator().iter_errors(obj), key=lambda e: [str(p) for p in e.absolute_path])
    if errors:
        first = jsonschema.exceptions.best_match(errors) if len(errors) > 1 else errors[0]
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise ReportValidationError(_json_path(first.absolute_path), first.message + more, source)
    _check_semantics(obj, source)


def _check_semantics(report: Mapping[str, Any], source: str | None) -> None:
    """The rules between fields: what a renderer or the gate would otherwise trip over."""
    _check_finite(report, [], source)
    seen: dict[str, int] = {}
    for i, clause in enumerate(report["clauses"]):
        if clause["id"] in seen:
            raise ReportValidationError(
                f"$.clauses[{i}].id",
                f"duplicate clause id {clause['id']!r} (first at $.clauses[{seen[clause['id']]}])",
                source,
            )
        seen[clause["id"]] = i
        for name, metric in (clause.get("metrics") or {}).items():
            if metric["kind"] == "series" and len(metric["steps"]) != len(metric["values"]):
                raise ReportValidationError(
                    f"$.clauses[{i}].metrics.{name}",
                    f"{len(metric['steps'])} steps but {len(metric['values'])} values",
                    source,
                )
    counts = Counter(c["status"] for c in report["clauses"])
    summary = report["summary"]
    for status in STATUSES:
        if summary[status] != counts[status]:
            raise ReportValidationError(
                f"$.summary.{status}",
                f"says {summary[status]} but {counts[status]} clauses have status {status!r}",
                source,
            )
    if summary["total"] != len(report["clauses"]):
        raise ReportValidationError(
            "$.summary.total",
            f"says {summary['total']} but the report has {len(report['clauses'])} clauses",
            source,
        )
    if "not_run" in summary:
        shard = (report.get("provenance") or {}).get("shard") or {}
        not_run = len(report.get("deselected") or ()) + len(shard.get("clauses_elsewhere") or ())
        if summary["not_run"] != not_run:
            raise ReportValidationError(
                "$.summary.not_run",
                f"says {summary['not_run']} but {not_run} applicable clauses are deselected or "
                "in another shard", source)
    if "passed_partial" in summary:
        partial = sum(c["status"] == "passed" and bool((c.get("cells") or {}).get("dropped"))
                      for c in report["clauses"])
        if summary["passed_partial"] != partial:
            raise ReportValidationError(
                "$.summary.passed_partial",
                f"says {summary['passed_partial']} but {partial} passed clauses have dropped "
                "cells", source)
    expected = score(summary)
    # 0.005 admits a writer that rounds to two decimals, not a different definition of score.
    if (expected is None) != (summary["score"] is None) or (
        expected is not None and abs(summary["score"] - expected) > SCORE_ROUNDING
    ):
        raise ReportValidationError(
            "$.summary.score",
            f"says {summary['score']} but passed (without a waiver) / applicable is {expected}",
            source,
        )


def _check_finite(node: Any, path: list[Any], source: str | None) -> None:
    # json.dumps writes NaN/Infinity, which is not JSON: browsers and jq reject the file.
    if isinstance(node, float) and not math.isfinite(node):
        raise ReportValidationError(_json_path(path), f"{node} is not a finite number", source)
    if isinstance(node, Mapping):
        for key, value in node.items():
            _check_finite(value, [*path, key], source)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _check_finite(value, [*path, i], source)


def upgrade(obj: Any) -> Any:
    """A schema 1.x report in the 2.0 form, so a baseline written before 2.0 can still be
    diffed and gated against. 1.x scored waived clauses as passes and had one clause-wide
    waiver per clause; here its `waived` clauses stay waived, the score becomes passed over
    applicable, and each old waiver becomes a clause-wide entry of `waivers`. Anything else is
    returned unchanged (validation then says what is wrong)."""
    if not isinstance(obj, dict) or not str(obj.get("schema_version", "")).startswith("1."):
        return obj
    out = json.loads(json.dumps(obj))
    out["schema_version"] = SCHEMA_VERSION
    out["upgraded_from"] = obj["schema_version"]
    for clause in out.get("clauses") or ():
        if clause.get("status") == "passed" and str(clause.get("message", "")).startswith(
                "partial:"):
            clause["status"] = "incomplete"  # 1.x passed a clause on partial evidence
        old = clause.pop("waiver", None)
        clause["waivers"] = [] if not old else [{
            "index": 1, "category": old.get("category", "backend-bug"),
            "reason": old.get("reason") or "(no reason)", "link": old.get("link"),
            "expires": old.get("expires", "1970-01-01"), "expired": bool(old.get("expired")),
            "scope": {"params": {"family": old["families"]}} if old.get("families") else {}}]
    if isinstance(out.get("summary"), dict) and isinstance(out.get("clauses"), list):
        out["summary"] = summarize_clauses(out["clauses"])
    return out


def load_report(path: str | Path) -> dict[str, Any]:
    """Read and validate a report.json; every fault is a `ReportValidationError`. A schema 1.x
    report is upgraded first (`upgrade`)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ReportValidationError("$", f"cannot read: {exc.strerror or exc}", str(path)) from exc
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ReportValidationError(
            "$", f"not JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})", str(path)
        ) from exc
    obj = upgrade(obj)
    validate_report(obj, source=str(path))
    return obj


class ValidatedReport(dict):
    """A report dict already validated (by `as_report`, which upgrades it first, or by
    `write_reports`), so `as_report` returns it as it is. `write_reports` validates once and
    hands this to every renderer, which then skip the schema walk (~0.1-0.5 s a report, paid
    once per renderer before; the kill matrix writes one report per mutant). Read-only by
    convention: a changed copy must go through `as_report` again."""


def as_report(report_or_path: Mapping[str, Any] | str | Path) -> dict[str, Any]:
    """Accept a report dict (validated here, unless it is a `ValidatedReport` already) or a
    path to one, so callers take either."""
    if isinstance(report_or_path, ValidatedReport):
        return report_or_path
    if isinstance(report_or_path, (str, Path)):
        return load_report(report_or_path)
    report = upgrade(dict(report_or_path))
    validate_report(report)
    return ValidatedReport(report)


def applicable(summary: Mapping[str, int]) -> int:
    """Clauses that apply to the backend: those judged (total - not_applicable) and, from
    schema 2.1, those the run left out whole (`not_run`: deselected, or in another shard)."""
    return summary["total"] - summary.get("not_applicable", 0) + summary.get("not_run", 0)


def score(summary: Mapping[str, int]) -> float | None:
    """Clauses passed *without* a waiver on every cell in scope / applicable clauses.

    A waiver is a reviewed, dated exception the gate accepts, but it is not conformance: waived
    and passed-with-waivers clauses are shown beside the score, never folded in. None when
    nothing applied: 0/0 is not a score.

    Over a partial run (schema 2.1: cells dropped by -k, --surfaces, the model size, a shard)
    the score is a lower bound of the whole run's: a clause that passed only on the cells it
    judged (`passed_partial`) is not counted, and clauses left out whole (`not_run`) stay in
    the denominator, so dropping cells can never raise it. A report of schema 2.0 has neither
    count: its score is passed / (total - not_applicable), as it was written.
    """
    n = applicable(summary)
    if n <= 0:
        return None
    return (summary.get("passed", 0) - summary.get("passed_partial", 0)) / n


def summarize_clauses(clauses: Iterable[Mapping[str, Any]],
                      not_run: int | None = None) -> dict[str, Any]:
    """The `summary` block for a list of clauses (writers use it so counts cannot drift).
    `not_run`: applicable clauses the run left out whole (a writer of schema 2.1 gives it,
    and the summary then counts `passed_partial`, the passed clauses with dropped cells)."""
    clauses = list(clauses)
    counts = Counter(c["status"] for c in clauses)
    summary: dict[str, Any] = {status: counts[status] for status in STATUSES}
    summary["total"] = len(clauses)
    if not_run is not None:
        summary["not_run"] = not_run
        summary["passed_partial"] = sum(
            c["status"] == "passed" and bool((c.get("cells") or {}).get("dropped"))
            for c in clauses)
    summary["score"] = score(summary)
    return summary


def _as_float_array(values: Any):
    """A float64 numpy copy of a tensor, array or iterable of float()-able values.

    Tensors are detected by duck typing so this module never imports torch: bfloat16 has no
    numpy dtype, so a tensor is widened to float64 on its own side first.
    """
    import numpy as np

    if hasattr(values, "detach") and hasattr(values, "double"):
        return values.detach().double().cpu().reshape(-1).numpy().copy()
    if isinstance(values, np.ndarray):
        return values.astype(np.float64).reshape(-1)
    if isinstance(values, (int, float)):
        return np.asarray([float(values)], dtype=np.float64)
    return np.asarray([float(v) for v in values], dtype=np.float64)


def summarize_values(values: Any, histogram_bins: int | None = 30) -> dict[str, Any]:
    """Summarize metric values (a tensor, array or iterable of numbers) as a distribution.

    Quantiles use linear interpolation between order statistics (numpy's default, the same as
    `torch.quantile`); `std` is the population standard deviation. NaN and inf are counted in
    `nonfinite` and left out of the statistics (strict JSON cannot carry them, and one inf would
    hide the shape of everything else). The histogram is log-binned when all values are positive
    and span two decades or more, so a ratio whose tail reaches 1e3 still shows its bulk near 1.
    Pass `histogram_bins=None` for the entries of a per-step series.
    """
    import numpy as np

    arr = _as_float_array(values)
    finite = arr[np.isfinite(arr)]
    out: dict[str, Any] = {
        "kind": "distribution",
        "count": int(finite.size),
        "nonfinite": int(arr.size - finite.size),
    }
    if finite.size == 0:
        out.update(min=None, max=None, mean=None, std=None)
        out["quantiles"] = {_qkey(q): None for q in QUANTILES}
        if histogram_bins:
            out["histogram"] = {"edges": [], "counts": [], "scale": "linear"}
        return out
    lo, hi = float(finite.min()), float(finite.max())
    out.update(min=lo, max=hi, mean=float(finite.mean()), std=float(finite.std()))
    out["quantiles"] = {
        _qkey(q): float(v) for q, v in zip(QUANTILES, np.quantile(finite, QUANTILES))
    }
    if histogram_bins:
        if lo > 0 and hi / lo >= 100:
            edges = np.geomspace(lo, hi, histogram_bins + 1)
            scale = "log"
        else:
            edges = np.histogram_bin_edges(finite, bins=histogram_bins)
            scale = "linear"
        counts, edges = np.histogram(finite, bins=edges)
        out["histogram"] = {
            "edges": [float(e) for e in edges],
            "counts": [int(c) for c in counts],
            "scale": scale,
        }
    return out


def summarize_series(per_step: Mapping[int, Any] | Iterable[tuple[int, Any]]) -> dict[str, Any]:
    """A per-step series metric from {step: values} (or (step, values) pairs), steps sorted."""
    items = per_step.items() if isinstance(per_step, Mapping) else per_step
    pairs = sorted((int(step), values) for step, values in items)
    return {
        "kind": "series",
        "steps": [step for step, _ in pairs],
        "values": [summarize_values(values, histogram_bins=None) for _, values in pairs],
    }


def scalar_metric(value: float) -> dict[str, Any]:
    """A scalar metric; a NaN/inf value is stored as null (strict JSON has no NaN)."""
    value = float(value)
    return {"kind": "scalar", "value": value if math.isfinite(value) else None}


def _qkey(q: float) -> str:
    return repr(float(q))
