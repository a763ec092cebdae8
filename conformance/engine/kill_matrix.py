"""The mutant kill matrix: every mutant against the clauses that claim to kill it.

Each mutant runs against exactly the clauses that claim to kill it (catalogue `mutants`),
whatever their surface; `full=True` runs it against every clause instead. Workers are
long-lived processes fed one mutant at a time (torch, transformers, the clause modules and
the families' processors are loaded once per worker: mutant_worker.py), longest mutants first.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from rlconform.conformance.engine import gpu_memory, shards

SURFACE_COST = {"trainer": 10, "rollout": 10}  # relative cost of a clause run, by surface
# ... and by capability: a `multiprocess` clause starts rank processes (each imports torch and
# transformers and builds a model): its mutants run first, beside the trainer ones
CAPABILITY_COST = {"multiprocess": 30}


def claims(names: list[str] | None = None) -> dict[str, list[str]]:
    """Mutant -> the clause IDs whose catalogue entry says they must kill it."""
    from rlconform.conformance import catalogue
    from rlconform.conformance.mutants import load_all

    names = sorted(names or load_all())
    return {n: [c.id for c in catalogue.CLAUSES if n in c.mutants] for n in names}


def _cost(clause_ids: list[str], previous: dict[str, float], name: str) -> float:
    if name in previous:
        return previous[name]
    from rlconform.conformance import catalogue

    def cost(clause) -> int:
        return max([SURFACE_COST.get(clause.surface, 1),
                    *(CAPABILITY_COST.get(cap, 1) for cap in clause.capabilities)])

    return float(sum(cost(catalogue.BY_ID[c]) for c in clause_ids) or 1)


def _collect(name: str, report_dir: Path, code: int | str | None = None) -> dict:
    """One mutant's result from its report. `error` (no verdict: neither killed nor survived)
    when its pytest run wrote no report, ended on a usage error, an internal error or an
    interrupt, or ran no clause test."""
    path = report_dir / "mutants" / f"mutant_{name}" / "report.json"
    bad_exit = _BAD_EXITS.get(code) if isinstance(code, int) else None
    if not path.is_file():
        why = f"its pytest run exited with {bad_exit or code}" if code is not None else \
            "its pytest run"
        return {"name": name, "failed": [], "ran": [], "duration_s": 0.0,
                "error": f"no report written ({why})"}
    report = json.loads(path.read_text())
    failed, by_exception, tests = [], [], {}
    for c in report["clauses"]:
        bad = [t for t in c["tests"] if t["outcome"] in ("failed", "error")]
        for t in bad:
            entry = tests.setdefault(t["nodeid"], {
                "kind": t.get("failure_kind") or "exception", "clauses": [],
                "family": (t.get("params") or {}).get("family")})
            if entry["kind"] != "assertion" and t.get("message"):
                # an exception is no kill: its message says what to fix (memory, a setup)
                entry["message"] = t["message"][:EXCEPTION_CHARS]
            entry["clauses"].append(c["id"])
        if any(t.get("failure_kind") == "assertion" for t in bad):
            failed.append(c["id"])
        elif bad:
            by_exception.append(c["id"])
    ran = [c["id"] for c in report["clauses"] if c["status"] != "not_applicable"]
    out = {"name": name, "failed": failed, "failed_by_exception_only": by_exception,
           "ran": ran, "failed_tests": tests,
           "duration_s": report["provenance"].get("duration_s", 0.0)}
    if bad_exit:
        said = "; ".join(report.get("problems") or ())  # a preflight refusal says why
        out["error"] = f"its pytest run exited with {bad_exit}" + (f": {said}" if said else "")
    elif "no clause test ran" in (report.get("problems") or ()):
        out["error"] = "its run ran no clause test (its claimed clauses deselected?)"
    return out


EXCEPTION_CHARS = 300

# pytest exit codes after which a mutant's report is no verdict
_BAD_EXITS = {int(pytest.ExitCode.INTERRUPTED): "INTERRUPTED",
              int(pytest.ExitCode.INTERNAL_ERROR): "INTERNAL_ERROR",
              int(pytest.ExitCode.USAGE_ERROR): "USAGE_ERROR (a bad option?)"}


class _Worker:
    def __init__(self, report_dir: Path, extra: list[str], env: dict):
        r, w = os.pipe()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rlconform.conformance.engine.mutant_worker",
             "--report-dir", str(report_dir), "--results-fd", str(w), *extra],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, pass_fds=(w,), env=env,
            text=True)
        os.close(w)
        self.results = os.fdopen(r, "r")
        self.job: str | None = None

    def send(self, name: str, clause_ids: list[str] | None, every_test: bool = False,
             first: list[str] = ()) -> None:
        self.job = name
        try:
            self.proc.stdin.write(json.dumps({"name": name, "clauses": clause_ids,
                                              "every_test": every_test,
                                              "first": list(first)}) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # the worker died: its results pipe reports EOF, and the mutant is recorded

    def stop(self) -> None:
        if self.proc.stdin and not self.proc.stdin.closed:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()
        self.proc.wait()
        self.results.close()


def _previous_durations(report_dir: Path) -> dict[str, float]:
    try:
        old = json.loads((report_dir / "mutants" / "kill_matrix.json").read_text())
        return {r["name"]: float(r.get("duration_s") or 0.0) for r in old["mutants"]}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def no_verdict(row: dict) -> bool:
    """A kill-matrix row whose mutant run failed (no report, a usage error, ...) and killed
    nothing: an error of the matrix run, never a survivor."""
    return bool(row.get("error")) and not row["killed"]


# Options `rlconform mutants` passes through to every mutant's pytest run: the plugin's (less
# those the matrix sets itself) and pytest's test selection. Anything else is refused before a
# worker starts: pytest would refuse it in every mutant's run, and no mutant would be judged.
MUTANT_SELECTION_OPTIONS = ("-k", "-m")
MUTANT_REFUSED = {
    "--backend": "each mutant is the backend of its own run; use --only NAME ...",
    "--no-report": "the kill matrix reads each mutant's report",
    "--placement": "each mutant runs the clauses that claim it; choose the mutants with "
                   "--mutant-surfaces",
    "--report-dir": "give it to `rlconform mutants --report-dir`",
    "--workers": "`rlconform run` takes --workers; `rlconform mutants` takes --jobs N "
                 "(worker processes)",
    "-n": "`rlconform mutants` takes --jobs N (worker processes), not pytest-xdist's -n",
    "--numprocesses": "`rlconform mutants` takes --jobs N (worker processes), not "
                      "pytest-xdist's -n",
}


def mutant_args_problem(extra: list[str]) -> str | None:
    """Why `extra` cannot be passed to every mutant's pytest run (naming the first option at
    fault), or None. Allowed: the plugin's options (see `rlconform run --help`; values are
    checked as the plugin checks them) and -k / -m."""
    import argparse

    from rlconform.conformance.engine.options import OPTIONS

    class _Refuse(Exception):
        pass

    class _Parser(argparse.ArgumentParser):
        def error(self, message):  # noqa: D401 - argparse's hook
            raise _Refuse(message)

    parser = _Parser(prog="rlconform mutants", add_help=False, allow_abbrev=False)
    for flag, kw in OPTIONS:
        if flag not in MUTANT_REFUSED:
            parser.add_argument(flag, **kw)
    for flag in MUTANT_SELECTION_OPTIONS:
        parser.add_argument(flag)
    for arg in extra:
        flag = arg.split("=", 1)[0]
        if flag in MUTANT_REFUSED or (flag.startswith("-n") and flag[2:].isdigit()):
            key = "-n" if flag.startswith("-n") else flag
            return f"option {flag} is not taken by `rlconform mutants`: {MUTANT_REFUSED[key]}"
    try:
        _, unknown = parser.parse_known_args(extra)
    except _Refuse as exc:
        return f"{exc}"
    if unknown:
        allowed = ", ".join([f for f, _ in OPTIONS if f not in MUTANT_REFUSED]
                            + list(MUTANT_SELECTION_OPTIONS))
        return (f"unrecognized argument {unknown[0]!r}"
                + (f" (and {' '.join(unknown[1:])})" if unknown[1:] else "")
                + f"; `rlconform mutants` passes through only {allowed} to each mutant's run")
    return None


def kill_matrix(report_dir: str | Path = "reports/out", jobs: int | None = None,
                only: list[str] | None = None, extra: list[str] | None = None,
                full: bool = False, on_result=None, surfaces: list[str] | None = None,
                every_test: bool = False, shard: tuple[int, int] | None = None,
                grow: tuple[Callable[[float], bool], int] | None = None) -> dict:
    """Run every mutant against the clauses that claim to kill it (with `full`: against every
    clause, every test of it, recording which tests each mutant fails), in `jobs` worker
    processes; write and return the kill matrix. A kill is a clause assertion failing (see
    engine/verdicts.py failure_kind): a mutant that only makes tests raise other
    exceptions is not killed.

    `on_result(row, done, total, elapsed_s)` is called as each mutant finishes. `surfaces`
    keeps the mutants of those surfaces only (the nightly's GPU regime: trainer, rollout).
    `every_test` (implied by `full`): no clause stops at its first kill, and the matrix lists,
    per clause test function, the mutants that fail it. `shard` (K, N): only shard K's share
    of the selected mutants (engine/shards.py; `rlconform merge` joins the shards' matrices).
    `grow` (when, jobs): more workers start, up to `jobs` in all, once `when(seconds)` is true,
    asked every 0.2 s with the recorded seconds of the mutants not yet started (the kill matrix
    run beside the clause run starts with one worker and takes a second core as the clause
    run ends: engine/beside.py)."""
    report_dir = Path(report_dir)
    extra = list(extra or [])
    problem = mutant_args_problem(extra)
    if problem:
        raise ValueError(problem)
    if "--profile" not in extra:
        extra += ["--profile", "ci"]  # derandomized: a kill is reproducible
    jobs = max(1, jobs or os.cpu_count() or 2)
    if surfaces:
        from rlconform.conformance.mutants import load_all

        known = {m.surface for m in load_all().values()}
        odd = sorted(set(surfaces) - known)
        if odd:
            raise ValueError(f"no mutants of surfaces {odd}; mutants exist for {sorted(known)}")
        only = [n for n, m in load_all().items() if m.surface in surfaces
                and (not only or n in only)]
    scope = None
    if shard is not None:
        scope = shard_scope(extra, shard[1], only)
        only = [n for n, k in scope.items() if k == shard[0]]
        if not only:
            raise ValueError(f"shard {shard[0]}/{shard[1]} holds no mutant: "
                             f"{len(scope)} mutants in {shard[1]} shards")
    if only:
        jobs = min(jobs, len(only))
    t0 = time.time()
    for stale in (report_dir / "mutants").glob("mutant_*/report.json"):
        stale.unlink()
    # no entry-point autoload (scanning every installed distribution costs ~0.4 s a mutant's
    # session): runner.pytest_args then loads the one plugin a mutant run needs by name
    env = dict(os.environ, PYTHONHASHSEED="0", PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    # each worker gets its share of the cores (torch would otherwise spin one thread per core in
    # every worker)
    most = max(jobs, grow[1] if grow else 0)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // most)))
    _share_gpu_ledger(env, extra)
    # the workers start loading torch and the clause modules while this process reads the
    # catalogue
    workers = [_Worker(report_dir, extra, env) for _ in range(jobs)]
    try:
        return _drive(workers, report_dir, extra, env, only, full, on_result, t0,
                      every_test or full,
                      shard=None if shard is None else {"k": shard[0], "n": shard[1],
                                                        "scope": scope},
                      grow=grow)
    finally:
        for w in workers:
            if w.proc.poll() is None:
                w.stop()


def _share_gpu_ledger(env: dict, extra: list[str]) -> None:
    """At production width on CUDA the jobs share one GPU: give them one reservation ledger
    (engine/gpu_memory.py). Each job's session made its own before: three jobs of production
    models on one H100 failed tests by exceptions (read as survivals) that the same mutants,
    one job at a time, failed by assertion."""
    from rlconform.fixtures.sizes import PRODUCTION

    regime = _regime(extra)
    if regime["device"].startswith("cuda") and regime["model_size"] == PRODUCTION:
        import tempfile

        env[gpu_memory.LEDGER_ENV] = os.path.join(
            tempfile.mkdtemp(prefix="rlconform-mutants-gpu-"), "ledger.json")


def shard_scope(extra: list[str], n: int, only: list[str] | None = None) -> dict[str, int]:
    """Every selected mutant -> its shard (1..n), balanced by the durations recorded for the
    matrix's regime (shards.py), else by the cost of its claimed clauses; the same on every
    machine of one commit (the report dir's last matrix, which orders the queue, is not used)."""
    from rlconform.conformance.mutants import load_all

    names = sorted(only or load_all())
    unknown = sorted(set(names) - set(load_all()))
    if unknown:
        raise LookupError(f"unknown mutants {unknown}; known: {', '.join(sorted(load_all()))}")
    expected = claims(names)
    costs = shards.mutant_costs(names, _regime_key(extra), lambda m: _cost(expected[m], {}, m))
    return shards.assign(costs, n)


def _drive(workers, report_dir: Path, extra: list[str], env: dict, only, full: bool,
           on_result, t0: float, every_test: bool = False, shard: dict | None = None,
           grow: tuple[Callable[[float], bool], int] | None = None) -> dict:
    import selectors

    from rlconform.conformance.mutants import load_all
    from rlconform.reports.write import write_text

    mutants = load_all()
    unknown = sorted(set(only or ()) - set(mutants))
    if unknown:
        raise LookupError(f"unknown mutants {unknown}; known: {', '.join(sorted(mutants))}")
    expected = claims(list(only or mutants))
    names = list(expected)
    previous = _previous_durations(report_dir)
    first = shards.killers(_regime_key(extra))
    # longest first: by this report dir's last matrix, else the durations recorded for the
    # regime (shard_durations.json: a fresh clone's first run starts the 14 s RANK-FAILURE
    # mutant at once instead of near the end), else the claim-based estimate
    recorded = shards.mutant_costs(names, _regime_key(extra), lambda n: _cost(expected[n], {}, n))
    cost = {n: previous.get(n, recorded[n]) for n in names}
    queue = sorted(names, key=lambda n: -cost[n])
    rows: dict[str, dict] = {}
    grew_at = None

    def finish(name: str, code: int | str | None) -> None:
        r = _collect(name, report_dir, code)
        error = code if isinstance(code, str) else None
        m = mutants[name]
        row = {"name": name, "defect": m.defect, "surface": m.surface,
               "expected": expected[name], "ran": r["ran"], "failed": r["failed"],
               "failed_by_exception_only": r.get("failed_by_exception_only", []),
               "killed": bool(set(r["failed"]) & set(expected[name])),
               "missed": [c for c in expected[name] if c not in r["failed"]],
               "duration_s": r["duration_s"]}
        row["failed_tests"] = r.get("failed_tests", {})
        if error or "error" in r:
            row["error"] = error or r["error"]
        rows[name] = row
        # what is finished so far, kept if the run is cut short (a GPU call's time limit)
        partial = report_dir / "mutants" / "kill_matrix.partial.json"
        partial.parent.mkdir(parents=True, exist_ok=True)
        write_text(partial, json.dumps({"complete": False, "regime": _regime(extra),
                                        "finished": len(rows), "of": len(names),
                                        "mutants": list(rows.values())}, indent=2) + "\n")
        if on_result is not None:
            on_result(row, len(rows), len(names), time.time() - t0)

    sel = selectors.DefaultSelector()

    def feed(w: _Worker) -> None:
        if queue:
            n = queue.pop(0)
            w.send(n, None if full else expected[n], every_test=every_test,
                   first=first.get(n, ()))
        else:
            w.job = None
            sel.unregister(w.results)
            w.stop()

    def add_worker() -> None:
        w = _Worker(report_dir, extra, env)
        workers.append(w)
        sel.register(w.results, selectors.EVENT_READ, w)
        feed(w)

    for w in list(workers):
        sel.register(w.results, selectors.EVENT_READ, w)
        feed(w)
    while len(rows) < len(names):
        if grow is not None and grow[0](sum(cost[n] for n in queue)):
            for _ in range(grow[1] - sum(w.proc.poll() is None for w in workers)):
                if queue:
                    add_worker()
            grew_at = round(time.time() - t0, 1)
            grow = None
        for key, _ in sel.select(None if grow is None else 0.2):
            w = key.data
            line = w.results.readline()
            if line:
                res = json.loads(line)
                finish(res["name"], res["code"])
                feed(w)
                continue
            # the worker died: record its mutant, replace the worker
            sel.unregister(w.results)
            died = w.job
            w.stop()
            if died is not None:
                finish(died, f"worker exited with {w.proc.returncode} during this mutant")
            if queue:
                add_worker()
    ordered = [rows[n] for n in names]
    matrix = summarize(ordered, _regime(extra), full, every_test, round(time.time() - t0, 2))
    if grew_at is not None:
        matrix["grew_at_s"] = grew_at  # when more workers started (grow)
    if shard is not None:
        matrix["shard"] = shard
    out = report_dir / "mutants"
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "kill_matrix.json", json.dumps(matrix, indent=2) + "\n")
    (out / "kill_matrix.partial.json").unlink(missing_ok=True)
    return matrix


def failures(m: dict, partial: bool = False, tests_checked: bool = False) -> list[str]:
    """Why a kill matrix fails, one line each ([] when it holds): what fails the gate of a
    report carrying it (runs with no verdict, survivors, claims that did not kill:
    reports/gate.kill_matrix_reasons), clauses that kill nothing (not for a `partial` matrix:
    `--only`, a shard), and with `tests_checked` (`--full`, `--every-test` on every mutant)
    clause tests that no mutant fails. `rlconform mutants` exits 1 on any; a clause run with
    the kill matrix beside it records each as a problem."""
    from rlconform.reports.gate import kill_matrix_reasons

    out = kill_matrix_reasons(m)
    if m["clauses_without_kill"] and not partial:
        out.append("clauses that kill no mutant in the kill matrix: "
                   + ", ".join(m["clauses_without_kill"]))
    if tests_checked and m["tests_without_kill"] and not partial:
        out.append("clause tests no mutant fails in the kill matrix: "
                   + ", ".join(m["tests_without_kill"]))
    return out


def summarize(ordered: list[dict], regime: dict, full: bool, every_test: bool,
              duration_s: float) -> dict:
    """The kill matrix of the mutants' rows: what no clause killed, the rows with no verdict,
    the claims that did not hold (a run's rows, or the shards' rows joined: merge.py)."""
    from rlconform.conformance import catalogue

    killers = {cid for r in ordered for cid in r["failed"]}
    matrix = {
        "regime": regime,
        "mutants": ordered,
        "selection": "all clauses, every test" if full else
        "claims, every test" if every_test else "claims: the clauses that name the mutant",
        "clauses_without_kill": [c.id for c in catalogue.CLAUSES if c.id not in killers],
        # a mutant whose run gave no verdict is an error of the matrix run, not a survivor,
        # and its claims are not judged
        "errors": [{"mutant": r["name"], "error": r["error"]} for r in ordered
                   if no_verdict(r)],
        "claims_not_killed": [{"mutant": r["name"], "clause": c} for r in ordered
                              if not no_verdict(r) for c in r["missed"]],
        # killed where claimed, but only by exceptions other than a clause assertion
        "killed_only_by_exceptions": [{"mutant": r["name"], "clause": c} for r in ordered
                                      for c in r.get("failed_by_exception_only", ())
                                      if c in r["expected"]],
        "duration_s": duration_s,
    }
    if every_test:
        matrix["tests"] = test_kills(ordered)
        matrix["tests_without_kill"] = [t for t, ms in matrix["tests"].items() if not ms]
    return matrix


def test_kills(rows: list[dict]) -> dict[str, list[str]]:
    """Clause test function (`test_codec.py::test_x`) -> the mutants that fail one of its
    cases on a clause assertion, for every clause test function (from a `--full` matrix)."""
    from rlconform.conformance.catalogue.docs import tests_by_clause

    out: dict[str, list[str]] = {t: [] for fns in tests_by_clause().values() for t in fns}
    for r in rows:
        for nodeid, failure in (r.get("failed_tests") or {}).items():
            function = nodeid.split("[", 1)[0]
            if failure["kind"] == "assertion" and r["name"] not in out.setdefault(function, []):
                out[function].append(r["name"])
    return dict(sorted(out.items()))


def kills_by_family(matrix: dict) -> dict[str, dict[str, list[str]]]:
    """mutant -> family -> the clauses that killed it on that family's tests (a clause assertion
    in a test parametrised with that family), from a kill matrix run; family "*" collects kills
    by tests that take no family."""
    out: dict[str, dict[str, list[str]]] = {}
    for r in matrix.get("mutants") or ():
        fams = out.setdefault(r["name"], {})
        for failure in (r.get("failed_tests") or {}).values():
            if failure["kind"] != "assertion":
                continue
            ids = fams.setdefault(failure.get("family") or "*", [])
            ids += [c for c in failure["clauses"] if c in r["expected"] and c not in ids]
    return out


def _regime(extra: list[str]) -> dict:
    """Device, dtype, model size and profile the mutants ran at (from the options passed)."""
    def opt(name: str, default: str) -> str:
        return extra[extra.index(name) + 1] if name in extra else default

    from rlconform.fixtures.sizes import model_size

    return {"device": opt("--device", "cpu"), "dtype": opt("--dtype", "float32"),
            "model_size": opt("--model-size", model_size()), "profile": opt("--profile", "ci")}


def _regime_key(extra: list[str]) -> str:
    """The key of the matrix's regime in the shards' record (durations, killing tests)."""
    r = _regime(extra)
    return shards.regime_key(r["device"], r["model_size"], r["profile"])
