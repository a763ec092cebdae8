"""Conformance reports: the versioned JSON model and its renderings, diff and gate.

`write_reports(report, out_dir)` is the one call a runner needs; `gate` and `diff_reports` back
`rlconform gate` and `rlconform diff`. Renderers read only validated reports.
"""

from .diff import METRIC_TOLERANCES, DiffResult, Tolerance, diff_reports, render_diff
from .gate import EXIT_FAILED, EXIT_OK, EXIT_USAGE, GateResult, gate
from .html import render_html
from .junit import render_junit
from .markdown import render_markdown
from .model import (
    SCHEMA_VERSION,
    STATUSES,
    ReportValidationError,
    load_report,
    scalar_metric,
    score,
    summarize_clauses,
    summarize_series,
    summarize_values,
    validate_report,
)
from .write import write_reports

__all__ = [
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_USAGE",
    "METRIC_TOLERANCES",
    "SCHEMA_VERSION",
    "STATUSES",
    "DiffResult",
    "GateResult",
    "ReportValidationError",
    "Tolerance",
    "diff_reports",
    "gate",
    "load_report",
    "render_diff",
    "render_html",
    "render_junit",
    "render_markdown",
    "scalar_metric",
    "score",
    "summarize_clauses",
    "summarize_series",
    "summarize_values",
    "validate_report",
    "write_reports",
]
