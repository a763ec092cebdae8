"""Process plumbing for the real backends: servers started and stopped by PID, Ray's lifecycle.

Real data planes leave processes behind when a run dies halfway (a Ray raylet, a storage
actor, a Mooncake master). Everything here is keyed by PID, never by process name, so that a
session stops exactly what it started and nothing that another user (or test run) owns.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path


class BackendUnavailable(RuntimeError):
    """The store behind a transport is gone (a dead actor, master or storage unit)."""


class BackendTimeout(BackendUnavailable, TimeoutError):
    """A store call did not answer in time; raised instead of stalling the trainer for minutes."""


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, ppid) of a process, or None when it does not exist."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    rest = raw[raw.rfind(")") + 2:].split()  # the command name may hold spaces and ')'
    return rest[0], int(rest[1])


def alive(pid: int) -> bool:
    """True while `pid` runs; a zombie (exited, not yet reaped) counts as gone."""
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def descendants(root: int | None = None) -> set[int]:
    """Live PIDs below `root` (default: this process), found through /proc parent links."""
    root = os.getpid() if root is None else root
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None and st[0] not in ("Z", "X"):
                children.setdefault(st[1], []).append(int(entry))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def wait_gone(pids: Sequence[int] | set[int], timeout: float) -> set[int]:
    """Wait until every PID has exited; return the ones still alive after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    left = {p for p in pids if alive(p)}
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = {p for p in left if alive(p)}
    return left


def kill_pids(pids: set[int], sig: int = signal.SIGKILL) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def free_port() -> int:
    """A loopback TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class Server:
    """A server process this session started (own session id, so a Ctrl-C does not orphan it)."""

    name: str
    proc: subprocess.Popen
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    @classmethod
    def start(cls, name: str, cmd: list[str], log_path: Path, ports: Sequence[int],
              ready_timeout: float = 15.0, env: dict | None = None) -> Server:
        """Start `cmd` and wait until it accepts connections on every port in `ports`."""
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
        server = cls(name, proc, log_path)
        deadline = time.monotonic() + ready_timeout
        while not all(_port_open(p) for p in ports):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = server.log_tail()
                server.stop()
                raise BackendUnavailable(f"{name} (pid {proc.pid}) did not come up on ports "
                                         f"{list(ports)}; log {log_path}:\n{tail}")
            time.sleep(0.05)
        return server

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds; always reaps, so no zombie is left."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc.wait()


@dataclass
class Cleanup:
    """What a session's exit found: the PIDs it started, and those it had to SIGKILL."""

    started: set[int] = field(default_factory=set)
    force_killed: set[int] = field(default_factory=set)


# The last Ray session's cleanup record, for tests and for docs/backends.md's findings.
LAST_RAY_CLEANUP = Cleanup()


def _rank_launcher() -> set[int]:
    ranks = sys.modules.get("rlconform.reference_impl.ranks")  # never imported from here
    return ranks.launcher_pids() if ranks is not None else set()


@contextlib.contextmanager
def ray_cluster(num_cpus: int = 2, object_store_mb: int = 256,
                grace: float = 10.0) -> Iterator[bool]:
    """A Ray cluster for one session: started here and stopped here, or reused if one runs.

    Yields True when this session owns the cluster. On exit every process the cluster spawned
    (GCS, raylet, agents, workers, found as descendants of this process by PID) must be gone
    within `grace` seconds of `ray.shutdown()`; stragglers are SIGKILLed by PID and recorded
    in LAST_RAY_CLEANUP, so a failed run cannot leak a raylet into the next one.
    """
    import ray

    global LAST_RAY_CLEANUP
    if ray.is_initialized():
        yield False
        return
    before = descendants()
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
             object_store_memory=object_store_mb << 20, log_to_driver=False,
             configure_logging=False)
    record = Cleanup()
    LAST_RAY_CLEANUP = record
    try:
        yield True
    finally:
        # workers spawned since init are included; the rank launcher, which outlives every
        # session of this process, is not (waiting for it cost each session its grace)
        record.started = descendants() - before - _rank_launcher()
        ray.shutdown()
        record.force_killed = wait_gone(record.started, grace)
        if record.force_killed:
            kill_pids(record.force_killed)
            wait_gone(record.force_killed, 2.0)


@contextlib.contextmanager
def env_vars(**values: str) -> Iterator[None]:
    """Set environment variables for the duration of a session, then restore them."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
