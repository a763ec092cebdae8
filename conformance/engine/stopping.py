"""A run stopped from outside (SIGTERM from a CI runner's timeout or `kill`, SIGINT from Ctrl-C)
ends like an interrupted pytest session: the signal raises KeyboardInterrupt in the main
thread, pytest stops the test it was running, and the plugin writes the report of what had run
(its clauses incomplete, a problem naming the signal) before the process exits with 128 + the
signal's number, as a shell reports a process a signal ended.

Without this, SIGTERM's default action ended the process at once and no report was written. A
second signal while the report is being written ends the process then (the default action).
"""

from __future__ import annotations

import contextlib
import signal
import threading

SIGNALS = (signal.SIGTERM, signal.SIGINT)
_received: list[int] = []


def _handler(signum, frame) -> None:
    _received.append(signum)
    for s in SIGNALS:  # a second signal ends the process, report or not
        signal.signal(s, signal.SIG_DFL)
    raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")


@contextlib.contextmanager
def reporting_on_signals():
    """While a run is in this block, SIGTERM and SIGINT interrupt it as Ctrl-C does (the report
    is written); outside the main thread, signals cannot be handled and nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _received.clear()
    previous = {s: signal.getsignal(s) for s in SIGNALS}
    for s in SIGNALS:
        signal.signal(s, _handler)
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def received() -> str | None:
    """The name of the signal that stopped the run in this process (SIGTERM, SIGINT), if one
    did."""
    return signal.Signals(_received[0]).name if _received else None


def exit_code(code: int) -> int:
    """The run's exit code: 128 + the signal's number when a signal stopped it."""
    return 128 + _received[0] if _received else code
