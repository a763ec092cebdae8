"""A run stopped from outside (SIGTERM from a CI runner's timeout or `kill`, SIGINT from Ctrl-C)
ends like an interrupted pytest session: the signal raises KeyboardInterrupt in the main
thread, pytest stops the test it was running, and the plugin writes the report of what had run
(its clauses incomplete, a problem naming the signal) before the process exits with 128 + the
signal's number, as a shell reports a process a signal ended.

Without this, SIGTERM's default action ended the process at once and no report was written.

A signal repeated within REPEAT_WINDOW_S of the first is the same request and is ignored: GNU
`timeout`, CI runners and terminals send the signal to the runner and then to its whole process
group (the runner again, its xdist workers, rank processes), so the runner receives it twice in a
row (measured: `timeout 285 rlconform run --workers 6 ...` on a GPU host ended with no report, the
second SIGTERM arriving after the first had been handled). A signal after that window ends the
process (the default action), report or not.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import pytest

SIGNALS = (signal.SIGTERM, signal.SIGINT)
REPEAT_WINDOW_S = 2.0
_received: list[int] = []
_first_at: list[float] = []
_active: list[bool] = []  # non-empty while a run is inside `reporting_on_signals`


def _handler(signum, frame) -> None:
    if _received:
        if time.monotonic() - _first_at[0] < REPEAT_WINDOW_S:
            return  # the process group's copy of the same request: the report is on its way
        for s in SIGNALS:  # a later signal ends the process, report or not
            signal.signal(s, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    _received.append(signum)
    _first_at.append(time.monotonic())
    raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")


@contextlib.contextmanager
def reporting_on_signals():
    """While a run is in this block, SIGTERM and SIGINT interrupt it as Ctrl-C does (the report
    is written); outside the main thread, signals cannot be handled and nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _received.clear()
    _first_at.clear()
    previous = {s: signal.getsignal(s) for s in SIGNALS}
    for s in SIGNALS:
        signal.signal(s, _handler)
    _active.append(True)
    try:
        yield
    finally:
        _active.clear()
        for s, h in previous.items():
            signal.signal(s, h)


def reassert() -> None:
    """Take the signals back where a backend's session replaced their handler: `ray.init`
    installs a SIGTERM handler that exits at once (ray._private.worker.init,
    `set_sigterm_handler`), so a run on a Ray-based store that `timeout` stopped wrote no
    report. Called before each test (`pytest_runtest_call` below)."""
    if not _active or threading.current_thread() is not threading.main_thread():
        return
    for s in SIGNALS:
        if signal.getsignal(s) is not _handler:
            signal.signal(s, _handler)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item) -> None:
    reassert()


def received() -> str | None:
    """The name of the signal that stopped the run in this process (SIGTERM, SIGINT), if one
    did."""
    return signal.Signals(_received[0]).name if _received else None


def exit_code(code: int) -> int:
    """The run's exit code: 128 + the signal's number when a signal stopped it."""
    return 128 + _received[0] if _received else code
