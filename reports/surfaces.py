"""Scores per surface: a verdict on each surface the backend implements, not on the parts the
reference lends it.

A backend built with `Backend.from_reference("my-store", transport=MyStore)` runs every clause,
most of them on the reference's codec, meta, trainer and rollout; the run's score mixes the
store's verdict with the reference's. Here each surface the backend implements gets its own:

- the clauses that judge a surface are the applicable clauses whose tests touch it: the
  clause's own surface, and any surface its tests reach through their fixtures or the backend
  (catalogue/docs.surfaces_by_clause: a trainer clause moves its data through the transport, a
  DP clause encodes with the codec);
- of those, the ones that touched a surface the backend does not implement ran *jointly* with
  the reference's part there, and are listed with the lent surfaces' names;
- the score is the run's rule on those clauses: passed without a waiver on every cell in scope
  over applicable (clauses left out of the run included), a lower bound when cells or clauses
  were left out.

Surfaces the backend does not implement are not scored: they are the reference's. A report
written before this section existed is scored at read time from what it holds (clause ids and
statuses, cells, `deselected`, the backend's surfaces), with the current catalogue.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .model import FAILING

RULE = ("a surface is judged by the applicable clauses whose tests touch it (the clause's own "
        "surface and those its tests reach through fixtures or the backend); score: passed "
        "without a waiver on every cell in scope over applicable, a lower bound when cells or "
        "clauses were left out; surfaces the backend does not implement are the reference's "
        "and not scored")


def surface_scores(report: Mapping[str, Any]) -> dict[str, Any]:
    """The report's per-surface verdict: the one it was written with, else derived now."""
    return report.get("surface_scores") or derive(report)


def derive(report: Mapping[str, Any]) -> dict[str, Any]:
    """The per-surface verdict from a report's clauses, `deselected`, shard scope and
    `backend_info` (surfaces, and `lent_surfaces` where the backend borrowed the reference's)."""
    from rlconform.conformance.backend import SURFACES
    from rlconform.conformance.catalogue.docs import surfaces_by_clause

    touched = surfaces_by_clause()
    info = report["backend_info"]
    lent = set(info.get("lent_surfaces") or ())
    declared = list(info["surfaces"])
    order = [s for s in SURFACES if s in declared] + [s for s in declared if s not in SURFACES]
    implemented = [s for s in order if s not in lent]
    shard = (report.get("provenance") or {}).get("shard") or {}
    not_run = list(report.get("deselected") or ()) + list(shard.get("clauses_elsewhere") or ())
    judged = {c["id"]: c for c in report["clauses"] if c["status"] != "not_applicable"}

    def reaches(cid: str) -> tuple[str, ...]:
        if cid in touched:
            return touched[cid]
        own = (judged.get(cid) or {}).get("surface")  # a clause the catalogue no longer has
        return (own,) if own else ()

    entries = []
    for surface in implemented:
        ids = [cid for cid in [*judged, *not_run] if surface in reaches(cid)]
        counts = {"passed": 0, "passed_partial": 0, "waived": 0, "failed": 0, "not_run": 0}
        dropped = False
        for cid in ids:
            c = judged.get(cid)
            if c is None:
                counts["not_run"] += 1
                continue
            cut = bool((c.get("cells") or {}).get("dropped"))
            dropped = dropped or cut
            if c["status"] == "passed":
                counts["passed_partial" if cut else "passed"] += 1
            elif c["status"] in ("passed_with_waivers", "waived"):
                counts["waived"] += 1
            elif c["status"] in FAILING:
                counts["failed"] += 1
        # a clause left out of the run ran with nothing: it is counted as not run only
        joint = [{"clause": cid, "lent": [s for s in reaches(cid) if s not in implemented]}
                 for cid in ids if cid in judged]
        entries.append({
            "surface": surface, "clauses": ids, "applicable": len(ids), **counts,
            "score": counts["passed"] / len(ids) if ids else None,
            "lower_bound": bool(counts["not_run"] or dropped),
            "joint": [j for j in joint if j["lent"]],
        })
    return {"rule": RULE, "implemented": implemented,
            "not_scored": [s for s in SURFACES if s not in implemented], "surfaces": entries}


def verdict_word(entry: Mapping[str, Any]) -> str:
    """FAIL when a clause judging the surface fails, PARTIAL when nothing fails but cells or
    clauses were left out, PASS otherwise (waived clauses are shown beside, not failed)."""
    if entry["failed"]:
        return "FAIL"
    return "PARTIAL" if entry["lower_bound"] else "PASS"


def score_text(entry: Mapping[str, Any]) -> str:
    """`95.2% (40/42)`, `… a lower bound` when cells or clauses were left out; `n/a` for none."""
    if entry["score"] is None:
        return "n/a (no applicable clause)"
    text = f"{entry['score']:.1%} ({entry['passed']}/{entry['applicable']})"
    return text + ", a lower bound" if entry["lower_bound"] else text


def joint_groups(entry: Mapping[str, Any]) -> list[tuple[list[str], list[str]]]:
    """The clauses that ran jointly with lent parts, grouped by the lent surfaces:
    [(["codec", "meta", "trainer"], ["TRAIN-RATIO-ONE", ...]), (["codec"], ["DP-ROUNDTRIP"])]."""
    groups: dict[tuple[str, ...], list[str]] = {}
    for j in entry["joint"]:
        groups.setdefault(tuple(j["lent"]), []).append(j["clause"])
    return [(list(k), v) for k, v in groups.items()]


def lines(report: Mapping[str, Any]) -> list[str]:
    """One line per implemented surface (the gate's output and a plain-text summary), then one
    naming the surfaces not scored."""
    scores = surface_scores(report)
    out = []
    for e in scores["surfaces"]:
        beside = [f"{e[k]} {label}" for k, label in (
            ("passed_partial", "passed on the cells judged only"), ("waived", "waived"),
            ("failed", "failing"), ("not_run", "not run")) if e[k]]
        joint = f"; {len(e['joint'])} jointly with lent parts" if e["joint"] else ""
        out.append(f"{e['surface']}: {verdict_word(e)} {score_text(e)}"
                   + (f", {', '.join(beside)}" if beside else "") + joint)
    if scores["not_scored"]:
        out.append("not scored (not implemented by the backend; the reference's where a clause "
                   f"needs them): {', '.join(scores['not_scored'])}")
    return out
