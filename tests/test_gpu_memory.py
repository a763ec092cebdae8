"""The GPU memory plan (conformance/engine/gpu_memory.py): planned peaks, the pre-flight refusal, the
reservation ledger shared by processes, folding a run's peaks into the plan. No GPU needed."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest

from rlconform.conformance.engine import gpu_memory as gm

PLAN = {"margin": 1.1, "default_gib": 40.0, "families": {
    "gemma3": {"peak_gib": 80.0, "tests": {"test_legacy_parity": 90.0}},
    "text": {"peak_gib": 20.0, "tests": {}}}}
GIB = 2**30


def test_planned_peaks_prefer_the_test_then_the_family_then_the_default():
    assert gm.planned_gib(PLAN, "gemma3", "test_legacy_parity[gemma3]") == pytest.approx(99.0)
    assert gm.planned_gib(PLAN, "gemma3", "test_other[gemma3]") == pytest.approx(88.0)
    assert gm.planned_gib(PLAN, "llava", "test_other[llava]") == 40.0
    assert gm.planned_gib(gm.load_plan(), "smolvlm", "test_x[smolvlm]") > 0


def test_preflight_refuses_a_gpu_too_small_for_the_largest_test():
    why = gm.preflight(PLAN, ["gemma3", "text"], 80 * GIB, "A100-80GB")
    assert why and "gemma3 needs 99 GiB" in why and "A100-80GB" in why and "text" not in why
    assert gm.preflight(PLAN, ["gemma3", "text"], 141 * GIB, "H200") is None


def test_preflight_judges_the_selected_tests_of_a_family():
    """A run that leaves a family's largest tests out (-k) is judged by the tests it runs: a
    test with its own measured peak needs that; one without needs the family's largest."""
    plan = {**PLAN, "families": {**PLAN["families"], "gemma3": {
        "peak_gib": 80.0, "tests": {"test_legacy_parity": 90.0, "test_small": 50.0}}}}
    assert gm.preflight(plan, ["gemma3"], 80 * GIB, "H100", tests={"gemma3": {"test_small"}}) \
        is None
    why = gm.preflight(plan, ["gemma3"], 80 * GIB, "H100",
                       tests={"gemma3": {"test_small", "test_legacy_parity"}})
    assert why and "gemma3 needs 99 GiB" in why
    why = gm.preflight(plan, ["gemma3"], 80 * GIB, "H100", tests={"gemma3": {"test_unmeasured"}})
    assert why and "gemma3 needs 88 GiB" in why


def _hold(path, budget, gib, seconds, started, log):
    ledger = gm.Ledger(path, budget)
    with gm.reservation(ledger, gib, "test") as waited:
        log.put(("in", gib, time.monotonic(), waited))
        started.set()
        time.sleep(seconds)
    log.put(("out", gib, time.monotonic(), 0.0))


def test_reservations_that_do_not_fit_wait_for_each_other(tmp_path):
    """Two 70 GiB tests on a 100 GiB budget run one after the other, never together; a
    20 GiB one runs beside either."""
    ctx = mp.get_context("spawn")
    path = tmp_path / "ledger.json"
    log, started = ctx.Queue(), ctx.Event()
    first = ctx.Process(target=_hold, args=(path, 100.0, 70.0, 6.0, started, log))
    first.start()
    assert started.wait(60)
    events_kept = [ctx.Event(), ctx.Event()]  # referenced until the children have them
    second = ctx.Process(target=_hold, args=(path, 100.0, 70.0, 0.1, events_kept[0], log))
    small = ctx.Process(target=_hold, args=(path, 100.0, 20.0, 0.1, events_kept[1], log))
    second.start()
    small.start()
    for p in (first, second, small):
        p.join(60)
        assert p.exitcode == 0
    events = [log.get(timeout=5) for _ in range(6)]
    first_out = next(t for kind, gib, t, _ in events if kind == "out" and gib == 70.0)
    second_in = max(t for kind, gib, t, _ in events if kind == "in" and gib == 70.0)
    assert second_in >= first_out, "the second 70 GiB test started before the first ended"
    small_in = next(t for kind, gib, t, _ in events if kind == "in" and gib == 20.0)
    assert small_in < first_out, "the 20 GiB test waited although it fit"
    assert gm.Ledger(path, 100.0).held() == {}


def test_a_dead_process_reservation_is_dropped_and_the_largest_test_runs_alone(tmp_path):
    path = tmp_path / "ledger.json"
    path.write_text('{"999999999": 90.0}')
    ledger = gm.Ledger(path, 100.0)
    assert ledger.try_reserve(95.0), "a dead process's reservation must not block"
    ledger.release()
    assert ledger.try_reserve(150.0), "a test larger than the budget runs when alone"
    ledger.release()


def test_a_run_folds_into_the_plan():
    report = {"clauses": [{"surface": "trainer", "tests": [
        {"nodeid": "test_trainer.py::test_legacy_parity[gemma3]", "params": {"family": "gemma3"},
         "gpu_peak_gib": 95.3},
        {"nodeid": "test_trainer.py::test_new[text]", "params": {"family": "text"},
         "gpu_peak_gib": 12.0},
        {"nodeid": "test_transport.py::test_x", "params": {}}]},
        {"surface": "transport", "tests": [
            {"nodeid": "test_transport.py::test_y[llava]", "params": {"family": "llava"},
             "gpu_peak_gib": 0.08}]}]}
    plan = gm.fold_report(PLAN, report)
    assert plan["families"]["gemma3"]["tests"]["test_legacy_parity"] == 95.3
    assert plan["families"]["gemma3"]["peak_gib"] == 95.3
    assert plan["families"]["text"]["tests"]["test_new"] == 12.0
    assert plan["families"]["text"]["peak_gib"] == 20.0
    assert "llava" not in plan["families"], "data-plane tests reserve nothing"
    assert PLAN["families"]["gemma3"]["tests"]["test_legacy_parity"] == 90.0, "input unchanged"


def test_preflight_judges_the_families_the_selected_model_tests_build(monkeypatch):
    """The run's preflight reads the families of the selected model tests only: a codec test
    of a large family builds no model, and a run that leaves a family out (-k) fits a smaller
    GPU (it refused an 80 GB H100 for SmolVLM while running only text and Qwen2-VL)."""
    import torch

    from rlconform.conformance.engine import session

    seen = {}
    monkeypatch.setattr(session, "_production_cuda", lambda config: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: type("P", (), {"total_memory": 80 * GIB, "name": "H100"}))
    monkeypatch.setattr(gm, "preflight",
                        lambda plan, families, total, name, tests: seen.setdefault(
                            "f", (families, tests)))
    ids = ["test_generation.py::test_generation_logprobs_agree_with_prev_logprobs[qwen2_vl]",
           "test_trainer_numerics.py::test_later_steps_ratio_is_the_policy_change[text-epochs-2]",
           "test_codec.py::test_family_roundtrip_with_shared_media[smolvlm]"]
    families, tests = session._gpu_plan_preflight(None, ids)  # the refusal's arguments
    assert families == ["qwen2_vl", "text"]
    assert tests == {"qwen2_vl": {"test_generation_logprobs_agree_with_prev_logprobs"},
                     "text": {"test_later_steps_ratio_is_the_policy_change"}}


class _Trainer:
    """Stands for what a failed model test's frames hold (tens of GB on a GPU)."""


def _fail_holding(trainer):
    model = trainer  # noqa: F841 (a local of the failed frame, as a clause's trainer is)
    try:
        raise KeyError("inner")
    except KeyError as inner:
        raise AssertionError("the clause failed") from inner


def test_a_failed_tests_frames_are_let_go_before_the_next_test_reserves():
    import sys
    import weakref

    trainer = _Trainer()
    alive = weakref.ref(trainer)
    try:
        _fail_holding(trainer)
    except AssertionError as e:  # what pytest's runner keeps for post-mortem debugging
        sys.last_type, sys.last_value, sys.last_traceback = type(e), e, e.__traceback__
    del trainer
    assert alive() is not None, "the failure's frames hold the trainer until they are let go"
    gm.drop_failed_frames()
    assert alive() is None
    assert not hasattr(sys, "last_value") and not hasattr(sys, "last_traceback")


def test_a_cuda_tests_teardown_lets_go_of_its_failure_first():
    import sys
    from types import SimpleNamespace

    from rlconform.conformance.engine import session

    def item(device):
        return SimpleNamespace(config=SimpleNamespace(getoption=lambda name: device))

    error = AssertionError("the clause failed")
    sys.last_type, sys.last_value, sys.last_traceback = type(error), error, None
    session.pytest_runtest_teardown(item("cpu"))
    assert sys.last_value is error, "a CPU run keeps pytest's post-mortem state"
    session.pytest_runtest_teardown(item("cuda:0"))
    assert not hasattr(sys, "last_value")
