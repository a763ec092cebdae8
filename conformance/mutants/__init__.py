"""Known-bad backends: the reference with exactly one field-seen defect each.

A clause that no mutant fails is a clause that cannot fail; the suite's own tests require every
clause to kill at least one mutant and every mutant to be killed by a clause that names it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from rlconform.conformance.backend import Backend


@dataclass(frozen=True)
class Mutant:
    name: str
    defect: str  # what is wrong, in the words of the field report
    backend: Callable[[], Backend]  # builds the mutated backend
    surface: str  # the surface it breaks


MUTANTS: dict[str, Mutant] = {}
_MODULES = ("transport", "store", "codec", "meta", "batch_ops", "trainer", "rollout", "ranks",
            "trainer_order", "global_state")


def mutant(name: str, defect: str, surface: str):
    """Register a factory `() -> Backend` as mutant `name`."""

    def wrap(factory: Callable[[], Backend]) -> Callable[[], Backend]:
        if name in MUTANTS:
            raise ValueError(f"mutant {name!r} registered twice")

        def build() -> Backend:
            b = factory()
            b.name = f"mutant:{name}"
            return b

        MUTANTS[name] = Mutant(name, defect, build, surface)
        return factory

    return wrap


def load_all() -> dict[str, Mutant]:
    for mod in _MODULES:
        try:
            importlib.import_module(f"{__name__}.{mod}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{mod}":
                raise
    return MUTANTS


def get_mutant(name: str) -> Mutant:
    load_all()
    try:
        return MUTANTS[name]
    except KeyError:
        raise LookupError(f"unknown mutant {name!r}; known: {', '.join(sorted(MUTANTS))}") from None


def keys_of_first_row(column):
    """A per-row dict column rebuilt through a columnar schema taken from its first non-empty
    row: keys that first appear in a later row are dropped (the defect of the mutants that
    call it, in the codec and in select)."""
    from rlconform.reference_impl.objects import ObjectColumn

    schema = next((list(r) for r in column.rows if r), [])
    return ObjectColumn([None if r is None else {k: v for k, v in r.items() if k in schema}
                         for r in column.rows])
