"""The run's state and its configuration: the backend and its waivers are loaded once per process
(`RlconformState`, kept in the config's stash), the profile's capabilities are checked, a GPU
too small for the memory plan is refused before any test runs, and the header names the run."""

from __future__ import annotations

import datetime as dt
import os
import time

import pytest

from rlconform.conformance import catalogue
from rlconform.conformance.backend import Backend, load_backend
from rlconform.conformance.engine import gpu_memory, verdicts
from rlconform.conformance.engine.items import clause_ids, plain_nodeid
from rlconform.conformance.engine.options import register_profiles, required_capabilities
from rlconform.conformance.engine.outcomes import logreport
from rlconform.conformance.engine.waivers import load_expectations


class RlconformState:
    def __init__(self, config: pytest.Config):
        self.config = config
        self.backend: Backend = load_backend(config.getoption("--backend"))
        self.expectations, self.problems = load_expectations(
            self.backend.expectations or self.backend.name, config.getoption("--expectations"),
            set(catalogue.BY_ID))
        self._check_requirements(config)
        self.results: dict[str, dict] = {}
        # node ids whose run is over (a report other than a passed setup): a test interrupted
        # in its call has a setup report only and must not count as passed
        self.reported: set[str] = set()
        # the selected tests (after deselection) and their clauses, known on the controller
        # once collection ends: a plain run has the items; under xdist the workers send node
        # ids only (clauses then unknown: {}), see pytest_xdist_node_collection_finished
        self.selected: dict[str, list[str]] | None = None
        self.exitstatus: int | None = None
        self.interrupted_workers: set[str] = set()
        self.started = time.time()
        self.started_at = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        self.report: dict | None = None
        # `--shard K/N`: K, N and the whole run's scope (engine/shards.py)
        self.shard: dict | None = None
        # the cells collection produced and those a filter dropped (engine/cells.py); under
        # xdist the controller reads a worker's (cells.ledger_of)
        self.cells = None
        # the signal that stopped the run (SIGTERM, SIGINT), when one did (engine/stopping.py)
        self.stopped_by: str | None = None

    def _check_requirements(self, config: pytest.Config) -> None:
        from rlconform.conformance.backend import CAPABILITIES

        required = required_capabilities(config)
        unknown = sorted(required - CAPABILITIES.keys())
        if unknown:
            raise ValueError(f"--require names unknown capabilities {unknown}; known: "
                             f"{sorted(CAPABILITIES)}")
        lacking = sorted(required - self.backend.capabilities)
        if lacking:
            clauses = [c.id for c in catalogue.CLAUSES
                       if set(c.capabilities) & set(lacking)]
            self.problems.append(
                f"profile {config.getoption('--profile')!r} requires capabilities {lacking}, "
                f"which backend {self.backend.name!r} does not declare (clauses not tested: "
                f"{', '.join(clauses) or 'none'})")

    # registered as a plugin object: on the xdist controller this sees every worker's reports
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if not hasattr(self.config, "workerinput"):
            logreport(self, report)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        """The selection of a run in one process (deselection is over by now)."""
        if hasattr(self.config, "workerinput"):
            return
        self.selected = {plain_nodeid(item.nodeid): clause_ids(item) for item in session.items}
        self._preflight()

    @pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: the plugin loads without xdist
    def pytest_xdist_node_collection_finished(self, node, ids) -> None:
        """The selection under xdist: the controller collects nothing; each worker sends the
        node ids of its session.items once its collection (and -k / --surfaces deselection,
        which run in the workers) is over. Every worker selects the same tests."""
        if self.selected is None:
            self.selected = {plain_nodeid(i): [] for i in ids}
            self._preflight()

    def _preflight(self) -> None:
        """Stop the run before any test on a GPU too small for its selection; the reason is
        also a problem of the report (a kill-matrix job reads it there: it has no terminal)."""
        why = _gpu_plan_preflight(self.config, list(self.selected))
        if why:
            self.problems.append(why)
            pytest.exit(why, returncode=pytest.ExitCode.USAGE_ERROR)

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error) -> None:
        """A worker that stopped on Ctrl-C: xdist then reports the test it was running as
        "crashed"; that test was interrupted, not failed (it counts as not reported)."""
        if error == "keyboard-interrupt":
            self.interrupted_workers.add(node.gateway.id)


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what collection left alive (torch, transformers, hypothesis, the clause modules
    and their items) out of the garbage collector: they live as long as the process, and every
    full collection would walk them again (in each xdist worker, as in a kill-matrix worker:
    engine/mutant_worker.py). Garbage is collected first, so nothing dead is kept."""
    import gc

    gc.collect()
    gc.freeze()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    """On CUDA, before a test's fixtures are torn down: let go of its frames if it failed
    (gpu_memory.drop_failed_frames). The model fixture's teardown then frees the GPU cache and
    releases the test's reservation, which is true only once nothing holds its trainers."""
    if item.config.getoption("--device").startswith("cuda"):
        gpu_memory.drop_failed_frames()


def state(config: pytest.Config) -> RlconformState:
    return config.stash[STATE_KEY]


STATE_KEY = pytest.StashKey[RlconformState]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "clause(*ids): ties a test to conformance clauses")
    from rlconform.fixtures import sizes

    if config.getoption("--model-size"):  # the workers inherit the environment
        os.environ[sizes.SIZE_ENV] = config.getoption("--model-size")
    try:
        sizes.model_size()
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from exc
    try:
        st = RlconformState(config)
    except (LookupError, TypeError, ValueError) as exc:
        raise pytest.UsageError(str(exc)) from exc
    config.stash[STATE_KEY] = st
    verdicts.set_adapter_source(st.backend.source)
    if not hasattr(config, "workerinput") and not config.getoption("--no-report"):
        from rlconform.conformance.engine.report import report_dir_clash, report_folder

        clash = report_dir_clash(report_folder(config, st.backend), st.backend)
        if clash:
            raise pytest.UsageError(clash)
    config.pluginmanager.register(st, "rlconform-state")
    _gpu_ledger(config)
    register_profiles()
    from hypothesis import settings

    settings.load_profile(f"rlconform-{config.getoption('--profile')}")


def _production_cuda(config: pytest.Config) -> bool:
    from rlconform.fixtures.sizes import PRODUCTION, model_size

    return config.getoption("--device").startswith("cuda") and model_size() == PRODUCTION


def _gpu_ledger(config: pytest.Config) -> None:
    """On the controller of a CUDA run at production width: share a reservation ledger with the
    workers (through the environment they inherit, so before they start)."""
    if hasattr(config, "workerinput") or not _production_cuda(config):
        return
    import tempfile

    os.environ.setdefault(gpu_memory.LEDGER_ENV, os.path.join(
        tempfile.mkdtemp(prefix="rlconform-gpu-"), "ledger.json"))


def _gpu_plan_preflight(config: pytest.Config, nodeids: list[str]) -> str | None:
    """On the controller, once the selection is known (after -k, --surfaces and the rest: a run
    that leaves the largest families out fits a smaller GPU): why the GPU is too small for the
    largest planned test of the families the selected model tests build, or None. A test
    without a `family` parameter is planned at the plan's default. The caller stops the run
    with pytest.exit: a worker raising in its collection crashes xdist wordlessly."""
    if not _production_cuda(config):
        return None
    import torch

    if not torch.cuda.is_available():
        return None  # the device fixture says so
    from rlconform.conformance.catalogue.docs import tests_by_clause
    from rlconform.conformance.engine.items import MODEL_SURFACES
    from rlconform.fixtures.sizes import PRODUCTION_MODELS

    model_tests = {t for cid, tests in tests_by_clause().items() if cid in catalogue.BY_ID
                   and catalogue.BY_ID[cid].surface in MODEL_SURFACES for t in tests}
    selected: dict[str, set[str]] = {}  # family -> the selected model tests' functions
    for nodeid in nodeids:  # plain ids: test_x.py::test_y[family-...]
        function, _, params = nodeid.partition("[")
        if function in model_tests:
            for family in set(params.split("]")[0].split("-")) & set(PRODUCTION_MODELS):
                selected.setdefault(family, set()).add(function.rsplit("::", 1)[-1])
    props = torch.cuda.get_device_properties(0)
    return gpu_memory.preflight(gpu_memory.load_plan(), sorted(selected), props.total_memory,
                                props.name, tests=selected)


def pytest_report_header(config) -> list[str]:
    st = config.stash.get(STATE_KEY, None)
    if st is None:
        return []
    b = st.backend
    return [f"rlconform backend: {b.name} (surfaces: {', '.join(b.surfaces)}); "
            f"profile {config.getoption('--profile')}, device {config.getoption('--device')}, "
            f"dtype {config.getoption('--dtype')}, waivers: {len(st.expectations.waivers)}"]
