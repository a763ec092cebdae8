"""Run the clause suite against a backend (one pytest session) and the mutant kill matrix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

CLAUSES_PACKAGE = "rlconform.conformance.clauses"


def pytest_args(backend: str, extra: list[str], workers: str | None = "auto") -> list[str]:
    args = ["-p", "rlconform.conformance.plugin", "--pyargs", CLAUSES_PACKAGE,
            "--backend", backend, "-p", "no:cacheprovider", "-o", "addopts=",
            "-W", "ignore::UserWarning"]
    if workers and workers != "0":
        args += ["-n", workers]
    return args + list(extra)


def run(backend: str = "reference", extra: list[str] | None = None,
        workers: str | None = "auto") -> int:
    """One pytest session in this process; returns its exit code."""
    import pytest

    from rlconform.conformance.backend import load_backend

    b = load_backend(backend)
    if b.session.__name__ != "_no_session" and workers == "auto":
        workers = "0"  # a backend with its own cluster runs in one process
    return int(pytest.main(pytest_args(backend, extra or [], workers)))


def run_all(names: list[str], extra: list[str], workers: str | None) -> int:
    codes = {}
    for name in names:
        codes[name] = subprocess.call([sys.executable, "-m", "rlconform.conformance.cli", "run",
                                       "--backend", name, "--workers", workers or "0", *extra])
    for name, code in codes.items():
        print(f"{name}: exit {code}")
    return max(codes.values(), default=0)


def _mutant_worker(names: list[str], report_dir: Path, extra: list[str]) -> None:
    """Run mutants one after another in this process: torch and the clause modules are
    imported once, not once per mutant."""
    import pytest

    from rlconform.conformance.mutants import get_mutant

    log = report_dir / "mutants" / "worker.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    for name in names:
        try:
            surface = get_mutant(name).surface
            code = pytest.main(pytest_args(f"mutant:{name}", [], None) + [
                "--report-dir", str(report_dir / "mutants"), "--surfaces", surface,
                "-q", "--no-header", "-p", "no:terminalreporter", *extra])
        except BaseException as exc:  # noqa: BLE001 - one broken mutant must not stop the rest
            code = f"{type(exc).__name__}: {exc}"
        with log.open("a") as f:
            f.write(f"{name}: {code}\n")


def _collect(name: str, report_dir: Path) -> dict:
    path = report_dir / "mutants" / f"mutant_{name}" / "report.json"
    if not path.is_file():
        return {"name": name, "failed": [], "duration_s": 0.0, "error": "no report written"}
    report = json.loads(path.read_text())
    failed = [c["id"] for c in report["clauses"] if c["status"] in ("failed", "error")]
    return {"name": name, "failed": failed,
            "duration_s": report["provenance"].get("duration_s", 0.0)}


def kill_matrix(report_dir: str | Path = "reports/out", jobs: int | None = None,
                only: list[str] | None = None, extra: list[str] | None = None) -> dict:
    """Run every mutant in its own pytest process and record which clauses failed on it."""
    from rlconform.conformance import catalogue
    from rlconform.conformance.mutants import load_all

    mutants = load_all()
    names = sorted(only or mutants)
    report_dir = Path(report_dir)
    jobs = jobs or max(1, (os.cpu_count() or 2))
    t0 = time.time()
    for stale in (report_dir / "mutants").glob("mutant_*/report.json"):
        stale.unlink()
    chunks = [names[i::jobs] for i in range(jobs)]
    procs = [subprocess.Popen([sys.executable, "-m", "rlconform.conformance.runner",
                               "--report-dir", str(report_dir), *(extra or []), "--", *chunk],
                              stdout=subprocess.DEVNULL, env=dict(os.environ, PYTHONHASHSEED="0"))
             for chunk in chunks if chunk]
    for p in procs:
        p.wait()
    runs = [_collect(n, report_dir) for n in names]
    expected = {n: [c.id for c in catalogue.CLAUSES if n in c.mutants] for n in names}
    rows = []
    for r in runs:
        m = mutants[r["name"]]
        killed = bool(set(r["failed"]) & set(expected[m.name]))
        row = {"name": m.name, "defect": m.defect, "surface": m.surface,
               "expected": expected[m.name], "failed": r["failed"], "killed": killed,
               "duration_s": r["duration_s"]}
        if "error" in r:
            row["error"] = r["error"]
        rows.append(row)
    killers = {cid for r in rows for cid in r["failed"]}
    matrix = {
        "mutants": rows,
        "clauses_without_kill": [c.id for c in catalogue.CLAUSES if c.id not in killers],
        "duration_s": round(time.time() - t0, 2),
    }
    out = report_dir / "mutants"
    out.mkdir(parents=True, exist_ok=True)
    (out / "kill_matrix.json").write_text(json.dumps(matrix, indent=2))
    return matrix


if __name__ == "__main__":  # the kill-matrix worker: runner.py --report-dir D [pytest args] -- m1 m2
    argv = sys.argv[1:]
    sep = argv.index("--")
    opts, mutant_names = argv[:sep], argv[sep + 1:]
    out_dir = Path(opts[opts.index("--report-dir") + 1])
    rest = [a for i, a in enumerate(opts) if a != "--report-dir" and opts[i - 1] != "--report-dir"]
    _mutant_worker(mutant_names, out_dir, rest)
