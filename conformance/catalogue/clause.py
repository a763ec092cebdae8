"""The `Clause` record: one invariant a backend MUST meet."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Clause:
    """A catalogue entry.

    `mutants` names the known-bad backends (conformance/mutants) this clause must kill; the
    suite's own tests hold it to that. `defect` cites the field defect it guards (BACKGROUND.md
    section 3) or says what would go wrong. `regime` states, for numeric clauses, when the
    identity must hold exactly and which tolerance applies elsewhere.
    """

    id: str
    must: str
    surface: str
    defect: str
    mutants: tuple[str, ...]
    capabilities: tuple[str, ...] = ()
    required: bool = True
    regime: str = ""
    # further surfaces the clause judges: it applies where any of `surface` and these is
    # provided (GEN-REFIT-SYNC: the trainer's weights and the engine's refit of them)
    also: tuple[str, ...] = ()

    @property
    def surfaces(self) -> tuple[str, ...]:
        return (self.surface, *self.also)

    @property
    def prefix(self) -> str:
        return self.id.split("-", 1)[0]
