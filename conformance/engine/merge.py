"""`rlconform merge`: the shard reports of one run (`--shard K/N`) joined into the report of that
run, and the shards of a kill matrix (`rlconform mutants --shard K/N`) into one matrix.

A shard report keeps every test's outcome and what its verdict rests on (shards.record_fields);
the merge puts the tests of all shards back into one run's state and builds the report with
the report builder (report_builder.assemble), so clause statuses, waiver use, metrics and the
summary are computed as in a run that was never split, not combined from the shards' verdicts.
The shards must come from one run: the same commit, catalogue, backend, regime, shard count and
scope; the merge refuses anything else, naming what differs. A shard whose report is not given
leaves its tests unreported: their clauses read incomplete and the report names the shard.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rlconform.conformance import catalogue

# what must be equal across every report of one run: label -> how to read it from a report
_SAME = {
    "backend": lambda r: r["backend"],
    "backend source": lambda r: (r.get("backend_info") or {}).get("source"),
    "backend surfaces": lambda r: (r.get("backend_info") or {}).get("surfaces"),
    "backend capabilities": lambda r: (r.get("backend_info") or {}).get("capabilities"),
    "git commit": lambda r: r["provenance"].get("git_commit"),
    "catalogue fingerprint": lambda r: r["provenance"].get("catalogue"),
    "content fingerprint": lambda r: (r["provenance"].get("content") or {}).get("digest"),
    "profile": lambda r: r["provenance"].get("profile"),
    "dtype": lambda r: r["provenance"].get("dtype"),
    "model size": lambda r: r["provenance"].get("model_size"),
    "seed": lambda r: r["provenance"].get("seed"),
}
# ... and across the shards of one part (one placement, or the whole run)
_SAME_PART = {
    "device type": lambda r: r["provenance"]["device"].get("type"),
    "shard count": lambda r: r["provenance"]["shard"]["n"],
    "placement": lambda r: r["provenance"]["shard"].get("placement"),
}
_WAIVER_USE = ("covered", "matched", "xpass_tests", "first_failure", "messages",
               "distinct_messages", "checks", "unused", "note")


class MergeError(ValueError):
    """Reports that are not the shards of one run."""


def is_kill_matrix(doc: dict) -> bool:
    return "mutants" in doc and "clauses" not in doc


def load(paths: list[str | Path]) -> tuple[list[tuple[str, dict]], list[tuple[str, dict]]]:
    """(run reports, kill matrices) of `paths`, each with its path; run reports validated."""
    from rlconform.reports.model import ReportValidationError, load_report

    runs, matrices = [], []
    for p in paths:
        try:
            doc = json.loads(Path(p).read_text())
        except (OSError, ValueError) as exc:
            raise MergeError(f"cannot read {p}: {exc}") from exc
        if isinstance(doc, dict) and is_kill_matrix(doc):
            matrices.append((str(p), doc))
            continue
        try:
            runs.append((str(p), load_report(p)))
        except ReportValidationError as exc:
            raise MergeError(f"cannot read report {p}: {exc}") from exc
    return runs, matrices


def _require_shards(items: list[tuple[str, dict]], shard_of, what: str) -> None:
    for path, doc in items:
        if not shard_of(doc):
            raise MergeError(f"{path} is not a shard {what} (made without --shard K/N or "
                             "--placement): only the shards of one run are merged")


def _check_same(items: list[tuple[str, dict]], same: dict, what: str) -> None:
    for label, read in same.items():
        values = {}
        for path, doc in items:
            values.setdefault(json.dumps(read(doc), sort_keys=True, default=str), path)
        if len(values) > 1:
            shown = "; ".join(f"{path}: {v}" for v, path in values.items())
            raise MergeError(f"the {what}s are not the shards of one run: their {label} "
                             f"differs ({shown})")


def _check_shards(items: list[tuple[str, dict]], shard_of, same: dict, what: str) -> int:
    """N, after refusing shards that are not the shards of one run (or part of a run)."""
    _require_shards(items, shard_of, what)
    _check_same(items, same, what)
    seen: dict[int, str] = {}
    for path, doc in items:
        k = shard_of(doc)["k"]
        if k in seen:
            raise MergeError(f"shard {k}/{shard_of(doc)['n']} given twice: {seen[k]} and {path}")
        seen[k] = path
    # (a shard whose workers all died before the end sent no scope: the others' stands)
    scopes = {json.dumps(shard_of(doc)["scope"], sort_keys=True) for _, doc in items
              if shard_of(doc).get("scope") is not None}
    if len(scopes) > 1:
        raise MergeError(f"the {what}s' shards split different selections (another -k, "
                         "--surfaces, --only or durations record): every shard of one run must "
                         "be made with the same options at the same commit")
    return shard_of(items[0][1])["n"]


def _parts(items: list[tuple[str, dict]]) -> list[list[tuple[str, dict]]]:
    """The reports grouped into the parts of the run (a `--placement`, or the whole run), each
    part's shards checked; parts must not share a test."""
    def shard(r):
        return (r.get("provenance") or {}).get("shard")

    _require_shards(items, shard, "report")
    _check_same(items, _SAME, "report")
    groups: dict[str | None, list[tuple[str, dict]]] = {}
    for path, doc in items:
        groups.setdefault(shard(doc).get("placement"), []).append((path, doc))
    parts = []
    owner: dict[str, str] = {}
    for key, group in groups.items():
        _check_shards(group, shard, _SAME_PART, "report")
        where = f"the {key} part" if key else "the run"
        for nodeid in _scope([shard(doc) for _, doc in group]):
            if nodeid in owner:
                raise MergeError(f"{nodeid} is in {owner[nodeid]} and in {where}: the parts of "
                                 "a run (--placement device, host, or none) must not overlap")
            owner[nodeid] = where
        parts.append(sorted(group, key=lambda x: shard(x[1])["k"]))
    return parts


def _scope(shards: list[dict]) -> dict:
    """A part's scope: any of its shards' (they are checked equal), {} when none knows it."""
    return next((s["scope"] for s in shards if s.get("scope") is not None), {})


def _missing(present: set[int], n: int) -> list[int]:
    return [k for k in range(1, n + 1) if k not in present]


class ReportedBackend:
    """The backend as its reports describe it (the merge does not load it: its packages and
    servers need not be where the merge runs)."""

    def __init__(self, info: dict):
        self.info = info
        self.name = info["name"]
        self.surfaces = list(info.get("surfaces") or ())
        self.capabilities = set(info.get("capabilities") or ())
        self.notes = dict(info.get("notes") or {})
        self.normalisations = dict(info.get("normalisations") or {})

    def provides(self, surface: str) -> bool:
        return surface in self.surfaces

    def describe(self) -> dict:
        return dict(self.info)


class ReportedWaiver:
    def __init__(self, clause: str, entry: dict):
        self.clause = clause
        self.index = entry["index"]
        self.expired = bool(entry.get("expired"))
        self._json = {k: v for k, v in entry.items() if k not in _WAIVER_USE}

    def to_json(self) -> dict:
        return dict(self._json)


class ReportedExpectations:
    def __init__(self, reports: list[dict]):
        self.waivers: list[ReportedWaiver] = []
        seen = set()
        for r in reports:
            for c in r["clauses"]:
                for w in c.get("waivers") or ():
                    if w["index"] not in seen:
                        seen.add(w["index"])
                        self.waivers.append(ReportedWaiver(c["id"], w))
        self.waivers.sort(key=lambda w: w.index)
        self.allow_drop = {d["clause"]: d["reason"] for d in
                           reports[0].get("coverage_drops_allowed") or ()}

    def for_clause(self, clause: str) -> list[ReportedWaiver]:
        return [w for w in self.waivers if w.clause == clause]


class MergedRun:
    """The run's state (what report_builder.assemble reads) rebuilt from its parts' shard
    reports."""

    def __init__(self, parts: list[list[dict]]):
        from rlconform.conformance.engine.report_builder import INTERRUPTED

        reports = [r for part in parts for r in part]
        self.backend = ReportedBackend(reports[0]["backend_info"])
        self.expectations = ReportedExpectations(reports)
        self.results: dict[str, dict] = {}
        for r in reports:
            for c in r["clauses"]:
                for t in c["tests"]:
                    if t["nodeid"] not in self.results:
                        self.results[t["nodeid"]] = _result(t, c["id"])
        self.reported = set(self.results)
        self.selected: dict[str, list[str]] = {}
        self.problems = list(dict.fromkeys(p for r in reports
                                           for p in r["provenance"]["shard"]["run_problems"]))
        self.missing: list[str] = []
        for part in parts:
            shards = [r["provenance"]["shard"] for r in part]
            n, placement = shards[0]["n"], shards[0].get("placement")
            scope = _scope(shards)
            self.selected.update({nodeid: e["clauses"] for nodeid, e in scope.items()})
            of = f" of the {placement} part" if placement else ""
            for k in _missing({s["k"] for s in shards}, n):
                self.missing.append(f"{k}/{n}{of}")
                count = sum(e["shard"] == k for e in scope.values())
                self.problems.append(f"shard {k}/{n}{of} missing: its report was not given to "
                                     f"`rlconform merge`, so its {count} tests did not report")
            for s in shards:
                if s.get("scope_unknown"):
                    self.problems.append(f"shard {s['k']}/{n}{of}: {s['scope_unknown']}")
        self.cells = _merged_cells([r["provenance"]["shard"] for r in reports])
        statuses = [r["provenance"]["shard"].get("exitstatus") for r in reports]
        self.exitstatus = INTERRUPTED if INTERRUPTED in statuses else next(
            (x for x in statuses if x not in (0, 1, None)), 0)
        self.unreported_why = (f"shard(s) {', '.join(self.missing)} not merged"
                               if self.missing else None)


def _merged_cells(shards: list[dict]):
    """The run's cells record from its shards' (cells.merged); None when a shard report
    predates it (its report then says the cells were not recorded)."""
    from rlconform.conformance.engine.cells import Ledger, merged

    if any("dropped" not in s or s.get("scope") is None for s in shards):
        return None
    ledgers = []
    for s in shards:
        scope = {n: e["clauses"] for n, e in s["scope"].items()}
        scope.update({n: d["clauses"] for n, d in s["dropped"].items()})
        ledgers.append((Ledger(scope, {n: (d["by"], d["why"]) for n, d in s["dropped"].items()}),
                        set(s["scope"])))
    return merged(ledgers)


def _result(t: dict, clause: str) -> dict:
    """A test entry of a shard report as the run's result record it was built from."""
    rec = t.get("record") or {}
    r = {"nodeid": t["nodeid"], "outcome": t["outcome"], "duration_s": t["duration_s"],
         "message": t.get("message") or "", "clauses": rec.get("clauses") or [clause],
         "params": t.get("params") or {}, "metrics": rec.get("metrics") or [],
         "hypothesis": t.get("hypothesis"), "kind": t.get("failure_kind"),
         "waivers": rec.get("waivers") or {}, "waived_messages": rec.get("waived_messages") or {},
         "waived_distinct": rec.get("waived_distinct") or {},
         "waived_sites": rec.get("waived_sites") or {},
         "unimplemented": rec.get("unimplemented")}
    if t.get("gpu_peak_gib") is not None:
        r["gpu_peak_gib"] = t["gpu_peak_gib"]
    return r


def merge_runs(items: list[tuple[str, dict]], kill_matrix: dict | None = None,
               mutant_effects: dict | None = None) -> dict:
    """The report of the run whose shard reports are `items` (path, report): the shards of
    the whole run, or of each of its parts (`--placement device` and `host`). The provenance
    is the first report's, with every shard's own beside it (`merged_shards`)."""
    from rlconform.conformance.backend import SURFACES
    from rlconform.conformance.engine.report_builder import assemble

    parts = [[r for _, r in part] for part in _parts(items)]
    now = catalogue.fingerprint()
    theirs = items[0][1]["provenance"].get("catalogue")
    if theirs != now:
        raise MergeError(f"the shards ran under clause catalogue {theirs}, this rlconform has "
                         f"{now}: merge with the rlconform of the commit the shards ran")
    st = MergedRun(parts)
    provs = [r["provenance"] for part in parts for r in part]
    first = items[0][1]["provenance"]
    prov = {k: v for k, v in first.items() if k != "shard"}
    prov.update(
        started_at=min(p.get("started_at") or "" for p in provs),
        finished_at=max(p.get("finished_at") or "" for p in provs),
        duration_s=round(sum(p.get("duration_s") or 0.0 for p in provs), 3),
        command=" ".join(sys.argv),
        merged_shards={"missing": st.missing, "shards": [
            {"placement": p["shard"].get("placement"), "k": p["shard"]["k"],
             "n": p["shard"]["n"], "duration_s": p.get("duration_s"),
             "command": p.get("command"), "device": p["device"].get("name"),
             "tests": sum(e["shard"] == p["shard"]["k"]
                          for e in (p["shard"].get("scope") or {}).values())}
            for p in provs]})
    # the run left tests out on purpose when a part did (-k, -m), when the parts' --surfaces
    # do not cover every surface, or when only one placement was run
    shards = [p["shard"] for p in provs]
    surfaces = set().union(*(s.get("surfaces") or SURFACES for s in shards))
    placements = {s.get("placement") for s in shards}
    subset = (any(s.get("keyword_subset") for s in shards) or not set(SURFACES) <= surfaces
              or (None not in placements and placements != {"device", "host"}))
    reports = [r for part in parts for r in part]
    km = kill_matrix if kill_matrix is not None else next(
        (r["kill_matrix"] for r in reports if r.get("kill_matrix")), None)
    effects = mutant_effects or next(
        (r["mutant_effects"] for r in reports if r.get("mutant_effects")), None)
    reference = st.backend.name == "reference"  # as a run: only its report carries them
    return assemble(st, prov, subset=subset, kill_matrix=km if reference else None,
                    mutant_effects=effects if reference else None,
                    partial_ok=any(s.get("partial_ok") for s in shards))


_SAME_MATRIX = {
    "regime": lambda m: m.get("regime"),
    "selection": lambda m: m.get("selection"),
    "shard count": lambda m: m["shard"]["n"],
}


def merge_matrices(items: list[tuple[str, dict]]) -> dict:
    """One kill matrix from its shards' (path, matrix); the mutants of a shard not given are
    rows with no verdict (errors: the matrix is incomplete and the gate fails it)."""
    from rlconform.conformance.engine.kill_matrix import claims, summarize
    from rlconform.conformance.mutants import load_all

    n = _check_shards(items, lambda m: m.get("shard"), _SAME_MATRIX, "kill matrix")
    scope: dict[str, int] = items[0][1]["shard"]["scope"]
    rows = {r["name"]: r for _, m in items for r in m["mutants"]}
    missing = _missing({m["shard"]["k"] for _, m in items}, n)
    expected = claims([name for name in scope if name not in rows]) if missing else {}
    mutants = load_all()
    ordered = []
    for name in sorted(scope):  # the order of an unsharded matrix
        if name in rows:
            ordered.append(rows[name])
            continue
        m = mutants[name]
        ordered.append({"name": name, "defect": m.defect, "surface": m.surface,
                        "expected": expected.get(name, []), "ran": [],
                        "failed": [], "failed_by_exception_only": [], "killed": False,
                        "missed": expected.get(name, []), "duration_s": 0.0,
                        "failed_tests": {},
                        "error": f"shard {scope[name]}/{n} of the kill matrix not merged"})
    every_test = any("tests" in m for _, m in items)
    full = items[0][1].get("selection", "").startswith("all clauses")
    out = summarize(ordered, items[0][1].get("regime") or {}, full, every_test,
                    round(sum(m.get("duration_s") or 0.0 for _, m in items), 2))
    out["merged_shards"] = {"n": n, "missing": missing,
                            "durations_s": {m["shard"]["k"]: m.get("duration_s")
                                            for _, m in items}}
    return out


def merge(paths: list[str | Path], out_dir: str | Path,
          mutant_effects: str | Path | None = None) -> tuple[dict | None, dict | None]:
    """Merge the shard reports and kill matrices among `paths` into `out_dir`
    (report.{json,md,html} and junit.xml; mutants/kill_matrix.json), the reference's report
    carrying the merged matrix and `mutant_effects` (a mutant_effects.json). Returns (report,
    matrix)."""
    from rlconform.conformance.engine.report_builder import write
    from rlconform.reports.write import write_text

    runs, matrices = load(paths)
    if not runs and not matrices:
        raise MergeError("nothing to merge: give the shards' report.json (and kill_matrix.json) "
                         "files")
    out = Path(out_dir)
    matrix = merge_matrices(matrices) if matrices else None
    if matrix is not None:
        (out / "mutants").mkdir(parents=True, exist_ok=True)
        write_text(out / "mutants" / "kill_matrix.json", json.dumps(matrix, indent=2) + "\n")
    effects = None
    if mutant_effects is not None:
        try:
            effects = json.loads(Path(mutant_effects).read_text())
        except (OSError, ValueError) as exc:
            raise MergeError(f"cannot read --mutant-effects {mutant_effects}: {exc}") from exc
    report = merge_runs(runs, matrix, effects) if runs else None
    if report is not None:
        write(report, out)
    return report, matrix
