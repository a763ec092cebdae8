"""Waivers: the failures a backend is known to have, each as narrow as the failure itself.

`conformance/expectations/<backend>.toml` (bundled) or `--expectations FILE`:

    [[waiver]]
    clause = "DP-LAYOUT"
    category = "backend-bug"           # backend-bug | unsupported | future
    reason = "returns 1-D columns as (N, 1)"
    function = "store.client.get"      # optional: the system's function at fault
    input = "a (3,) int64 column"      # optional: the smallest input that shows it
    link = "https://..."               # optional: upstream issue or fix
    expires = 2027-03-01
    # the scope, at least one of:
    tests = ["test_layout_*"]          # test names (fnmatch), "name" or "name[param-id]"
    params = { family = ["llava"] }    # parametrisation values (fnmatch); every key must match
    match = "came back jagged"         # regex searched in the failure ("ExcType: message")

    [coverage]                          # optional: clauses this backend stopped testing on purpose
    allow_drop = [{ clause = "TRAIN-RATIO-ONE", reason = "trainer surface left out: ..." }]

A waiver *covers* the tests of its clause that its `tests` and `params` select. A failure of a
covered test is waived when it matches `match` (any failure when there is no `match`); every
other failure is a failure. Expectations that no longer hold are failures too (`xpass`): a
covered test that passes under a waiver that names tests or params, and a waiver that matched
no failure at all. Web-platform-tests keep expectations per test for the same reason: a partial
upstream fix shows. A waiver without any scope (a whole clause, any failure) is refused.

Expired, malformed, unscoped and duplicated waivers, and waivers naming no clause, are problems:
they fail the run (and the gate), so waivers cannot rot silently.
"""

from __future__ import annotations

import datetime as dt
import fnmatch
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

CATEGORIES = ("backend-bug", "unsupported", "future")
BUNDLED_DIR = Path(__file__).parents[1] / "expectations"
REQUIRED_KEYS = ("clause", "category", "reason", "expires")
SCOPE_KEYS = ("tests", "params", "match")
OPTIONAL_KEYS = ("link", "function", "input")


@dataclass(frozen=True)
class Waiver:
    clause: str
    category: str
    reason: str
    expires: dt.date
    link: str | None = None
    function: str | None = None
    input: str | None = None
    # scope: test-name patterns, parameter patterns (name -> value patterns), message regex
    tests: tuple[str, ...] = ()
    params: tuple[tuple[str, tuple[str, ...]], ...] = ()
    match: str | None = None
    # 1-based position in its file: how reports and messages name one waiver among several
    index: int = 0
    _regex: re.Pattern | None = field(default=None, compare=False, repr=False)

    @property
    def expired(self) -> bool:
        return self.expires < dt.date.today()

    @property
    def selects_tests(self) -> bool:
        """Whether the waiver names its tests (by name or parameters): then every test it
        covers is expected to fail, and one that passes is `xpass`."""
        return bool(self.tests or self.params)

    @property
    def label(self) -> str:
        return f"{self.clause} waiver #{self.index}"

    def covers(self, clauses: list[str] | tuple[str, ...], name: str,
               params: Mapping[str, str]) -> bool:
        """Whether a test tied to `clauses`, called `name` (`test_x[qwen2_vl-2]`; the function
        name alone also matches) with parametrisation `params` (values as strings), is within
        this waiver's scope."""
        if self.clause not in clauses:
            return False
        if self.tests:
            function = name.split("[", 1)[0]
            if not any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(function, p)
                       for p in self.tests):
                return False
        for key, patterns in self.params:
            value = params.get(key)
            if value is None or not any(fnmatch.fnmatchcase(value, p) for p in patterns):
                return False
        return True

    def matches(self, failure: str) -> bool:
        """Whether a failure text ("ExcType: message") is the failure this waiver describes."""
        if self.match is None:
            return True
        regex = self._regex or re.compile(self.match)
        return regex.search(failure) is not None

    def scope_json(self) -> dict:
        out: dict = {}
        if self.tests:
            out["tests"] = list(self.tests)
        if self.params:
            out["params"] = {k: list(v) for k, v in self.params}
        if self.match is not None:
            out["match"] = self.match
        return out

    def to_json(self) -> dict:
        out = {"index": self.index, "category": self.category, "reason": self.reason,
               "link": self.link, "expires": self.expires.isoformat(), "expired": self.expired,
               "scope": self.scope_json()}
        for key in ("function", "input"):
            if getattr(self, key):
                out[key] = getattr(self, key)
        return out


@dataclass
class Expectations:
    """A backend's waivers (in file order) and the coverage it gave up on purpose."""

    waivers: list[Waiver] = field(default_factory=list)
    # clause -> reason: clauses that may be untested now although a baseline tested them
    allow_drop: dict[str, str] = field(default_factory=dict)
    path: str | None = None

    def for_clause(self, clause: str) -> list[Waiver]:
        return [w for w in self.waivers if w.clause == clause]

    def active(self) -> list[Waiver]:
        return [w for w in self.waivers if not w.expired]


def bundled_path(backend_name: str) -> Path | None:
    p = BUNDLED_DIR / f"{backend_name}.toml"
    return p if p.is_file() else None


def _strings(value, what: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{what} must be a non-empty list of strings")
    return tuple(value)


# an exception type's name alone: it matches every failure that raises it, whatever the cause
_BARE_EXCEPTION = re.compile(r"\(?\^?\s*[A-Z]\w*(?:Error|Exception|Warning|Interrupt)\s*:?\s*\$?\)?")


def _top_alternatives(pattern: str) -> list[str]:
    """The branches of `pattern`'s top-level `|` (not those inside groups or classes)."""
    out, depth, cls, start, i = [], 0, False, 0, 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\":
            i += 2
            continue
        if cls:
            cls = ch != "]"
        elif ch == "[":
            cls = True
        elif ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "|" and depth == 0:
            out.append(pattern[start:i])
            start = i + 1
        i += 1
    return [*out, pattern[start:]]


def _loose_pattern(match: str, regex: re.Pattern) -> str | None:
    """Why a waiver's pattern would take failures of other causes (None: it names one): it
    matches any text, or one of its branches is only an exception type's name. A bare
    `TypeError` branch waived a stage that dropped image_grid_thw on nine families."""
    if regex.search("") is not None:
        return "matches any text"
    bare = [b for b in _top_alternatives(match) if _BARE_EXCEPTION.fullmatch(b.strip())]
    if bare:
        return f"has a branch that is only an exception type ({', '.join(bare)})"
    return None


def _template_branch(match: str, clause: str) -> str | None:
    """Why a branch of `match` takes more than one failure of the clause's own checks (None:
    each branch names a check and a value of it): it matches two of the clause's assertion
    templates (two different checks), or one template whose values are all left open (the same
    check failing on another field or row). verl's `tag` branch under META-DP-SHARD matched
    every tag check of the clause; a shard that zeroed every row's length passed under it."""
    from rlconform.conformance.catalogue.templates import FILL, templates_by_clause

    templates = templates_by_clause().get(clause, ())
    whys = []
    for branch in _top_alternatives(match):
        try:
            rx = re.compile(branch)
        except re.error:  # a branch of a valid pattern that only compiles whole
            continue
        hits = [t for t in templates if rx.search(t) or rx.search(f"AssertionError: {t}")]
        if len(hits) > 1:
            whys.append(f"its branch {branch!r} matches {len(hits)} different checks of the "
                        f"clause ({hits[0]!r}, {hits[1]!r}{', ...' if len(hits) > 2 else ''}): "
                        "name the one that fails")
        elif hits and FILL in hits[0]:
            whys.append(f"its branch {branch!r} matches the clause's own message {hits[0]!r} "
                        f"whatever its values ({FILL}): name the field, row or value that "
                        "fails, so that the same check failing on another one still fails")
    return "; ".join(whys) or None


def _parse_waiver(entry: dict, where: str, known: set[str], index: int) -> Waiver:
    """One `[[waiver]]` table as a Waiver; ValueError says what is wrong with it."""
    if not isinstance(entry, dict):
        raise ValueError(f"{where} is not a table")
    missing = [k for k in REQUIRED_KEYS if k not in entry]
    if missing:
        raise ValueError(f"{where} lacks {missing}")
    clause, category, expires = entry["clause"], entry["category"], entry["expires"]
    odd = sorted(set(entry) - set(REQUIRED_KEYS) - set(SCOPE_KEYS) - set(OPTIONAL_KEYS))
    if odd:
        hint = " (families = [...] is now params = { family = [...] })" \
            if "families" in odd else ""
        raise ValueError(f"{where} ({clause}) has unknown keys {odd}; known: "
                         f"{sorted(REQUIRED_KEYS + SCOPE_KEYS + OPTIONAL_KEYS)}{hint}")
    if clause not in known:
        raise ValueError(f"{where} names unknown clause {clause!r}")
    if category not in CATEGORIES:
        raise ValueError(f"{where} ({clause}) has category {category!r}; use one of "
                         f"{list(CATEGORIES)}")
    if isinstance(expires, dt.datetime):
        expires = expires.date()
    if not isinstance(expires, dt.date):
        raise ValueError(f"{where} ({clause}) expires {expires!r}: give a TOML date (2027-03-01)")
    if not any(k in entry for k in SCOPE_KEYS):
        raise ValueError(
            f"{where} ({clause}) covers the whole clause: give its scope (tests = [...], "
            "params = {family = [...]} and/or match = \"message regex\"), so that any other "
            "failure of the clause still fails")
    tests = _strings(entry["tests"], f"{where} ({clause}) tests") if "tests" in entry else ()
    params: list[tuple[str, tuple[str, ...]]] = []
    if "params" in entry:
        if not isinstance(entry["params"], dict) or not entry["params"]:
            raise ValueError(f"{where} ({clause}) params must be a table: "
                             "params = { family = [\"llava\"] }")
        for key, value in entry["params"].items():
            if isinstance(value, (int, float, bool)):
                value = str(value)
            params.append((key, _strings(value, f"{where} ({clause}) params.{key}")))
    regex = None
    match = entry.get("match")
    if match is not None:
        if not isinstance(match, str) or not match:
            raise ValueError(f"{where} ({clause}) match must be a non-empty regex string")
        try:
            regex = re.compile(match)
        except re.error as exc:
            raise ValueError(f"{where} ({clause}) match is not a valid regex: {exc}") from exc
        loose = _loose_pattern(match, regex)
        if loose:
            raise ValueError(f"{where} ({clause}) match {match!r} {loose}: name the message "
                             "of the failure it waives, so that another failure of the same "
                             "type still fails")
        generic = _template_branch(match, clause)
        if generic:
            raise ValueError(f"{where} ({clause}) match {match!r}: {generic}")
    optional = {}
    for key in OPTIONAL_KEYS:
        if key in entry:
            if not isinstance(entry[key], str) or not entry[key].strip():
                raise ValueError(f"{where} ({clause}) {key} must be a non-empty string")
            optional[key] = entry[key]
    return Waiver(clause, category, str(entry["reason"]), expires, tests=tests,
                  params=tuple(params), match=match, index=index, _regex=regex, **optional)


def _parse_coverage(data, where: str, known: set[str]) -> tuple[dict[str, str], list[str]]:
    allow: dict[str, str] = {}
    problems: list[str] = []
    if not isinstance(data, dict) or set(data) - {"allow_drop"}:
        return {}, [f"{where} [coverage] takes only allow_drop = [{{clause = ..., reason = ...}}]"]
    for n, item in enumerate(data.get("allow_drop", [])):
        if not isinstance(item, dict) or set(item) != {"clause", "reason"} or \
                not str(item.get("reason", "")).strip():
            problems.append(f"{where} [coverage] allow_drop #{n + 1} needs exactly a clause "
                            "and a reason")
        elif item["clause"] not in known:
            problems.append(f"{where} [coverage] allow_drop #{n + 1} names unknown clause "
                            f"{item['clause']!r}")
        else:
            allow[item["clause"]] = str(item["reason"])
    return allow, problems


def load_expectations(backend_name: str, path: str | Path | None, known: set[str]
                      ) -> tuple[Expectations, list[str]]:
    """The backend's expectations, and the problems found (each fails the run)."""
    p = Path(path) if path else bundled_path(backend_name)
    if p is None:
        return Expectations(), []
    if not p.is_file():
        return Expectations(), [f"expectations file {p} does not exist"]
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as exc:
        return Expectations(), [f"expectations file {p} is not valid TOML: {exc}"]
    out = Expectations(path=str(p))
    problems: list[str] = []
    seen: dict[tuple, int] = {}
    for n, entry in enumerate(data.get("waiver", [])):
        where = f"{p.name} waiver #{n + 1}"
        try:
            w = _parse_waiver(entry, where, known, n + 1)
        except ValueError as exc:
            problems.append(str(exc))
            continue
        key = (w.clause, w.tests, w.params, w.match)
        if key in seen:
            problems.append(f"{where} repeats the scope of waiver #{seen[key]} ({w.clause})")
            continue
        seen[key] = n + 1
        if w.expired:
            problems.append(f"{w.label} in {p.name} expired on {w.expires.isoformat()}: fix "
                            f"the backend or renew the waiver ({w.reason})")
        out.waivers.append(w)
    if "coverage" in data:
        out.allow_drop, more = _parse_coverage(data["coverage"], p.name, known)
        problems += more
    unknown_keys = set(data) - {"waiver", "coverage"}
    if unknown_keys:
        problems.append(f"{p.name} has unknown tables {sorted(unknown_keys)}")
    return out, problems
