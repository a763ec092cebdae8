"""Each clause's assertion templates: the literal text of every failure message its tests can
raise, each value in it left as a placeholder (`…`, `'…'` for a `!r` value).

The waiver lint reads them (engine/waivers.py): a waiver's pattern that matches a template whose
values are all placeholders names a check but none of its values, so it also takes the same check
failing on another field, row or value; one that matches two templates takes two different
checks. Read from the clause modules' source (ast, no import: the loader of expectation files
runs before torch is imported), as docs.tests_by_clause reads the clause marks.

What counts as a template: an `assert`'s message; the message of `raise AssertionError(...)`,
`pytest.fail(...)` and the clause helpers that raise one (`fail_each`, `_fail`); a string a
helper returns or appends as a "why" (`return f"..."`, `whys.append(f"...")`) in the clause
package. A message held in a variable first is not seen: the lint misses what it cannot read,
it never refuses on a guess.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

FILL = "\u2026"  # a value the template leaves open
_QUOTED_FILL = f"'{FILL}'"
_WORDS = re.compile(r"[A-Za-z]{2,}")  # a template has words of its own, not only values
_RAISERS = ("AssertionError", "pytest.fail", "fail_each", "_fail", "self._fail")


def _text(node: ast.AST) -> str | None:
    """A message expression's text with its values as placeholders; None when it has no
    literal text of its own (a name, a call)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        parts = []
        for v in node.values:
            if isinstance(v, ast.Constant):
                parts.append(str(v.value))
            else:
                parts.append(_QUOTED_FILL if getattr(v, "conversion", -1) == ord("r") else FILL)
        return "".join(parts)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _text(node.left), _text(node.right)
        if left is None and right is None:
            return None
        return (left or FILL) + (right or FILL)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):  # "..." % values
        left = _text(node.left)
        return None if left is None else left.replace("%r", _QUOTED_FILL).replace("%s", FILL) \
            .replace("%d", FILL)
    return None


def _messages(node: ast.AST) -> list[ast.AST]:
    """The message expressions `node` raises or returns as a failure text."""
    if isinstance(node, ast.Assert):
        return [node.msg] if node.msg is not None else []
    if isinstance(node, ast.Call):
        name = ast.unparse(node.func)
        if name in _RAISERS:
            return list(node.args[:1])
        if name.endswith(".append") and node.args:
            return [node.args[0]]
    if isinstance(node, ast.Return) and node.value is not None:
        return [node.value]
    return []


def _branches(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, ast.IfExp):
        return [*_branches(node.body), *_branches(node.orelse)]
    return [node]


def module_templates(path: Path) -> tuple[str, ...]:
    """The templates of one clause module, in source order, without repeats. A text that is a
    placeholder alone (`f"{why}"`, `f"{a}-{b}"`) is no template: it has no words of its own."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    out: dict[str, None] = {}
    for node in ast.walk(tree):
        for msg in _messages(node):
            for expr in _branches(msg):
                text = _text(expr)
                if text and _WORDS.search(text.replace(FILL, "")):
                    out[text] = None
    return tuple(out)


@functools.cache
def templates_by_clause() -> dict[str, tuple[str, ...]]:
    """Clause ID -> the templates its failures can carry: those of the modules holding its
    tests and of the shared helpers (`_check.py` and the other `_*.py` of the package)."""
    import rlconform.conformance.clauses as pkg

    from .docs import tests_by_clause

    root = Path(pkg.__path__[0])
    shared = [t for p in sorted(root.glob("_*.py")) for t in module_templates(p)]
    by_module = {p.name: module_templates(p) for p in sorted(root.glob("test_*.py"))}
    out = {}
    for clause, tests in tests_by_clause().items():
        modules = sorted({t.split("::", 1)[0] for t in tests})
        found = dict.fromkeys([t for m in modules for t in by_module.get(m, ())] + shared)
        out[clause] = tuple(found)
    return out
