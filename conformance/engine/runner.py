"""Run the clause suite against a backend: one pytest session with the plugin, in this process
(`run`), or every bundled backend each in its own process (`run_all`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CLAUSES_PACKAGE = "rlconform.conformance.clauses"
PLUGIN = "rlconform.conformance.engine.plugin"
# The pytest plugins a run needs besides its own, loaded by name: `run` turns pytest's entry-point
# autoload off (RLCONFORM_PLUGIN_AUTOLOAD=1 keeps it on). Autoload scans every installed
# distribution (~0.4 s a process) and has pytest assertion-rewrite each plugin distribution's
# modules on import: all of hypothesis (~180 modules) and anyio, ~1 s of CPU in every process
# (the controller, each xdist worker) where bytecode writing is off. Another plugin is named
# with `-p` (`rlconform run -- -p pytest_cov --cov ...`).
HYPOTHESIS_PLUGIN = "_hypothesis_pytestplugin"


def pytest_args(backend: str, extra: list[str], workers: str | None = "auto") -> list[str]:
    args = ["-p", PLUGIN, "-p", "rlconform.conformance.engine.progress",
            "-p", "rlconform.conformance.engine.stopping",
            "--pyargs", CLAUSES_PACKAGE,
            "--backend", backend, "-p", "no:cacheprovider", "-o", "addopts=",
            # libraries' UserWarnings are noise in a conformance run, except PyTorch's
            # determinism warnings: under warn_only a kernel without a deterministic
            # implementation says so only there. The ini form, because -W escapes its message
            # regex.
            "-o", "filterwarnings=ignore::UserWarning\ndefault:.*deterministic:UserWarning"]
    by_name = bool(os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"))
    if by_name:
        args += ["-p", HYPOTHESIS_PLUGIN]
    if workers and workers != "0":
        if by_name:
            args += ["-p", "xdist.plugin"]
        # loadgroup: like load, except tests of one xdist group share a worker (on a GPU the
        # model-building tests form one group: collection._one_device_group)
        args += ["-n", workers, "--dist", "loadgroup"]
    return args + list(extra)


def run(backend: str = "reference", extra: list[str] | None = None,
        workers: str | None = "auto") -> int:
    """One pytest session in this process; returns its exit code (128 + the signal's number
    when SIGTERM or SIGINT stopped it: its report is written first, engine/stopping.py)."""
    from rlconform.conformance.backend import load_backend
    from rlconform.conformance.engine import stopping

    _importable_from_here(backend)
    if os.environ.get("RLCONFORM_PLUGIN_AUTOLOAD") != "1":
        os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # inherited by xdist workers
    b = load_backend(backend)
    if b.session.__name__ != "_no_session" and workers == "auto":
        workers = "0"  # a backend with its own cluster runs in one process
    with stopping.reporting_on_signals():
        code = int(pytest.main(pytest_args(backend, extra or [], workers)))
    return stopping.exit_code(code)


# exit code of a run whose backend could not be judged because a system it needs is not there
# (a store that does not answer, a framework that is not installed): sysexits' EX_UNAVAILABLE
UNAVAILABLE = 69


def _importable_from_here(spec: str) -> None:
    """An out-of-tree backend named by module path (`my_pkg.adapter:backend`) is imported from
    the current directory too, as `python -m` would: here, and in every process the run starts
    (xdist workers, rank processes, a second client), through PYTHONPATH."""
    if ":" not in spec or spec.startswith("mutant:"):
        return
    here = os.getcwd()
    if here not in sys.path:
        sys.path.insert(0, here)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if here not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([here, *paths])


def run_all(names: list[str], extra: list[str], workers: str | None) -> int:
    """Run every backend in `names`, each in its own process. Backends that cannot be loaded
    (a framework not installed, a checkout not given) are named with the reason and left out;
    the rest run. Exit 1 when a backend that ran failed; else UNAVAILABLE when one could not
    be loaded or its store was unreachable; else 0."""
    from rlconform.conformance.backend import load_backend

    unavailable: dict[str, str] = {}
    runnable = []
    for name in names:
        try:
            load_backend(name)
        except Exception as exc:  # noqa: BLE001 - any load failure: the system is not there
            unavailable[name] = f"{type(exc).__name__}: {exc}"
        else:
            runnable.append(name)
    for name, why in unavailable.items():
        print(f"rlconform: backend {name} not available, left out: {why}", flush=True)
    codes = {}
    for name in runnable:
        codes[name] = subprocess.call([sys.executable, "-m", "rlconform.conformance.cli", "run",
                                       "--backend", name, "--workers", workers or "0", *extra])
    failed = [n for n, c in codes.items() if c not in (0, UNAVAILABLE)]
    for name, code in codes.items():
        what = {0: "passed", UNAVAILABLE: "not available (its store did not answer)"}.get(
            code, "FAILED")
        if code == UNAVAILABLE:
            unavailable[name] = "its store did not answer"
        print(f"{name}: {what} (exit {code})")
    for name, why in unavailable.items():
        if name not in codes:
            print(f"{name}: not available (not run): {why}")
    if failed:
        return 1
    return UNAVAILABLE if unavailable else 0
