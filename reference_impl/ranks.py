"""Data-parallel ranks as processes: the rank contract, and the reference implementation of it.

This docstring is the one place the contract is written down (docs/ARCHITECTURE.md points here).

Roles
-----
- The **driver** holds only the meta. It writes the rollout, computes advantages, mints the
  shards (`meta.shard_for_dp(world)`) and sends rank r exactly `shards[r]` (possibly empty).
- A **rank** is a process of its own. It opens its own transport from the driver transport's
  address, fetches its shard, computes prev and reference logprobs, writes them back as
  columns, and trains; gradients meet in an all-reduce over `torch.distributed`.

What a transport offers (capability `multiprocess`)
---------------------------------------------------
- `transport.address()` returns a picklable object saying where the store is;
- `backend.transport(address=that)`, called in any process of the machine, opens a transport
  on the same store (joining whatever cluster it needs: Ray, TransferQueue); its `close()`
  releases that process's connection and never drops the store's data.
Bundled: `reference` (served.py: the in-memory store served over an authenticated loopback
socket from a thread of the driver, no Ray), `transferqueue-simple` (Ray GCS address +
namespace; the rank attaches to the running controller), `ray-objectstore` (Ray GCS address +
the name of the index actor). A rank's writes to the Ray object store are owned by the rank, so
ranks live as long as their group (a pool), not one step.

How ranks are started (the launcher)
------------------------------------
`backend.trainer(settings, transport, codec, ranks=RankLaunch(world, backend=SPEC, ...))`
returns a `RankGroup` in the driver instead of a trainer (a backend whose ranks are launched
otherwise, e.g. as Ray actors, returns its own object with the same methods). The reference
group starts `world` rank processes, each running `rank_main --driver HOST:PORT --rank R` (the
authentication key in the environment, PR_SET_PDEATHSIG so a rank dies with its driver):
forked from a fork server that has imported torch, transformers' models and rlconform once per
driver process (multiprocessing's forkserver, started at the first group; the driver's
environment of that group is the rank's), or, with RLCONFORM_RANK_START=exec, as fresh
interpreters `python -m rlconform.reference_impl.ranks`. Each connects back over
`multiprocessing.connection`, then every rank joins
`torch.distributed` (TCP rendezvous on loopback; gloo on CPU, NCCL when each rank has its own
GPU, gloo when several ranks share one GPU). Inside a rank the default process group *is* the
data-parallel group. `SPEC` is what `load_backend` understands (a registered name,
`mutant:NAME`, `module:attr`); the rank loads it itself and uses the reference for the surfaces
the backend lacks, exactly as the plugin composes them.

What a rank receives
--------------------
1. at start: the `RankLaunch` (world, backend spec, device, timeouts), its rank, the
   rendezvous address;
2. `group.bind(settings, transport, codec)`: the `TrainerSettings`, `transport.address()` and
   the codec's `pixel_dtype`. The rank opens its transport (`backend.transport(address=...)`),
   builds its codec (`backend.codec(pixel_dtype)`) and a fresh trainer
   `backend.trainer(settings, transport, codec)`: every rank starts from the same weights
   (`settings.seed`). bind may be repeated (a new transport, new settings, fresh weights) without
   restarting the processes;
3. `group.step(shards)`: rank r receives `shards[r]`, pickled with the meta surface's own
   pickling (whatever that keeps is all the rank gets).

What a rank does in a step
--------------------------
`compute_logprobs(shard, LOGPROB)`, `compute_logprobs(shard, REFERENCE_LOGPROB)` (skipped for
an empty shard), then `train(shard)` (`train([])` for an empty shard: it must still join every
collective). Inside a rank the trainer's `train` MUST normalise the loss by the loss-token count
of the whole step (summed over ranks) and SUM the gradients over ranks before clipping and the
optimizer step (reference: `GRPOCore.loss_normalizer` / `reduce_gradients`, built on
`dp_sum` / `dp_reduce_gradients` below). The loss is already divided by the step's token count,
so the sum is the right reduction; DDP's average would divide every gradient by `world`.

What a rank returns (`RankReport`)
----------------------------------
Its loss share (the sum of its micro-batch losses; the step's loss is the sum over ranks, in rank
order), the grad norm (of the reduced gradients: the same on every rank), its per-token metrics
(micro-batch -> row -> token), a digest of its updated weights (the same on every rank), rank 0's
`state_dict` when asked, its wall time. With `RankLaunch(probe=True)` also what the *harness*
observed around the trainer (a recording transport and forward hooks, not the trainer's own
word): the meta as it arrived, every fetch (keys, fields, the columns and tags that came back),
every put (keys, fields, columns) and every forward (stage, model, inputs).

Failure
-------
A rank that dies or raises fails the step: `RankFailed`, naming the rank, its pid, how it ended
(signal or exit code, or the exception) and the stage it was in, raised within about a second of
the death (never only after the collective timeout), once every other rank has been stopped
(SIGTERM, then SIGKILL, by PID) and reaped. `group.step(..., kill=(rank, stage))` makes that
rank SIGKILL itself on entering `stage` (an OOM kill's stand-in; the failure clause uses it).
After a failure the group is dead; `close()` is idempotent and stops whatever still runs.

Determinism: a rank's logprobs equal those of the same micro-batch in any other process
(BACKGROUND.md s7); conformance/catalogue/ranks.py states exactly when a step is bitwise
equal to world 1.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import os
import pickle
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Client, Connection, Listener, wait

import torch
from torch import Tensor

from .bitexact import as_bytes

STAGES = ("logprob", "reference_logprob", "train")
AUTHKEY_ENV = "RLCONFORM_RANK_AUTHKEY"


# -- the collective helpers a data-parallel trainer uses ---------------------------------------
def dp_world() -> int:
    """The data-parallel world of this process: 1 unless torch.distributed is initialised."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def _collective_device() -> torch.device:
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def dp_sum(value: int) -> int:
    """`value` summed over the data-parallel ranks (itself in one process)."""
    if dp_world() == 1:
        return int(value)
    import torch.distributed as dist

    t = torch.tensor([int(value)], dtype=torch.int64, device=_collective_device())
    dist.all_reduce(t)
    return int(t.item())


def dp_max(value: int) -> int:
    if dp_world() == 1:
        return int(value)
    import torch.distributed as dist

    t = torch.tensor([int(value)], dtype=torch.int64, device=_collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def dp_reduce_gradients(model: torch.nn.Module, average: bool = False) -> None:
    """Sum (or, with `average`, average) every trainable parameter's gradient over the ranks.

    A parameter with a gradient on some rank but not on this one (a media-free shard never
    reaches the vision tower) takes part with zeros; one with a gradient on no rank keeps
    `None`, as in one process (AdamW then skips it, as world 1 does). One flat buffer per
    dtype, one all-reduce each. Nothing happens in one process.
    """
    world = dp_world()
    if world == 1:
        return
    import torch.distributed as dist

    dev = _collective_device()
    params = [p for p in model.parameters() if p.requires_grad]
    have = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=dev)
    dist.all_reduce(have, op=dist.ReduceOp.MAX)
    for p, h in zip(params, have.tolist()):
        if h and p.grad is None:
            p.grad = torch.zeros_like(p)
    buckets: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    for p in params:
        if p.grad is not None:
            buckets.setdefault(p.grad.dtype, []).append(p)
    for group in buckets.values():
        flat = torch.cat([p.grad.reshape(-1) for p in group]).to(dev)
        dist.all_reduce(flat)
        if average:
            flat /= world
        at = 0
        for p in group:
            n = p.grad.numel()
            p.grad.copy_(flat[at:at + n].view_as(p.grad))
            at += n


# -- what the driver and the ranks exchange ------------------------------------------------------
@dataclass(frozen=True)
class RankLaunch:
    """How to start a group of ranks (picklable: every rank receives it).

    `backend`: the spec each rank loads (`load_backend`). `device`: "cpu" or "cuda" (rank r
    on GPU r mod the GPU count). `dist_backend`: "gloo" or "nccl"; None picks NCCL when the
    device is CUDA and there is a GPU per rank, gloo otherwise. `timeout_s` bounds a step and
    every collective; `start_timeout_s` the start (imports, rendezvous). `probe`: ranks report
    what they fetched, put and fed their model. `threads`: torch intra-op threads per rank
    (on CPU, gradients are bitwise only between processes with the same thread count).
    """

    world: int
    backend: str = "reference"
    device: str = "cpu"
    dist_backend: str | None = None
    timeout_s: float = 300.0
    start_timeout_s: float = 180.0
    probe: bool = False
    threads: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.world, int) or self.world < 1:
            raise ValueError(f"RankLaunch.world must be a positive int, got {self.world!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"RankLaunch.device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.dist_backend not in (None, "gloo", "nccl"):
            raise ValueError(f"RankLaunch.dist_backend must be gloo, nccl or None, got "
                             f"{self.dist_backend!r}")


class RankFailed(RuntimeError):
    """A rank died, raised or did not answer: the step (or the group's start) failed."""


@dataclass
class RankReport:
    """What one rank returns from a step (see the module docstring)."""

    rank: int
    pid: int
    loss: float
    grad_norm: float
    metrics: dict[str, Tensor]
    weights_digest: str
    seconds: float
    stage_seconds: dict[str, float] = field(default_factory=dict)
    state_dict: dict[str, Tensor] | None = None
    received: dict | None = None  # the shard meta as it arrived: keys, fields, seq_lens, tags, extra
    fetches: list[dict] = field(default_factory=list)  # stage, keys, fields, columns, tags
    puts: list[dict] = field(default_factory=list)  # stage, keys, fields, columns
    forwards: list[dict] = field(default_factory=list)  # stage, model, inputs


@dataclass
class RankStep:
    """A step over every rank: the loss is the sum of the ranks' shares (rank order), the grad
    norm and the weights are rank 0's (every rank's are in `ranks`)."""

    loss: float
    grad_norm: float
    metrics: dict[str, Tensor]
    state_dict: dict[str, Tensor] | None
    ranks: list[RankReport]
    seconds: float


def _send(conn: Connection, obj) -> None:
    """Plain pickle (not multiprocessing's ForkingPickler, which would share tensor memory)."""
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn: Connection):
    return pickle.loads(conn.recv_bytes())


def die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """PR_SET_PDEATHSIG: a rank gets SIGKILL when its driver dies, so it cannot be orphaned."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except Exception:  # noqa: BLE001 - best effort (non-Linux): the driver still stops ranks
        pass


# -- how rank processes start --------------------------------------------------------------------
START_ENV = "RLCONFORM_RANK_START"
# what a rank imports before it can connect: ~3 s of CPU a process (torch, transformers' models)
_PRELOAD = ["torch", "torch.distributed", "rlconform.reference_impl.ranks",
            "rlconform.fixtures.families", "rlconform.conformance.backend"]


def _start_method() -> str:
    """"forkserver" (the default on Linux): ranks are forked from a server process that has
    imported what every rank needs, once per driver process; "exec": each rank is a fresh
    interpreter (`python -m rlconform.reference_impl.ranks`), for a backend whose rank must not
    inherit those imports. A group of two ranks started in ~0.2 s instead of ~3 s of CPU each,
    which was most of a small rank test and of every rank mutant's run."""
    method = os.environ.get(START_ENV, "forkserver")
    if method not in ("forkserver", "exec"):
        raise ValueError(f"{START_ENV} must be 'forkserver' or 'exec', got {method!r}")
    if method == "forkserver":
        import multiprocessing

        if "forkserver" not in multiprocessing.get_all_start_methods():
            return "exec"
    return method


_FORKSERVER = None


def _forkserver():
    global _FORKSERVER
    if _FORKSERVER is None:
        import multiprocessing

        ctx = multiprocessing.get_context("forkserver")
        # the server is started at the first rank of this process and imports these once;
        # it never runs a collective or touches a GPU, so what it forks is a clean rank
        ctx.set_forkserver_preload(_PRELOAD)
        _FORKSERVER = ctx
    return _FORKSERVER


def process_context(preload: Sequence[str] = ()):
    """The multiprocessing context this driver's rank processes start from, for a backend that
    starts its own (conformance/backends/trl.py): the fork server, importing `preload` too
    (added to what it imports once; it takes effect if the server has not started yet, else a
    rank imports them itself), or under RLCONFORM_RANK_START=exec the spawn context (fresh
    interpreters)."""
    global _FORKSERVER
    import multiprocessing

    if _start_method() == "exec":
        return multiprocessing.get_context("spawn")
    added = [m for m in preload if m not in _PRELOAD]
    if added:
        _PRELOAD.extend(added)
        _FORKSERVER = None  # set the server's preload again, with them
    return _forkserver()


def start_launcher() -> None:
    """Start this process's rank launcher now, where ranks are forked: the fork server and
    multiprocessing's resource tracker, which then live as long as this process. For a caller
    that counts its child processes before and after a group."""
    if _start_method() == "forkserver":
        from multiprocessing import forkserver

        _forkserver()
        forkserver.ensure_running()


def launcher_pids() -> set[int]:
    """This process's rank launcher (fork server, multiprocessing's resource tracker) once
    started: helpers that live as long as this process, not something a session started, so
    a session that counts its child processes leaves them out."""
    if _FORKSERVER is None:
        return set()
    from multiprocessing import forkserver, resource_tracker

    pids = {getattr(forkserver._forkserver, "_forkserver_pid", None),
            getattr(resource_tracker._resource_tracker, "_pid", None)}
    return {p for p in pids if p}


def _forked_rank_main(argv: list[str], env: dict[str, str], log: str) -> None:  # pragma: no cover
    """A rank forked from the server: the driver's environment of this group, output to the
    rank's log, SIGKILL with its parent (the server, which ends with the driver), then
    rank_main as a fresh interpreter would run it."""
    os.environ.clear()
    os.environ.update(env)
    out = os.open(log, os.O_WRONLY | os.O_APPEND)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    die_with_parent()
    code = rank_main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as `python -m ...ranks` does: no interpreter teardown


class _ForkedRank:
    """A rank process forked by the server, with the part of subprocess.Popen the group uses
    (pid, poll, returncode, wait, terminate, kill; negative codes are signals, as there)."""

    def __init__(self, argv: list[str], env: dict[str, str], log: str):
        self._p = _forkserver().Process(target=_forked_rank_main, args=(argv, env, log),
                                        name=f"rlconform-rank {argv[-1]}", daemon=True)
        self._p.start()
        self.pid = self._p.pid

    @property
    def returncode(self) -> int | None:
        return self._p.exitcode

    def poll(self) -> int | None:
        return self._p.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._p.join(timeout)
        if self._p.exitcode is None:
            raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout)
        return self._p.exitcode

    def terminate(self) -> None:
        self._p.terminate()

    def kill(self) -> None:
        self._p.kill()


def _how_it_ended(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


# -- the driver side -----------------------------------------------------------------------------
class RankGroup:
    """`world` rank processes, started and stopped by PID (see the module docstring)."""

    def __init__(self, launch: RankLaunch, settings, transport, codec=None):
        self.launch = launch
        self.world = launch.world
        self._procs: list[subprocess.Popen] = []
        self._logs: list[str] = []
        self._conns: list[Connection | None] = [None] * self.world
        self._stage: list[str] = ["start"] * self.world
        self._listener: Listener | None = None
        self._dead = False
        self._closed = False
        self.steps = 0
        t0 = time.monotonic()
        try:
            self._start()
            self.bind(settings, transport, codec)
        except BaseException:
            self._stop_ranks()
            self._dead = True
            raise
        self.start_seconds = time.monotonic() - t0

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    @property
    def alive(self) -> bool:
        return not (self._dead or self._closed)

    # -- start ------------------------------------------------------------------------------
    def _start(self) -> None:
        key = secrets.token_bytes(32)
        self._listener = Listener(("127.0.0.1", 0), authkey=key)
        host, port = self._listener.address
        env = dict(os.environ)
        env[AUTHKEY_ENV] = key.hex()
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env.setdefault("OMP_NUM_THREADS", str(self.launch.threads))
        forked = _start_method() == "forkserver"
        for r in range(self.world):
            fd, log = tempfile.mkstemp(prefix=f"rlconform-rank{r}-", suffix=".log")
            self._logs.append(log)
            argv = ["--driver", f"{host}:{port}", "--rank", str(r)]
            if forked:
                os.close(fd)
                self._procs.append(_ForkedRank(argv, env, log))
                continue
            with os.fdopen(fd, "w") as out:
                self._procs.append(subprocess.Popen(
                    [sys.executable, "-m", "rlconform.reference_impl.ranks", *argv],
                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                    preexec_fn=die_with_parent))
        accepted: list = []
        done = threading.Event()

        def accept() -> None:
            while len(accepted) < self.world and not done.is_set():
                try:
                    conn = self._listener.accept()
                    accepted.append((conn, _recv(conn)))
                except Exception:  # noqa: BLE001 - closed listener or a bad handshake
                    if done.is_set():
                        return

        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        deadline = time.monotonic() + self.launch.start_timeout_s
        try:
            while len(accepted) < self.world:
                dead = {r: p.poll() for r, p in enumerate(self._procs) if p.poll() is not None}
                if dead:
                    self._fail("start", {r: f"{_how_it_ended(c)} before connecting"
                                         for r, c in dead.items()})
                if time.monotonic() > deadline:
                    self._fail("start", {r: "did not connect within "
                                         f"{self.launch.start_timeout_s:g}s" for r in
                                         range(self.world) if r not in
                                         {h[1] for _c, h in accepted}})
                time.sleep(0.02)
        finally:
            done.set()
            if thread.is_alive():  # blocked in accept(): a bare connect lets it see `done`
                from .served import _wake

                _wake(host, port)
        for conn, hello in accepted:
            _kind, rank, _pid = hello
            self._conns[rank] = conn
        from rlconform.conformance.backends._procs import free_port

        init_method = f"tcp://127.0.0.1:{free_port()}"
        for r, conn in enumerate(self._conns):
            _send(conn, ("launch", self.launch, r, init_method))
        self._collect("start", self.launch.start_timeout_s)

    # -- the wait loop ----------------------------------------------------------------------
    def _collect(self, what: str, timeout_s: float) -> list:
        """One reply per rank; any rank that dies, raises or stays silent fails `what`."""
        replies: dict[int, object] = {}
        deadline = time.monotonic() + timeout_s
        while len(replies) < self.world:
            pending = {self._conns[r]: r for r in range(self.world) if r not in replies}
            for conn in wait(list(pending), timeout=0.1):
                r = pending[conn]
                try:
                    msg = _recv(conn)
                except (EOFError, OSError):
                    self._fail(what, {r: "closed its connection"})
                if msg[0] == "stage":
                    self._stage[r] = msg[1]
                elif msg[0] == "error":
                    self._stage[r] = msg[1]
                    self._fail(what, {r: f"raised in {msg[1]}:\n{msg[2]}"})
                else:
                    replies[r] = msg[1]
            dead = {r: p.returncode for r, p in enumerate(self._procs) if p.poll() is not None}
            if dead:
                self._fail(what, {r: _how_it_ended(c) for r, c in dead.items()})
            if time.monotonic() > deadline:
                self._fail(what, {r: f"did not answer within {timeout_s:g}s"
                                  for r in range(self.world) if r not in replies})
        return [replies[r] for r in range(self.world)]

    def _fail(self, what: str, problems: dict[int, str]):
        """Stop every rank, then raise RankFailed naming the ranks that failed and how."""
        # a surviving rank often reports the collective error first; give the rank that died
        # a moment to be reaped, so the error names it and how it ended
        settle = time.monotonic() + 1.0
        while time.monotonic() < settle:
            if any(p.poll() is not None for p in self._procs):
                break
            time.sleep(0.02)
        for r, p in enumerate(self._procs):
            if p.poll() is None:
                continue
            ended, seen = _how_it_ended(p.returncode), problems.get(r)
            problems[r] = ended if seen in (None, ended) else f"{ended} ({seen})"
        dead = sorted(r for r, p in enumerate(self._procs) if p.poll() is not None)
        for r in dead:
            self._drain_stages(r)
        order = dead + sorted(r for r in problems if r not in dead)
        lines = []
        for r in order:
            pid = self._procs[r].pid if r < len(self._procs) else "?"
            lines.append(f"rank {r} (pid {pid}) {problems[r]} [stage: {self._stage[r]}]")
            tail = self._log_tail(r) if r in dead else ""
            if tail:
                lines.append("  log: " + tail.replace("\n", "\n  log: "))
        self._stop_ranks()
        self._dead = True
        others = [r for r in range(self.world) if r not in problems]
        stopped = f"; ranks {others} were stopped" if others else ""
        raise RankFailed(f"{what} failed on {self.world} ranks{stopped}:\n" + "\n".join(lines))

    def _drain_stages(self, r: int) -> None:
        """Read what a dead rank sent before it died: its death can be seen before its last
        stage message is read (a rank killed on entering `train` was reported in the stage
        before it)."""
        conn = self._conns[r] if r < len(self._conns) else None
        try:
            while conn is not None and conn.poll(0):
                msg = _recv(conn)
                if msg[0] in ("stage", "error"):
                    self._stage[r] = msg[1]
        except (EOFError, OSError):
            pass

    def _log_tail(self, r: int, n: int = 12) -> str:
        try:
            with open(self._logs[r], errors="replace") as f:
                return "\n".join(f.read().splitlines()[-n:])
        except (OSError, IndexError):
            return ""

    def _stop_ranks(self) -> None:
        """SIGTERM every live rank, SIGKILL after 3 s, reap all (by PID: only what we started)."""
        for p in self._procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.terminate()
        deadline = time.monotonic() + 3.0
        for p in self._procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for conn in self._conns:
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.close()
        if self._listener is not None:
            with contextlib.suppress(Exception):
                self._listener.close()
            self._listener = None
        for log in self._logs:
            with contextlib.suppress(OSError):
                os.unlink(log)

    def _check(self) -> None:
        if self._closed:
            raise RuntimeError("the rank group is closed")
        if self._dead:
            raise RankFailed("the rank group is dead: a rank failed earlier; start a new one")

    # -- the surface ------------------------------------------------------------------------
    def bind(self, settings, transport, codec=None) -> None:
        """Every rank opens `transport` by its address and builds a fresh trainer."""
        self._check()
        opener = getattr(transport, "address", None)
        if opener is None:
            raise TypeError(f"transport {type(transport).__name__} cannot be opened from another "
                            "process: it has no address() (capability 'multiprocess')")
        address = opener()
        pixel_dtype = getattr(codec, "pixel_dtype", None)
        for conn in self._conns:
            _send(conn, ("bind", settings, address, pixel_dtype))
        self._collect("bind", self.launch.start_timeout_s)

    def step(self, shards: Sequence, *, kill: tuple[int, str] | None = None,
             return_state: bool = True, timeout_s: float | None = None) -> RankStep:
        """Send rank r `shards[r]`; each runs prev, reference and train passes; gather."""
        self._check()
        if len(shards) != self.world:
            raise ValueError(f"step got {len(shards)} shards for {self.world} ranks")
        if kill is not None and kill[1] not in STAGES:
            raise ValueError(f"kill stage must be one of {STAGES}, got {kill[1]!r}")
        t0 = time.monotonic()
        # pickle every shard before sending any: a meta that cannot travel fails here, not
        # with half the ranks already waiting in a collective
        payloads = [pickle.dumps(("step", shard, kill, return_state and r == 0),
                                 protocol=pickle.HIGHEST_PROTOCOL)
                    for r, shard in enumerate(shards)]
        for conn, payload in zip(self._conns, payloads):
            conn.send_bytes(payload)
        reports: list[RankReport] = self._collect(
            f"step {self.steps}", self.launch.timeout_s if timeout_s is None else timeout_s)
        self.steps += 1
        metrics: dict[str, list[Tensor]] = {}
        for rep in reports:
            for k, v in rep.metrics.items():
                metrics.setdefault(k, []).append(v)
        return RankStep(sum(rep.loss for rep in reports), reports[0].grad_norm,
                        {k: torch.cat(v) for k, v in metrics.items()}, reports[0].state_dict,
                        reports, time.monotonic() - t0)

    def close(self) -> None:
        """Ask every rank to exit, then stop what is left by PID (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if not self._dead:
            for conn in self._conns:
                with contextlib.suppress(Exception):
                    _send(conn, ("exit",))
            deadline = time.monotonic() + 5.0
            for p in self._procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(max(0.0, deadline - time.monotonic()))
        self._stop_ranks()

    def __enter__(self) -> RankGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- the driver's step -------------------------------------------------------------------------
def dataplane_step_ranks(batch, group, transport, codec, meta_cls=None, partition: str = "step0",
                         *, rewards=None, advantages=None, group_size: int = 1,
                         uid: str = "uid", clear: bool = True, kill=None,
                         return_state: bool = True, timeout_s: float | None = None):
    """grpo.dataplane_step with real ranks: the driver writes, shards and waits; ranks work.

    Returns a `grpo.StepOutcome` whose `extra` holds the `RankStep` ("ranks") and the shard
    metas as minted ("shard_metas").
    """
    from .grpo import (
        StepOutcome,
        _advantages,
        mint_keys,
        put_advantages,
        shard_rows,
        write_rollout,
    )
    from .meta import BatchMeta

    meta_cls = meta_cls or BatchMeta
    keys = mint_keys(batch.batch_size, group_size, uid)
    meta = write_rollout(batch, transport, codec, meta_cls, partition, keys)
    adv = _advantages(batch, rewards, advantages, group_size)
    try:
        meta = put_advantages(batch, adv, transport, codec, meta, partition, keys)
        shards, _ = meta.shard_for_dp(group.world)
        out = group.step(shards, kill=kill, return_state=return_state, timeout_s=timeout_s)
    finally:
        if clear:
            transport.clear(partition, keys)
    return StepOutcome(out.loss, out.metrics, out.grad_norm, out.state_dict, adv,
                       shard_rows(keys, shards),
                       {"keys": keys, "ranks": out, "shard_metas": shards,
                        "seconds": out.seconds})


# -- the rank side -------------------------------------------------------------------------------
def _surface(backend, name: str):
    if backend.provides(name):
        return getattr(backend, name)
    from rlconform.conformance.backends.reference import backend as reference

    return getattr(reference, name)


def _meta_dict(meta) -> dict:
    return {k: getattr(meta, k, None) for k in ("partition", "keys", "fields", "seq_lens",
                                                 "tags", "extra")}


def _digest(state: dict[str, Tensor]) -> str:
    h = hashlib.sha256()
    for name, t in state.items():
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(repr(tuple(t.shape)).encode())
        h.update(as_bytes(t))
    return h.hexdigest()


class _Probe:
    """A recording transport that also keeps what each get returned, stage by stage."""

    def __init__(self, inner, record: bool = True):
        self.inner = inner
        self.record = record
        self.stage = "bind"
        self.fetches: list[dict] = []
        self.puts: list[dict] = []
        self.forwards: list[dict] = []

    def put(self, partition, keys, columns, tags=None):
        from .served import pack_columns

        if self.record:
            self.puts.append({"stage": self.stage, "keys": list(keys), "fields": list(columns),
                              "columns": pack_columns(columns)})
        return self.inner.put(partition, keys, columns, tags)

    def get(self, partition, keys, select_fields=None):
        from .served import pack_columns

        cols, tags = self.inner.get(partition, keys, select_fields=select_fields)
        if self.record:
            self.fetches.append({"stage": self.stage, "keys": list(keys),
                                 "fields": list(select_fields or []),
                                 "columns": pack_columns(cols), "tags": tags})
        return cols, tags

    def list(self, partition):
        return self.inner.list(partition)

    def clear(self, partition, keys=None):
        return self.inner.clear(partition, keys)

    def close(self):
        return self.inner.close()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def hook(self, label: str):
        def record(module, args, kwargs):
            data = {k: v.detach().cpu() for k, v in kwargs.items() if isinstance(v, Tensor)}
            if args and isinstance(args[0], Tensor):
                data.setdefault("input_ids", args[0].detach().cpu())
            self.forwards.append({"stage": self.stage, "model": label, "inputs": data})

        return record


class _Rank:
    """One rank's state: its transport, codec and trainer (rebuilt on every bind)."""

    def __init__(self, conn: Connection, rank: int, launch: RankLaunch):
        from rlconform.conformance.backend import load_backend

        self.conn, self.rank, self.launch = conn, rank, launch
        self.backend = load_backend(launch.backend)
        self.transport = None
        self.probe: _Probe | None = None
        self.trainer = None
        self.hooks: list = []

    def _release(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []
        if self.transport is not None:
            with contextlib.suppress(Exception):
                self.transport.close()
        self.transport = self.trainer = self.probe = None

    def bind(self, settings, address, pixel_dtype) -> None:
        self._release()
        self.transport = _surface(self.backend, "transport")(address=address)
        self.probe = _Probe(self.transport, record=self.launch.probe)
        codec = _surface(self.backend, "codec")(pixel_dtype)
        self.trainer = _surface(self.backend, "trainer")(settings, self.probe, codec)
        if self.launch.probe:
            self.hooks.append(self.trainer.model.register_forward_pre_hook(
                self.probe.hook("policy"), with_kwargs=True))
            ref = getattr(self.trainer, "reference_model", None)
            if ref is not None and ref is not self.trainer.model:
                self.hooks.append(ref.register_forward_pre_hook(self.probe.hook("reference"),
                                                                with_kwargs=True))

    def _enter(self, stage: str, kill) -> None:
        self.probe.stage = stage
        _send(self.conn, ("stage", stage))
        if kill is not None and kill[0] == self.rank and kill[1] == stage:
            os.kill(os.getpid(), signal.SIGKILL)

    def step(self, shard, kill, return_state: bool) -> RankReport:
        from .registry import Stage

        if self.trainer is None:
            raise RuntimeError("step before bind")
        probe = self.probe
        probe.fetches, probe.puts, probe.forwards = [], [], []
        received = _meta_dict(shard) if self.launch.probe else None
        t0 = time.monotonic()
        times = {}
        n = len(shard)
        for stage, pass_ in (("logprob", Stage.LOGPROB),
                             ("reference_logprob", Stage.REFERENCE_LOGPROB)):
            self._enter(stage, kill)
            s0 = time.monotonic()
            if n:
                shard = self.trainer.compute_logprobs(shard, pass_)
            times[stage] = time.monotonic() - s0
        self._enter("train", kill)
        s0 = time.monotonic()
        result = self.trainer.train(shard if n else [])
        times["train"] = time.monotonic() - s0
        state = self.trainer.state_dict()
        probe.stage = "report"
        report = RankReport(
            self.rank, os.getpid(), float(result.loss), float(result.grad_norm),
            {k: v.detach().cpu() for k, v in result.metrics.items()}, _digest(state),
            time.monotonic() - t0, times, state if return_state else None, received)
        if self.launch.probe:
            report.fetches, report.puts, report.forwards = probe.fetches, probe.puts, \
                probe.forwards
        return report

    def close(self) -> None:
        self._release()


def _init_dist(launch: RankLaunch, rank: int, init_method: str) -> None:
    import torch.distributed as dist

    backend = launch.dist_backend
    if launch.device.startswith("cuda"):
        gpus = torch.cuda.device_count()
        if gpus == 0:
            raise RuntimeError("RankLaunch.device is cuda but this rank sees no GPU")
        torch.cuda.set_device(rank % gpus)
        if backend is None:
            backend = "nccl" if launch.world <= gpus else "gloo"
    backend = backend or "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank,
                            world_size=launch.world,
                            timeout=datetime.timedelta(seconds=launch.timeout_s))


def rank_main(argv: Sequence[str] | None = None) -> int:
    """A rank process: connect to the driver, join the group, serve bind/step until exit."""
    import argparse

    p = argparse.ArgumentParser(description="an rlconform data-parallel rank (started by "
                                "RankGroup; not meant to be run by hand)")
    p.add_argument("--driver", required=True, help="HOST:PORT of the driver's listener")
    p.add_argument("--rank", type=int, required=True)
    a = p.parse_args(argv)
    key = os.environ.pop(AUTHKEY_ENV, None)
    if key is None:
        print(f"{AUTHKEY_ENV} is not set: ranks are started by RankGroup", file=sys.stderr)
        return 2
    import warnings

    # transformers' models trip this torch.fx deprecation on every import; keep the rank logs
    # (quoted in RankFailed) to what matters
    warnings.filterwarnings("ignore", message=".*is_fx_tracing.*")
    host, _, port = a.driver.rpartition(":")
    conn = Client((host, int(port)), authkey=bytes.fromhex(key))
    _send(conn, ("hello", a.rank, os.getpid()))
    state: _Rank | None = None
    stage = "start"
    try:
        _kind, launch, rank, init_method = _recv(conn)
        torch.set_num_threads(launch.threads)
        try:
            _init_dist(launch, rank, init_method)
            state = _Rank(conn, rank, launch)
        except BaseException:
            _send(conn, ("error", stage, traceback.format_exc()))
            raise
        _send(conn, ("done", None))
        while True:
            msg = _recv(conn)
            if msg[0] == "exit":
                break
            try:
                if msg[0] == "bind":
                    stage = "bind"
                    state.bind(*msg[1:])
                    _send(conn, ("done", None))
                elif msg[0] == "step":
                    stage = "step"
                    _send(conn, ("done", state.step(*msg[1:])))
                else:
                    raise ValueError(f"unknown message {msg[0]!r}")
            except Exception:  # noqa: BLE001 - report, then wait: the driver stops the group
                where = state.probe.stage if state is not None and state.probe else stage
                _send(conn, ("error", where, traceback.format_exc()))
    except (EOFError, OSError):
        return 1  # the driver is gone
    finally:
        if state is not None:
            state.close()
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    # run the importable module's main, so what is pickled back names
    # rlconform.reference_impl.ranks, not __main__
    from rlconform.reference_impl import ranks as _ranks

    code = _ranks.rank_main()
    sys.stdout.flush()
    sys.stderr.flush()
    # skip the interpreter's teardown: with a gloo group and the models alive, its garbage
    # collection at exit was seen to hang for > 5 s (everything was closed above)
    os._exit(code)
