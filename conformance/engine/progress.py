"""Per-clause progress lines during a clause run (`rlconform run` loads it beside the plugin).

pytest prints a dot per test; a backend author wants to know which clause is running and
whether it is failing. This plugin prints one line when a test fails (its clause, the failures
so far) and one when every selected test of a clause has reported:

    rlconform: DP-NAMES done: 3 tests, 0 failed  [12/25 clauses, 151/513 tests, 0 failed]

It reads the test reports the controller sees (also under xdist) and the clause of each test
from its report's properties (set by rlconform.conformance.engine.plugin).
"""

from __future__ import annotations

from collections import Counter

import pytest

CLAUSE_PROP = "rlconform_clauses"


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

    def _write(self, lines: list[str]) -> None:
        tr = self.config.pluginmanager.get_plugin("terminalreporter")
        if tr is None or not lines:
            return
        if tr.verbosity <= 0:
            # progress characters (-q, or dots under xdist, where ensure_newline does not
            # know the line is open): this test's character ends the current line
            tr.write("\n")
        else:
            tr.ensure_newline()
        for line in lines:
            tr.write_line(f"rlconform: {line}")

    def _totals(self, clauses_of: dict[str, list[str]]) -> None:
        self.total = Counter(c for ids in clauses_of.values() for c in ids)
        self.tests_total = len(clauses_of)

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
        lines = [f"{cid}: {name} FAILED ({self.failed[cid]} failed of {self.done[cid]} tests "
                 "so far)" for cid in clauses] if failed else []
        for cid in clauses if self.total is not None else ():
            if cid not in self.finished and self.done[cid] >= self.total.get(cid, 0):
                self.finished.add(cid)
                lines.append(
                    f"{cid} done: {self.done[cid]} tests, {self.failed[cid]} failed  "
                    f"[{len(self.finished)}/{len(self.total)} clauses, "
                    f"{self.tests_done}/{self.tests_total} tests, "
                    f"{sum(self.failed.values())} failed]")
        self._write(lines)


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(ClauseProgress(config), "rlconform-progress")
