"""Watching a trainer's step where its model is: the numerics clauses' watchers and `watching`.

A watcher factory is a picklable callable `factory(model) -> watcher` (a class of this module,
or functools.partial of one), so a trainer whose step runs in other processes can build it
there. The watcher hooks `model` at once; `watcher.remove()` unhooks it and returns its record
(picklable; tensors on the CPU wherever the record crosses a process).

Two declarations let a data-parallel trainer hand the clause one record per watcher:
- `across_ranks`: how the records of the ranks of one step join. "same": every rank must hold
  the same record (the reduced gradient, the optimizer steps): the trainer checks they agree and
  hands one; "rows": a list over the rank's own forwards: the ranks' lists in rank order (the
  order of the shards' rows in the step's batch).
- `after_backward()` (optional): a trainer whose backward changes the gradients after their
  accumulate hooks fired (DDP all-reduces at the backward's end) calls it once each backward
  has returned, so the watcher reads the gradients the optimizer will be given.

`watching(trainer, factories)` uses the trainer's own `watch(factories)` where it offers one
(conformance/backend.py, the trainer surface) and otherwise builds the watchers on
`trainer.model` in this process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor


@contextlib.contextmanager
def watching(trainer, factories) -> Iterator[list]:
    """Yields a list that holds, once the block has run, one record per factory (in order) of
    what the trainer did inside the block."""
    factories = list(factories)
    own = getattr(trainer, "watch", None)
    if own is not None:
        with own(factories) as records:
            yield records
        return
    watchers = [f(trainer.model) for f in factories]
    records: list = []
    try:
        yield records
    finally:
        records.extend(w.remove() for w in watchers)


class GradCapture:
    """The gradient accumulated into each parameter of `model` by the last backward of the
    step (post-accumulate hooks), i.e. before clipping and the optimizer step."""

    across_ranks = "same"

    def __init__(self, model: torch.nn.Module):
        self._last: dict[str, Tensor] = {}
        self._params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self._hooks = [p.register_post_accumulate_grad_hook(
            lambda p, n=n: self._last.__setitem__(n, p.grad.detach().clone()))
            for n, p in self._params.items()]

    def after_backward(self) -> None:
        """The gradients as the backward left them, once a reduction changed them after the
        hooks fired (every parameter holding one)."""
        for n, p in self._params.items():
            if p.grad is not None:
                self._last[n] = p.grad.detach().clone()

    def remove(self) -> dict[str, Tensor]:
        """The gradients, where they were and in their own dtype (compared tensor by tensor
        there: at production widths a float64 pass over them on the CPU takes seconds)."""
        for h in self._hooks:
            h.remove()
        return dict(self._last)


@dataclass
class LogitRecord:
    input_ids: Tensor
    attention_mask: Tensor
    logits: Tensor  # [B, K, V] as the model returned them (K <= S: the last K positions)
    grad: list = field(default_factory=list)  # dL/dlogits, filled by the backward


class LogitCapture:
    """Every forward of `model` that builds a graph: its inputs, logits and dL/dlogits (of the
    loss its own process differentiates)."""

    across_ranks = "rows"

    def __init__(self, model: torch.nn.Module):
        self.records: list[LogitRecord] = []

        def hook(module, args, kwargs, output):
            logits = getattr(output, "logits", None)
            if logits is None or not logits.requires_grad:
                return
            ids = kwargs.get("input_ids", args[0] if args else None)
            mask = kwargs.get("attention_mask")
            mask = torch.ones_like(ids) if mask is None else mask
            rec = LogitRecord(ids.detach().cpu(), mask.detach().cpu(),
                              logits.detach().double().cpu())
            logits.register_hook(lambda g: rec.grad.append(g.detach().double().cpu()))
            self.records.append(rec)

        self._hook = model.register_forward_hook(hook, with_kwargs=True)

    def remove(self) -> list[LogitRecord]:
        self._hook.remove()
        return self.records


@dataclass
class OptimizerStep:
    grads: dict[str, Tensor]  # the gradient the optimizer applies (after clipping), CPU
    weights: dict[str, Tensor] | None  # the weights it starts from (when kept), CPU


class OptimizerSteps:
    """Every optimizer step taken on `model`'s parameters: torch's global optimizer step hooks
    (they fire for any torch optimizer, whatever wraps it; a wrapper's own step that calls an
    inner one is recorded once). `weights`: keep the weights each step starts from."""

    across_ranks = "same"

    def __init__(self, model: torch.nn.Module, weights: bool = False):
        self.names = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
        self.model, self.keep_weights = model, weights
        self.steps: list[OptimizerStep] = []
        self._pending: OptimizerStep | None = None
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        self._hooks = [register_optimizer_step_pre_hook(self._pre),
                       register_optimizer_step_post_hook(self._post)]

    def _ours(self, optimizer) -> bool:
        return any(id(p) in self.names for g in optimizer.param_groups for p in g["params"])

    def _pre(self, optimizer, args, kwargs):
        if not self._ours(optimizer):
            return
        grads = {n: p.grad.detach().to("cpu", copy=True) for n, p in
                 self.model.named_parameters() if p.requires_grad and p.grad is not None}
        kept = {k: v.detach().to("cpu", copy=True) for k, v in
                self.model.state_dict().items()} if self.keep_weights else None
        self._pending = OptimizerStep(grads, kept)

    def _post(self, optimizer, args, kwargs):
        if self._pending is not None and self._ours(optimizer):
            self.steps.append(self._pending)
            self._pending = None

    def remove(self) -> list[OptimizerStep]:
        for h in self._hooks:
            h.remove()
        return self.steps
