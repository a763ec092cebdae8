"""Hold an adapter's declared data path (`Backend.data_path`) to its code: every `entered` step's
function is patched with a counting wrapper while the adapter's surfaces run, and a step that
was never called is a failure naming it."""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import inspect
from collections import Counter
from collections.abc import Iterator
from unittest import mock


def resolve(dotted: str) -> tuple[object, str]:
    """(owner, attribute) of a dotted import path: the longest importable module prefix, then
    attributes (`verl.protocol.DataProto.from_dict` -> (DataProto, "from_dict"))."""
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:-1]:
            if not hasattr(owner, name) and inspect.ismodule(owner) and \
                    importlib.util.find_spec(f"{owner.__name__}.{name}") is not None:
                raise ImportError(f"{dotted}: module {owner.__name__}.{name} does not import")
            owner = getattr(owner, name)
        if not hasattr(owner, parts[-1]):
            raise AttributeError(f"{dotted}: {owner!r} has no attribute {parts[-1]!r}")
        return owner, parts[-1]
    raise ImportError(f"{dotted}: no importable module prefix")


def _counting(fn, counts: Counter, key: str):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        counts[key] += 1
        return fn(*args, **kwargs)

    return wrapper


@contextlib.contextmanager
def counting_calls(functions, counts: Counter | None = None) -> Iterator[Counter]:
    """Patch each dotted function (module functions, methods, class- and staticmethods) with a
    wrapper that counts its calls, keeping its descriptor kind (a class: a subclass counting
    each instance it builds); yields the counter."""
    counts = Counter() if counts is None else counts
    with contextlib.ExitStack() as stack:
        for dotted in functions:
            owner, name = resolve(dotted)
            raw = inspect.getattr_static(owner, name)
            if inspect.isclass(raw):
                # a class is called to build an instance: a subclass counting its __init__
                # keeps isinstance checks against the patched name working
                new = type(raw.__name__, (raw,), {
                    "__init__": _counting(raw.__init__, counts, dotted),
                    "__module__": raw.__module__, "__qualname__": raw.__qualname__})
            elif isinstance(raw, classmethod):
                new = classmethod(_counting(raw.__func__, counts, dotted))
            elif isinstance(raw, staticmethod):
                new = staticmethod(_counting(raw.__func__, counts, dotted))
            else:
                new = _counting(raw, counts, dotted)
            stack.enter_context(mock.patch.object(owner, name, new))
        yield counts


def assert_entered(backend, run, from_source=None, from_ranks=None) -> Counter:
    """Run `run()` with every entered step of `backend.data_path` counted; fail naming each one
    the run never called. `from_source(counts)`: a context manager that counts the steps an
    adapter runs from the framework's source file because their module does not import (it
    adds to `counts` under the step's name); those are not patched by name.
    `from_ranks(functions, counts)`: a context manager under which the adapter's rank
    processes count their calls of `functions` (`counting_calls`, run inside each rank) and
    add them to `counts`: a call made in a rank process is not seen by this one."""
    entered = [s.function for s in backend.data_path if s.status == "entered"]
    assert entered, f"backend {backend.name!r} declares no entered step"
    counts: Counter = Counter()
    importable = []
    for f in entered:
        try:
            resolve(f)
        except ImportError:
            assert from_source is not None, f"{f}: its module does not import here"
            continue
        importable.append(f)
    with counting_calls(importable, counts), \
            (from_source(counts) if from_source else contextlib.nullcontext()), \
            (from_ranks(importable, counts) if from_ranks else contextlib.nullcontext()):
        run()
    never = [f for f in entered if not counts[f]]
    assert not never, (f"{backend.name}: declared entered but never called while its surfaces "
                       f"ran: {never}")
    return counts
