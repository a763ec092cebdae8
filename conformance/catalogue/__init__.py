"""The clause catalogue: the one list of clauses that the tests, reports, docs and meta-tests read.

Each module of this package lists the clauses of one part of the system (data_plane, trainer,
generation, ranks; the `Clause` record is clause.py) and this module joins them; nothing else
lists clauses. docs.py reads which clause tests are tied to which clause and generates the
documents made from the catalogue.
"""

from __future__ import annotations

from .clause import Clause
from .data_plane import DATA_PLANE_CLAUSES, REGIME_CLAUSES
from .generation import GENERATION_CLAUSES
from .ranks import RANK_CLAUSES
from .trainer import PASS_CLAUSES, TRAINER_CLAUSES


def _all() -> list[Clause]:
    # the catalogue's order (docs/clauses.md, reports, the fingerprint)
    clauses = [*DATA_PLANE_CLAUSES, *REGIME_CLAUSES, *TRAINER_CLAUSES, *GENERATION_CLAUSES,
               *PASS_CLAUSES, *RANK_CLAUSES]
    ids = [c.id for c in clauses]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise ValueError(f"clause IDs defined twice: {dup}")
    return clauses


CLAUSES: list[Clause] = _all()
BY_ID: dict[str, Clause] = {c.id: c for c in CLAUSES}


def get(clause_id: str) -> Clause:
    try:
        return BY_ID[clause_id]
    except KeyError:
        raise KeyError(f"unknown clause {clause_id!r}; known: {', '.join(BY_ID)}") from None


def fingerprint() -> str:
    """A short hash of what a report's verdicts rest on: every clause's definition (ID, MUST,
    surfaces, capabilities, requiredness, regime) and the test functions tied to it. Reports
    record it; a committed report whose fingerprint differs from the current one is stale."""
    import hashlib
    import json

    from .docs import tests_by_clause

    tests = tests_by_clause()
    data = [[c.id, c.must, list(c.surfaces), list(c.capabilities), c.required, c.regime,
             sorted(tests.get(c.id, []))] for c in CLAUSES]
    return hashlib.sha256(json.dumps(data).encode()).hexdigest()[:16]
