"""The rlconform pytest plugin: runs the clause tests against one backend and writes its report.

Load it with `-p rlconform.conformance.plugin` (`rlconform run` does). It
- loads the backend (`--backend`) and its waivers (`--expectations`);
- ties every collected test to its clauses (`@pytest.mark.clause(ID, ...)`), marks tests of
  clauses the backend does not declare as not applicable, and gives each test the waivers that
  cover it (web-platform-tests style expectations, per test: conformance/verdicts.py);
- derives each clause's status from its tests on the controller (xdist-safe: everything it needs
  travels in the test reports' user_properties) and writes the report;
- sets the exit status: non-zero when a clause failed, errored, passed where a waiver expected
  a failure (xpass), was skipped although declared or left partial, or a waiver is bad.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import re
import time
from pathlib import Path

import pytest

from rlconform.conformance import catalogue, gpu_memory, verdicts
from rlconform.conformance.backend import SURFACES, Backend, StoreUnreachable, load_backend
from rlconform.conformance.waivers import load_expectations

CLAUSE_PROP = "rlconform_clauses"
METRIC_PROP = "rlconform_metric"
NA_PREFIX = "not_applicable: "

PROFILES = {
    # dev: fast feedback while writing a backend
    "dev": dict(max_examples=15, deadline=None, print_blob=True),
    # ci: derandomized and bounded, so a run is reproducible and fits the CI budget
    "ci": dict(max_examples=40, deadline=None, derandomize=True, database=None, print_blob=True),
    # nightly: large search on the GPU box
    "nightly": dict(max_examples=300, deadline=None, print_blob=True),
}
# Capabilities a profile requires of every backend it judges: a backend that does not declare
# one fails the run (a problem in the report) instead of quietly not testing it. The nightly
# GPU job trains in bfloat16, so a backend that cannot carry it has not been judged there.
PROFILE_REQUIRES: dict[str, frozenset[str]] = {
    "dev": frozenset(),
    "ci": frozenset(),
    "nightly": frozenset({"bfloat16"}),
}

# The plugin's options, defined once: pytest_addoption registers them and `rlconform run --help`
# lists them (they pass through to pytest).
OPTIONS: list[tuple[str, dict]] = [
    ("--backend", dict(default="reference",
                       help="backend under test: a registered name, mutant:<name>, or "
                            "module:attr")),
    ("--profile", dict(default="dev", choices=sorted(PROFILES),
                       help="hypothesis profile: dev (fast), ci (derandomized, bounded), "
                            "nightly (large; requires " + ", ".join(
                                sorted(PROFILE_REQUIRES["nightly"])) + ")")),
    ("--require", dict(default="", metavar="CAP[,CAP]",
                       help="capabilities the backend must declare (besides the profile's); "
                            "a missing one fails the run")),
    ("--device", dict(default="cpu", help="device for trainer clauses: cpu or cuda")),
    ("--model-size", dict(default=None, choices=["tiny", "production", "tiny-head32"],
                          help="trainer and rollout models: tiny (~2 layers, hidden 64; CPU CI) "
                               "or production (published widths of a real checkpoint per "
                               "family, random weights, built on the device; families without "
                               "one are deselected), or tiny-head32 (tiny with 32-wide attention heads, "
                               "for engines without head_dim 16: vLLM on CPU) (default: "
                               "$RLCONFORM_MODEL_SIZE or tiny)")),
    ("--dtype", dict(default="float32", choices=["float32", "bfloat16"],
                     help="policy dtype (pixel fields, trainer)")),
    ("--seed", dict(type=int, default=0, help="seed for models and fixtures")),
    ("--expectations", dict(default=None,
                            help="waiver file (default: the backend's bundled expectations, "
                                 "if any)")),
    ("--replay", dict(default=None,
                      help="re-run hypothesis tests with a failure blob from a report: "
                           "VERSION:BLOB")),
    ("--report-dir", dict(default="reports/out",
                          help="reports go to REPORT_DIR/<backend>/")),
    ("--no-report", dict(action="store_true", help="write no report files")),
    ("--surfaces", dict(default=None,
                        help="comma-separated surfaces: run only the clauses of these surfaces "
                             "(a partial run: the gate fails it)")),
    ("--wandb", dict(action="store_true",
                     help="log the summary, metrics and report files to wandb (offline by "
                          "default)")),
]


def options_help(skip: tuple[str, ...] = ("--backend",)) -> str:
    """The plugin's options as `rlconform run --help` shows them (`skip`: the run command's
    own options)."""
    lines = ["options passed through to the clause run (pytest plugin rlconform):"]
    for flag, kw in OPTIONS:
        if flag in skip:
            continue
        meta = "" if kw.get("action") == "store_true" else " " + (
            kw.get("metavar") or ("{" + ",".join(kw["choices"]) + "}" if "choices" in kw
                                  else flag.lstrip("-").upper().replace("-", "_")))
        default = kw.get("default")
        tail = "" if default is None or default is False or default == "" \
            else f" (default: {default})"
        lines.append(f"  {flag}{meta}")
        lines.append(f"      {kw['help']}{tail}")
    lines.append("any other argument goes to pytest (e.g. -k EXPR, -x, -q)")
    return "\n".join(lines)


def _register_profiles() -> None:
    from hypothesis import HealthCheck, settings

    common = dict(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                         HealthCheck.function_scoped_fixture])
    for name, kw in PROFILES.items():
        settings.register_profile(f"rlconform-{name}", **common, **kw)


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("rlconform", "rlconform conformance suite")
    for flag, kw in OPTIONS:
        g.addoption(flag, **kw)


def required_capabilities(config: pytest.Config) -> frozenset[str]:
    extra = {c.strip() for c in (config.getoption("--require") or "").split(",") if c.strip()}
    return PROFILE_REQUIRES[config.getoption("--profile")] | extra


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
            _logreport(self, report)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        """The selection of a run in one process (deselection is over by now)."""
        if hasattr(self.config, "workerinput"):
            return
        self.selected = {_plain_nodeid(item.nodeid): _clause_ids(item) for item in session.items}
        _preflight(self.config, list(self.selected))

    @pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: the plugin loads without xdist
    def pytest_xdist_node_collection_finished(self, node, ids) -> None:
        """The selection under xdist: the controller collects nothing; each worker sends the
        node ids of its session.items once its collection (and -k / --surfaces deselection,
        which run in the workers) is over. Every worker selects the same tests."""
        if self.selected is None:
            self.selected = {_plain_nodeid(i): [] for i in ids}
            _preflight(self.config, list(self.selected))

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error) -> None:
        """A worker that stopped on Ctrl-C: xdist then reports the test it was running as
        "crashed"; that test was interrupted, not failed (it counts as not reported)."""
        if error == "keyboard-interrupt":
            self.interrupted_workers.add(node.gateway.id)


def _state(config: pytest.Config) -> RlconformState:
    return config.stash[_KEY]


_KEY = pytest.StashKey[RlconformState]()


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
    config.stash[_KEY] = st
    verdicts.set_adapter_source(st.backend.source)
    if not hasattr(config, "workerinput") and not config.getoption("--no-report"):
        clash = report_dir_clash(report_folder(config, st.backend), st.backend)
        if clash:
            raise pytest.UsageError(clash)
    config.pluginmanager.register(st, "rlconform-state")
    _gpu_ledger(config)
    _register_profiles()
    from hypothesis import settings

    settings.load_profile(f"rlconform-{config.getoption('--profile')}")


def applicability(backend: Backend, clause) -> str | None:
    """Why `clause` does not apply to `backend`, or None when it does."""
    if not any(backend.provides(s) for s in clause.surfaces):
        why = _noted(backend, clause.surfaces)
        return f"backend provides no {' or '.join(repr(s) for s in clause.surfaces)} " \
               f"surface{why}"
    lacking = [c for c in clause.capabilities if c not in backend.capabilities]
    if lacking:
        return f"backend does not declare {lacking}{_noted(backend, lacking)}"
    return None


def _noted(backend: Backend, names) -> str:
    """': <the backend's notes on names>' (what the report's "not tested" shows), or ''."""
    notes = [backend.notes[n] for n in names if backend.notes.get(n)]
    return f": {'; '.join(notes)}" if notes else ""


@pytest.hookimpl(tryfirst=True)  # before xdist reads the xdist_group markers we add
def pytest_collection_modifyitems(session, config: pytest.Config, items) -> None:
    st = _state(config)
    replay = config.getoption("--replay")
    errors = []
    surfaces = config.getoption("--surfaces")
    if surfaces:
        keep_surfaces = set(surfaces.split(","))
        unknown = sorted(keep_surfaces - set(SURFACES))
        if unknown:
            raise pytest.UsageError(f"--surfaces names unknown surfaces {unknown}; "
                                    f"known: {', '.join(SURFACES)}")
        kept, dropped = [], []
        for item in items:
            ids = _clause_ids(item)
            on = any(i in catalogue.BY_ID and set(catalogue.BY_ID[i].surfaces) & keep_surfaces
                     for i in ids)
            (kept if on else dropped).append(item)
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = kept
    _deselect_sizeless_families(config, items)
    _one_device_group(config, items)
    for item in items:
        ids = _clause_ids(item)
        if not ids:
            errors.append(f"{item.nodeid} is tied to no clause (@pytest.mark.clause)")
            continue
        unknown = [i for i in ids if i not in catalogue.BY_ID]
        if unknown:
            errors.append(f"{item.nodeid} names unknown clauses {unknown}")
            continue
        item.user_properties.append((CLAUSE_PROP, ids))
        reasons = [r for r in (applicability(st.backend, catalogue.BY_ID[i]) for i in ids) if r]
        if reasons:
            item.add_marker(pytest.mark.skip(reason=NA_PREFIX + "; ".join(sorted(set(reasons)))))
            continue
        verdicts.scope_item(item, st.expectations.waivers, ids)
        if replay:
            _apply_replay(item, replay)
    if errors:
        raise pytest.UsageError("clause tests are misdeclared:\n  " + "\n  ".join(errors))


MODEL_SURFACES = ("trainer", "rollout")


def _deselect_sizeless_families(config: pytest.Config, items) -> None:
    """At a model size a family lacks (production: the 7-8B families), its trainer and rollout
    tests are deselected, never skipped or silently run at another size; the report's
    provenance names the size and the models."""
    from rlconform.fixtures.sizes import has_size, model_size

    size = model_size()
    dropped = []
    for item in items:
        callspec = getattr(item, "callspec", None)
        family = callspec.params.get("family") if callspec else None
        ids = _clause_ids(item)
        on_models = any(catalogue.BY_ID[i].surface in MODEL_SURFACES for i in ids
                        if i in catalogue.BY_ID)
        if isinstance(family, str) and on_models and not has_size(family, size):
            dropped.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [i for i in items if i not in dropped]


DEVICE_GROUP = "rlconform-device"


def _one_device_group(config: pytest.Config, items) -> None:
    """On a GPU, tests that build models (trainer and rollout clauses) form DEVICE_GROUPS xdist
    groups by family, so under `--dist loadgroup` at most that many run at once while the
    data-plane tests spread over the other workers: a production-width trainer (policy, frozen
    reference, AdamW state, activations) peaks at 45-52 GiB (measured on an H200: Gemma3-4B,
    SmolVLM), so two fit one 139 GiB GPU and eight did not. The two largest families sit in
    different groups.

    The grouped tests move to the front: xdist hands out work units in collection order, and
    the two groups are the run's longest units (~500 s each at production widths, against
    ~400 s of every other test together spread over the other workers); collected after the
    data-plane modules they started only once those had been dealt out."""
    if not config.getoption("--device").startswith("cuda") or \
            not getattr(config.option, "loadgroup", False):  # set in xdist workers
        return
    grouped, rest = [], []
    for item in items:
        ids = _clause_ids(item)
        if any(i in catalogue.BY_ID and catalogue.BY_ID[i].surface in MODEL_SURFACES
               for i in ids):
            callspec = getattr(item, "callspec", None)
            family = callspec.params.get("family") if callspec else None
            _suffix_nodeid(item, f"{DEVICE_GROUP}-{_device_group(family)}")
            grouped.append(item)
        else:
            rest.append(item)
    items[:] = grouped + rest


DEVICE_GROUPS = 2
# family -> group, balanced by the model tests' measured cost (tests per family x seconds per
# production step on the H200: qwen2_vl 17 x 4.6, gemma3 12 x 8.4 | text 14 x 5.0, smolvlm
# 12 x 5.1, qwen2_5_vl 4 x 7.1, qwen3_vl 4 x 4.7); the two largest (gemma3 50 GiB, smolvlm
# 52 GiB per step) in different groups
_GROUP_OF = {"qwen2_vl": 0, "gemma3": 0, "text": 1, "smolvlm": 1, "qwen2_5_vl": 1, "qwen3_vl": 1}


def _device_group(family) -> int:
    if not isinstance(family, str):
        return 0
    if family in _GROUP_OF:
        return _GROUP_OF[family]
    return sum(map(ord, family)) % DEVICE_GROUPS


def _suffix_nodeid(item, group: str) -> None:
    """What an `xdist_group` marker does under --dist loadgroup: append "@group" to the test's
    id, which the controller's scheduler reads. Done here, in a tryfirst hook, for two reasons
    seen with xdist 3.8: its hook read the markers before ours had added them (pytest 9.1.1 on
    the H200: eight workers built production models at once and ran out of memory), and it
    writes the suffix to `item._nodeid`, which pytest >= 9.2 no longer reads (`item._id`)."""
    new = f"{item.nodeid}@{group}"
    if hasattr(item, "_id"):  # pytest >= 9.2
        from _pytest.nodeid import coerce_node_id

        item._id = coerce_node_id(new)
    else:
        item._nodeid = new


def _apply_replay(item, replay: str) -> None:
    version, _, blob = replay.partition(":")
    if not blob:
        raise pytest.UsageError("--replay takes VERSION:BLOB as printed in the report")
    fn = getattr(item, "obj", None)
    if fn is not None and getattr(fn, "is_hypothesis_test", False):
        fn._hypothesis_internal_use_reproduce_failure = (version, blob)


# -- fixtures ---------------------------------------------------------------------------------
def _reference():
    from rlconform.conformance.backends.reference import backend

    return backend


@pytest.fixture(scope="session")
def backend(request) -> Backend:
    return _state(request.config).backend


@pytest.fixture(scope="session", autouse=True)
def _backend_session(request):
    st = _state(request.config)
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(st.backend.session())
        except StoreUnreachable as exc:
            # one run-level error, not every clause failing on the same refused connection
            st.problems.append(f"store unreachable: {exc}")
            st.selected = None  # no test was left out by the run: none could be judged
            pytest.exit(f"rlconform: backend {st.backend.name!r}: the store is unreachable: "
                        f"{exc}", returncode=STORE_UNREACHABLE_EXIT)
        yield
        _sweep(st)


def _surface(backend: Backend, name: str):
    return getattr(backend, name) if backend.provides(name) else getattr(_reference(), name)


@pytest.fixture
def transport(backend):
    t = _surface(backend, "transport")()
    written = track_writes(t)
    yield t
    try:
        clear_written(t, written)  # also when the test failed: a persistent store keeps nothing
    finally:
        t.close()


# -- clean-up of what the clause tests wrote -----------------------------------------------------
# partitions the `transport` fixtures of this process wrote, swept once more at session end
_WRITTEN: set[str] = set()
# the run's exit code when the store is unreachable: no clause could be judged (sysexits'
# EX_UNAVAILABLE, runner.UNAVAILABLE)
STORE_UNREACHABLE_EXIT = 69


def track_writes(t) -> set[str]:
    """The partitions `t.put` writes from now on (recorded before each put: one that fails
    halfway may have stored part of its rows). The transport keeps its type: its `put` is
    wrapped on the instance."""
    written: set[str] = set()
    put = t.put

    def put_and_track(*args, **kwargs):
        partition = args[0] if args else kwargs.get("partition")
        if isinstance(partition, str):
            written.add(partition)
            _WRITTEN.add(partition)
        return put(*args, **kwargs)

    try:
        t.put = put_and_track
    except AttributeError:  # a transport whose instances take no attributes: not tracked
        pass
    return written


def clear_written(t, written: set[str]) -> list[str]:
    """Clear every partition in `written` through `t`; the partitions whose clear failed."""
    failed = []
    for partition in sorted(written):
        try:
            t.clear(partition)
        except KeyError:
            pass  # nothing stored there (a refused put, an earlier clear)
        except Exception:  # noqa: BLE001 - a refused name, a closed or broken store
            failed.append(partition)
    return failed


def _sweep(st: RlconformState) -> None:
    """At the end of a run, the partitions the clause tests wrote must list nothing in the
    store (what the run wrote it removed); any left is cleared and is a run-level problem."""
    if not _WRITTEN or not st.backend.provides("transport"):
        return
    try:
        t = st.backend.transport()
    except Exception:  # noqa: BLE001 - the session is ending; the clauses judged the store
        return
    left = {}
    try:
        for partition in sorted(_WRITTEN):
            try:
                keys = t.list(partition)
            except Exception:  # noqa: BLE001 - KeyError: gone; a refused name: never stored
                continue
            if keys:
                left[partition] = len(keys)
        clear_written(t, set(left))
    finally:
        t.close()
    if left:
        shown = ", ".join(f"{p!r} ({n} keys)" for p, n in list(left.items())[:8])
        st.problems.append(f"the run left data in the store: {len(left)} partitions the clause "
                           f"tests wrote still listed keys at the end ({shown}); cleared now")


@pytest.fixture
def codec_factory(backend):
    """The codec surface's factory, for tests that set `pixel_dtype`."""
    return _surface(backend, "codec")


@pytest.fixture
def codec(codec_factory):
    return codec_factory()


@pytest.fixture
def meta_cls(backend):
    return _surface(backend, "meta")()


@pytest.fixture
def batch_ops(backend):
    return _surface(backend, "batch_ops")()


@pytest.fixture(scope="session")
def device(request) -> str:
    dev = request.config.getoption("--device")
    if dev.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            pytest.fail("--device cuda given but torch.cuda.is_available() is False")
    return dev


@pytest.fixture(scope="session")
def dtype(request):
    import torch

    return getattr(torch, request.config.getoption("--dtype"))


@pytest.fixture(scope="session")
def profile(request) -> str:
    return request.config.getoption("--profile")


@pytest.fixture(scope="session")
def seed(request) -> int:
    return request.config.getoption("--seed")


@pytest.fixture(scope="module")
def rollouts(device, dtype, seed):
    """The trainer clauses' rollouts (test_trainer.Rollouts, shared per device, dtype and seed),
    with one intra-op thread on CPU: hidden-64 models gain nothing from more, and on a busy
    2-core runner spinning worker threads made each step ~10x slower (logprobs are bitwise the
    same for any thread count, BACKGROUND.md s7)."""
    import torch

    from rlconform.conformance.clauses.test_trainer import Rollouts

    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)
    yield Rollouts.shared(device, dtype, seed)
    torch.set_num_threads(threads)


GPU_PEAK_PROP = "rlconform_gpu_peak_gib"


@pytest.fixture(autouse=True)
def _device_memory(request):
    """On CUDA: a model test at production width first reserves its planned peak from the GPU
    budget the workers share (conformance/gpu_memory.py: it waits while the others' tests leave
    too little), records its own peak for the plan, and afterwards frees what its models held:
    a trainer (policy, frozen reference, AdamW state) takes tens of GB, and the next test builds
    its own."""
    if not request.config.getoption("--device").startswith("cuda"):
        yield
        return
    import contextlib
    import gc

    import torch

    hold = contextlib.nullcontext()
    ledger_path = os.environ.get(gpu_memory.LEDGER_ENV)
    if ledger_path and _is_model_test(request.node):
        callspec = getattr(request.node, "callspec", None)
        family = callspec.params.get("family") if callspec else None
        gib = gpu_memory.planned_gib(gpu_memory.load_plan(), family if isinstance(family, str)
                                     else None, request.node.name)
        budget = gpu_memory.budget_gib(torch.cuda.get_device_properties(0).total_memory)
        hold = gpu_memory.reservation(gpu_memory.Ledger(ledger_path, budget), gib,
                                      request.node.nodeid)
    with hold:
        torch.cuda.reset_peak_memory_stats()
        yield
        peak = torch.cuda.max_memory_reserved() / 2**30
        request.node.user_properties.append((GPU_PEAK_PROP, round(peak, 2)))
        gc.collect()
        torch.cuda.empty_cache()


def _is_model_test(item) -> bool:
    return any(i in catalogue.BY_ID and catalogue.BY_ID[i].surface in MODEL_SURFACES
               for i in _clause_ids(item))


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


def _preflight(config: pytest.Config, nodeids) -> None:
    """Stop the run, before any test runs, on a GPU too small for the largest planned test of
    the families the selected model tests build (after -k, --surfaces and the rest: a run that
    leaves the largest families out fits a smaller GPU). A test without a `family` parameter
    is planned at the plan's default."""
    if not _production_cuda(config):
        return
    import torch

    if not torch.cuda.is_available():
        return  # the device fixture says so
    from rlconform.fixtures.sizes import PRODUCTION_MODELS

    from .docs import tests_by_clause

    model_tests = {t for cid, tests in tests_by_clause().items() if cid in catalogue.BY_ID
                   and catalogue.BY_ID[cid].surface in MODEL_SURFACES for t in tests}
    families = set()
    for nodeid in nodeids:
        path, _, rest = nodeid.partition("::")
        function, _, params = rest.partition("[")
        if f"{path.split('/')[-1]}::{function}" in model_tests:
            families |= set(params.split("]")[0].split("-")) & set(PRODUCTION_MODELS)
    props = torch.cuda.get_device_properties(0)
    why = gpu_memory.preflight(gpu_memory.load_plan(), sorted(families), props.total_memory,
                               props.name)
    if why:
        pytest.exit(why, returncode=pytest.ExitCode.USAGE_ERROR)


@pytest.fixture
def record_metric(request):
    """`record_metric(name, values, step=None)`: a distribution (tensor/list) or a scalar."""
    from rlconform.reports.model import scalar_metric, summarize_values

    def record(name: str, values, step: int | None = None) -> None:
        if isinstance(values, (int, float)):
            entry = scalar_metric(values)
        else:
            entry = summarize_values(values)
        request.node.user_properties.append(
            (METRIC_PROP, {"name": name, "step": step, "summary": entry}))

    return record


# -- results ----------------------------------------------------------------------------------
HYPOTHESIS_PROP = "rlconform_hypothesis"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """Property tests' examples see the waivers covering their test (verdicts.py)."""
    with verdicts.example_waivers(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Keep hypothesis' notes (the shrunk example and the replay blob) and the test's verdict
    (waivers matched, how it failed) on the report."""
    outcome = yield
    rep = outcome.get_result()
    exc = call.excinfo.value if call.excinfo is not None else None
    notes = getattr(exc, "__notes__", None)
    if notes:
        rep.user_properties.append((HYPOTHESIS_PROP, [str(n) for n in notes]))
    if _tied_clauses(item) is not None:
        v = verdicts.verdict(item, call, rep)
        if v is not None:
            rep.user_properties.append((verdicts.VERDICT_PROP, v))

_BLOB = re.compile(r"@reproduce_failure\('([^']+)', b'([^']+)'\)")


def _clause_ids(item) -> list[str]:
    return [i for m in item.iter_markers("clause") for i in m.args]


def _plain_nodeid(nodeid: str) -> str:
    """A test's id as reports show it: relative to the clause package (`test_codec.py::test_x[a]`,
    wherever rlconform is installed) and without the "@<group>" that xdist's loadgroup (and
    _suffix_nodeid) append."""
    nodeid = nodeid.split("@" + DEVICE_GROUP)[0]
    path, sep, rest = nodeid.partition("::")
    return f"{path.rsplit('clauses/', 1)[-1]}{sep}{rest}"


def _tied_clauses(item) -> list[str] | None:
    return next((v for k, v in item.user_properties if k == CLAUSE_PROP), None)


# a test's outcome only moves towards the worse: a failed call stays failed whatever its
# teardown does; a waived setup error is not turned into a pass by a later phase
_OUTCOME_RANK = {"passed": 0, "xpass": 1, "waived": 2, "skipped": 3, "failed": 4, "error": 5}


def _logreport(st: RlconformState, report: pytest.TestReport) -> None:
    props = dict(report.user_properties)
    nodeid = _plain_nodeid(report.nodeid)
    clauses = props.get(CLAUSE_PROP)
    if clauses is None:
        # xdist reports a test whose worker died (when "???") without the item's properties
        worker = getattr(getattr(report, "node", None), "gateway", None)
        if worker is not None and worker.id in st.interrupted_workers:
            return  # interrupted, not crashed: the test did not report
        known = st.results.get(nodeid) or {}
        clauses = known.get("clauses") or (st.selected or {}).get(nodeid)
        if not clauses:
            return
    if report.when in ("call", "teardown") or not report.passed:
        st.reported.add(nodeid)
    r = st.results.setdefault(nodeid, {
        "nodeid": nodeid, "outcome": "passed", "duration_s": 0.0, "message": "",
        "clauses": clauses, "params": props.get(verdicts.PARAMS_PROP) or {}, "metrics": [],
        "hypothesis": None, "kind": None, "waivers": {}, "waived_messages": {},
        "unimplemented": None,
    })
    r["duration_s"] += report.duration
    if report.when == "call":
        r["metrics"] = [v for k, v in report.user_properties if k == METRIC_PROP]
    if props.get(GPU_PEAK_PROP) is not None:
        r["gpu_peak_gib"] = props[GPU_PEAK_PROP]
    v = props.get(verdicts.VERDICT_PROP) or {}
    for index, n in (v.get("waivers") or {}).items():
        r["waivers"][index] = max(n, r["waivers"].get(index, 0))
    for index, msg in (v.get("waived_messages") or {}).items():
        r["waived_messages"].setdefault(index, msg)
    if v.get("unimplemented"):
        r["unimplemented"] = v["unimplemented"]
    wasxfail = getattr(report, "wasxfail", None)
    outcome = None
    if report.skipped and wasxfail is None:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        outcome = "not_applicable" if reason.startswith(NA_PREFIX) else "skipped"
        r["message"] = reason.removeprefix(NA_PREFIX)
    elif report.skipped:  # a failure (or failing examples) that covering waivers matched
        outcome = "waived"
        r["message"] = next(iter(r["waived_messages"].values()), wasxfail)
    elif report.passed and wasxfail is not None:
        outcome = "xpass"
        r["message"] = f"{wasxfail}: remove or narrow the waiver"
    elif report.failed:
        text = report.longreprtext or str(report.longrepr)
        outcome = "error" if report.when != "call" else "failed"
        r["message"] = _first_error_line(text)
        r["kind"] = v.get("kind")
        notes = dict(report.user_properties).get(HYPOTHESIS_PROP) or []
        examples = [n.strip() for n in notes if not _BLOB.search(n)]
        blob = _BLOB.search("\n".join(notes)) or _BLOB.search(text)
        if blob or examples:
            r["hypothesis"] = {
                "example": "\n".join(examples)[:4000],
                "blob": f"{blob.group(1)}:{blob.group(2)}" if blob else "",
            }
    if outcome in ("not_applicable",) or (
            outcome is not None and _OUTCOME_RANK[outcome] >= _OUTCOME_RANK.get(r["outcome"], 0)):
        r["outcome"] = outcome


def _first_error_line(text: str) -> str:
    lines = [ln[2:].strip() for ln in text.splitlines() if ln.startswith("E ")]
    # an exception group (hypothesis found several failures) draws boxes: keep the words
    lines = [ln.lstrip("|").strip() for ln in lines]
    lines = [ln for ln in lines if ln and not ln.startswith("+-")]
    msg = " ".join(lines) if lines else text.strip().splitlines()[-1] if text.strip() else ""
    return msg[:2000]


def pytest_sessionfinish(session, exitstatus) -> None:
    config = session.config
    if hasattr(config, "workerinput"):
        return
    st = _state(config)
    st.exitstatus = exitstatus
    from rlconform.conformance.report_builder import build_report

    report = build_report(st, config)
    report_dir = None
    if not config.getoption("--no-report"):
        report_dir = report_folder(config, st.backend)
        from rlconform.conformance.report_builder import write

        write(report, report_dir)
        if config.getoption("--wandb"):
            from rlconform.conformance.wandb_log import log_report

            log_report(report, report_dir)
    st.report = report
    from rlconform.reports.model import FAILING

    failing = [c["id"] for c in report["clauses"] if c["status"] in FAILING]
    tr = config.pluginmanager.get_plugin("terminalreporter")
    if tr is not None:
        _print_summary(tr, report, report_dir)
    interrupted = exitstatus in (pytest.ExitCode.INTERRUPTED, pytest.ExitCode.USAGE_ERROR,
                                 pytest.ExitCode.INTERNAL_ERROR, STORE_UNREACHABLE_EXIT)
    if interrupted:
        return
    collection_failed = session.testsfailed and not st.results
    session.exitstatus = (pytest.ExitCode.TESTS_FAILED
                          if failing or report["problems"] or collection_failed
                          else pytest.ExitCode.OK)


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def report_folder(config: pytest.Config, backend: Backend) -> Path:
    return Path(config.getoption("--report-dir")) / _safe(backend.name)


def report_dir_clash(folder: Path, backend: Backend) -> str | None:
    """Why `backend` must not write into `folder` (it holds another backend's report), or None.

    Two backends with one name would overwrite each other's reports; the report records where
    its backend was loaded from, and a run from another source refuses the folder."""
    import json

    path = folder / "report.json"
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    theirs = (old.get("backend_info") or {}).get("source") or ""
    if theirs and backend.source and theirs != backend.source:
        return (f"{folder} holds the report of backend {old.get('backend')!r} loaded from "
                f"{theirs}; this backend ({backend.source}) has the same name. Give it its own "
                "name, or another --report-dir")
    return None


def _print_summary(tr, report: dict, report_dir: Path | None) -> None:
    from rlconform.reports._common import headline

    tr.write_sep("=", f"rlconform: {report['backend']}")
    for c in report["clauses"]:
        if c["status"] != "passed" or c["message"]:  # a passed clause's note: partial evidence
            if c["status"] == "not_applicable":
                continue  # listed once per surface or capability below
            tr.write_line(f"  {c['status'].upper():19} {c['id']}: {c['message'][:160]}")
    for e in report.get("not_tested") or ():
        tr.write_line(f"  NOT TESTED          {e['kind']} {e['name']} ({len(e['clauses'])} "
                      f"clauses): {e['why'][:120]}")
    for p in report["problems"]:
        tr.write_line(f"  PROBLEM             {p}")
    tr.write_line(f"  {headline(report)}")
    if report_dir is not None:
        tr.write_line(f"  report: {report_dir}/report.html (.json, .md, junit.xml)")


def pytest_report_header(config) -> list[str]:
    st = config.stash.get(_KEY, None)
    if st is None:
        return []
    b = st.backend
    return [f"rlconform backend: {b.name} (surfaces: {', '.join(b.surfaces)}); "
            f"profile {config.getoption('--profile')}, device {config.getoption('--device')}, "
            f"dtype {config.getoption('--dtype')}, waivers: {len(st.expectations.waivers)}"]

