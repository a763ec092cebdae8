"""A clause run that ends before every selected test reported must say so in its report, and
`rlconform mutants` must refuse options it does not take instead of reporting every mutant as
survived."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rlconform.reports.gate import gate
from rlconform.reports.html import render_html
from rlconform.reports.markdown import render_markdown

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "rlconform.conformance.cli"]
# seven quick data-plane tests, in file order: DP-LAYOUT x4, DP-TAGS, DP-CLEAR-ISOLATION x2
SELECT = ("test_layout_preserved or test_tags_follow_keys or test_clear_removes "
          "or test_partitions_are_isolated")
SELECTED = 7

# raises KeyboardInterrupt (what Ctrl-C and `timeout -s INT` deliver) inside the call of the
# test whose id contains $RLC_INTERRUPT_AT: pytest then ends the session INTERRUPTED, in-process
# or in an xdist worker (whose controller then stops every worker)
INTERRUPTER = textwrap.dedent("""
    import os

    def pytest_runtest_call(item):
        if os.environ["RLC_INTERRUPT_AT"] in item.nodeid:
            raise KeyboardInterrupt
""")


def _run(tmp_path: Path, workers: str, interrupt_at: str, *extra: str):
    (tmp_path / "rlc_interrupter.py").write_text(INTERRUPTER)
    out_dir = tmp_path / "out"  # not there yet: an existing path argument moves pytest's rootdir
    env = {**os.environ, "RLC_INTERRUPT_AT": interrupt_at,
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([*CLI, "run", "--workers", workers, "--report-dir", str(out_dir),
                           "-p", "rlc_interrupter", "-k", SELECT, *extra],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    path = out_dir / "reference" / "report.json"
    report = json.loads(path.read_text()) if path.is_file() else None
    return proc.returncode, report, proc.stdout + proc.stderr, out_dir / "reference"


def _tests(report: dict) -> dict[str, str]:
    return {t["nodeid"].rsplit("::", 1)[-1]: t["outcome"]
            for c in report["clauses"] for t in c["tests"]}


def _interrupted_problem(report: dict) -> str:
    found = [p for p in report["problems"] if p.startswith("run interrupted")]
    assert len(found) == 1, report["problems"]
    return found[0]


def _shown_everywhere(report: dict, problem: str, folder: Path, output: str) -> None:
    verdict = gate(report)
    assert not verdict.ok and f"problem: {problem}" in verdict.reasons, verdict.reasons
    assert problem in render_markdown(report)
    assert problem in (folder / "report.md").read_text()
    html = render_html(report)
    assert "run interrupted before every selected test reported" in html
    assert "run interrupted before every selected test reported" in " ".join(output.split())


@pytest.mark.slow
def test_an_interrupted_run_says_so_and_names_the_clauses_left_partial(tmp_path):
    """In process: the last selected test is interrupted in its call (it has a passed setup
    report, nothing more). The six before it reported; DP-CLEAR-ISOLATION passed on one of its
    two tests and must say so; before the fix the report listed no problem at all and the
    interrupted test's setup counted as a pass."""
    code, report, out, folder = _run(tmp_path, "0", "test_partitions_are_isolated")
    assert code == int(pytest.ExitCode.INTERRUPTED), out[-3000:]
    assert report is not None, out[-3000:]
    problem = _interrupted_problem(report)
    assert f": 6 of {SELECTED} tests reported; clause results are partial" in problem, problem
    assert problem.endswith("clauses whose tests did not all report: DP-CLEAR-ISOLATION"), problem
    tests = _tests(report)
    assert "test_partitions_are_isolated" not in tests, tests
    assert len(tests) == 6 and set(tests.values()) == {"passed"}, tests
    clause = {c["id"]: c for c in report["clauses"]}["DP-CLEAR-ISOLATION"]
    assert clause["status"] == "incomplete"  # its one reported test passed: not a verdict
    assert clause["message"].startswith("partial: 1 of 2 selected tests reported "
                                        "(run interrupted)"), clause["message"]
    _shown_everywhere(report, problem, folder, out)
    assert "partial: 1 of 2 selected tests reported" in out  # the terminal summary


@pytest.mark.slow
def test_an_interrupted_xdist_run_says_so(tmp_path):
    """Under xdist the controller collects nothing: the selection comes from the workers'
    collections (after -k deselection, which runs in the workers), the interrupted test is not
    reported as a crash, and the clauses of tests that never reported are still named."""
    code, report, out, folder = _run(tmp_path, "2", "test_tags_follow_keys")
    assert code == int(pytest.ExitCode.INTERRUPTED), out[-3000:]
    assert report is not None, out[-3000:]
    problem = _interrupted_problem(report)
    reported = int(problem.split(": ", 1)[1].split(" of ", 1)[0])
    assert f" of {SELECTED} tests reported" in problem and reported < SELECTED, problem
    assert "DP-TAGS" in problem.split("clauses whose tests did not all report: ", 1)[1], problem
    assert "unknown clauses" not in problem, problem
    tests = _tests(report)
    assert "test_tags_follow_keys_in_request_order" not in tests, tests  # not an error
    assert len(tests) == reported and set(tests.values()) == {"passed"}, tests
    _shown_everywhere(report, problem, folder, out)


@pytest.mark.slow
def test_a_complete_run_records_no_such_problem(tmp_path):
    """The check fails only runs that lost tests: the same selection, nothing interrupted."""
    code, report, out, _ = _run(tmp_path, "2", "no test has this in its id", "--partial-ok")
    assert code == 0, out[-3000:]
    assert report["problems"] == [], report["problems"]
    assert len(_tests(report)) == SELECTED
    assert all(not c["message"] for c in report["clauses"]), report["clauses"]


def _xdist_crash_report(nodeid: str, worker: str) -> pytest.TestReport:
    """What xdist's DSession.handle_crashitem reports for the test a dead worker was running:
    no user properties, when "???"."""
    from types import SimpleNamespace

    rep = pytest.TestReport(nodeid=nodeid, location=("m.py", None, "m.py"), keywords={},
                            outcome="failed", longrepr=f"worker {worker!r} crashed while "
                            f"running {nodeid!r}", when="???")
    rep.node = SimpleNamespace(gateway=SimpleNamespace(id=worker), _workerinfocache=f"[{worker}]")
    return rep


def test_a_test_whose_worker_died_is_an_error_and_an_interrupted_one_is_unreported():
    """A worker that dies (out of memory, a segfault) mid-test leaves that test with a passed
    setup report and then xdist's crash report, which carries no clause properties: the test
    is an error of its clause (before: the crash report was dropped and the setup counted as a
    pass). A worker stopped by Ctrl-C is not a crash: its test did not report."""
    from types import SimpleNamespace

    from rlconform.conformance.engine.items import CLAUSE_PROP
    from rlconform.conformance.engine.outcomes import logreport

    st = SimpleNamespace(results={}, reported=set(), selected=None, interrupted_workers={"gw1"})
    for nodeid, worker in (("m.py::test_a", "gw0"), ("m.py::test_b", "gw1")):
        setup = pytest.TestReport(nodeid=nodeid, location=("m.py", 1, nodeid), keywords={},
                                  outcome="passed", longrepr=None, when="setup",
                                  user_properties=[(CLAUSE_PROP, ["DP-TAGS"])])
        logreport(st, setup)
        assert nodeid not in st.reported  # a passed setup is not a result
        logreport(st, _xdist_crash_report(nodeid, worker))
    crashed = st.results["m.py::test_a"]
    assert "m.py::test_a" in st.reported
    assert crashed["outcome"] == "error" and crashed["clauses"] == ["DP-TAGS"], crashed
    assert "crashed while running" in crashed["message"]
    assert "m.py::test_b" not in st.reported


# -- rlconform mutants: options -------------------------------------------------------------
def test_mutants_refuses_an_option_it_does_not_take_before_any_worker_starts(tmp_path):
    """`--workers` belongs to `rlconform run`; `mutants` used to hand it to every mutant's
    pytest run, which refused it, and printed "SURVIVED ... no report written" for all 96."""
    for args, names in ((["--workers", "2"], ["--workers", "--jobs"]),
                        (["-n", "2"], ["-n", "--jobs"]),
                        (["--wrokers=2"], ["--wrokers=2"]),
                        (["--profile", "fast"], ["--profile", "invalid choice"]),
                        (["--backend", "reference"], ["--backend", "--only"])):
        proc = subprocess.run([*CLI, "mutants", "--report-dir", str(tmp_path), "--jobs", "1",
                               "--only", "aliasing_put", *args],
                              capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert "usage: rlconform mutants" in proc.stderr, proc.stderr
        for name in names:
            assert name in proc.stderr, (args, proc.stderr)
        assert "SURVIVED" not in proc.stdout and "survived" not in proc.stdout, proc.stdout
        assert not (tmp_path / "mutants").exists(), "a worker started"


def test_mutants_passes_through_the_options_meant_for_each_run():
    from rlconform.conformance.engine.kill_matrix import mutant_args_problem

    assert mutant_args_problem(["--profile", "ci", "--device", "cpu", "--dtype", "bfloat16",
                                "--model-size", "tiny", "--seed", "3", "--require",
                                "bfloat16", "-k", "test_ranks", "-m", "not slow",
                                "--surfaces=transport", "--expectations", "w.toml"]) is None
    assert "--workers" in mutant_args_problem(["--workers", "2"])
    assert "'--frobnicate'" in mutant_args_problem(["-k", "x", "--frobnicate"])


@pytest.mark.slow
def test_a_mutant_run_that_wrote_no_report_is_an_error_not_a_survivor(tmp_path):
    """`--require` passes through and is checked by the plugin in each mutant's run: an
    unknown capability is a usage error there, and no report is written. That mutant has no
    verdict: an ERROR of the matrix run (exit 1), never "survived", and its claims are not
    counted as claims that did not kill."""
    proc = subprocess.run([*CLI, "mutants", "--report-dir", str(tmp_path), "--jobs", "1",
                           "--only", "aliasing_put", "--require", "no_such_capability"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    progress = [ln for ln in proc.stdout.splitlines() if ln.startswith("[1/1")]
    assert len(progress) == 1 and "ERROR" in progress[0] and "SURVIVED" not in progress[0], out
    assert "no report written (its pytest run exited with USAGE_ERROR" in progress[0], out
    assert "gave no verdict" in out and "aliasing_put: no report written" in out, out
    assert "1 mutants, 0 killed, 0 survived, 1 errors (no verdict)" in out, out
    assert "survived: " not in out, out
    matrix = json.loads((tmp_path / "mutants" / "kill_matrix.json").read_text())
    assert [e["mutant"] for e in matrix["errors"]] == ["aliasing_put"], matrix
    assert matrix["claims_not_killed"] == [], matrix


def test_reports_show_a_mutant_without_verdict_as_an_error():
    from rlconform.reports.sample import example_report

    report = example_report()
    row = report["kill_matrix"]["mutants"][0]
    row.update(killed=False, failed=[], error="no report written (its pytest run exited with "
                                               "USAGE_ERROR (a bad option?))")
    md = render_markdown(report)
    line = next(ln for ln in md.splitlines() if ln.startswith(f"| {row['name']} |"))
    assert "ERROR: no report written" in line and "survived" not in line, line
    html = render_html(report)
    assert "error: no verdict" in html and "no report written" in html


def test_a_refused_mutant_run_says_why_and_an_exception_keeps_its_message(tmp_path):
    """A mutant run stopped by the GPU preflight names the refusal (a kill-matrix job has no
    terminal: the reason is read from its report's problems), and a test that failed by an
    exception (no kill) keeps the exception's message in the matrix row."""
    from rlconform.conformance.engine.kill_matrix import _collect

    folder = tmp_path / "mutants" / "mutant_m"
    folder.mkdir(parents=True)
    why = "the GPU memory plan does not fit H100 (79 GiB, 71 GiB usable): smolvlm needs 94 GiB"
    test = {"nodeid": "test_t.py::test_x[text]", "outcome": "failed",
            "failure_kind": "exception", "params": {"family": "text"},
            "message": "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"}
    report = {"clauses": [{"id": "C", "status": "failed", "tests": [test]}],
              "problems": [why], "provenance": {"duration_s": 0.1}}
    (folder / "report.json").write_text(json.dumps(report))
    row = _collect("m", tmp_path, int(pytest.ExitCode.USAGE_ERROR))
    assert row["error"] == f"its pytest run exited with USAGE_ERROR (a bad option?): {why}"
    assert row["failed_by_exception_only"] == ["C"] and row["failed"] == []
    assert row["failed_tests"]["test_t.py::test_x[text]"]["message"] == test["message"]


def test_kill_matrix_jobs_on_one_gpu_share_one_memory_ledger():
    """At production width on CUDA every job of the kill matrix gets the same ledger (the
    environment they inherit); elsewhere none is set (a session makes its own if it needs one)."""
    from rlconform.conformance.engine import gpu_memory
    from rlconform.conformance.engine.kill_matrix import _share_gpu_ledger

    env = {}
    _share_gpu_ledger(env, ["--device", "cuda", "--model-size", "production"])
    assert env[gpu_memory.LEDGER_ENV].endswith("ledger.json")
    for extra in (["--device", "cpu", "--model-size", "production"],
                  ["--device", "cuda", "--model-size", "tiny"]):
        env = {}
        _share_gpu_ledger(env, extra)
        assert gpu_memory.LEDGER_ENV not in env
