"""`--with-kill-matrix`: the mutant kill matrix runs beside the clause run, in the same command.

The main job ran the kill matrix (two worker processes), then the clause run (two xdist
workers): each phase paid its own start-up and its own idle tail, and every process imported
torch, transformers and the clause modules. Here the clause run keeps one process (`rlconform
run --workers 0`, the nox session's choice) while the kill matrix starts with one worker on the
other core; as the clause run nears its end, the kill matrix takes the other cores too
(`kill_matrix(grow=...)`, the rule in `when` below), and the report waits for it and carries
it, as when it ran first.

The kill matrix is the same: every mutant, the claiming clauses, the `ci` profile derandomised,
written to REPORT_DIR/mutants/kill_matrix.json before the report reads it. Its failures
(survivors, claims that did not kill, runs without a verdict, clauses that kill nothing) are
problems of the run, so the run exits 1 on them as `rlconform mutants` would. CPU only: a GPU
run's kill matrix has its own regime (`rlconform mutants --device cuda ...`, in shards).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from rlconform.conformance.engine.session import state

_RUN: list[dict | None] = [None]  # this process's run (pytest_runtest_logfinish gets no config)
# a kill-matrix worker's start (imports torch, transformers, the clause modules), and the
# mutants running when the matrix grows (not in its count of what is left): ~5 s
WORKER_START_S = 5.0


def _enabled(config: pytest.Config) -> bool:
    return bool(config.getoption("--with-kill-matrix")) and not hasattr(config, "workerinput")


def pytest_configure(config: pytest.Config) -> None:
    if not _enabled(config):
        return
    why = None
    if config.getoption("--device") != "cpu":
        why = ("runs the kill matrix on the CPU, beside a CPU clause run; on a GPU run "
               "`rlconform mutants --device cuda ...` on its own (the nightly's shards)")
    elif config.getoption("--backend") != "reference":
        why = "is for the reference backend, whose report carries the kill matrix"
    elif config.getoption("--shard") or config.getoption("--placement"):
        why = "is for a whole run: a shard's kill matrix runs in shards of its own"
    if why:
        raise pytest.UsageError(f"--with-kill-matrix {why}")


def pytest_sessionstart(session: pytest.Session) -> None:
    config = session.config
    if not _enabled(config) or config.getoption("collectonly", False):
        return
    import torch

    from rlconform.conformance.engine.kill_matrix import kill_matrix

    jobs = max(1, os.cpu_count() or 1)
    run = {"grow": threading.Event(), "matrix": None, "error": None,
           "threads": torch.get_num_threads()}
    # this process's tests get the one core the kill matrix's first workers leave: torch's
    # OpenMP threads spin while they wait, and one thread more than there are cores to run
    # them cost ~15% more CPU for the same work
    torch.set_num_threads(1)

    def when(matrix_left_s: float) -> bool:
        """Take the other cores once the clause run is done, or earlier, once what the kill
        matrix has left (plus a worker's start) is twice what the clause run has left: from
        then on three processes share two cores (the clause run at 2/3 of one, the matrix at
        4/3), and both end together (recorded durations of both: engine/shard_durations.json,
        the clause run's scaled by its pace so far)."""
        if run["grow"].is_set():
            return True
        if run.get("left_s") is None:
            return False
        # the recorded seconds, scaled by how fast this run's tests have gone so far
        done = run["done_s"]
        scale = (time.time() - run["t_first"]) / done if done > 5.0 else 1.0
        return matrix_left_s + 2 * WORKER_START_S >= 2 * run["left_s"] * scale

    def go() -> None:
        try:
            run["matrix"] = kill_matrix(Path(config.getoption("--report-dir")),
                                        jobs=max(1, jobs - 1), grow=(when, jobs))
        except Exception as exc:  # noqa: BLE001 - reported as a problem of the run
            run["error"] = f"{type(exc).__name__}: {exc}"

    run["thread"] = threading.Thread(target=go, name="rlconform-kill-matrix", daemon=True)
    run["thread"].start()
    _RUN[0] = run


def pytest_collection_finish(session: pytest.Session) -> None:
    """The expected seconds of each selected test (recorded durations of the regime:
    engine/shard_durations.json), to start the kill matrix's next workers before the clause
    tests end (`when` above)."""
    run = _RUN[0]
    if run is None:
        return
    from rlconform.conformance.engine import shards
    from rlconform.conformance.engine.items import plain_nodeid

    ids = {plain_nodeid(i.nodeid): i.nodeid for i in session.items}
    costs = shards.test_costs({n: False for n in ids}, shards.regime_key("cpu", "tiny", "ci"),
                              {})
    run["left"] = {ids[n]: c for n, c in costs.items()}
    run["done_s"], run["t_first"] = 0.0, time.time()
    run["left_s"] = sum(run["left"].values())


def pytest_runtest_logfinish(nodeid: str, location) -> None:
    run = _RUN[0]
    if run is not None and "left" in run:
        cost = run["left"].pop(nodeid, 0.0)
        run["done_s"] += cost
        run["left_s"] = max(0.0, run["left_s"] - cost)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtestloop(session: pytest.Session):
    yield
    run = _RUN[0]
    if run is not None:
        run["grow"].set()  # the clause tests are done: the kill matrix takes every core


@pytest.hookimpl(tryfirst=True)  # before report.py builds the report that carries the matrix
def pytest_sessionfinish(session: pytest.Session, exitstatus) -> None:
    run = _RUN[0]
    if run is None:
        return
    import torch

    from rlconform.conformance.engine import stopping
    from rlconform.conformance.engine.kill_matrix import failures

    st = state(session.config)
    _RUN[0] = None
    torch.set_num_threads(run["threads"])
    if exitstatus == pytest.ExitCode.INTERRUPTED or stopping.received():
        # not waited for: its workers end at their next mutant, when this process's pipe closes
        st.problems.append("the kill matrix beside the run did not finish (run interrupted)")
        return
    run["grow"].set()
    waited = time.time()
    tr = session.config.pluginmanager.get_plugin("terminalreporter")
    if run["thread"].is_alive() and tr is not None:
        tr.write_line("rlconform: waiting for the kill matrix beside the run ...")
    run["thread"].join()
    if run["error"]:
        st.problems.append(f"the kill matrix beside the run failed: {run['error']}")
        return
    m = run["matrix"]
    st.problems += failures(m)
    if tr is not None:
        killed = sum(r["killed"] for r in m["mutants"])
        tr.write_line(f"rlconform: kill matrix: {len(m['mutants'])} mutants, {killed} killed, "
                      f"{m['duration_s']} s beside the run (a second worker from "
                      f"{m.get('grew_at_s', '-')} s; waited {time.time() - waited:.1f} s after "
                      f"the clause tests)")
