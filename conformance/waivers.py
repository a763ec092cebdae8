"""Waivers: clauses a backend is known to fail, with a reason and an expiry date.

`conformance/expectations/<backend>.toml` (bundled) or `--expectations FILE`:

    [[waiver]]
    clause = "DP-LAYOUT"
    category = "backend-bug"        # backend-bug | unsupported | future
    families = ["llava"]            # optional: only the clause's tests on these model families
    reason = "returns 1-D columns as (N, 1)"
    link = "https://..."            # optional
    expires = 2027-03-01

An expired waiver, a waiver naming no clause, a duplicated waiver and a malformed entry are
problems: they fail the run (and the gate), so waivers cannot rot silently.
"""

from __future__ import annotations

import datetime as dt
import sys
from dataclasses import dataclass
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

CATEGORIES = ("backend-bug", "unsupported", "future")
BUNDLED_DIR = Path(__file__).parent / "expectations"


@dataclass(frozen=True)
class Waiver:
    clause: str
    category: str
    reason: str
    expires: dt.date
    link: str | None = None
    # the model families the waiver covers (the clause's tests parametrised by `family`);
    # empty: every test of the clause
    families: tuple[str, ...] = ()

    @property
    def expired(self) -> bool:
        return self.expires < dt.date.today()

    def covers(self, family: str | None) -> bool:
        """Whether a test of the clause run on `family` (None: not per family) is waived."""
        return not self.families or family in self.families

    def to_json(self) -> dict:
        out = {"category": self.category, "reason": self.reason, "link": self.link,
               "expires": self.expires.isoformat(), "expired": self.expired}
        if self.families:
            out["families"] = list(self.families)
        return out


def bundled_path(backend_name: str) -> Path | None:
    p = BUNDLED_DIR / f"{backend_name}.toml"
    return p if p.is_file() else None


def load_waivers(backend_name: str, path: str | Path | None, known: set[str]
                 ) -> tuple[dict[str, Waiver], list[str]]:
    """Waivers by clause ID, and the problems found (each fails the run)."""
    p = Path(path) if path else bundled_path(backend_name)
    if p is None:
        return {}, []
    if not p.is_file():
        return {}, [f"expectations file {p} does not exist"]
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as exc:
        return {}, [f"expectations file {p} is not valid TOML: {exc}"]
    waivers: dict[str, Waiver] = {}
    problems: list[str] = []
    for n, entry in enumerate(data.get("waiver", [])):
        where = f"{p.name} waiver #{n + 1}"
        missing = [k for k in ("clause", "category", "reason", "expires") if k not in entry]
        if missing:
            problems.append(f"{where} lacks {missing}")
            continue
        clause, category, expires = entry["clause"], entry["category"], entry["expires"]
        if clause not in known:
            problems.append(f"{where} names unknown clause {clause!r}")
            continue
        if category not in CATEGORIES:
            problems.append(f"{where} ({clause}) has category {category!r}; use one of "
                            f"{list(CATEGORIES)}")
            continue
        if isinstance(expires, dt.datetime):
            expires = expires.date()
        if not isinstance(expires, dt.date):
            problems.append(f"{where} ({clause}) expires {expires!r}: give a TOML date "
                            "(2027-03-01)")
            continue
        if clause in waivers:
            problems.append(f"{where} waives {clause} a second time")
            continue
        families = entry.get("families", [])
        if not isinstance(families, list) or not all(isinstance(f, str) for f in families):
            problems.append(f"{where} ({clause}) families must be a list of family names")
            continue
        w = Waiver(clause, category, str(entry["reason"]), expires, entry.get("link"),
                   tuple(families))
        if w.expired:
            problems.append(f"waiver for {clause} expired on {expires.isoformat()}: "
                            f"fix the backend or renew the waiver ({w.reason})")
        waivers[clause] = w
    unknown_keys = set(data) - {"waiver"}
    if unknown_keys:
        problems.append(f"{p.name} has unknown tables {sorted(unknown_keys)}")
    return waivers, problems
