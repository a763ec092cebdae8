"""Run the clause suite against a backend (one pytest session) and the mutant kill matrix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
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


def _run_mutant(name: str, report_dir: Path, extra: list[str]) -> dict:
    out = report_dir / "mutants"
    t0 = time.time()
    env = dict(os.environ, PYTHONHASHSEED="0")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *pytest_args(f"mutant:{name}", [], None),
         "--report-dir", str(out), "--no-header", "-q", *extra],
        capture_output=True, text=True, env=env)
    path = out / f"mutant_{name}" / "report.json"
    if not path.is_file():
        return {"name": name, "failed": [], "error": proc.stdout[-2000:] + proc.stderr[-2000:],
                "duration_s": round(time.time() - t0, 2)}
    report = json.loads(path.read_text())
    failed = [c["id"] for c in report["clauses"] if c["status"] in ("failed", "error")]
    return {"name": name, "failed": failed, "duration_s": round(time.time() - t0, 2)}


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
    with ThreadPoolExecutor(jobs) as pool:
        runs = list(pool.map(lambda n: _run_mutant(n, report_dir, extra or []), names))
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
