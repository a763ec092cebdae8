"""report.html: one self-contained page (no network) for a reader with a browser.

Everything is inline: CSS, a small filter script, and the plots as base64 PNGs drawn with
matplotlib's Agg canvas (a `Figure` bound to `FigureCanvasAgg`, so pyplot's global state and
backend are never touched). Every report string reaches the page through Jinja2 with autoescape
on; the script reads data attributes, never report text, so a message cannot inject code.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

from ._common import (
    EFFECT_HEADER,
    STATUS_LABEL,
    cells_line,
    clause_cells_cell,
    data_path_summary,
    family_matrix,
    first_line,
    flatten,
    fmt_duration,
    fmt_num,
    headline,
    is_flat,
    iter_metrics,
    kill_cell,
    kill_matrix_columns,
    metric_overview,
    mutant_effect_caption,
    mutant_effect_rows,
    not_tested_lines,
    partial_clauses,
    scope_text,
    sorted_clauses,
)
from .diff import METRIC_TOLERANCES
from .gate import gate
from .model import QUANTILES, STATUSES
from .surfaces import joint_groups, score_text, surface_scores
from .surfaces import verdict_word as surface_word

TEMPLATE_DIR = Path(__file__).with_name("templates")
# A span of two decades or more is plotted on a log axis: a ratio whose tail reaches 1e3
# squashes its bulk near 1 into one pixel column on a linear axis.
LOG_SPAN = 100.0
_FIGSIZE = (5.6, 3.2)  # inches at 100 dpi: two plots side by side in a 1200 px column
_DPI = 100
_MARGINS = dict(left=0.13, right=0.97, top=0.90, bottom=0.27)
_COLORS = {
    "min": "#0969da",
    "max": "#cf222e",
    "mean": "#1f2328",
    "fill": "#8c959f",
    "target": "#1a7f37",
}


@cache
def _environment():
    import jinja2

    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATE_DIR),
        autoescape=True,  # explicit: select_autoescape would not match the .html.j2 name
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )


def _spans_decades(lo: float | None, hi: float | None) -> bool:
    return lo is not None and hi is not None and lo > 0 and hi / lo >= LOG_SPAN


def _target(name: str) -> float | None:
    for tol in METRIC_TOLERANCES.get(name, ()):
        if tol.target is not None:
            return tol.target
    return None


def _figure():
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # Fixed margins, not a layout engine: constrained layout measured every tick label and
    # drew each figure twice (a dry run, then the pixels), ~60 % of a report's render time.
    # The left margin holds an 8-character tick label and the y label; the bottom one the
    # x label and one legend row below it.
    fig = Figure(figsize=_FIGSIZE, dpi=_DPI)
    fig.subplots_adjust(**_MARGINS)
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=_DPI)
    return buf.getvalue()


def _point_pad(value: float) -> float:
    # A point mass (every value identical, the on-policy probs_ratio) is drawn centred in a
    # +-5 % window; matplotlib's default would put it on an edge with a "+1" offset label.
    return abs(value) * 0.05 or 0.05


def _finish(fig, ax, title: str, ncol: int) -> bytes:
    ax.set_title(title, fontsize=10)
    ax.tick_params(labelsize=8)
    # Below the axes, not "best": inside, a legend hides the tail a reader looks for.
    fig.legend(loc="lower center", ncol=ncol, fontsize=7, frameon=False,
               bbox_to_anchor=(0.5, 0.0))
    return _png(fig)


def plot_distribution(
    title: str, metric: Mapping[str, Any], target: float | None = None
) -> bytes | None:
    """Histogram with min/mean/max lines; None when there is nothing finite to draw."""
    if not metric.get("count") or metric.get("min") is None:
        return None
    lo, hi, n = metric["min"], metric["max"], metric["count"]
    fig, ax = _figure()
    hist = metric.get("histogram") or {}
    if lo == hi:
        ax.vlines(
            [lo], 0, n, color=_COLORS["fill"], linewidth=8, label=f"all {n} values = {lo:.9g}"
        )
        ax.set_xlim(lo - _point_pad(lo), lo + _point_pad(lo))
        ax.set_ylim(0, n * 1.1)
        ax.ticklabel_format(axis="x", useOffset=False)
    else:
        if hist.get("counts"):
            ax.stairs(
                hist["counts"],
                hist["edges"],
                fill=True,
                color=_COLORS["fill"],
                alpha=0.6,
                label=f"n = {n}",
            )
        else:
            qs = [v for v in (metric.get("quantiles") or {}).values() if v is not None]
            ax.plot(qs, [0] * len(qs), "|", color=_COLORS["fill"], markersize=20, label="quantiles")
        for stat, style in (("min", "--"), ("mean", "-"), ("max", "--")):
            ax.axvline(
                metric[stat],
                color=_COLORS[stat],
                linestyle=style,
                linewidth=1.2,
                label=f"{stat} {metric[stat]:.6g}",
            )
        if hist.get("scale") == "log" or _spans_decades(lo, hi):
            ax.set_xscale("log")
        else:
            ax.ticklabel_format(axis="x", useOffset=False)
    if target is not None:
        ax.axvline(
            target,
            color=_COLORS["target"],
            linestyle=":",
            linewidth=1.4,
            label=f"target {target:g}",
        )
    ax.set_ylabel("count", fontsize=9)
    if metric.get("nonfinite"):
        ax.annotate(
            f"{metric['nonfinite']} NaN/inf left out",
            (0.01, 0.97),
            xycoords="axes fraction",
            va="top",
            fontsize=8,
            color=_COLORS["max"],
        )
    return _finish(fig, ax, title, ncol=5)


def plot_series(title: str, metric: Mapping[str, Any], target: float | None = None) -> bytes | None:
    """Per-step min..max band (and 5-95 % band) around the mean; None when no step has data."""
    points = [(s, v) for s, v in zip(metric["steps"], metric["values"]) if v.get("count")]
    if not points:
        return None
    steps = [s for s, _ in points]
    lows = [v["min"] for _, v in points]
    highs = [v["max"] for _, v in points]
    means = [v["mean"] for _, v in points]
    fig, ax = _figure()
    ax.fill_between(steps, lows, highs, color=_COLORS["fill"], alpha=0.25, label="min–max")
    q05 = [(v.get("quantiles") or {}).get("0.05") for _, v in points]
    q95 = [(v.get("quantiles") or {}).get("0.95") for _, v in points]
    if all(q is not None for q in q05 + q95):
        ax.fill_between(steps, q05, q95, color=_COLORS["fill"], alpha=0.45, label="5–95 %")
    ax.plot(steps, lows, ".-", color=_COLORS["min"], linewidth=0.8, markersize=3, label="min")
    ax.plot(steps, means, "o-", color=_COLORS["mean"], linewidth=1.4, markersize=3, label="mean")
    ax.plot(steps, highs, ".-", color=_COLORS["max"], linewidth=0.8, markersize=3, label="max")
    if target is not None:
        ax.axhline(
            target,
            color=_COLORS["target"],
            linestyle=":",
            linewidth=1.2,
            label=f"target {target:g}",
        )
    if min(lows) == max(highs):
        ax.set_ylim(lows[0] - _point_pad(lows[0]), lows[0] + _point_pad(lows[0]))
        ax.ticklabel_format(axis="y", useOffset=False)
    elif _spans_decades(min(lows), max(highs)):
        ax.set_yscale("log")
    else:
        ax.ticklabel_format(axis="y", useOffset=False)
    if len(steps) > 1:
        ax.set_xlim(min(steps), max(steps))
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("step", fontsize=9)
    return _finish(fig, ax, title, ncol=6)


def plot_metric(clause_id: str, name: str, metric: Mapping[str, Any]) -> bytes | None:
    """PNG bytes of one metric's plot (scalars have none); reusable outside the page."""
    title = f"{clause_id} · {name}"
    if metric["kind"] == "distribution":
        return plot_distribution(title, metric, _target(name))
    if metric["kind"] == "series":
        return plot_series(title, metric, _target(name))
    return None


def _anchor(*parts: str) -> str:
    return "-".join("".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in p) for p in parts)


def _stat_row(name: str, kind: str, d: Mapping[str, Any], anchor: str | None) -> dict[str, Any]:
    q = d.get("quantiles") or {}
    return {
        "name": name,
        "kind": kind,
        "anchor": anchor,
        "count": fmt_num(d.get("count")),
        "nonfinite": d.get("nonfinite") or 0,
        "min": fmt_num(d.get("min")),
        "quantiles": [fmt_num(q.get(repr(x))) for x in QUANTILES],
        "max": fmt_num(d.get("max")),
        "mean": fmt_num(d.get("mean")),
        "std": fmt_num(d.get("std")),
    }


def _clause_view(clause: Mapping[str, Any], plotted: set[tuple[str, str]]) -> dict[str, Any]:
    metrics = []
    for name in sorted(clause.get("metrics") or {}):
        m = clause["metrics"][name]
        anchor = _anchor("plot", clause["id"], name) if (clause["id"], name) in plotted else None
        if m["kind"] == "distribution":
            metrics.append({**_stat_row(name, "distribution", m, anchor), "steps": []})
        elif m["kind"] == "series":
            o = metric_overview(m)
            row = _stat_row(
                name,
                f"series ({len(m['steps'])} steps)",
                {"count": o["count"], "min": o["min"], "max": o["max"], "mean": o["mean"]},
                anchor,
            )
            row["steps"] = [
                {"step": s, **_stat_row(name, "step", v, None)}
                for s, v in zip(m["steps"], m["values"])
            ]
            metrics.append(row)
        else:
            v = m["value"]
            metrics.append(
                {
                    **_stat_row(name, "scalar", {"count": 1, "min": v, "max": v, "mean": v}, None),
                    "steps": [],
                }
            )
    tests = [
        {
            "nodeid": t["nodeid"],
            "outcome": t["outcome"],
            "duration": fmt_duration(t.get("duration_s")),
            "message": t.get("message") or "",
            "kind": t.get("failure_kind") or "",
            "example": (t.get("hypothesis") or {}).get("example") or "",
            "blob": (t.get("hypothesis") or {}).get("blob") or "",
        }
        for t in clause["tests"]
    ]
    return {
        "id": clause["id"],
        "anchor": _anchor("clause", clause["id"]),
        "title": clause.get("title") or "",
        "surface": clause.get("surface") or "none",
        "status": clause["status"],
        "label": STATUS_LABEL[clause["status"]],
        "required": clause.get("required", True),
        "capabilities": clause.get("capabilities") or [],
        "defect": clause.get("defect") or "",
        "mutants": clause.get("mutants") or [],
        "message": clause["message"],
        "short": first_line(clause["message"], 140),
        "duration": fmt_duration(clause.get("duration_s")),
        "n_tests": len(tests),
        "n_passed": sum(t["outcome"] == "passed" for t in tests),
        "n_waived": sum(t["outcome"] == "waived" for t in tests),
        "cells": clause_cells_cell(clause),
        "tests": tests,
        "metrics": metrics,
        "waivers": [{**w, "scope_text": scope_text(w)} for w in clause.get("waivers") or ()],
    }


def _data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def _surface_rows(report: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A row per surface the backend implements: its verdict, score and counts, and the
    clauses that judged it jointly with parts the reference lent, grouped by those parts."""
    return [{"surface": e["surface"], "word": surface_word(e), "score": score_text(e),
             "passed": e["passed"], "partial": e["passed_partial"], "waived": e["waived"],
             "failed": e["failed"], "not_run": e["not_run"],
             "joint": [(", ".join(lent), ", ".join(ids)) for lent, ids in joint_groups(e)]}
            for e in surface_scores(report)["surfaces"]]


def render_html(report: Mapping[str, Any]) -> str:
    verdict = gate(report)
    summary = report["summary"]
    plots = []
    for clause, name, metric in iter_metrics(report):
        if is_flat(metric):
            continue  # no spread: its table row says it all; a plot per family would bloat the page
        png = plot_metric(clause["id"], name, metric)
        if png is None:
            continue
        plots.append(
            {
                "clause": clause["id"],
                "name": name,
                "kind": metric["kind"],
                "anchor": _anchor("plot", clause["id"], name),
                "clause_anchor": _anchor("clause", clause["id"]),
                "src": _data_uri(png),
                "alt": f"{metric['kind']} of {name} for {clause['id']}",
            }
        )
    plotted = {(p["clause"], p["name"]) for p in plots}
    clauses = [_clause_view(c, plotted) for c in sorted_clauses(report["clauses"])]
    km = report.get("kill_matrix")
    kill = None
    if km and km["mutants"]:
        columns = kill_matrix_columns(km)
        kill = {
            "columns": columns,
            "killed": sum(m["killed"] for m in km["mutants"]),
            "rows": [
                {
                    "name": m["name"],
                    "defect": m.get("defect") or "",
                    "killed": m["killed"],
                    "error": "" if m["killed"] else m.get("error") or (
                        "failed only by exceptions, no clause assertion" if m["failed"] else ""),
                    "cells": [kill_cell(m, c) for c in columns],
                }
                for m in sorted(km["mutants"], key=lambda m: (m["killed"], m["name"]))
            ],
        }
    info = report["backend_info"]
    provenance = [
        ("backend.surfaces", ", ".join(info["surfaces"])),
        ("backend.capabilities", ", ".join(info["capabilities"]) or "—"),
    ]
    if info.get("source"):
        provenance.append(("backend.source", info["source"]))
    provenance += [(k, fmt_num(v)) for k, v in flatten(report["provenance"])]
    surfaces = sorted({c["surface"] for c in clauses})
    context = {
        "report": report,
        "backend": report["backend"],
        "description": info.get("description") or "",
        "ok": verdict.ok,
        "badge": verdict.word,
        "reasons": verdict.reasons,
        "headline": headline(report),
        "families": family_matrix(report),
        "counts": [(s, STATUS_LABEL[s], summary[s]) for s in STATUSES],
        "total": summary["total"],
        "clauses": clauses,
        "surfaces": surfaces,
        "statuses": [(s, STATUS_LABEL[s], summary[s]) for s in STATUSES if summary[s]],
        "quantile_labels": [f"p{round(q * 100):02d}" for q in QUANTILES],
        "plots": plots,
        "kill": kill,
        "problems": report.get("problems") or [],
        "deselected": report.get("deselected") or [],
        "cells_line": cells_line(report),
        "partial_clauses": partial_clauses(report, 5),
        "not_tested": not_tested_lines(report),
        "surface_scores": _surface_rows(report),
        "not_scored": surface_scores(report)["not_scored"],
        "data_path": data_path_summary(report),
        "effects": None if not (report.get("mutant_effects") or {}).get("rows") else {
            "caption": mutant_effect_caption(report["mutant_effects"]),
            "header": EFFECT_HEADER, "rows": mutant_effect_rows(report["mutant_effects"])},
        "provenance": provenance,
        "generated": report["provenance"].get("finished_at") or "",
        "version": report["provenance"].get("rlconform_version") or "",
    }
    return _environment().get_template("report.html.j2").render(**context)
