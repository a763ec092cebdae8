"""The numerics clauses' watchers and `watching` (conformance/clauses/_watch.py): a trainer
without `watch` is watched on its `model` in this process, as the clauses always did; one with
it is asked instead."""

from __future__ import annotations

import contextlib
import pickle
from functools import partial
from types import SimpleNamespace

import pytest
import torch

from rlconform.conformance.clauses._watch import (
    GradCapture,
    LogitCapture,
    OptimizerSteps,
    watching,
)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def _step(model, opt, x) -> dict:
    """One backward and optimizer step; the gradients the backward left (before the step)."""
    opt.zero_grad(set_to_none=True)
    model(x).pow(2).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    return grads


def test_a_trainer_without_watch_is_watched_on_its_model_in_process():
    model = _model()
    trainer = SimpleNamespace(model=model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(5, 3)
    with watching(trainer, [GradCapture, partial(OptimizerSteps, weights=True)]) as records:
        want = _step(model, opt, x)
    grads, steps = records
    assert set(grads) == set(want) and all(torch.equal(grads[k], want[k]) for k in want)
    (step,) = steps
    assert all(torch.equal(step.grads[k], want[k]) for k in want)
    assert all(torch.equal(step.weights[k], initial[k]) for k in initial)
    _step(model, opt, x)  # after the block: unhooked
    assert len(steps) == 1 and all(torch.equal(grads[k], want[k]) for k in want)


def test_a_trainer_with_watch_is_asked_and_its_model_left_alone():
    asked = []

    class Elsewhere:
        @property
        def model(self):
            raise AssertionError("watching built a watcher on trainer.model")

        @contextlib.contextmanager
        def watch(self, factories):
            asked.append(list(factories))
            out: list = []
            yield out
            out.extend(f"record of {f.__name__}" for f in factories)

    with watching(Elsewhere(), (GradCapture, LogitCapture)) as records:
        assert records == []
    assert asked == [[GradCapture, LogitCapture]]
    assert records == ["record of GradCapture", "record of LogitCapture"]


def test_after_backward_reads_gradients_a_reduction_changed_after_the_hooks():
    """What a data-parallel trainer calls once DDP's all-reduce has changed the gradients the
    accumulate hooks saw (here: halved in place after the backward)."""
    model = _model()
    watcher = GradCapture(model)
    model(torch.randn(5, 3)).sum().backward()
    local = {n: p.grad.clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad.mul_(0.5)
    assert all(torch.equal(watcher._last[k], local[k]) for k in local)
    watcher.after_backward()
    got = watcher.remove()
    assert all(torch.equal(got[k], local[k] * 0.5) for k in local)


@pytest.mark.parametrize("factory", [GradCapture, LogitCapture,
                                     partial(OptimizerSteps, weights=True)])
def test_factories_and_their_records_cross_a_process(factory):
    """A factory is pickled to rank processes and its record back (tensors on the CPU)."""
    model = _model()
    assert pickle.loads(pickle.dumps(factory)) is factory or \
        pickle.loads(pickle.dumps(factory)).func is factory.func
    watcher = factory(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(model, opt, torch.randn(2, 3))
    record = pickle.loads(pickle.dumps(watcher.remove()))
    assert record is not None
    assert watcher.across_ranks in ("same", "rows")
