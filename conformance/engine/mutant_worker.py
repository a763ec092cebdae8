"""A kill-matrix worker: a long-lived process that runs one mutant's pytest session after another,
fed by kill_matrix.py (`python -m rlconform.conformance.engine.mutant_worker --report-dir D
--results-fd N [args]`), with torch, transformers, the clause modules and the families'
processors loaded once. Also `write_bytecode`, which compiles what these processes import."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from rlconform.conformance.engine.runner import pytest_args


class _MutantRun:
    """pytest plugin for one mutant run inside a kill-matrix worker.

    - keeps only the tests tied to `clause_ids` (None: every clause), and collects only the
      clause modules that hold them;
    - once one test of a clause has failed on a clause assertion, the clause has killed the
      mutant: its remaining tests are skipped (`every_test=False`; a failed clause stays failed
      whatever they do). A failure by any other exception (a TypeError in the mutant) kills
      nothing, so the clause's other tests still run. `every_test=True` (`--full`) runs every
      test, to show which tests can fail;
    - hypothesis neither shrinks nor explains a failing example (phases explicit, reuse,
      generate, target): the kill is decided by the first failing example, and a minimal
      example is of no use here. The examples tried are those of the chosen profile.
    """

    def __init__(self, clause_ids: list[str] | None, every_test: bool = False):
        self.clause_ids = None if clause_ids is None else set(clause_ids)
        self.every_test = every_test
        self.killed: set[str] = set()
        self.modules = clause_modules(clause_ids)

    def pytest_ignore_collect(self, collection_path: Path, config) -> bool | None:
        """Collect only the clause modules that hold a test of the claimed clauses (test ids
        stay those of a whole-package run)."""
        if self.modules is not None and collection_path.suffix == ".py" and \
                collection_path.name.startswith("test_") and \
                collection_path.parent.name == "clauses":
            return collection_path.name not in self.modules
        return None

    @staticmethod
    def _ids(item) -> list[str]:
        return [i for m in item.iter_markers("clause") for i in m.args]

    @pytest.hookimpl(trylast=True)
    def pytest_configure(self, config) -> None:
        from hypothesis import Phase, settings

        settings.register_profile("rlconform-mutant-run", parent=settings.default,
                                  phases=[Phase.explicit, Phase.reuse, Phase.generate,
                                          Phase.target])
        settings.load_profile("rlconform-mutant-run")

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, session, config, items) -> None:
        if self.clause_ids is None:
            return
        from rlconform.conformance.engine import cells

        cells.drop(config, items,
                   [i for i in items if not set(self._ids(i)) & self.clause_ids],
                   "kill_matrix", "kill matrix: a clause that does not claim this mutant")

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item) -> None:
        ids = set(self._ids(item))
        if self.clause_ids is not None:
            ids &= self.clause_ids
        if ids and ids <= self.killed and not self.every_test:
            pytest.skip(f"kill matrix: {', '.join(sorted(ids))} already killed this mutant")

    def pytest_runtest_logreport(self, report) -> None:
        if report.failed:
            props = dict(report.user_properties)
            if (props.get("rlconform_verdict") or {}).get("kind") == "assertion":
                self.killed.update(props.get("rlconform_clauses", ()))


_TESTS_BY_CLAUSE: dict[str, list[str]] = {}


def clause_modules(clause_ids: list[str] | None) -> set[str] | None:
    """The clause module files (`test_codec.py`) holding a test tied to one of `clause_ids`; None (the
    whole package) for None. A mutant's run collects only these: collecting all ~3,000 test
    functions of the package took most of a small mutant's run."""
    if clause_ids is None:
        return None
    if not _TESTS_BY_CLAUSE:  # read once per worker (it parses every clause module)
        from rlconform.conformance.catalogue.docs import tests_by_clause

        _TESTS_BY_CLAUSE.update(tests_by_clause())
    files = {t.split("::", 1)[0] for c in clause_ids for t in _TESTS_BY_CLAUSE.get(c, ())}
    return files or None


class _KillersFirst:
    """Runs first the tests that killed the mutant when its regime was last recorded
    (shards.killers), the rest in their order. The verdict does not change: a clause is killed
    when any of its tests fails by assertion, whichever runs first; a recorded test that no
    longer kills only costs its own time. It saves the tests before it: a store mutant caught
    only by the `[separator]` names ran ten other name classes' state machines first."""

    def __init__(self, first: list[str]):
        self.first = set(first)

    @pytest.hookimpl(trylast=True)  # after pytest's own reordering by fixture scope
    def pytest_collection_modifyitems(self, session, config, items) -> None:
        if self.first:
            # (imported here: items.py imports torch, which write_bytecode must import first)
            from rlconform.conformance.engine.items import plain_nodeid

            items.sort(key=lambda i: plain_nodeid(i.nodeid) not in self.first)


def _run_one_mutant(name: str, clause_ids: list[str] | None, report_dir: Path,
                    extra: list[str], every_test: bool = False,
                    first: list[str] = ()) -> int | str:
    try:
        return int(pytest.main(pytest_args(f"mutant:{name}", [], None) + [
            "--report-dir", str(report_dir / "mutants"), "-q", "--no-header",
            # report.json only: what the matrix reads (rendering the html, markdown and junit
            # of ~200 mutant reports cost ~0.1 s each)
            "--report-formats", "",
            "-p", "no:terminalreporter", *extra],
            plugins=[_MutantRun(clause_ids, every_test), _KillersFirst(list(first))]))
    except BaseException as exc:  # noqa: BLE001 - one broken mutant must not stop the rest
        return f"{type(exc).__name__}: {exc}"


def _warm_up() -> None:
    """Import what every mutant run needs before the first pytest session. hypothesis is a
    pytest plugin distribution, so pytest would otherwise assertion-rewrite each of its ~180
    modules on import (seconds of CPU; nothing caches the result where bytecode writing is
    off); torch and the catalogue are needed anyway. Clause test modules are imported by the
    sessions and keep their assertion rewriting."""
    import importlib

    import _hypothesis_pytestplugin  # noqa: F401
    import hypothesis  # noqa: F401
    import torch  # noqa: F401

    from rlconform.conformance.engine import plugin

    for module in plugin.pytest_plugins:
        importlib.import_module(module)
    from rlconform.conformance.mutants import load_all

    load_all()


def write_bytecode() -> list[str]:
    """Import what the suite's processes import (torch, transformers and every family's model
    and processor modules, hypothesis, pytest, rlconform's own modules) with bytecode writing
    on, so that every process started later loads compiled modules, also where
    PYTHONDONTWRITEBYTECODE is set (it only stops writing). nox installs with `pip
    --no-compile`, which would otherwise byte-compile all of torch and transformers. Returns
    the modules that could not be imported (optional dependencies that are not installed)."""
    import importlib
    import pkgutil

    sys.dont_write_bytecode = False
    _warm_up()
    import rlconform
    from rlconform.fixtures.families import FAMILY_NAMES, build_family

    missing = []
    for mod in pkgutil.walk_packages(rlconform.__path__, "rlconform."):
        if ".clauses" in mod.name or mod.name.endswith("__main__"):
            continue  # clause modules are pytest's to import (it rewrites their asserts)
        try:
            importlib.import_module(mod.name)
        except Exception:  # noqa: BLE001 - an optional dependency that is not installed
            missing.append(mod.name)
    for name in FAMILY_NAMES:
        build_family(name)
    return missing


def _mutant_worker(report_dir: Path, extra: list[str], results_fd: int) -> None:
    """Serve mutants from stdin (one JSON `{"name", "clauses"}` a line) until EOF, writing one
    JSON line per finished mutant to `results_fd`.

    After each mutant the surviving objects (imported modules, the families' processors) are
    frozen out of the garbage collector: pytest collects garbage at the end of every session,
    and a full collection over torch and transformers costs ~1 s per mutant on a small box."""
    import gc

    log = report_dir / "mutants" / "worker.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    _warm_up()
    gc.collect()
    gc.freeze()
    with os.fdopen(results_fd, "w", buffering=1) as results:
        for line in sys.stdin:
            job = json.loads(line)
            t0 = time.time()
            code = _run_one_mutant(job["name"], job["clauses"], report_dir, extra,
                                   job.get("every_test", False), job.get("first", ()))
            with log.open("a") as f:
                f.write(f"{job['name']}: {code}\n")
            results.write(json.dumps({"name": job["name"], "code": code,
                                      "wall_s": round(time.time() - t0, 3)}) + "\n")
            gc.collect()
            gc.freeze()


if __name__ == "__main__":  # mutant_worker.py --report-dir D --results-fd N [args]
    argv = sys.argv[1:]

    def _opt(name: str) -> str:
        return argv[argv.index(name) + 1]

    out_dir, fd = Path(_opt("--report-dir")), int(_opt("--results-fd"))
    rest = [a for i, a in enumerate(argv)
            if a not in ("--report-dir", "--results-fd")
            and (i == 0 or argv[i - 1] not in ("--report-dir", "--results-fd"))]
    _mutant_worker(out_dir, rest, fd)
