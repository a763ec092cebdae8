"""Where the main job's time goes (`nox -s conformance`: the clause run with the kill matrix
beside it).

    python bench/main_job_breakdown.py [--run [--one-after-the-other]] [--report-dir DIR]

With `--run` it runs the main job itself, as the nox session does (`rlconform run --profile ci
--workers 0 --with-kill-matrix`; with `--one-after-the-other` as it did before: `rlconform
mutants`, then `rlconform run` with xdist workers), and times it: wall, and user+sys of every
process it started (less noisy than wall on a shared machine). Without it, it reads the
reports a previous run left in `--report-dir`. Either way it prints:

- imports: wall of a fresh interpreter importing torch, transformers, hypothesis and the
  plugin (what every kill-matrix worker, xdist worker and rank process pays once);
- kill matrix: the mutants' pytest time by surface, the slowest mutants, and the rest of the
  phase (worker start-up, collection per mutant, waiting) as jobs x wall minus that sum;
- clauses: test time by clause module, the slowest tests, and the rest (xdist worker start-up,
  collection, the last worker waiting for the other) as workers x wall minus the tests' sum.

The budget (README, "the main job"): both phases together at most 90 s on 2 cores with
nothing else running, the environment built.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path


def _timed(cmd: list[str]) -> tuple[float, float]:
    """Run `cmd`; (wall s, user+sys s of it and its children)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    code = subprocess.call(cmd)
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if code not in (0,):
        sys.exit(f"{' '.join(cmd)} exited with {code}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def _imports() -> float:
    code = ("import torch, transformers, hypothesis, pytest; "
            "import rlconform.conformance.engine.plugin; "
            "from transformers import Qwen2VLForConditionalGeneration")
    t0 = time.monotonic()
    subprocess.check_call([sys.executable, "-c", code])
    return time.monotonic() - t0


def _table(rows, head: str) -> None:
    print(head)
    for secs, what in rows:
        print(f"  {secs:7.1f}  {what}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", action="store_true", help="run the main job and time it")
    p.add_argument("--one-after-the-other", action="store_true",
                   help="with --run: the kill matrix first, then the clause run with xdist "
                        "workers (the main job before the kill matrix ran beside the run)")
    p.add_argument("--report-dir", default="reports/out")
    p.add_argument("--top", type=int, default=12)
    a = p.parse_args(argv)
    out = Path(a.report_dir)
    cores = os.cpu_count() or 1
    phases = {}
    beside = not a.one_after_the_other
    if a.run:
        rl = [sys.executable, "-m", "rlconform.conformance.cli"]
        if beside:  # as `nox -s conformance` runs it
            phases["clauses with the kill matrix beside"] = _timed(
                [*rl, "run", "--profile", "ci", "--report-dir", str(out), "--workers", "0",
                 "--with-kill-matrix"])
        else:
            phases["kill matrix"] = _timed([*rl, "mutants", "--report-dir", str(out)])
            phases["clauses"] = _timed([*rl, "run", "--profile", "ci", "--report-dir",
                                        str(out)])
    print(f"cores: {cores}; load average now: {os.getloadavg()[0]:.2f} "
          "(other work on the machine inflates wall, less so user+sys)")
    print(f"imports (fresh interpreter: torch, transformers, hypothesis, the plugin): "
          f"{_imports():.1f} s wall")
    for name, (wall, cpu) in phases.items():
        print(f"{name}: {wall:.1f} s wall, {cpu:.1f} s user+sys")
    if phases:
        print(f"main job (both phases): {sum(w for w, _ in phases.values()):.1f} s wall, "
              f"{sum(c for _, c in phases.values()):.1f} s user+sys; budget 90 s wall")

    matrix = json.loads((out / "mutants" / "kill_matrix.json").read_text())
    rows = matrix["mutants"]
    mutant_sum = sum(r["duration_s"] for r in rows)
    by_surface = collections.Counter()
    for r in rows:
        by_surface[r["surface"]] += r["duration_s"]
    killed = sum(r["killed"] for r in rows)
    wall = matrix["duration_s"]
    print(f"\nkill matrix: {len(rows)} mutants, {killed} killed, {wall:.1f} s wall; "
          f"mutants' pytest time {mutant_sum:.1f} s"
          + ("" if beside else f"; the rest (worker start-up, per-mutant session and "
             f"collection, idle tail) ~{cores * wall - mutant_sum:.1f} s of {cores} x wall"))
    _table([(v, k) for k, v in by_surface.most_common()], "  by surface:")
    _table([(r["duration_s"], f"{r['name']} ({', '.join(r['expected'])})")
            for r in sorted(rows, key=lambda r: -r["duration_s"])[:a.top]], "  slowest:")

    report = json.loads((out / "reference" / "report.json").read_text())
    tests = [(t.get("duration_s") or 0.0, t["nodeid"]) for c in report["clauses"]
             for t in c["tests"]]
    test_sum = sum(s for s, _ in tests)
    run_wall = report["provenance"].get("duration_s") or 0.0
    workers = 1 if beside else cores  # `--workers 0` beside; else one xdist worker per core
    by_module = collections.Counter()
    for s, nodeid in tests:
        by_module[nodeid.split("::")[0]] += s
    print(f"\nclauses: {len(tests)} tests, {run_wall:.1f} s wall (pytest session"
          + (", the wait for the kill matrix included" if beside else "")
          + f"); tests' time {test_sum:.1f} s; the rest (start-up, collection, "
          + ("report, the wait" if beside else "xdist start-up, idle tail")
          + f") ~{workers * run_wall - test_sum:.1f} s of {workers} x wall")
    _table([(v, k) for k, v in by_module.most_common(a.top)], "  by module:")
    _table(sorted(tests, reverse=True)[:a.top], "  slowest:")
    return 0


if __name__ == "__main__":
    sys.exit(main())
