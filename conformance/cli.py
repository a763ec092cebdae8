"""`rlconform`: run the suite, list backends and clauses, run the mutants, diff and gate reports,
and put every backend's report on one scoreboard.

Exit codes: 0 success; 1 a clause failed / the gate failed / a mutant survived or its run gave no
verdict (an error of the kill matrix); 2 usage error or an invalid report; 69 a system the backend
needs is not available (its store did not answer; with `--backend all`: a backend could not be
loaded, and none that ran failed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _cmd_run(a, extra) -> int:
    from rlconform.conformance.engine import runner

    if a.backend == "all":
        from rlconform.conformance.backends import BUNDLED, own_session

        # a backend with its own environment (vllm: `nox -s vllm`) runs from its session
        return runner.run_all([n for n in BUNDLED if not own_session(n)], extra, a.workers)
    return runner.run(a.backend, extra, a.workers)


def _cmd_backends(a, extra) -> int:
    from rlconform.conformance.backend import known_backends, load_backend

    for name, spec in sorted(known_backends().items()):
        try:
            b = load_backend(name).describe()
            print(f"{name:24} surfaces: {', '.join(b['surfaces'])}")
            print(f"{'':24} capabilities: {', '.join(b['capabilities']) or '-'}")
            for what, why in b["notes"].items():
                print(f"{'':24} no {what}: {why}")
        except Exception as exc:  # noqa: BLE001 - listing must go on past a broken backend
            print(f"{name:24} ({spec}) cannot be loaded: {exc}")
    return 0


def _cmd_clauses(a, extra) -> int:
    from rlconform.conformance.catalogue.docs import clause_table

    if a.format == "json":
        from dataclasses import asdict

        from rlconform.conformance.catalogue import CLAUSES

        print(json.dumps([asdict(c) for c in CLAUSES], indent=2))
    else:
        print(clause_table(), end="")
    return 0


def _cmd_mutants(a, extra) -> int:
    from rlconform.conformance.engine.kill_matrix import failures, kill_matrix, no_verdict
    from rlconform.conformance.engine.shards import parse

    shard = parse(a.shard)  # a bad K/N: exit 2 before any worker starts

    def progress(row: dict, done: int, total: int, elapsed: float) -> None:
        mark = "ERROR   " if no_verdict(row) else "killed  " if row["killed"] else "SURVIVED"
        by = ", ".join(c for c in row["failed"] if c in row["expected"]) or "-"
        note = f"  ERROR {row['error']}" if row.get("error") else ""
        if row["missed"] and row["killed"]:
            note += f"  (claimed, not killed by: {', '.join(row['missed'])})"
        only_exc = [c for c in row.get("failed_by_exception_only", ()) if c in row["expected"]]
        if only_exc:
            first = next((f["message"] for f in (row.get("failed_tests") or {}).values()
                          if f.get("kind") != "assertion" and f.get("message")), "")
            note += (f"  (failed only by exceptions, no assertion: {', '.join(only_exc)}"
                     + (f"; first: {first.splitlines()[0][:160]}" if first else "") + ")")
        print(f"[{done:>{len(str(total))}}/{total} {elapsed:6.1f}s] {mark} {row['name']:36} "
              f"by {by} ({row['duration_s']:.1f}s){note}", flush=True)

    against = "every test of every clause" if a.full else "the clauses that claim to kill it"
    print(f"rlconform mutants: each mutant against {against}; results as they finish",
          flush=True)
    surfaces = [x for x in (a.mutant_surfaces or "").split(",") if x]
    m = kill_matrix(a.report_dir, a.jobs, a.only or None, extra, full=a.full,
                    on_result=progress, surfaces=surfaces or None, every_test=a.every_test,
                    shard=shard)
    errors = m["errors"]
    survived = [r["name"] for r in m["mutants"] if not r["killed"] and not no_verdict(r)]
    if errors:
        print(f"ERROR: the runs of {len(errors)} mutants gave no verdict (neither killed nor "
              "survived; the kill matrix is incomplete):")
        for e in errors:
            print(f"  {e['mutant']}: {e['error']}")
    if survived:
        print(f"survived: {', '.join(survived)}")
    if m.get("killed_only_by_exceptions"):
        print("claims met only by exceptions other than a clause assertion (not kills): "
              + ", ".join(f"{c['clause']} x {c['mutant']}" for c in m["killed_only_by_exceptions"]))
    if a.full or a.every_test:
        print(f"clause tests failed by at least one mutant: "
              f"{len(m['tests']) - len(m['tests_without_kill'])} of {len(m['tests'])}")
        if m["tests_without_kill"]:
            print("clause tests no mutant fails (on a clause assertion): "
                  + ", ".join(m["tests_without_kill"]))
    if m["claims_not_killed"]:
        print("claims that did not kill (the catalogue names the mutant, the clause passed): "
              + ", ".join(f"{c['clause']} x {c['mutant']}" for c in m["claims_not_killed"]))
    partial = a.only or shard  # clauses may kill what another shard holds
    if m["clauses_without_kill"] and not partial:
        print(f"clauses that kill no mutant: {', '.join(m['clauses_without_kill'])}")
    killed = sum(r["killed"] for r in m["mutants"])
    print(f"{len(m['mutants'])} mutants, {killed} killed, {len(survived)} survived"
          + (f", {len(errors)} errors (no verdict)" if errors else "")
          + f", {m['duration_s']} s; {a.report_dir}/mutants/kill_matrix.json")
    failed = failures(m, partial=bool(partial),
                      tests_checked=(a.full or a.every_test) and "-k" not in extra)
    return 1 if failed else 0


def _load(path):
    from rlconform.reports.model import ReportValidationError, load_report

    try:
        return load_report(path)
    except (OSError, ReportValidationError) as exc:
        raise ValueError(f"cannot read report {path}: {exc}") from exc


def _cmd_diff(a, extra) -> int:
    from rlconform.reports.diff import diff_reports, render_diff

    print(render_diff(diff_reports(_load(a.old), _load(a.new))))
    return 0


def _cmd_gate(a, extra) -> int:
    from rlconform.reports.gate import gate

    allow = [c.strip() for c in (a.allow_coverage_drop or "").split(",") if c.strip()]
    # paths: an unreadable or invalid report exits 2
    result = gate(a.report, a.baseline, allow_coverage_drop=allow)
    print(result.render())
    return result.exit_code


def _cmd_memory_plan(a, extra) -> int:
    from rlconform.conformance.engine import gpu_memory

    plan = gpu_memory.fold_report(gpu_memory.load_plan(), _load(a.report))
    text = json.dumps(plan, indent=2) + "\n"
    if a.write:
        gpu_memory.PLAN_PATH.write_text(text)
        print(f"wrote {gpu_memory.PLAN_PATH}")
    else:
        print(text, end="")
    return 0


def _cmd_merge(a, extra) -> int:
    from rlconform.conformance.engine.merge import merge
    from rlconform.reports._common import headline

    report, matrix = merge(a.inputs, a.out, a.mutant_effects)
    if matrix is not None:
        killed = sum(r["killed"] for r in matrix["mutants"])
        print(f"kill matrix: {len(matrix['mutants'])} mutants, {killed} killed, "
              f"{len(matrix['errors'])} without a verdict"
              + (f" (shards not given: {matrix['merged_shards']['missing']})"
                 if matrix["merged_shards"]["missing"] else "")
              + f" -> {a.out}/mutants/kill_matrix.json")
    if report is not None:
        print(headline(report))
        print(f"report: {a.out}/report.json (.md, .html, junit.xml)")
    return 0


def _cmd_shard_durations(a, extra) -> int:
    from pathlib import Path

    from rlconform.conformance.engine import shards

    out = Path(a.out) if a.out else None
    # fold into the file being written (a checkout's copy may differ from the installed one)
    record = shards.load_durations(out) if out and out.is_file() else shards.load_durations()
    for path in a.reports:
        doc = json.loads(open(path).read())
        if "clauses" in doc:
            doc = _load(path)
        regime, tests, mutants = shards.durations_from(doc)
        record = shards.fold(record, regime, tests, mutants, shards.killers_from(doc))
    text = json.dumps(record, indent=2) + "\n"
    if a.write or out:
        path = out or shards.DURATIONS_PATH
        path.write_text(text)
        print(f"wrote {path}")
    else:
        print(text, end="")
    return 0


def _cmd_scoreboard(a, extra) -> int:
    from rlconform.reports.scoreboard import write

    md, html = a.md, a.html
    if md is None and html is None:
        md, html = f"{a.out}/scoreboard.md", f"{a.out}/scoreboard.html"
    board = write(a.reports, md, html)
    print(f"scoreboard: {len(board.entries)} reports x {len(board.clause_ids)} clauses -> "
          f"{', '.join(str(p) for p in (md, html) if p)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rlconform", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    from rlconform.conformance.engine.options import options_help

    r = sub.add_parser("run", help="run the clause suite against a backend; extra args go to "
                                   "pytest (e.g. --profile ci --device cuda --dtype bfloat16)",
                       epilog=options_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("--backend", default="reference", help="name, mutant:<name>, module:attr, "
                                                          "or all (every bundled backend)")
    r.add_argument("--workers", default="auto", help="pytest-xdist workers (0: in process)")
    sub.add_parser("backends", help="list known backends, their surfaces and capabilities")
    c = sub.add_parser("clauses", help="print the clause catalogue")
    c.add_argument("--format", choices=["markdown", "json"], default="markdown")
    m = sub.add_parser("mutants", help="run every mutant and write the kill matrix; passes "
                                       "the plugin's options (--profile, --device, ...) and "
                                       "-k / -m through to each mutant's run")
    m.add_argument("--report-dir", default="reports/out")
    m.add_argument("--jobs", type=int, default=None)
    m.add_argument("--only", nargs="*", default=[])
    m.add_argument("--every-test", action="store_true",
                   help="every test of each mutant's claimed clauses (no stop at the first "
                        "kill), reporting per clause test the mutants that fail it")
    m.add_argument("--mutant-surfaces", default="", metavar="SURFACE[,SURFACE]",
                   help="only the mutants of these surfaces (the nightly GPU regime: "
                        "trainer,rollout)")
    m.add_argument("--full", action="store_true",
                   help="run each mutant against every test of every clause, not only the "
                        "clauses that claim to kill it, and report per clause test the mutants "
                        "that fail it (slow: nightly and on demand); fails when a clause test "
                        "fails on no mutant")
    m.add_argument("--shard", default=None, metavar="K/N",
                   help="only shard K of N of the selected mutants (balanced by recorded "
                        "durations; `rlconform merge` joins the shards' kill_matrix.json)")
    mg = sub.add_parser("merge", help="join the shard reports of one run (run --shard K/N; "
                                      "kill_matrix.json of mutants --shard K/N) into one")
    mg.add_argument("inputs", nargs="+", metavar="REPORT.json",
                    help="the shards' report.json and/or mutants/kill_matrix.json files")
    mg.add_argument("-o", "--out", required=True, metavar="OUT_DIR",
                    help="write report.{json,md,html}, junit.xml and mutants/kill_matrix.json "
                         "here")
    mg.add_argument("--mutant-effects", default=None, metavar="FILE",
                    help="the mutants' numeric effects (mutant_effects.json) the merged "
                         "reference report carries, when the shards did not find one")
    sd = sub.add_parser("shard-durations", help="fold the per-test durations of run reports "
                                                "and kill matrices into the shards' record "
                                                "(print, or --write it)")
    sd.add_argument("reports", nargs="+")
    sd.add_argument("--write", action="store_true",
                    help="write the record rlconform reads (the installed package's "
                         "shard_durations.json; an editable install's is the checkout's)")
    sd.add_argument("--out", default=None, metavar="FILE",
                    help="write the record to FILE instead, e.g. "
                         "conformance/engine/shard_durations.json of a checkout to commit")
    d = sub.add_parser("diff", help="compare two report.json files")
    d.add_argument("old")
    d.add_argument("new")
    g = sub.add_parser("gate", help="exit 0 only when the report may ship")
    g.add_argument("report")
    g.add_argument("--baseline", default=None)
    g.add_argument("--allow-coverage-drop", default="", metavar="CLAUSE[,CLAUSE]|all",
                   help="clauses the baseline tested that may go untested now (intended: a "
                        "surface or capability dropped on purpose); without it, lost coverage "
                        "fails the gate")
    mp = sub.add_parser("memory-plan", help="fold a CUDA run's measured per-test GPU peaks "
                                            "into the GPU memory plan (print, or --write it)")
    mp.add_argument("report")
    mp.add_argument("--write", action="store_true",
                    help="write conformance/engine/gpu_memory_plan.json (in a source checkout)")
    s = sub.add_parser("scoreboard", help="every backend against every clause, from report.json "
                                          "files or directories holding them (Markdown + HTML)")
    s.add_argument("reports", nargs="+", help="report.json files, or directories: their "
                                              "report.json files at any depth, *.json at the top")
    s.add_argument("--md", default=None, help="write the Markdown page here")
    s.add_argument("--html", default=None, help="write the HTML page here")
    s.add_argument("--out", default="reports/out", help="without --md/--html: write "
                                                        "scoreboard.md and scoreboard.html here")
    a, extra = p.parse_known_args(argv)
    handler = {"run": _cmd_run, "backends": _cmd_backends, "clauses": _cmd_clauses,
               "mutants": _cmd_mutants, "diff": _cmd_diff, "gate": _cmd_gate,
               "memory-plan": _cmd_memory_plan, "scoreboard": _cmd_scoreboard,
               "merge": _cmd_merge, "shard-durations": _cmd_shard_durations}[a.cmd]
    if extra and a.cmd not in ("run", "mutants"):
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    if a.cmd == "mutants":
        from rlconform.conformance.engine.kill_matrix import mutant_args_problem

        problem = mutant_args_problem(extra)
        if problem:
            m.error(problem)  # usage, the message, exit 2: before any worker starts
    try:
        return handler(a, extra)
    except (LookupError, ValueError) as exc:
        print(f"rlconform {a.cmd}: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return _pipe_closed()


def _pipe_closed() -> int:
    """The reader of stdout went away (`rlconform gate ... | head`): no traceback, and none
    at exit either (stdout now points at /dev/null, so the final flush has somewhere to go)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 141  # 128 + SIGPIPE, what a shell reports for a process the closed pipe ended


if __name__ == "__main__":
    sys.exit(main())
