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

# Capabilities a backend may declare. Each gates the clauses that list it (catalogue
# `capabilities`): they apply only where it is declared; a declared capability whose clause is
# skipped counts as a failure. A capability that gates no clause is not one (a test holds it).
CAPABILITIES = {
    "object_columns": "stores non-tensor (object) columns",
    "partitions": "isolates partitions from each other",
    "dp": "serves length-balanced data-parallel shards",
    "bfloat16": "carries bfloat16 tensors",
    "batch_algebra": "batch_ops select / concat / split of whole batches (media, object rows)",
    "micro_batching": "batch_ops micro_batches: row-recording, optionally shuffled micro-batches",
    "truncation": "batch_ops truncate: cuts a batch to a sequence length (a framework with no "
    "such function leaves it out, saying so in notes)",
    "padding": "batch_ops pad_to: pads a batch to a sequence length (a framework with no such "
    "function leaves it out, saying so in notes)",
    "batch_union": "batch_ops union: the fields of two batches over the same rows (verl "
    "DataProto.union)",
    "multiprocess": "a transport other processes reopen: transport.address() is picklable and "
    "backend.transport(address=...) opens the same store there (data-parallel rank processes, "
    "reference_impl/ranks.py)",
}

# Capabilities that gated no clause and were removed: declaring one is an error that says why,
# so a backend does not believe it left checks out (or in) by declaring it.
REMOVED_CAPABILITIES = {
    "jagged_columns": "every transport must carry jagged columns (DP-ROUNDTRIP tests them)",
    "media_dedup": "de-duplicated media rows are part of every media clause's input",
    "dim1_packing": "media packed along dim 1 (SmolVLM, Idefics3, LLaVA-NeXT) are part of every "
                    "media clause's input; a backend that cannot carry them fails there",
    "cpu": "the device is the run's --device, not a capability",
    "cuda": "the device is the run's --device, not a capability",
}

ENTRY_POINT_GROUP = "rlconform.backends"
REFERENCE_NAME = "reference"
REFERENCE_SOURCE = "rlconform.conformance.backends.reference:backend"


class StoreUnreachable(ConnectionError):
    """Raised by a backend's `session` when the store it needs cannot be reached (a server
    that is down, a wrong address): the run ends with this one error instead of every clause
    failing on the same refused connection."""


# How a framework function on a backend's data path is reached (PathStep.status).
PATH_STATUSES = {
    "entered": "called by the adapter with real inputs; its output is used",
    "stubbed": "not called: it needs what a CPU test run lacks (a GPU, a cluster, a server); "
    "the adapter supplies the smallest real stand-in",
    "rebuilt": "the adapter does the function's work itself instead of calling it",
}


@dataclass(frozen=True)
class PathStep:
    """One framework function on a backend's data path, from the rollout's output to the model's
    forward and the optimizer step, and how the adapter reaches it.

    `function` is the dotted import path (`"verl.protocol.DataProto.from_dict"`): for `entered`
    steps the adapter's tests patch that name and require a call during the adapter's run, so
    a declaration cannot drift from the code. `why` is required for `stubbed` and `rebuilt`
    (what is missing, what stands in); `surface` names the adapter surface that takes the step.
    """

    function: str
    status: str
    why: str = ""
    surface: str = ""

    def __post_init__(self) -> None:
        if self.status not in PATH_STATUSES:
            raise ValueError(f"path step {self.function!r}: status {self.status!r} is not one of "
                             f"{sorted(PATH_STATUSES)}")
        if self.status != "entered" and not self.why.strip():
            raise ValueError(f"path step {self.function!r} is {self.status}: say why")
        if self.surface and self.surface not in SURFACES:
            raise ValueError(f"path step {self.function!r}: surface {self.surface!r} is not one "
                             f"of {SURFACES}")
        if "." not in self.function or " " in self.function:
            raise ValueError(f"path step function {self.function!r} must be a dotted import "
                             "path (module.attribute)")

    def describe(self) -> dict:
        return {"function": self.function, "status": self.status, "why": self.why,
                "surface": self.surface}


@contextlib.contextmanager
def _no_session() -> Iterator[None]:
    yield


@dataclass
class Backend:
    r"""One system under test: a name, surface factories, capabilities and a session.

    Every surface is a *factory*, called once per test so nothing leaks between tests:

    | surface     | factory signature                                   | returns |
    |-------------|-----------------------------------------------------|---------|
    | `transport` | `()`; with `multiprocess`: `(address=None)`         | an object with `put`, `get`, `list`, `clear`, `close` (ARCHITECTURE.md "Transport surface"); with `multiprocess` also `address()` (picklable), and `factory(address=a)` reopens the same store in another process (reference_impl/ranks.py) |
    | `codec`     | `(pixel_dtype: torch.dtype \| None = None)`         | an object with `encode(Batch) -> WireBatch`, `decode(WireBatch) -> Batch`; `pixel_dtype` casts POLICY media once, at encode |
    | `meta`      | `()`                                                | a *class* with BatchMeta's constructor and algebra (`subset`, `slice`, `concat`, `drop`, `with_fields`, `stamp_tags`, `shard_for_dp`); every method returns that class |
    | `batch_ops` | `()`                                                | an object with `validate`, `multimodal_inputs`; with `truncation` `truncate`, with `padding` `pad_to` (reference: `reference_impl.batch.BatchOps`) |
    | `trainer`   | `(settings, transport=None, codec=None)`            | the data-plane trainer when `transport` is given, else the in-memory one: `model` (the policy module its passes run and its backward accumulates into; clauses hook its logits and gradients), `compute_logprobs`, `train`, `state_dict` (conformance/backends/reference_trainer_rollout.py); a trainer whose step runs where `model` is not (rank processes) offers `watch(factories)`: a context manager yielding a list that holds, after the block, one record per watcher factory, each built on the model where the block's step ran (the protocol: conformance/clauses/_watch.py); with `ranks=RankLaunch(...)` a rank group (`bind`, `step`, `close`, `pids`): the rank contract in reference_impl/ranks.py; a factory whose trainers render and process the prompts themselves sets `reads_prompts = True`, and the clauses' batches then carry each row's prompt text and images (`raw_prompt`, reference_impl/prompts.py) |
    | `rollout`   | `(family, settings)`                                | `generate(prompts, images, max_new_tokens, seed) -> Batch` (`max_new_tokens`: an int, or one cap per prompt, 0 allowed; EOS may end a completion early), `refit(state_dict)` |

    rlconform composes a backend with the reference for the surfaces it lacks, so every clause
    runs inside a whole step; a clause applies only where its surface is provided and its
    capabilities are declared. `notes` says, per surface or capability left out, why (a
    framework with nothing to wrap there): reports list every clause not tested with that
    reason. `session` is a context manager entered once per test run around every test: a
    backend that needs a cluster (Ray, a Mooncake master) starts it there and stops it on exit.
    `changes_globals` declares, per surface, process-global state (an RNG, grad mode, an
    environment variable: conformance/clauses/_globals.py) its operations must change, and why;
    the NO-GLOBAL-EFFECTS clauses allow it there and report it.

    The common case, the reference with one surface replaced, is one call:
    `Backend.from_reference("my-store", transport=MyStore)`. Every backend needs its own name:
    reports go to `<report-dir>/<name>/`, and a run refuses a folder that holds another
    backend's report.
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
    # where the backend was loaded from (`module:attr`, a bundled name's target, or
    # `mutant:<name>`); set by `load_backend`, recorded in reports to keep report folders apart
    source: str = ""
    # the version of the system under test ("OpenRLHF 0.11.2", "NeMo-RL 0.5 at commit 7ea279a"):
    # reports record it in backend_info, the scoreboard shows it
    version: str = ""
    # the stem of the bundled waiver file, conformance/expectations/<stem>.toml ("": the name);
    # a backend whose known failures depend on the version it finds picks its file here
    expectations: str = ""
    # the framework's data path, function by function (PathStep), and per clause ID what the
    # adapter normalises in the framework's output before the clause judges it
    data_path: tuple[PathStep, ...] = ()
    normalisations: dict[str, str] = field(default_factory=dict)
    # per surface, the process-global state its operations must change and why (names as
    # conformance/clauses/_globals.py reads them: "torch_rng", "grad_mode", "env.<VARIABLE>",
    # ...): the *-NO-GLOBAL-EFFECTS clauses allow these and report each one they see change
    changes_globals: dict[str, dict[str, str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.capabilities = frozenset(self.capabilities)
        self.data_path = tuple(self.data_path)
        odd_steps = [s for s in self.data_path if not isinstance(s, PathStep)]
        if odd_steps:
            raise TypeError(f"backend {self.name!r}: data_path holds {odd_steps[:2]}, not "
                            "PathStep objects")
        twice = sorted({s.function for s in self.data_path
                        if sum(t.function == s.function for t in self.data_path) > 1})
        if twice:
            raise ValueError(f"backend {self.name!r}: data_path names {twice} more than once")
        removed = sorted((self.capabilities | set(self.notes)) & REMOVED_CAPABILITIES.keys())
        if removed:
            raise ValueError(
                f"backend {self.name!r} declares (or notes) capabilities that no longer exist: "
                + "; ".join(f"{c}: {REMOVED_CAPABILITIES[c]}" for c in removed)
                + ". Drop them.")
        unknown = self.capabilities - CAPABILITIES.keys()
        if unknown:
            raise ValueError(
                f"backend {self.name!r} declares unknown capabilities {sorted(unknown)}; "
                f"known: {sorted(CAPABILITIES)}"
            )
        if not self.surfaces:
            raise ValueError(f"backend {self.name!r} provides no surface; give one of {SURFACES}")
        self._check_changes_globals()
        odd = sorted(set(self.notes) - set(SURFACES) - CAPABILITIES.keys())
        if odd:
            raise ValueError(f"backend {self.name!r} has notes on {odd}, which are neither "
                             f"surfaces {SURFACES} nor capabilities {sorted(CAPABILITIES)}")

    def _check_changes_globals(self) -> None:
        if not self.changes_globals:
            return
        from rlconform.conformance.clauses import _globals

        for surface, states in self.changes_globals.items():
            if surface not in SURFACES:
                raise ValueError(f"backend {self.name!r}: changes_globals names surface "
                                 f"{surface!r}, not one of {SURFACES}")
            if not isinstance(states, dict):
                raise TypeError(f"backend {self.name!r}: changes_globals[{surface!r}] must map "
                                f"each state to why it changes, not {type(states).__name__}")
            for name, why in states.items():
                if not _globals.known(name):
                    raise ValueError(
                        f"backend {self.name!r}: changes_globals[{surface!r}] names "
                        f"{name!r}, which is not global state the suite reads; known: "
                        f"{sorted(_globals.READERS)} and env.<VARIABLE>")
                if not str(why).strip():
                    raise ValueError(f"backend {self.name!r}: changes_globals[{surface!r}]"
                                     f"[{name!r}]: say why the surface changes it")

    @classmethod
    def from_reference(cls, name: str, *, description: str = "", capabilities=(), without=(),
                       **overrides: Any) -> Backend:
        """The reference backend with some parts replaced (surfaces, session, notes), under its
        own `name`: `Backend.from_reference("my-store", transport=MyStore)`.

        Capabilities add up: the reference's (less those of each surface replaced: a new
        transport declares `partitions`, `multiprocess`, ... itself) plus `capabilities`, less
        `without` (to leave one out on purpose; say why in `notes`). CAPABILITIES lists them
        all; docs/writing-a-transport.md says which clauses each one turns on.
        """
        if not name or name == REFERENCE_NAME:
            raise ValueError(f"a backend built from the reference needs its own name, not "
                             f"{name!r}: its report would overwrite the reference's")
        from rlconform.conformance.backends.reference import derive

        return derive(name, description or f"the reference with "
                      f"{', '.join(sorted(overrides)) or 'nothing'} replaced",
                      capabilities, without, **overrides)

    @property
    def surfaces(self) -> tuple[str, ...]:
        return tuple(s for s in SURFACES if getattr(self, s) is not None)

    def provides(self, surface: str) -> bool:
        return getattr(self, surface) is not None

    @property
    def lent(self) -> tuple[str, ...]:
        """The surfaces this backend takes from the reference unchanged (the parts
        `from_reference` did not replace): the run exercises them, its report does not score
        them. The reference itself lends nothing."""
        if self.name == REFERENCE_NAME:
            return ()
        from rlconform.conformance.backends import reference

        return tuple(s for s in self.surfaces
                     if getattr(self, s) is getattr(reference.backend, s))

    def describe(self) -> dict:
        return {
            "name": self.name,
            "description": self.description,
            "surfaces": list(self.surfaces),
            **({"lent_surfaces": list(self.lent)} if self.lent else {}),
            "capabilities": sorted(self.capabilities),
            "notes": dict(self.notes),
            "source": self.source,
            **({"version": self.version} if self.version else {}),
            **({"data_path": [s.describe() for s in self.data_path]} if self.data_path else {}),
            **({"normalisations": dict(self.normalisations)} if self.normalisations else {}),
            **({"changes_globals": {k: dict(v) for k, v in self.changes_globals.items()}}
               if self.changes_globals else {}),
        }


def package_version(dist: str, label: str | None = None) -> str:
    """`"<label> <installed version of dist>"` for `Backend.version`; "" when not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"{label or dist} {version(dist)}"
    except PackageNotFoundError:
        return ""


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
    found.setdefault(REFERENCE_NAME, REFERENCE_SOURCE)
    from rlconform.conformance.backends import BUNDLED

    for name, (spec, _reqs) in BUNDLED.items():
        found.setdefault(name, spec)
    return found


def load_backend(spec: str) -> Backend:
    """Resolve `--backend`: a registered name, `mutant:<name>` or `module.path:attribute`."""
    if spec.startswith("mutant:"):
        from rlconform.conformance.mutants import get_mutant

        backend = get_mutant(spec.removeprefix("mutant:")).backend()
        backend.source = spec
        return backend
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
    if backend.name == REFERENCE_NAME and target != REFERENCE_SOURCE:
        raise ValueError(
            f"backend {spec!r} ({target}) calls itself {REFERENCE_NAME!r}, the bundled "
            "reference's name, and would overwrite its report: give it its own name, e.g. "
            "Backend.from_reference('my-store', transport=MyStore)")
    backend.source = target
    return backend
