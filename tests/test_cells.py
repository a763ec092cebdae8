"""Cells: a verdict says what it judged. A clause's cells are the collected parametrisations of
its tests (family, regime, config point); a filter that drops one (-k, the model size, a
surface selection, a shard) makes the clause and the run PARTIAL, names what was lost, keeps
the score from rising, and makes `rlconform run` exit non-zero unless told (--partial-ok). A
run stopped by a signal writes the report of what had run, and a test running past a few
seconds is named on the terminal."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rlconform.conformance.engine import cells
from rlconform.conformance.engine.progress import ClauseProgress
from rlconform.reports._common import headline
from rlconform.reports.diff import diff_reports, render_diff
from rlconform.reports.gate import gate
from rlconform.reports.html import render_html
from rlconform.reports.markdown import render_markdown
from rlconform.reports.model import load_report

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "rlconform.conformance.cli"]

# the probe: a codec that casts Nemotron-Omni's fp32-on-purpose pixels fails WIRE-DTYPE on that
# family only. Judged on every family it fails; with that family filtered out it "passes", and
# before cells its score rose from 0 of 1 to 1 of 1.
MUTANT = "mutant:casts_kept_fp32_media"
WHOLE = "test_dtype_policy"  # every cell of WIRE-DTYPE (its two test functions)
FILTERED = "test_dtype_policy and not nemotron_omni"
LOST = {"test_codec.py::test_dtype_policy[nemotron_omni]",
        "test_codec.py::test_dtype_policy_reaches_dict_media[nemotron_omni]"}


def _run(out: Path, *extra: str, env: dict | None = None, backend: str = MUTANT):
    proc = subprocess.run([*CLI, "run", "--backend", backend, "--workers", "0", "-q",
                           "--report-dir", str(out), *extra], capture_output=True, text=True,
                          cwd=ROOT, timeout=600, env={**os.environ, **(env or {})})
    found = sorted(out.glob("*/report.json"))
    return proc.returncode, (found[0] if found else None), proc.stdout + proc.stderr


def _clause(report: dict, cid: str) -> dict:
    return next(c for c in report["clauses"] if c["id"] == cid)


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cells")
    whole = _run(tmp / "whole", "--surfaces", "codec", "-k", WHOLE)
    filtered = _run(tmp / "filtered", "--surfaces", "codec", "-k", FILTERED)
    told = _run(tmp / "told", "--surfaces", "codec", "-k", FILTERED, "--partial-ok")
    return whole, filtered, told


@pytest.mark.slow
def test_a_filter_inside_a_clause_makes_it_partial_and_names_the_lost_cells(probe):
    (code_w, path_w, out_w), (code, path, out), _ = probe
    whole, report = load_report(path_w), load_report(path)
    c_w, c = _clause(whole, "WIRE-DTYPE"), _clause(report, "WIRE-DTYPE")
    # judged on every cell, the clause fails on the family it breaks
    assert c_w["status"] == "failed" and code_w == 1, out_w[-2000:]
    assert c_w["cells"]["judged"] == c_w["cells"]["in_scope"] == 13 and \
        c_w["cells"]["dropped"] == 0, c_w["cells"]
    # filtered: what ran passed, and the clause says it was judged on 11 of its 13 cells
    assert c["status"] == "passed", c
    assert (c["cells"]["judged"], c["cells"]["in_scope"], c["cells"]["dropped"]) == (11, 13, 2)
    assert {d["cell"] for d in c["cells"]["dropped_cells"]} == LOST
    assert all(d["why"] == f"-k {FILTERED!r}" and d["by"] == "keyword"
               for d in c["cells"]["dropped_cells"])
    assert "cells: 11 of 13 judged; 2 dropped" in c["message"]
    assert "test_dtype_policy[nemotron_omni]" in c["message"]
    # the run: PARTIAL, not PASS, in every format and on the terminal, and a non-zero exit
    assert report["cells"]["partial"] and "keyword" in report["cells"]["partial_by"]
    assert not report["cells"]["partial_ok"]
    assert headline(report).startswith("PARTIAL: "), headline(report)
    assert code == 1, out[-2000:]
    assert "PARTIAL run (" in out and "--partial-ok" in out, out[-2000:]
    assert "PASSED (PARTIAL)    WIRE-DTYPE: cells: 11 of 13 judged" in out, out[-2000:]
    for text in (render_markdown(report), render_html(report), path.with_suffix(".md")
                 .read_text()):
        assert "test_dtype_policy[nemotron_omni]" in text and "PARTIAL" in text
    verdict = gate(path)
    assert not verdict.ok and verdict.partial_only and verdict.word == "PARTIAL"
    (reason,) = [r for r in verdict.reasons if "judged on fewer cells" in r]
    assert "WIRE-DTYPE 11/13 (test_dtype_policy[nemotron_omni]" in reason, reason
    gate_cli = subprocess.run([*CLI, "gate", str(path)], capture_output=True, text=True)
    assert gate_cli.returncode == 1 and "WIRE-DTYPE 11/13" in gate_cli.stdout, gate_cli.stdout


@pytest.mark.slow
def test_dropping_cells_never_raises_the_score(probe):
    """The score over a partial run is a lower bound of the whole run's: a clause that passed
    only on the cells it judged is not counted, and clauses left out stay in the denominator.
    Counted the old way (passed / judged clauses) the filtered run read 100% against 0%."""
    (_, path_w, _), (_, path, _), _ = probe
    whole, report = load_report(path_w), load_report(path)
    s_w, s = whole["summary"], report["summary"]
    assert s["passed"] == 1 and s["passed_partial"] == 1, s
    assert s["score"] <= s_w["score"], (s["score"], s_w["score"])
    old_way = s["passed"] / (s["total"] - s["not_applicable"])
    assert old_way == 1.0 and s["score"] == 0.0, (old_way, s)
    assert s["not_run"] == len(report["deselected"]) > 0
    assert "a lower bound: partial run" in headline(report)
    assert "1 passed on the cells judged only (not scored)" in headline(report)


@pytest.mark.slow
def test_diff_and_gate_against_the_whole_run_do_not_call_it_a_fix(probe):
    (_, path_w, _), (_, path, _), _ = probe
    result = diff_reports(path_w, path)
    assert "WIRE-DTYPE" not in {ch.id for ch in result.newly_passing}
    (lost,) = [ch for ch in result.cells_lost if ch.id == "WIRE-DTYPE"]
    assert (lost.old, lost.new, lost.cells) == ("failed", "passed", "13 -> 11 of 13")
    text = render_diff(result)
    assert "judged on fewer cells than before (a pass here is not a fix)" in text
    assert "cells judged 13 -> 11 of 13" in text
    verdict = gate(path, baseline=path_w)
    assert not verdict.ok
    assert any(r.startswith("coverage lost: WIRE-DTYPE judged 13 cells in the baseline and "
                            "11 now") for r in verdict.reasons), verdict.reasons


@pytest.mark.slow
def test_partial_ok_is_recorded_and_the_gate_still_fails_the_run(probe):
    _, _, (code, path, out) = probe
    report = load_report(path)
    assert code == 0, out[-2000:]
    assert report["cells"]["partial_ok"] and report["cells"]["partial"]
    assert "partial run intended (--partial-ok)" in out
    assert "(partial run intended: --partial-ok)" in headline(report)
    verdict = gate(path)
    assert not verdict.ok and verdict.word == "PARTIAL"


@pytest.mark.slow
def test_the_model_size_drop_is_named_per_family(tmp_path):
    """Production width has no 7-8B families: their trainer cells are dropped, never run at
    another size, and the report says which and why."""
    code, path, out = _run(tmp_path, "--model-size", "production", "--surfaces", "trainer",
                           "-k", "test_ratio_one_from_independent_recompute and llava",
                           backend="reference")
    assert code == 1, out[-2000:]
    report = load_report(path)
    by = {(r["by"], r["why"]) for r in report["cells"]["dropped_by"]}
    assert ("model_size", "--model-size production: family 'llava_next' has no production "
            "model (fixtures/sizes.py)") in by, by
    assert "model_size" in report["cells"]["partial_by"]


# -- a run stopped from outside ------------------------------------------------------------------
SLEEPER = textwrap.dedent("""
    import os, signal, sys, time

    def pytest_runtest_setup(item):
        if os.environ.get("RLC_FOREIGN_SIGTERM"):  # as ray.init does: exit at once on SIGTERM
            signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))

    def pytest_runtest_call(item):
        if os.environ["RLC_SLEEP_AT"] in item.nodeid:
            time.sleep(300)
""")


@pytest.mark.slow
@pytest.mark.parametrize("foreign", ["", "1"], ids=["own-handler", "session-replaced-it"])
def test_a_signal_writes_the_report_of_what_had_run(tmp_path, foreign):
    """SIGTERM while a test runs (a store that hangs), sent as `timeout` sends it (to the
    runner, then to its process group): the progress line names that test and
    its time so far, and the run ends with a report (the test before it kept, the running one's
    clause incomplete, the signal named), exit status 128 + 15; also when the backend's
    session installed a SIGTERM handler of its own (ray.init does) before the test."""
    (tmp_path / "rlc_sleeper.py").write_text(SLEEPER)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "RLC_SLEEP_AT": "test_partitions_are_isolated", "RLCONFORM_SLOW_TEST_S": "1",
           "RLC_FOREIGN_SIGTERM": foreign}
    proc = subprocess.Popen(
        [*CLI, "run", "--workers", "0", "-q", "--report-dir", str(out), "-p", "rlc_sleeper",
         "--partial-ok", "-k", "test_tags_follow_keys or test_partitions_are_isolated"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env,
        start_new_session=True)
    seen, deadline = [], time.monotonic() + 300
    try:
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("rlconform: running ") or time.monotonic() > deadline:
                break
        assert seen and seen[-1].startswith(
            "rlconform: running test_transport.py::test_partitions_are_isolated "
            "(DP-CLEAR-ISOLATION): "), "".join(seen)[-3000:]
        # as GNU timeout and CI runners stop a job: the runner first, then its whole process
        # group (the runner again): the repeat must not end the report being written
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGTERM)
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, rest[-3000:]
    report = load_report(out / "reference" / "report.json")
    assert report["provenance"]["stopped_by"] == "SIGTERM"
    (problem,) = report["problems"]
    assert problem.startswith("run interrupted by SIGTERM before every selected test reported: "
                              "1 of 2 tests reported"), problem
    assert _clause(report, "DP-TAGS")["status"] == "passed"
    stopped = _clause(report, "DP-CLEAR-ISOLATION")
    assert stopped["status"] == "incomplete" and stopped["cells"]["unreported"] == 1, stopped
    assert "score n/a: run incomplete" in headline(report)
    assert not gate(report).ok
    assert "run interrupted by SIGTERM" in rest


def test_the_progress_line_names_a_slow_test_and_repeats_while_it_runs():
    progress = ClauseProgress(config=None)
    progress.slow_s = 5.0
    progress.clauses_of = {"x/test_store.py::test_put[a]": ["DP-STORE-MODEL"]}
    progress.running["x/test_store.py::test_put[a]"] = 100.0
    assert progress.slow_lines(103.0) == []
    assert progress.slow_lines(106.0) == \
        ["running x/test_store.py::test_put[a] (DP-STORE-MODEL): 6 s"]
    assert progress.slow_lines(120.0) == []  # named 14 s ago
    assert progress.slow_lines(136.5) == \
        ["running x/test_store.py::test_put[a] (DP-STORE-MODEL): 36 s"]
    progress.pytest_runtest_logfinish("x/test_store.py::test_put[a]", None)
    assert progress.slow_lines(200.0) == []


# -- readers of reports that predate cells, and the merge's record ------------------------------
def test_committed_reports_read_their_cells_or_say_they_were_not_recorded():
    old = 0
    for path in sorted((ROOT / "docs" / "backend-reports").glob("*.json")):
        report = load_report(path)
        result = diff_reports(report, report)
        assert not any("judged on fewer cells" in r or "coverage lost" in r
                       for r in gate(report, baseline=report).reasons), path
        if "cells" in report:  # regenerated since cells: a full run judges every cell in scope
            c = report["cells"]
            assert not c["partial"] and c["judged"] + c["skipped"] == c["in_scope"], path
            assert f"cells: {c['judged']} of {c['in_scope']} in scope judged" in headline(report)
            continue
        old += 1
        assert headline(report).endswith("cells not recorded"), path
        assert "| — |" in render_markdown(report)  # the clause table's cells column
        assert result.unchanged and result.old_cells == "not recorded"
    # a report from before cells, as a reader meets it: not one number invented
    if not old:
        report = load_report(next((ROOT / "docs" / "backend-reports").glob("*.json")))
        report = {k: v for k, v in report.items() if k != "cells"}
        report["clauses"] = [{k: v for k, v in c.items() if k != "cells"}
                             for c in report["clauses"]]
        assert headline(report).endswith("cells not recorded")


def test_a_merge_drops_only_the_cells_no_part_selected():
    host = cells.Ledger({"a": ["X"], "b": ["X"], "c": ["Y"]},
                        {"b": ("placement", "--placement host (the device part's share)"),
                         "c": ("keyword", "-k 'not c'")})
    device = cells.Ledger({"a": ["X"], "b": ["X"], "c": ["Y"]},
                          {"a": ("placement", "--placement device (the host part's share)"),
                           "c": ("placement", "--placement device (the host part's share)")})
    both = cells.merged([(host, {"a"}), (device, {"b"})])
    assert both.dropped == {"c": ("keyword", "-k 'not c'")}, both.dropped
    alone = cells.merged([(host, {"a"})])
    assert set(alone.dropped) == {"b", "c"}
    assert cells.needs_consent({"partial_by": ["keyword"], "partial_ok": False})
    assert not cells.needs_consent({"partial_by": [], "partial_ok": False})
    assert not cells.needs_consent({"partial_by": ["keyword"], "partial_ok": True})


def test_the_run_record_round_trips_through_json():
    ledger = cells.Ledger({"t.py::f[a]": ["X"]}, {"t.py::f[a]": ("shard", "--shard 1/2")})
    again = cells.Ledger.from_json(json.loads(json.dumps(ledger.to_json())))
    assert (again.scope, again.dropped) == (ledger.scope, ledger.dropped)
