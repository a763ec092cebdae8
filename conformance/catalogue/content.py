"""The content fingerprint: a digest of every file a report's verdicts rest on.

The catalogue fingerprint (`catalogue.fingerprint`) covers what the clauses say and the names of
their tests; a verdict also moves when a test body, a fixture or strategy, a tolerance, a
reference part, the rules that turn outcomes into verdicts, the backend's adapter or its waiver
file changes, and none of those changes a name. Every report records this digest with each
file's own (`provenance.content`), so the staleness check (tests/test_scoreboard.py, the
scoreboard's `stale` mark) names the files that changed since the report was made.

Left out on purpose: the report's renderers, the progress line, sharding, the CLI, recorded
durations and memory plans (they change how a run is shown or scheduled, not what it judges),
and the mutants (the kill matrix in the reference's report carries its own regime and rows).
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

# the package root (rlconform is a namespace package: its folder is this file's grandparent's
# parent)
ROOT = Path(__file__).resolve().parents[2]

# what every verdict rests on, as globs under ROOT
VERDICT_FILES = (
    "conformance/clauses/*.py",        # the clause tests and their checks
    "conformance/catalogue/*.py",      # clause definitions, regimes, tolerances
    "conformance/backend.py",          # the backend API the adapters fill
    "conformance/engine/verdicts.py",  # outcome -> verdict
    "conformance/engine/waivers.py",   # what a waiver may cover
    "conformance/engine/cells.py",     # what a verdict counts
    "conformance/engine/outcomes.py",  # what a test's outcome records
    "conformance/engine/fixtures.py",  # the fixtures every clause test takes
    "fixtures/**/*.py",                # strategies, families, processed batches, sizes
    "reference_impl/**/*.py",          # the reference parts lent to every backend
)


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:12]


@functools.cache
def _common() -> dict[str, str]:
    out = {}
    for pattern in VERDICT_FILES:
        for p in sorted(ROOT.glob(pattern)):
            if "__pycache__" not in p.parts:
                out[p.relative_to(ROOT).as_posix()] = _digest(p.read_bytes())
    return out


def _key(path: Path) -> str:
    """A file's name in the map: relative to the package root when inside it, else absolute."""
    path = path.resolve()
    try:
        return path.relative_to(ROOT).as_posix()
    except ValueError:
        return path.as_posix()


def adapter_file(source: str | None) -> Path | None:
    """The file of a backend's adapter from its `source` (`pkg.module:attr`); None for a
    mutant of the reference, a backend built in-process, or a module that cannot be found."""
    if not source or ":" not in source or source.startswith("mutant:"):
        return None
    import importlib.util

    try:
        spec = importlib.util.find_spec(source.split(":", 1)[0])
    except (ImportError, ValueError):
        return None
    return Path(spec.origin) if spec and spec.origin and spec.origin.endswith(".py") else None


def fingerprint(adapter_source: str | None, waiver_file: str | Path | None) -> dict:
    """{"digest": one hash over every file, "files": {name: its own hash}} for a report of
    the backend loaded from `adapter_source` judged with `waiver_file` (None: no waivers)."""
    files = dict(_common())
    for extra in (adapter_file(adapter_source), waiver_file):
        if extra is not None and Path(extra).is_file():
            files[_key(Path(extra))] = _digest(Path(extra).read_bytes())
    digest = hashlib.sha256(json.dumps(sorted(files.items())).encode()).hexdigest()[:16]
    return {"digest": digest, "files": files}


def changed(recorded: dict | None) -> list[str] | None:
    """What changed since a report recorded `recorded` (its provenance.content): the files
    whose content differs, that are gone, or that are new among VERDICT_FILES; [] when
    nothing did; None when the report recorded no content fingerprint."""
    if not recorded or "files" not in recorded:
        return None
    now = dict(_common())
    out = []
    for name, was in sorted(recorded["files"].items()):
        p = Path(name) if Path(name).is_absolute() else ROOT / name
        if not p.is_file():
            out.append(f"{name} (gone)")
        elif (now.get(name) or _digest(p.read_bytes())) != was:
            out.append(name)
    out += [f"{name} (new)" for name in sorted(set(now) - set(recorded["files"]))]
    return out
