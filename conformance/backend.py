"""The backend plugin API: what a backend provides and how rlconform finds it.

A backend is a `Backend` object: a name, the surfaces it implements (each a factory), and the
capabilities it declares. rlconform composes it with reference parts for the surfaces it lacks,
and a clause applies only when its surface and capabilities are declared.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

# transport, codec, trainer and rollout are the surfaces of DESIGN.md; meta (the BatchMeta algebra)
# and batch_ops (truncate / pad / validate / stage inputs) are surfaces too, because that is where
# several field defects lived (BACKGROUND.md section 3) and frameworks ship their own versions.
SURFACES = ("transport", "codec", "meta", "batch_ops", "trainer", "rollout")

# Capabilities a backend may declare. A clause that needs one applies only where it is declared;
# a declared capability whose clause is skipped counts as a failure.
CAPABILITIES = {
    "jagged_columns": "stores jagged (nested) tensor columns",
    "object_columns": "stores non-tensor (object) columns",
    "media_dedup": "carries de-duplicated media rows (several samples sharing a segment)",
    "dim1_packing": "carries media packed along dim 1 (Idefics3/SmolVLM tiles, LLaVA-NeXT)",
    "partitions": "isolates partitions from each other",
    "dp": "serves length-balanced data-parallel shards",
    "bfloat16": "carries bfloat16 tensors",
    "cpu": "runs on the CPU",
    "cuda": "runs on a CUDA device",
}

ENTRY_POINT_GROUP = "rlconform.backends"


@contextlib.contextmanager
def _no_session() -> Iterator[None]:
    yield


@dataclass
class Backend:
    """One system under test.

    Each surface is a zero-argument factory returning a fresh instance, so every test gets its
    own transport (or trainer, ...) and nothing leaks between tests. `session` is a context
    manager entered once per test run around every test: a backend that needs a cluster (Ray,
    a Mooncake master) starts it there and stops it on exit.
    """

    name: str
    description: str = ""
    transport: Callable[[], Any] | None = None
    codec: Callable[[], Any] | None = None
    meta: Callable[[], type] | None = None
    batch_ops: Callable[[], Any] | None = None
    trainer: Callable[..., Any] | None = None
    rollout: Callable[..., Any] | None = None
    capabilities: frozenset[str] = field(default_factory=frozenset)
    session: Callable[[], contextlib.AbstractContextManager] = _no_session
    notes: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.capabilities = frozenset(self.capabilities)
        unknown = self.capabilities - CAPABILITIES.keys()
        if unknown:
            raise ValueError(
                f"backend {self.name!r} declares unknown capabilities {sorted(unknown)}; "
                f"known: {sorted(CAPABILITIES)}"
            )
        if not self.surfaces:
            raise ValueError(f"backend {self.name!r} provides no surface; give one of {SURFACES}")

    @property
    def surfaces(self) -> tuple[str, ...]:
        return tuple(s for s in SURFACES if getattr(self, s) is not None)

    def provides(self, surface: str) -> bool:
        return getattr(self, surface) is not None

    def describe(self) -> dict:
        return {
            "name": self.name,
            "description": self.description,
            "surfaces": list(self.surfaces),
            "capabilities": sorted(self.capabilities),
            "notes": dict(self.notes),
        }


def _load_attr(spec: str) -> Any:
    module_name, _, attr = spec.partition(":")
    module = importlib.import_module(module_name)
    obj = module
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj() if callable(obj) and not isinstance(obj, Backend) else obj


def known_backends() -> dict[str, str]:
    """Backend name -> `module:attr` for every registered backend and mutant."""
    found = {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}
    found.setdefault("reference", "rlconform.conformance.backends.reference:backend")
    from rlconform.conformance.backends import BUNDLED

    for name, (spec, _reqs) in BUNDLED.items():
        found.setdefault(name, spec)
    return found


def load_backend(spec: str) -> Backend:
    """Resolve `--backend`: a registered name, `mutant:<name>` or `module.path:attribute`."""
    if spec.startswith("mutant:"):
        from rlconform.conformance.mutants import get_mutant

        return get_mutant(spec.removeprefix("mutant:")).backend()
    known = known_backends()
    if spec in known:
        target = known[spec]
    elif ":" in spec:
        target = spec
    else:
        from rlconform.conformance.mutants import load_all

        MUTANTS = load_all()
        raise LookupError(
            f"unknown backend {spec!r}. Known backends: {', '.join(sorted(known))}; "
            f"mutants: mutant:<name> with name in {', '.join(sorted(MUTANTS))}; "
            "or give module.path:attribute"
        )
    try:
        backend = _load_attr(target)
    except (ImportError, AttributeError) as exc:
        raise LookupError(f"backend {spec!r} ({target}) could not be loaded: {exc}") from exc
    if not isinstance(backend, Backend):
        raise TypeError(f"backend {spec!r} ({target}) is a {type(backend).__name__}, not a Backend")
    return backend
