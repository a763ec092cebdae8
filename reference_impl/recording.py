"""A transport wrapper and a model hook that record what a trainer really did, in order.

A counter that proves a stage ran proves nothing about its numbers (BACKGROUND.md section 5);
these records let a clause check *which* fields each fetch asked for, that a forward ran
between a stage's fetch and its put, and what media reached the model, and let it tamper with a
column on its way in (the canary that tells an earned ratio from a forced one).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class Event:
    kind: str  # "put", "get", "clear" or "forward"
    partition: str = ""
    keys: tuple[str, ...] = ()
    fields: tuple[str, ...] = ()
    data: dict = field(default_factory=dict)  # put: columns; forward: model inputs (CPU)


class RecordingTransport:
    """Delegates to `inner`; logs every put / get / clear into `events`.

    `on_put(name, column) -> column` may rewrite a column before it is stored (a canary).
    """

    def __init__(self, inner, events: list[Event] | None = None,
                 on_put: Callable[[str, Tensor], Tensor] | None = None):
        self.inner = inner
        self.events: list[Event] = [] if events is None else events
        self.on_put = on_put

    def put(self, partition: str, keys: Sequence[str], columns: dict[str, Tensor],
            tags: Sequence[dict] | None = None) -> None:
        if self.on_put is not None:
            columns = {k: self.on_put(k, v) for k, v in columns.items()}
        self.events.append(Event("put", partition, tuple(keys), tuple(columns),
                                 dict(columns)))
        self.inner.put(partition, keys, columns, tags)

    def get(self, partition: str, keys: Sequence[str], select_fields: Sequence[str]):
        self.events.append(Event("get", partition, tuple(keys), tuple(select_fields)))
        return self.inner.get(partition, keys, select_fields=select_fields)

    def clear(self, partition: str, keys: Sequence[str] | None = None) -> None:
        self.events.append(Event("clear", partition, tuple(keys or ())))
        self.inner.clear(partition, keys)

    def list(self, partition: str) -> list[str]:
        return self.inner.list(partition)

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    # -- queries ------------------------------------------------------------------------
    def of(self, kind: str) -> list[Event]:
        return [e for e in self.events if e.kind == kind]

    def put_of(self, column: str) -> list[Event]:
        return [e for e in self.events if e.kind == "put" and column in e.fields]

    def fetch_before(self, column: str) -> list[Event]:
        """For each put that writes `column`, the last get before it (that stage's fetch)."""
        out = []
        for i, e in enumerate(self.events):
            if e.kind == "put" and column in e.fields:
                gets = [g for g in self.events[:i] if g.kind == "get"]
                out.append(gets[-1] if gets else None)
        return out

    def forwards_between(self, start: Event, stop: Event) -> list[Event]:
        i, j = _index(self.events, start), _index(self.events, stop)
        return [e for e in self.events[i + 1:j] if e.kind == "forward"]


def _index(events: list[Event], e: Event) -> int:
    for i, x in enumerate(events):
        if x is e:
            return i
    raise ValueError("event not in this log")


def record_forwards(model: torch.nn.Module, events: list[Event], label: str = "policy"):
    """Log each forward of `model` (its tensor inputs, on the CPU) into `events`.

    Returns the hook handle; call `.remove()` when done.
    """

    def hook(module, args, kwargs):
        data = {k: v.detach().cpu() for k, v in kwargs.items() if isinstance(v, Tensor)}
        if args and isinstance(args[0], Tensor):
            data.setdefault("input_ids", args[0].detach().cpu())
        events.append(Event("forward", label, (), tuple(data), data))

    return model.register_forward_pre_hook(hook, with_kwargs=True)


def match_rows(forward_ids: Tensor, forward_mask: Tensor, batch_ids: Tensor,
               batch_lens: Tensor) -> list[int]:
    """For each row of a forward, the batch row whose tokens it starts with (truncation keeps
    a prefix); raises when a forward row matches no batch row."""
    out = []
    for r in range(forward_ids.shape[0]):
        n = int(forward_mask[r].sum())
        ids = forward_ids[r, :n]
        for j in range(batch_ids.shape[0]):
            if int(batch_lens[j]) >= n and torch.equal(batch_ids[j, :n], ids):
                out.append(j)
                break
        else:
            raise AssertionError(f"forward row {r} ({n} tokens) matches no rollout row")
    return out


def media_mismatches(events: list[Event], batch) -> list[str]:
    """Every forward whose media inputs differ from the rollout batch's rows it carries.

    Each forward's rows are identified by their tokens; the expected model input of a packed
    field is the rollout's rows for those samples as one model-input tensor (None: the field
    must be absent). Values, dtype and shape must match exactly.
    """
    from .packed import PackedTensor

    packed = {n: v for n, v in batch.fields.items() if isinstance(v, PackedTensor)}
    problems = []
    for k, e in enumerate(x for x in events if x.kind == "forward"):
        rows = match_rows(e.data["input_ids"], e.data["attention_mask"], batch["input_ids"],
                          batch["input_lengths"])
        for name, v in packed.items():
            want = v.select(rows).as_tensor()
            got = e.data.get(name)
            if want is None and got is None:
                continue
            if want is None or got is None:
                problems.append(f"forward {k} ({e.partition}, rows {rows}): {name} "
                                f"{'absent' if got is None else 'present'}, expected the "
                                "opposite")
            elif want.shape != got.shape or want.dtype != got.dtype:
                problems.append(f"forward {k} ({e.partition}, rows {rows}): {name} "
                                f"{list(got.shape)} {got.dtype}, expected {list(want.shape)} "
                                f"{want.dtype}")
            elif not torch.equal(want.cpu(), got):
                problems.append(f"forward {k} ({e.partition}, rows {rows}): {name} values "
                                "differ from the rollout's")
    return problems
