"""Under CI (the CI variable set) nothing may skip: CI installs everything the tests need
(`nox -s tests` installs the Debian packages too), so a skip there hides a broken set-up. On a
developer machine a test that cannot have what it needs skips and says why (`-rs`)."""

from __future__ import annotations

import os

import pytest
import torch

_SKIPPED: list[str] = []


def _record(report) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        _SKIPPED.append(f"{report.nodeid}: {reason}")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _record(report)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    _record(report)  # a module that skips itself at import (allow_module_level=True)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get("CI") and _SKIPPED and not hasattr(session.config, "workerinput"):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if os.environ.get("CI") and _SKIPPED:
        terminalreporter.write_sep("=", f"CI is set: {len(_SKIPPED)} skipped tests fail the run",
                                   red=True)
        for line in _SKIPPED:
            terminalreporter.write_line(f"  {line}")


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny-model tests (more only contend on 2 cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
