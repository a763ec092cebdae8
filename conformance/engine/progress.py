"""Per-clause progress lines during a clause run (`rlconform run` loads it beside the plugin).

pytest prints a dot per test; a backend author wants to know which clause is running and
whether it is failing. This plugin prints one line when a test fails (its clause, the failures
so far, the first line of the failure) and one when every selected test of a clause has reported:

    rlconform: DP-NAMES done: 3 tests, 0 failed  [12/25 clauses, 151/513 tests, 0 failed]

and, once a test has run longer than a few seconds (RLCONFORM_SLOW_TEST_S, default 5), a line
naming it and how long it has run, repeated every 30 s while it runs, so that a slow store
does not look hung:

    rlconform: running test_store_machine.py::test_store_model[case] (DP-STORE-MODEL): 35 s

It reads the test reports the controller sees (also under xdist: workers forward the start and
end of each test) and the clause of each test from its report's properties (set by
rlconform.conformance.engine.plugin).
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter

import pytest

CLAUSE_PROP = "rlconform_clauses"
SLOW_ENV = "RLCONFORM_SLOW_TEST_S"
SLOW_S = 5.0  # a test running longer than this is named, with its time so far
REPEAT_S = 30.0  # ... and again every this many seconds while it runs


class ClauseProgress:
    def __init__(self, config: pytest.Config):
        self.config = config
        self.total: Counter[str] | None = None  # clause -> selected tests (None: not known yet)
        self.done: Counter[str] = Counter()
        self.failed: Counter[str] = Counter()
        self.finished: set[str] = set()
        self.tests_done = 0
        self.tests_total = 0
        self.seen: set[str] = set()
        self.clauses_of: dict[str, list[str]] = {}
        # the tests running now (node id -> when it started), and when each was last named
        self.running: dict[str, float] = {}
        self.named: dict[str, float] = {}
        self.slow_s = float(os.environ.get(SLOW_ENV) or SLOW_S)
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.out = None  # the watcher's copy of the terminal (pytest_sessionstart)

    def _write(self, lines: list[str]) -> None:
        tr = self.config.pluginmanager.get_plugin("terminalreporter")
        if tr is None or not lines:
            return
        with self.lock:  # the watcher thread writes to the same terminal
            if tr.verbosity <= 0:
                # progress characters (-q, or dots under xdist, where ensure_newline does not
                # know the line is open): this test's character ends the current line
                tr.write("\n")
            else:
                tr.ensure_newline()
            for line in lines:
                tr.write_line(f"rlconform: {line}")
            tr.flush()  # a CI log is a pipe: a line left in the buffer reads as a hang

    def _totals(self, clauses_of: dict[str, list[str]]) -> None:
        self.clauses_of = clauses_of
        self.total = Counter(c for ids in clauses_of.values() for c in ids)
        self.tests_total = len(clauses_of)

    # -- the running tests --------------------------------------------------------------------
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        """Start the watcher on the controller. It writes to its own copy of the terminal's
        file descriptor, taken now, while pytest does not capture: in a run in one process
        the test it names is running, and pytest captures what is written to fd 1 then."""
        if hasattr(self.config, "workerinput") or \
                self.config.pluginmanager.get_plugin("terminalreporter") is None:
            return
        try:
            self.out = open(os.dup(1), "w", buffering=1, encoding="utf-8", closefd=True)
        except OSError:
            return  # no terminal to write to
        threading.Thread(target=self._watch, name="rlconform-progress", daemon=True).start()

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self.stop.set()
        with self.lock:
            if self.out is not None:
                self.out.close()
                self.out = None

    def pytest_runtest_logstart(self, nodeid: str, location) -> None:
        if not hasattr(self.config, "workerinput"):
            self.running[nodeid] = time.monotonic()

    def pytest_runtest_logfinish(self, nodeid: str, location) -> None:
        self.running.pop(nodeid, None)
        self.named.pop(nodeid, None)

    def slow_lines(self, now: float) -> list[str]:
        """A line for each test that has run past the threshold and was not named in the last
        REPEAT_S seconds."""
        from rlconform.conformance.engine.items import plain_nodeid

        lines = []
        for nodeid, started in list(self.running.items()):
            ran = now - started
            last = self.named.get(nodeid)
            if ran < self.slow_s or (last is not None and now - last < REPEAT_S):
                continue
            self.named[nodeid] = now
            clauses = self.clauses_of.get(nodeid) or []
            of = f" ({', '.join(clauses)})" if clauses else ""
            lines.append(f"running {plain_nodeid(nodeid)}{of}: {ran:.0f} s")
        return lines

    def _watch(self) -> None:
        while not self.stop.wait(min(1.0, self.slow_s / 2)):
            lines = self.slow_lines(time.monotonic())
            with self.lock:
                if lines and self.out is not None:
                    self.out.write("\n" + "".join(f"rlconform: {line}\n" for line in lines))
                    self.out.flush()

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        if hasattr(self.config, "workerinput"):
            return
        self._totals({i.nodeid: [c for m in i.iter_markers("clause") for c in m.args]
                      for i in session.items})

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node, ids) -> None:
        if self.total is not None:
            return
        from rlconform.conformance.catalogue.docs import tests_by_clause
        from rlconform.conformance.engine.items import plain_nodeid

        by_function: dict[str, list[str]] = {}
        for cid, functions in tests_by_clause().items():
            for function in functions:
                by_function.setdefault(function, []).append(cid)

        def clauses(nodeid: str) -> list[str]:
            # without the "@rlconform-..." xdist group a grouped test's id ends in
            path, _, name = plain_nodeid(nodeid).split("[", 1)[0].partition("::")
            return by_function.get(f"{path.rsplit('/', 1)[-1]}::{name.rsplit('::', 1)[-1]}", [])

        self._totals({i: clauses(i) for i in ids})

    @pytest.hookimpl(trylast=True)  # after the terminal reporter wrote the test's progress
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if hasattr(self.config, "workerinput"):
            return
        over = report.when == "call" or (report.when == "setup" and not report.passed)
        if not over or report.nodeid in self.seen:
            return
        self.seen.add(report.nodeid)
        clauses = dict(report.user_properties).get(CLAUSE_PROP) or []
        self.tests_done += 1
        failed = report.failed and not hasattr(report, "wasxfail")
        for cid in clauses:
            self.done[cid] += 1
            if failed:
                self.failed[cid] += 1
        name = report.nodeid.rsplit("::", 1)[-1]
        why = _first_line(report) if failed else ""
        lines = [f"{cid}: {name} FAILED ({self.failed[cid]} failed of {self.done[cid]} tests "
                 f"so far){why}" for cid in clauses] if failed else []
        for cid in clauses if self.total is not None else ():
            if cid not in self.finished and self.done[cid] >= self.total.get(cid, 0):
                self.finished.add(cid)
                lines.append(
                    f"{cid} done: {self.done[cid]} tests, {self.failed[cid]} failed  "
                    f"[{len(self.finished)}/{len(self.total)} clauses, "
                    f"{self.tests_done}/{self.tests_total} tests, "
                    f"{sum(self.failed.values())} failed]")
        self._write(lines)


def _first_line(report: pytest.TestReport, width: int = 200) -> str:
    """`: <exception>: <message>`, the failure's first line cut to `width` characters, so that
    what failed is read when it fails, not only when the run ends (a store machine's failing
    test shrinks for minutes before the report is written)."""
    crash = getattr(report.longrepr, "reprcrash", None)
    text = (getattr(crash, "message", None) or "").strip().splitlines()
    if not text:
        return ""
    line = text[0]
    return ": " + (line if len(line) <= width else line[:width - 3] + "...")


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(ClauseProgress(config), "rlconform-progress")
