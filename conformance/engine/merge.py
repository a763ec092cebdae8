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

# what must be equal across the shards of one run: label -> how to read it from a report
_SAME = {
    "backend": lambda r: r["backend"],
    "backend source": lambda r: (r.get("backend_info") or {}).get("source"),
    "backend surfaces": lambda r: (r.get("backend_info") or {}).get("surfaces"),
    "backend capabilities": lambda r: (r.get("backend_info") or {}).get("capabilities"),
    "git commit": lambda r: r["provenance"].get("git_commit"),
    "catalogue fingerprint": lambda r: r["provenance"].get("catalogue"),
    "device type": lambda r: r["provenance"]["device"].get("type"),
    "profile": lambda r: r["provenance"].get("profile"),
    "dtype": lambda r: r["provenance"].get("dtype"),
    "model size": lambda r: r["provenance"].get("model_size"),
    "seed": lambda r: r["provenance"].get("seed"),
    "shard count": lambda r: r["provenance"]["shard"]["n"],
}
_WAIVER_USE = ("covered", "matched", "xpass_tests", "first_failure", "unused", "note")


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


def _check_shards(items: list[tuple[str, dict]], shard_of, same: dict, what: str) -> int:
    """N, after refusing inputs that are not the shards of one run."""
    for path, doc in items:
        if not shard_of(doc):
            raise MergeError(f"{path} is not a shard {what} (made without --shard K/N): only "
                             "the shards of one run are merged")
    for label, read in same.items():
        values = {}
        for path, doc in items:
            values.setdefault(json.dumps(read(doc), sort_keys=True, default=str), path)
        if len(values) > 1:
            shown = "; ".join(f"{path}: {v}" for v, path in values.items())
            raise MergeError(f"the {what}s are not the shards of one run: their {label} "
                             f"differs ({shown})")
    seen: dict[int, str] = {}
    for path, doc in items:
        k = shard_of(doc)["k"]
        if k in seen:
            raise MergeError(f"shard {k} given twice: {seen[k]} and {path}")
        seen[k] = path
    scopes = {json.dumps(shard_of(doc).get("scope"), sort_keys=True) for _, doc in items}
    if len(scopes) > 1:
        raise MergeError(f"the {what}s' shards split different selections (another -k, "
                         "--surfaces, --only or durations record): every shard of one run must "
                         "be made with the same options at the same commit")
    return shard_of(items[0][1])["n"]


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
    """The run's state (what report_builder.assemble reads) rebuilt from its shard reports."""

    def __init__(self, reports: list[dict], n: int):
        from rlconform.conformance.engine.report_builder import INTERRUPTED

        first = reports[0]
        self.backend = ReportedBackend(first["backend_info"])
        self.expectations = ReportedExpectations(reports)
        self.results: dict[str, dict] = {}
        for r in reports:
            for c in r["clauses"]:
                for t in c["tests"]:
                    if t["nodeid"] not in self.results:
                        self.results[t["nodeid"]] = _result(t, c["id"])
        self.reported = set(self.results)
        scope = first["provenance"]["shard"]["scope"] or {}
        self.selected = {nodeid: e["clauses"] for nodeid, e in scope.items()}
        shards = [r["provenance"]["shard"] for r in reports]
        self.missing = _missing({s["k"] for s in shards}, n)
        self.problems = list(dict.fromkeys(p for s in shards for p in s["run_problems"]))
        for k in self.missing:
            count = sum(e["shard"] == k for e in scope.values())
            self.problems.append(f"shard {k}/{n} missing: its report was not given to "
                                 f"`rlconform merge`, so its {count} tests did not report")
        for s in shards:
            if s.get("scope_unknown"):
                self.problems.append(f"shard {s['k']}/{n}: {s['scope_unknown']}")
        statuses = [s.get("exitstatus") for s in shards]
        self.exitstatus = INTERRUPTED if INTERRUPTED in statuses else next(
            (x for x in statuses if x not in (0, 1)), 0)
        self.unreported_why = (f"shard(s) {', '.join(f'{k}/{n}' for k in self.missing)} not "
                               "merged" if self.missing else None)


def _result(t: dict, clause: str) -> dict:
    """A test entry of a shard report as the run's result record it was built from."""
    rec = t.get("record") or {}
    r = {"nodeid": t["nodeid"], "outcome": t["outcome"], "duration_s": t["duration_s"],
         "message": t.get("message") or "", "clauses": rec.get("clauses") or [clause],
         "params": t.get("params") or {}, "metrics": rec.get("metrics") or [],
         "hypothesis": t.get("hypothesis"), "kind": t.get("failure_kind"),
         "waivers": rec.get("waivers") or {}, "waived_messages": rec.get("waived_messages") or {},
         "unimplemented": rec.get("unimplemented")}
    if t.get("gpu_peak_gib") is not None:
        r["gpu_peak_gib"] = t["gpu_peak_gib"]
    return r


def merge_runs(items: list[tuple[str, dict]], kill_matrix: dict | None = None) -> dict:
    """The report of the run whose shard reports are `items` (path, report)."""
    from rlconform.conformance.engine.report_builder import assemble

    n = _check_shards(items, lambda r: (r.get("provenance") or {}).get("shard"), _SAME,
                      "report")
    now = catalogue.fingerprint()
    theirs = items[0][1]["provenance"].get("catalogue")
    if theirs != now:
        raise MergeError(f"the shards ran under clause catalogue {theirs}, this rlconform has "
                         f"{now}: merge with the rlconform of the commit the shards ran")
    reports = [r for _, r in sorted(items, key=lambda x: x[1]["provenance"]["shard"]["k"])]
    st = MergedRun(reports, n)
    provs = [r["provenance"] for r in reports]
    prov = {k: v for k, v in provs[0].items() if k != "shard"}
    prov.update(
        started_at=min(p.get("started_at") or "" for p in provs),
        finished_at=max(p.get("finished_at") or "" for p in provs),
        duration_s=round(sum(p.get("duration_s") or 0.0 for p in provs), 3),
        command=" ".join(sys.argv),
        merged_shards={
            "n": n, "missing": st.missing,
            "shards": [{"k": p["shard"]["k"], "duration_s": p.get("duration_s"),
                        "command": p.get("command"), "device": p["device"].get("name"),
                        "tests": sum(e["shard"] == p["shard"]["k"]
                                     for e in (p["shard"]["scope"] or {}).values())}
                       for p in provs]})
    subset = any(p["shard"].get("subset") for p in provs)
    km = kill_matrix if kill_matrix is not None else next(
        (r["kill_matrix"] for r in reports if r.get("kill_matrix")), None)
    effects = next((r["mutant_effects"] for r in reports if r.get("mutant_effects")), None)
    return assemble(st, prov, subset=subset, kill_matrix=km if st.backend.name == "reference"
                    else None, mutant_effects=effects)


_SAME_MATRIX = {
    "regime": lambda m: m.get("regime"),
    "selection": lambda m: m.get("selection"),
    "shard count": lambda m: m["shard"]["n"],
}


def merge_matrices(items: list[tuple[str, dict]]) -> dict:
    """One kill matrix from its shards' (path, matrix); the mutants of a shard not given are
    rows with no verdict (errors: the matrix is incomplete and the gate fails it)."""
    from rlconform.conformance.engine.kill_matrix import claims, summarize

    n = _check_shards(items, lambda m: m.get("shard"), _SAME_MATRIX, "kill matrix")
    scope: dict[str, int] = items[0][1]["shard"]["scope"]
    rows = {r["name"]: r for _, m in items for r in m["mutants"]}
    missing = _missing({m["shard"]["k"] for _, m in items}, n)
    expected = claims([name for name in scope if name not in rows]) if missing else {}
    ordered = []
    for name in sorted(scope):  # the order of an unsharded matrix
        if name in rows:
            ordered.append(rows[name])
            continue
        ordered.append({"name": name, "expected": expected.get(name, []), "ran": [],
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


def merge(paths: list[str | Path], out_dir: str | Path) -> tuple[dict | None, dict | None]:
    """Merge the shard reports and kill matrices among `paths` into `out_dir`
    (report.{json,md,html} and junit.xml; mutants/kill_matrix.json). Returns (report, matrix)."""
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
    report = merge_runs(runs, matrix) if runs else None
    if report is not None:
        write(report, out)
    return report, matrix
