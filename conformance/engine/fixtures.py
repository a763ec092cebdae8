"""The fixtures clause tests receive: the backend and its surfaces (the reference's where the
backend provides none), the run's device, dtype, profile and seed, the trainer clauses' rollouts,
`record_metric`, and the GPU memory each model test reserves. The `transport` fixture clears
what a test wrote, and the run sweeps the store once more at its end."""

from __future__ import annotations

import contextlib
import functools
import os

import pytest

from rlconform.conformance.backend import Backend, StoreUnreachable
from rlconform.conformance.engine import gpu_memory
from rlconform.conformance.engine.items import GPU_PEAK_PROP, METRIC_PROP, is_model_test
from rlconform.conformance.engine.session import RlconformState, state


def _reference():
    from rlconform.conformance.backends.reference import backend

    return backend


@pytest.fixture(scope="session")
def backend(request) -> Backend:
    return state(request.config).backend


@pytest.fixture(scope="session", autouse=True)
def _backend_session(request):
    st = state(request.config)
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

    @functools.wraps(put)  # keeps put's signature: clauses name its arguments from it
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
def rollouts(backend, device, dtype, seed):
    """The trainer clauses' rollouts (test_trainer.Rollouts, shared per device, dtype and seed;
    with each row's `raw_prompt` where the backend's trainer reads prompts: clauses/_prompts.py),
    with one intra-op thread on CPU: hidden-64 models gain nothing from more, and on a busy
    2-core runner spinning worker threads made each step ~10x slower (logprobs are bitwise the
    same for any thread count, BACKGROUND.md s7)."""
    import torch

    from rlconform.conformance.clauses.test_trainer import Rollouts

    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)
    yield Rollouts.shared(device, dtype, seed,
                          backend.trainer if backend.provides("trainer") else None)
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _device_memory(request):
    """On CUDA: a model test at production width first reserves its planned peak from the GPU
    budget the workers share (engine/gpu_memory.py: it waits while the others' tests leave
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
    if ledger_path and is_model_test(request.node):
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
