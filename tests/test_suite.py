"""The suite's own tests: the reference passes, every mutant dies, waivers and skips count.

Each run goes through the real entry point (`rlconform run`, a pytest session with the plugin)
in a subprocess, so what is tested is what a backend author runs.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rlconform.conformance import catalogue
from rlconform.conformance.catalogue.docs import tests_by_clause as clause_tests
from rlconform.conformance.mutants import load_all

if sys.version_info < (3, 11):  # pragma: no cover - hypothesis brings the backport
    from exceptiongroup import ExceptionGroup

ROOT = Path(__file__).resolve().parents[1]


def run_suite(tmp_path: Path, backend: str, *extra: str, env: dict | None = None,
              partial_ok: bool = True):
    """Run the clause suite; returns (exit code, report dict or None, output). `partial_ok`:
    the run is told a partial run is intended (--partial-ok): most tests here select a few
    clauses (--surfaces, -k), and what they check is the verdict of those, which a partial
    run's own exit status would otherwise hide (tests/test_cells.py checks that one)."""
    out_dir = tmp_path / f"run{len(list(tmp_path.glob('run*')))}"
    cmd = [sys.executable, "-m", "rlconform.conformance.cli", "run", "--backend", backend,
           "--workers", "0", "--report-dir", str(out_dir), "-q",
           *(["--partial-ok"] if partial_ok else []), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **(env or {})}, timeout=900)
    found = sorted(out_dir.glob("*/report.json"))
    report = json.loads(found[0].read_text()) if found else None
    return proc.returncode, report, proc.stdout + proc.stderr


def statuses(report: dict) -> dict[str, str]:
    return {c["id"]: c["status"] for c in report["clauses"]}


# -- the catalogue is consistent -----------------------------------------------------------
def test_every_clause_has_tests_a_defect_and_mutants():
    tests = clause_tests()
    mutants = load_all()
    for c in catalogue.CLAUSES:
        assert tests.get(c.id), f"clause {c.id} has no test"
        assert c.defect.strip(), f"clause {c.id} names no defect"
        assert c.must.strip().endswith("."), f"clause {c.id}'s MUST statement is not a sentence"
        assert c.mutants, f"clause {c.id} names no mutant it must kill"
        unknown = [m for m in c.mutants if m not in mutants]
        assert not unknown, f"clause {c.id} names unknown mutants {unknown}"
    named = {m for c in catalogue.CLAUSES for m in c.mutants}
    orphans = sorted(set(mutants) - named)
    assert not orphans, f"mutants no clause claims to kill: {orphans}"


def test_tests_name_only_known_clauses():
    unknown = sorted(set(clause_tests()) - set(catalogue.BY_ID))
    assert not unknown, f"tests tied to clauses missing from the catalogue: {unknown}"


# -- reference and mutants -----------------------------------------------------------------
@pytest.mark.slow
def test_reference_passes_every_clause_and_every_mutant_dies(tmp_path):
    """The main job as `nox -s conformance` runs it: the reference passes every clause, with the
    kill matrix beside the run (`--with-kill-matrix`): every mutant killed by a clause that
    claims it, every clause kills one, and the report carries the matrix."""
    code, report, out = run_suite(tmp_path, "reference", "--profile", "ci",
                                  "--with-kill-matrix", partial_ok=False)
    assert report is not None, out[-3000:]
    bad = {k: v for k, v in statuses(report).items() if v != "passed"}
    assert not bad, f"reference clauses not passing: {bad}\n{out[-3000:]}"
    assert not report["problems"], report["problems"]
    assert code == 0, out[-3000:]
    assert {c.id for c in catalogue.CLAUSES} == set(statuses(report)), "clauses missing"
    for f in ("report.json", "report.md", "report.html", "junit.xml"):
        assert (tmp_path / "run0" / "reference" / f).stat().st_size > 0, f"{f} not written"
    m = report["kill_matrix"]
    assert m is not None and json.loads(
        (tmp_path / "run0" / "mutants" / "kill_matrix.json").read_text()) == m
    assert {r["name"] for r in m["mutants"]} == set(load_all())
    survivors = {r["name"]: r.get("error", "") for r in m["mutants"] if not r["killed"]}
    assert not survivors, f"mutants not killed by a clause that names them: {survivors}"
    assert not m["clauses_without_kill"], \
        f"clauses that kill no mutant: {m['clauses_without_kill']}"
    assert not m["claims_not_killed"], \
        f"clauses that name a mutant but do not kill it: {m['claims_not_killed']}"
    assert "rlconform: kill matrix: " in out, out[-2000:]


@pytest.mark.parametrize("args, why", [
    (["--backend", "mutant:densify_uniform_rows"], "is for the reference backend"),
    (["--backend", "reference", "--shard", "1/2"], "is for a whole run"),
    (["--backend", "reference", "--device", "cuda"], "runs the kill matrix on the CPU"),
])
def test_the_kill_matrix_beside_the_run_is_refused_where_it_does_not_belong(
        tmp_path, capsys, args, why):
    from rlconform.conformance.engine.runner import pytest_args

    code = pytest.main(pytest_args(args[1], [*args[2:], "--report-dir", str(tmp_path),
                                             "--with-kill-matrix", "--co", "-q"], "0"))
    assert code == pytest.ExitCode.USAGE_ERROR
    assert f"--with-kill-matrix {why}" in capsys.readouterr().err


def test_a_kill_matrix_beside_the_run_that_fails_fails_the_run(tmp_path, monkeypatch):
    """A survivor of the kill matrix beside the run is a problem of the run: exit 1, as
    `rlconform mutants` would exit (one mutant, claimed by a clause that cannot kill it)."""
    from rlconform.conformance.engine import kill_matrix

    seen = {}

    def fake(report_dir, jobs=None, grow=None, **kw):
        t0 = time.time()  # more workers once the clause tests are done (none left to run)
        while not grow[0](0.0) and time.time() - t0 < 60:
            time.sleep(0.05)
        seen.update(jobs=jobs, grow=grow[1], grew=grow[0](0.0))
        return {"mutants": [{"name": "m", "killed": False, "failed": [], "expected": ["X"]}],
                "errors": [], "claims_not_killed": [{"clause": "X", "mutant": "m"}],
                "clauses_without_kill": [], "tests_without_kill": [], "duration_s": 0.1}

    monkeypatch.setattr(kill_matrix, "kill_matrix", fake)
    from rlconform.conformance.engine.runner import pytest_args

    code = pytest.main(pytest_args("reference", [
        "--report-dir", str(tmp_path), "--with-kill-matrix", "--partial-ok", "-q",
        "-k", "test_none_and_empty_object_tags_survive"], "0"))
    assert code == 1
    assert seen["grew"] and seen["jobs"] >= 1 and seen["grow"] >= seen["jobs"]
    report = json.loads((tmp_path / "reference" / "report.json").read_text())
    assert any("mutant m survived in the kill matrix" in p and
               "no clause assertion failed in X" in p for p in report["problems"]), \
        report["problems"]


# -- statuses, waivers, skips --------------------------------------------------------------
def _waiver_file(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "waivers.toml"
    p.write_text(textwrap.dedent(body))
    return p


ALIAS_MESSAGE = "values differ at the bit level"


def _clause(report: dict, cid: str) -> dict:
    return next(c for c in report["clauses"] if c["id"] == cid)


def test_a_waiver_waives_the_failure_it_names_and_nothing_else(tmp_path):
    w = _waiver_file(tmp_path, f"""
        [[waiver]]
        clause = "DP-NO-ALIAS"
        category = "backend-bug"
        reason = "put keeps the caller's tensor"
        function = "T.put"
        input = "a batch mutated by the caller after put"
        tests = ["test_no_aliasing"]
        match = "{ALIAS_MESSAGE}"
        expires = 2099-01-01
    """)
    code, report, out = run_suite(tmp_path, "mutant:aliasing_put", "--surfaces", "transport",
                                  "-k", "test_no_aliasing or test_tags_are_not_aliased",
                                  "--expectations", str(w))
    c = _clause(report, "DP-NO-ALIAS")
    # its other test (tags) passes: the clause passed, with a waiver
    assert c["status"] == "passed_with_waivers", out[-2000:]
    (waiver,) = c["waivers"]
    assert (waiver["matched"], waiver["covered"], waiver["function"]) == (1, 1, "T.put")
    assert ALIAS_MESSAGE in waiver["first_failure"]
    outcomes = {t["nodeid"].split("::")[1]: t["outcome"] for t in c["tests"]}
    assert outcomes == {"test_no_aliasing": "waived", "test_tags_are_not_aliased": "passed"}
    assert code == 0, f"a run whose only failure is waived must pass\n{out[-2000:]}"
    # the same waiver with a pattern the failure does not match waives nothing
    w.write_text(w.read_text().replace(ALIAS_MESSAGE, "dtype changed"))
    code, report, out = run_suite(tmp_path, "mutant:aliasing_put", "--surfaces", "transport",
                                  "-k", "test_no_aliasing or test_tags_are_not_aliased",
                                  "--expectations", str(w))
    c = _clause(report, "DP-NO-ALIAS")
    assert c["status"] == "failed" and c["tests"][0]["failure_kind"] == "assertion", c
    assert code != 0


def test_a_waiver_that_no_longer_holds_is_xpass(tmp_path):
    """Per test: a test a waiver names (by parameters) that passes is xpass, so a partial
    upstream fix shows; per waiver: a pattern that matched no failure is xpass."""
    w = _waiver_file(tmp_path, """
        [[waiver]]
        clause = "DP-ROUNDTRIP"
        category = "backend-bug"
        reason = "thought broken on gemma3"
        params = { family = ["gemma3"] }
        expires = 2099-01-01

        [[waiver]]
        clause = "DP-TAGS"
        category = "future"
        reason = "thought broken"
        match = "tags lost"
        expires = 2099-01-01
    """)
    # the two clauses' tests only (test_transport.py holds them)
    code, report, out = run_suite(tmp_path, "reference", "--surfaces", "transport",
                                  "--expectations", str(w), "-k", "test_transport.py")
    rt, tags = _clause(report, "DP-ROUNDTRIP"), _clause(report, "DP-TAGS")
    assert rt["status"] == "xpass" and tags["status"] == "xpass", (rt["message"], tags["message"])
    xpassed = [t for t in rt["tests"] if t["outcome"] == "xpass"]
    assert xpassed and all(t["params"]["family"] == "gemma3" for t in xpassed)
    assert all(t["outcome"] == "passed" for t in rt["tests"] if t not in xpassed)
    assert tags["waivers"][0]["unused"] and "matched no failure" in tags["message"]
    assert code != 0


@pytest.mark.parametrize("body, problem", [
    ('clause = "DP-TAGS"\ncategory = "future"\nreason = "r"\nmatch = "qqq"\n'
     'expires = 2001-01-01', "expired"),
    ('clause = "NOPE-1"\ncategory = "future"\nreason = "r"\nmatch = "qqq"\n'
     'expires = 2099-01-01', "NOPE-1"),
    ('clause = "DP-TAGS"\ncategory = "meh"\nreason = "r"\nmatch = "qqq"\n'
     'expires = 2099-01-01', "category"),
    ('clause = "DP-TAGS"\ncategory = "future"\nreason = "r"\nexpires = 2099-01-01',
     "covers the whole clause"),
    ('clause = "DP-TAGS"\ncategory = "future"\nreason = "r"\nmatch = "("\n'
     'expires = 2099-01-01', "not a valid regex"),
    ('clause = "DP-TAGS"\ncategory = "future"\nreason = "r"\nfamilies = ["x"]\n'
     'expires = 2099-01-01', "params = { family"),
    # the lint: a branch that is only an exception type, a pattern that matches any text
    ('clause = "DP-TAGS"\ncategory = "future"\nreason = "r"\n'
     'match = "tags differ|TypeError"\nexpires = 2099-01-01',
     "has a branch that is only an exception type (TypeError)"),
    ('clause = "DP-TAGS"\ncategory = "future"\nreason = "r"\nmatch = "tags|"\n'
     'expires = 2099-01-01', "matches any text"),
    # the clause's own wording: a branch that matches two of its checks, or one of its messages
    # whatever the values (verl's `tag` under META-DP-SHARD hid a shard that zeroed lengths)
    ('clause = "META-DP-SHARD"\ncategory = "future"\nreason = "r"\nmatch = "13 % 8|tag"\n'
     'expires = 2099-01-01', "its branch 'tag' matches"),
    ('clause = "DP-LAYOUT-CONFLICT"\ncategory = "future"\nreason = "r"\n'
     'match = "was accepted"\nexpires = 2099-01-01', "different checks of the clause"),
    ('clause = "BATCH-ALGEBRA"\ncategory = "future"\nreason = "r"\n'
     'match = "is shared with the result"\nexpires = 2099-01-01',
     "matches the clause's own message \"\u2026: row \u2026 of '\u2026' is shared with the result"),
    ('clause = "BATCH-ALGEBRA"\ncategory = "future"\nreason = "r"\n'
     'match = "of \'.*\' is shared"\nexpires = 2099-01-01', "whatever its values"),
])
def test_bad_waivers_are_refused_with_their_reason(tmp_path, body, problem):
    from rlconform.conformance.engine.waivers import load_expectations

    w = _waiver_file(tmp_path, "[[waiver]]\n" + body + "\n")
    _, problems = load_expectations("reference", w, set(catalogue.BY_ID))
    assert any(problem in p for p in problems), problems


def test_a_waiver_that_names_the_failing_value_passes_the_lint(tmp_path):
    """The narrowed forms of the refused patterns above load without a problem: the lint asks
    for a value of the check (a field, a layout), not for a longer pattern."""
    from rlconform.conformance.engine.waivers import load_expectations

    w = _waiver_file(tmp_path, "".join(
        f'[[waiver]]\nclause = "{c}"\ncategory = "future"\nreason = "r"\nmatch = "{m}"\n'
        'expires = 2099-01-01\n\n' for c, m in [
            ("BATCH-ALGEBRA", "row \\\\d+ of 'mm_train_inputs' is shared with the result"),
            ("DP-LAYOUT-CONFLICT", "in another layout \\\\(dense_then_jagged\\\\) was accepted"),
            ("META-DP-SHARD", "concatenating the shards \\\\(a DP collect\\\\) lost or changed tags"),
        ]))
    exp, problems = load_expectations("reference", w, set(catalogue.BY_ID))
    assert problems == [] and len(exp.waivers) == 3


def test_assertion_templates_keep_the_words_and_open_the_values(tmp_path):
    """What the lint compares against: each message's literal words, a `!r` value as `'…'`,
    any other value as `…`; both arms of a conditional message; no text of values alone."""
    from rlconform.conformance.catalogue.templates import module_templates

    src = tmp_path / "test_x.py"
    src.write_text(
        "def test_x(a, b, whys):\n"
        "    assert a, f'field {a!r} is missing; rows {b} have media'\n"
        "    assert b, 'lost' if a else f'{a} gained keys'\n"
        "    assert a, 'row ' + str(b) + ' differs'\n"
        "    assert b, f'{a}-{b}'\n"
        "    whys.append(f'tags[{a}] came back as list')\n")
    assert module_templates(src) == (
        "field '\u2026' is missing; rows \u2026 have media", "lost", "\u2026 gained keys",
        "row \u2026 differs", "tags[\u2026] came back as list")


def test_a_bad_waiver_fails_the_run(tmp_path):
    """Each refusal above is a problem of the run: it is in the report and the run exits 1
    (one case end to end; the rest are the same path)."""
    w = _waiver_file(tmp_path, '[[waiver]]\nclause = "DP-TAGS"\ncategory = "future"\n'
                     'reason = "r"\nmatch = "tags differ|TypeError"\nexpires = 2099-01-01\n')
    code, report, out = run_suite(tmp_path, "reference", "--surfaces", "meta",
                                  "--expectations", str(w), "-k", "test_dp_shards")
    assert code != 0, out[-2000:]
    assert any("has a branch that is only an exception type (TypeError)" in p
               for p in report["problems"]), report["problems"]


TWO_DEFECTS_BACKEND = '''
import torch
from rlconform.conformance.backend import Backend
from rlconform.reference_impl.dataplane import InMemoryDataPlane

class TwoDefects(InMemoryDataPlane):
    """Refuses one-row puts (defect A) and flips a value of two-row gets (defect B)."""

    def put(self, partition, keys, columns, tags=None):
        if len(keys) == 1:
            raise RuntimeError("defect A: refuses a one-row put")
        return super().put(partition, keys, columns, tags)

    def get(self, partition, keys, select_fields):
        out = super().get(partition, keys, select_fields)
        cols = out[0] if isinstance(out, tuple) else out
        if len(keys) == 2 and "input_ids" in cols:
            c = cols["input_ids"]
            if c.is_nested:
                rows = [r.clone() for r in c.unbind()]
                if rows[0].numel():
                    rows[0].view(-1)[0] += 1
                cols["input_ids"] = torch.nested.nested_tensor(rows, layout=torch.jagged)
            else:
                c = c.clone()
                c.view(-1)[0] += 1
                cols["input_ids"] = c
        return out

backend = Backend(name="two-defects", transport=TwoDefects, capabilities={"partitions"})
'''


def test_a_waived_example_does_not_stop_the_search(tmp_path):
    """A property test keeps exploring after an example a waiver matches: the other defect of
    the same clause is still found (and with both waived, the clause is waived)."""
    (tmp_path / "two_defects.py").write_text(TWO_DEFECTS_BACKEND)
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    w = _waiver_file(tmp_path, """
        [[waiver]]
        clause = "DP-ROUNDTRIP"
        category = "backend-bug"
        reason = "one-row puts refused"
        tests = ["test_property_columns_roundtrip"]
        match = "defect A"
        expires = 2099-01-01
    """)
    args = ("--surfaces", "transport", "-k", "test_property_columns_roundtrip", "--profile",
            "ci", "--expectations", str(w))
    code, report, out = run_suite(tmp_path, "two_defects:backend", *args, env=env)
    (t,) = _clause(report, "DP-ROUNDTRIP")["tests"]
    assert t["outcome"] == "failed" and "defect A" not in t["message"], t
    assert "input_ids" in t["message"], t["message"]
    w.write_text(w.read_text() + textwrap.dedent("""
        [[waiver]]
        clause = "DP-ROUNDTRIP"
        category = "backend-bug"
        reason = "two-row gets corrupted"
        tests = ["test_property_columns_roundtrip"]
        match = "input_ids"
        expires = 2099-01-01
    """))
    code, report, out = run_suite(tmp_path, "two_defects:backend", *args, env=env)
    c = _clause(report, "DP-ROUNDTRIP")
    assert c["tests"][0]["outcome"] == "waived", c
    assert sorted(w["matched"] for w in c["waivers"]) == [1, 1], c["waivers"]


UNIMPLEMENTED_BACKEND = '''
from rlconform.conformance.backend import Backend

class Ops:
    def __getattr__(self, name):
        raise NotImplementedError(f"BatchOps.{name} is not wrapped")

backend = Backend(name="half-done", batch_ops=Ops, capabilities={"truncation"})
'''


def test_a_declared_surface_that_is_not_implemented_is_a_run_error(tmp_path):
    (tmp_path / "half_done.py").write_text(UNIMPLEMENTED_BACKEND)
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    code, report, out = run_suite(tmp_path, "half_done:backend", "--surfaces", "batch_ops",
                                  "-k", "truncat", env=env)
    assert code != 0
    problems = [p for p in report["problems"] if "NotImplementedError" in p]
    assert problems and "leave the surface out" in problems[0].lower()
    assert "notes=" in problems[0]


SKIPPING_BACKEND = '''
import pytest
from rlconform.conformance.backend import Backend
from rlconform.reference_impl.dataplane import InMemoryDataPlane

def _transport():
    pytest.skip("storage not reachable")

backend = Backend(name="skipper", transport=_transport, capabilities={"partitions"})
transport_only = Backend(name="transport-only", transport=InMemoryDataPlane,
                         capabilities={"partitions"})
'''


def test_skip_of_a_declared_surface_fails_and_undeclared_is_not_applicable(tmp_path):
    (tmp_path / "skipper_backend.py").write_text(SKIPPING_BACKEND)
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    code, report, out = run_suite(tmp_path, "skipper_backend:backend", "--surfaces",
                                  "transport,codec", env=env)
    st = statuses(report)
    assert st["DP-TAGS"] == "skipped", st
    assert st["WIRE-ROUNDTRIP"] == "not_applicable", st
    assert code != 0, "a skipped declared clause must fail the run"
    code, report, out = run_suite(tmp_path, "skipper_backend:transport_only", "--surfaces",
                                  "transport,codec", env=env)
    st = statuses(report)
    assert st["DP-TAGS"] == "passed" and st["WIRE-JAGGED"] == "not_applicable", st
    assert code == 0, out[-2000:]


def test_out_of_tree_example_backend(tmp_path):
    env = {"PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    code, report, out = run_suite(tmp_path, "examples.bytes_transport:backend", env=env)
    assert code == 0, out[-3000:]
    st = statuses(report)
    assert st["DP-ROUNDTRIP"] == "passed" and st["WIRE-ROUNDTRIP"] == "not_applicable"


def test_unknown_backend_lists_the_known_ones(tmp_path):
    code, report, out = run_suite(tmp_path, "no-such-backend")
    assert code != 0 and report is None
    assert "reference" in out and "mutant:" in out, out[-2000:]


def test_cli_lists_backends_and_clauses():
    run = lambda *a: subprocess.run([sys.executable, "-m", "rlconform.conformance.cli", *a],  # noqa: E731
                                    capture_output=True, text=True, timeout=120)
    out = run("backends")
    assert out.returncode == 0 and "reference" in out.stdout
    assert "transport" in out.stdout
    out = run("clauses")
    assert out.returncode == 0
    for c in catalogue.CLAUSES:
        assert f"`{c.id}`" in out.stdout, f"{c.id} missing from `rlconform clauses`"


def test_generated_clause_table_is_current():
    from rlconform.conformance.catalogue.docs import clause_table

    doc = ROOT / "docs" / "clauses.md"
    assert doc.read_text() == clause_table(), \
        "docs/clauses.md is stale: run `rlconform clauses > docs/clauses.md`"


def test_hypothesis_failure_is_reported_and_replays(tmp_path):
    # a drawn failure (explicit examples fail without a blob): a test with no explicit examples
    code, report, out = run_suite(tmp_path, "mutant:rows_grouped_by_put", "--surfaces",
                                  "transport", "-k", "test_property_get_in_any_order",
                                  "--profile", "ci")
    assert code != 0
    failures = [t for c in report["clauses"] for t in c["tests"] if t["hypothesis"]]
    assert failures, "the hypothesis failure's example and blob are not in the report"
    h = failures[0]["hypothesis"]
    assert "data=" in h["example"] and ":" in h["blob"], h
    again = [sys.executable, "-m", "pytest", "-p", "rlconform.conformance.engine.plugin", "--pyargs",
             "rlconform.conformance.clauses", "--no-report", "-p", "no:cacheprovider", "-q",
             "-k", "test_transport_untrusted and test_property_get_in_any_order",
             "--replay", h["blob"]]
    bad = subprocess.run([*again, "--backend", "mutant:rows_grouped_by_put"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert bad.returncode != 0 and "Failing test case" in bad.stdout, bad.stdout[-2000:]
    fixed = subprocess.run([*again, "--backend", "reference"], capture_output=True, text=True,
                           cwd=ROOT, timeout=300)
    assert "DidNotReproduce" in fixed.stdout, fixed.stdout[-2000:]


FAKE_WANDB = '''
import json, os
_log = os.environ["FAKE_WANDB_LOG"]

def _write(kind, payload):
    with open(_log, "a") as f:
        f.write(json.dumps([kind, payload], default=str) + "\\n")

class Artifact:
    def __init__(self, name, type):
        self.name, self.files = name, []
    def add_file(self, path):
        self.files.append(os.path.basename(path))

class _Run:
    def log(self, data, step=None):
        _write("log", data)
    def log_artifact(self, art):
        _write("artifact", {"name": art.name, "files": art.files})
    def finish(self):
        _write("finish", {"mode": os.environ.get("WANDB_MODE")})

def init(project=None, name=None, config=None):
    _write("init", {"project": project, "backend": (config or {}).get("backend")})
    return _Run()
'''


def test_wandb_only_with_the_flag(tmp_path):
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "wandb.py").write_text(FAKE_WANDB)
    log = tmp_path / "wandb.jsonl"
    env = {"PYTHONPATH": f"{fake}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "FAKE_WANDB_LOG": str(log)}
    code, report, out = run_suite(tmp_path, "reference", "--surfaces", "meta", env=env)
    assert code == 0, out[-2000:]
    assert not log.exists(), "wandb was used without --wandb"
    code, report, out = run_suite(tmp_path, "reference", "--surfaces", "meta", "--wandb",
                                  env=env)
    assert code == 0, out[-2000:]
    events = [json.loads(line) for line in log.read_text().splitlines()]
    kinds = [k for k, _ in events]
    assert kinds[0] == "init" and kinds[-1] == "finish", kinds
    logged = {k: v for kind, data in events if kind == "log" for k, v in data.items()}
    assert logged["summary/passed"] == report["summary"]["passed"]
    artifact = next(d for k, d in events if k == "artifact")
    assert set(artifact["files"]) == {"report.json", "report.md", "report.html", "junit.xml"}
    assert events[-1][1]["mode"] == "offline", "wandb must default to offline"


def test_a_run_shows_determinism_warnings_and_hides_other_user_warnings(tmp_path):
    """A clause run silences libraries' UserWarnings but not PyTorch's determinism warnings
    (a kernel without a deterministic implementation under warn_only says so only there)."""
    (tmp_path / "warns.py").write_text(textwrap.dedent("""
        import warnings, pytest
        @pytest.hookimpl(hookwrapper=True)
        def pytest_runtest_call(item):
            warnings.warn("Flash Attention defaults to a non-deterministic algorithm.")
            warnings.warn("index_add_cuda_ does not have a deterministic implementation")
            warnings.warn("a library's chatter")
            yield
    """))
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    out = subprocess.run(
        [sys.executable, "-m", "rlconform.conformance.cli", "run", "--backend", "reference",
         "--workers", "0", "--report-dir", str(tmp_path / "r"), "-k", "test_no_aliasing",
         "--partial-ok", "-p", "warns"], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "non-deterministic algorithm" in out.stdout, out.stdout[-2000:]
    assert "does not have a deterministic implementation" in out.stdout, out.stdout[-2000:]
    assert "chatter" not in out.stdout, out.stdout[-2000:]


def test_every_capability_gates_a_clause_and_the_readme_table_is_current():
    from rlconform.conformance.backend import CAPABILITIES
    from rlconform.conformance.catalogue.docs import capability_table

    gating = {cap for c in catalogue.CLAUSES for cap in c.capabilities}
    idle = sorted(set(CAPABILITIES) - gating)
    assert not idle, f"capabilities that gate no clause (remove them or gate clauses): {idle}"
    unknown = sorted(gating - set(CAPABILITIES))
    assert not unknown, f"clauses need capabilities no backend can declare: {unknown}"
    # the checkout's reports: an installed rlconform (the nox session's) holds none
    assert capability_table(ROOT / "docs" / "backend-reports") in \
        (ROOT / "README.md").read_text(), "README's capability table is stale: run `nox -s docs`"


def test_a_removed_capability_is_refused_with_the_reason():
    from rlconform.conformance.backend import Backend
    from rlconform.reference_impl.dataplane import InMemoryDataPlane

    with pytest.raises(ValueError, match="dim1_packing: media packed along dim 1"):
        Backend(name="old", transport=InMemoryDataPlane, capabilities={"dim1_packing"})


def test_a_not_implemented_answer_of_the_system_is_a_result_not_a_stub(tmp_path):
    """NotImplementedError raised inside the system under test (here a module outside the
    adapter) is that system's answer to the input: the clause fails (waivable), no run error."""
    (tmp_path / "the_system.py").write_text(
        "def truncate(batch, n):\n    raise NotImplementedError('truncation of packed media')\n")
    (tmp_path / "system_adapter.py").write_text(textwrap.dedent('''
        import the_system
        from rlconform.conformance.backend import Backend
        from rlconform.reference_impl.batch import BatchOps

        class Ops(BatchOps):
            def truncate(self, batch, n):
                return the_system.truncate(batch, n)

        backend = Backend(name="system", batch_ops=Ops, capabilities={"truncation"})
    '''))
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    code, report, out = run_suite(tmp_path, "system_adapter:backend", "--surfaces", "batch_ops",
                                  "-k", "truncat", env=env)
    assert code != 0
    assert not [p for p in report["problems"] if "NotImplementedError" in p], report["problems"]
    failed = [t for c in report["clauses"] for t in c["tests"] if t["outcome"] == "failed"]
    assert failed and any("truncation of packed media" in t["message"] for t in failed)


def test_a_failure_group_is_waived_only_when_every_member_is():
    """hypothesis reports several distinct failures as one exception group: a waiver that
    matches one member must not waive the others."""
    import datetime as dt

    from rlconform.conformance.engine.verdicts import CoveringWaivers
    from rlconform.conformance.engine.waivers import Waiver


    w = Waiver("DP-TAGS", "backend-bug", "r", dt.date(2099, 1, 1), match="defect A", index=1)
    ctx = CoveringWaivers([w])
    group = ExceptionGroup("two", [RuntimeError("defect A"), AssertionError("defect B")])
    assert ctx.find(group) is None
    both = ExceptionGroup("two", [RuntimeError("defect A"), ValueError("defect A again")])
    found = ctx.find(both)
    assert found is not None and [x.index for x, *_ in found] == [1, 1]


def test_a_soft_check_failure_is_sited_at_the_clause_line_that_called_the_shared_check():
    """Several differences from a shared check of `_check.py` (`fail_each` raises each in its
    own frame and gathers them in a group): each failure's check is the clause test's line
    that called the shared check, not the helper's line nor \"outside the clauses\"."""
    import datetime as dt

    import torch

    from rlconform.conformance.engine.verdicts import CLAUSES_DIR, CoveringWaivers
    from rlconform.conformance.engine.waivers import Waiver

    source = textwrap.dedent('''
        from rlconform.conformance.clauses._check import assert_columns_equal

        def a_clause_test(want, got):
            assert_columns_equal(want, got)
    ''')
    ns: dict = {}
    exec(compile(source, str(CLAUSES_DIR / "test_sited.py"), "exec"), ns)
    want = {"a": torch.ones(2), "b": torch.ones(2)}
    with pytest.raises(ExceptionGroup) as info:
        ns["a_clause_test"](want, {"a": torch.zeros(2), "b": torch.zeros(2)})
    ctx = CoveringWaivers([Waiver("DP-TAGS", "backend-bug", "r", dt.date(2099, 1, 1),
                                  match="column '[ab]'", index=1)])
    found = ctx.find(info.value)
    assert found is not None and [site for *_, site in found] == ["test_sited.py:5 AssertionError"] * 2
    ctx.record(found)
    assert ctx.sites == {1: {"test_sited.py:5 AssertionError": 2}}


def test_a_waived_check_hides_none_of_the_checks_after_it(tmp_path):
    """DP-NAMES checks each refused name and call on its own (SoftChecks): a waiver for the
    first one (the empty partition name accepted) leaves the test failing on the others, named
    in its message; a waiver that matches every one of them waives it."""
    test = "test_names_the_contract_refuses_raise_a_clear_error"
    w = _waiver_file(tmp_path, f"""
        [[waiver]]
        clause = "DP-NAMES"
        category = "backend-bug"
        reason = "the empty partition name is accepted"
        function = "T.put"
        input = "put('', ['k'], columns)"
        tests = ["{test}"]
        match = "^AssertionError: put to partition '': accepted; the contract refuses it$"
        expires = 2099-01-01
    """)
    args = ("--surfaces", "transport", "-k", test, "--expectations", str(w))
    code, report, out = run_suite(tmp_path, "mutant:refused_names_accepted", *args)
    c = _clause(report, "DP-NAMES")
    (t,) = c["tests"]
    assert c["status"] == "failed" and t["outcome"] == "failed", out[-2000:]
    assert t["failure_kind"] == "assertion", t
    assert re.match(r"\d+ failures: AssertionError: put to partition '': accepted", t["message"])
    for after in ("put of key '': accepted", "get from partition '': accepted"):
        assert after in t["message"], (after, t["message"][:3000])
    assert code != 0
    w.write_text(w.read_text().replace(
        "^AssertionError: put to partition '': accepted; the contract refuses it$",
        "^AssertionError: ((put to|get from|list of|clear of) partition|(put|get|clear) of "
        "key|put of field) .+: accepted; the contract refuses it$"))
    code, report, out = run_suite(tmp_path, "mutant:refused_names_accepted", *args)
    c = _clause(report, "DP-NAMES")
    assert c["status"] == "waived", out[-2000:]  # its one test, every check of it waived
    assert [t["outcome"] for t in c["tests"]] == ["waived"], c["tests"]
    # the report lists what the waiver took, kind by kind (one check on other names is one
    # kind; each call of the eight is its own)
    (w,) = c["waivers"]
    texts = [m["message"] for m in w["messages"]]
    assert w["distinct_messages"] >= 8 and len(texts) == min(20, w["distinct_messages"]), w
    assert "AssertionError: put of key '': accepted; the contract refuses it" in texts, texts
    key = next(m for m in w["messages"] if m["message"].startswith("AssertionError: put of key"))
    assert key["count"] == key["variants"] > 1, key
    # ... and the checks that raised them: clause lines (not the helpers that raise for them)
    assert w["checks"] and all(re.fullmatch(r"test_\w+\.py:\d+ AssertionError", k["site"])
                               for k in w["checks"]), w["checks"]
    assert sum(k["count"] for k in w["checks"]) >= sum(m["count"] for m in w["messages"])


def test_waived_messages_are_counted_by_kind():
    """Texts alike up to names, hex, numbers and lists are one kind; another check is not."""
    from rlconform.conformance.engine.report_builder import _message_kinds, message_kind

    a = "AssertionError: column 'x' row 1: expected 2.0 (0x40000000), got 1.0 (0x3f800000)"
    b = "AssertionError: column 'y' row 12: expected -3.5e-07 (0xb4bbe5de), got 0.0 (0x0)"
    other = "AssertionError: column 'x' came back dense [16, 512]; it was written jagged"
    assert message_kind(a) == message_kind(b) != message_kind(other)
    # lists of values are one value; an empty list is not; what follows the first line (the
    # store machine's shortest program) is detail
    rows = "AssertionError: field 'p' is missing; rows [0, 1, 3] have media"
    assert message_kind(rows) == message_kind(rows.replace("[0, 1, 3]", "[2]") + "\nprogram")
    assert message_kind(rows) != message_kind(rows.replace("[0, 1, 3]", "[]"))
    # names without quotes (a family and form, a dtype) are values too; plain words are not
    union = "AssertionError: {}: union with shared objects was ok, with equal copies refused"
    assert message_kind(union.format("gemma3-mm_train_inputs")) == \
        message_kind(union.format("llava_next-packed")) != message_kind(union.format("rows"))
    # a text kept to its first 300 characters, cut inside a long name, is of its whole kind
    whole = "AssertionError: get raised ValueError; field 'f' is not stored for keys [] of 'p'"
    cut = "AssertionError: get raised ValueError; field 'f" + "x" * 280
    (kind,) = _message_kinds([{whole: 2, cut: 1}])
    assert kind == {"message": whole, "count": 3, "variants": 2}
    # ... and so is one cut anywhere else: a soft check's joined failures, kept to 300 characters
    part = "qwen2_vl {} after pad_to: model inputs ['pixel_values'], the processor gives ['x', 'y']"
    joined = ["AssertionError: " + "; ".join(part.format(f) for f in forms)
              for forms in (["mm_train_inputs"] * 5, ["multi_modal_inputs"] * 5)]
    kinds = _message_kinds([{t[:300]: 1 for t in joined}, {joined[0][:290]: 1}])
    assert [k["count"] for k in kinds] == [2, 1], kinds  # the one of 290 was not cut: its own
    kinds = _message_kinds([{a: 2, other: 1}, {b: 1}])
    assert kinds == [{"message": a, "count": 3, "variants": 2},
                     {"message": other, "count": 1, "variants": 1}]


def test_field_checks_report_every_difference():
    """assert_columns_equal / assert_batch_equal report each differing field as its own
    failure (one AssertionError per field in an ExceptionGroup), each the clause's own
    assertion; a single difference stays a plain AssertionError."""
    import torch

    from rlconform.conformance.clauses._check import assert_batch_equal, assert_columns_equal
    from rlconform.conformance.engine.verdicts import failure_kind
    from rlconform.reference_impl.batch import Batch

    want = {"a": torch.zeros(2), "b": torch.ones(2), "c": torch.ones(1)}
    got = {"a": torch.zeros(2), "b": torch.tensor([1.0, -0.0]), "d": torch.ones(1)}
    with pytest.raises(ExceptionGroup) as group:
        assert_columns_equal(want, got)
    assert [str(e).split(":")[0] for e in group.value.exceptions] == [
        "columns ['c'] missing from the result", "unexpected columns ['d'] in the result",
        "column 'b'"]
    assert failure_kind(group.value) == "assertion"
    assert all(failure_kind(e) == "assertion" for e in group.value.exceptions)
    with pytest.raises(AssertionError, match="^column 'b': 1 value differs"):
        assert_columns_equal(want, {"a": got["a"], "b": got["b"], "c": want["c"]})
    ids, mask = torch.arange(6).reshape(2, 3), torch.ones(2, 3, dtype=torch.int64)
    bad_ids, bad_mask = ids.clone(), mask.clone()
    bad_ids[1, 2], bad_mask[0, 0] = 9, 0
    lengths = torch.tensor([3, 3])
    with pytest.raises(ExceptionGroup) as group:
        assert_batch_equal(
            Batch({"input_ids": ids, "attention_mask": mask, "input_lengths": lengths}),
            Batch({"input_ids": bad_ids, "attention_mask": bad_mask, "input_lengths": lengths}),
            "step 1")
    assert [str(e).split(":")[:2] for e in group.value.exceptions] == [
        ["step 1", " field 'input_ids'"], ["step 1", " field 'attention_mask'"]]


STORE_AUTHOR_BACKEND = TWO_DEFECTS_BACKEND.replace(
    'backend = Backend(name="two-defects", transport=TwoDefects, capabilities={"partitions"})',
    'backend = Backend.from_reference("two-defects-store", transport=TwoDefects,\n'
    '                                 capabilities={"partitions"})')


def test_a_store_built_from_the_reference_is_scored_on_its_store(tmp_path):
    """`Backend.from_reference(name, transport=...)`: the report records the surfaces the
    reference lent, scores the store alone on the clauses that touch it, and says so at its
    top and in the gate's output; with `--surfaces transport` the store's own verdict is
    partial too (the trainer clauses that move data through it did not run)."""
    (tmp_path / "store_author.py").write_text(STORE_AUTHOR_BACKEND)
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    code, report, out = run_suite(tmp_path, "store_author:backend", "--surfaces", "transport",
                                  "-k", "test_property_columns_roundtrip or test_tags",
                                  env=env)
    assert report is not None, out[-3000:]
    assert report["backend_info"]["lent_surfaces"] == ["codec", "meta", "batch_ops", "trainer",
                                                       "rollout"]
    scores = report["surface_scores"]
    assert scores["implemented"] == ["transport"], scores
    (store,) = scores["surfaces"]
    assert "DP-ROUNDTRIP" in store["clauses"] and "TRAIN-RATIO-ONE" in store["clauses"]
    assert "WIRE-ROUNDTRIP" not in store["clauses"]
    assert store["failed"] >= 1 and store["not_run"] >= 13 and store["lower_bound"]
    assert {"clause": "DP-ROUNDTRIP", "lent": ["codec"]} in store["joint"]
    found = sorted(tmp_path.glob("run*/*/report.md"))
    md = found[0].read_text()
    assert "### Surfaces judged" in md and "| transport | FAIL |" in md, md[:3000]
    gate_out = subprocess.run(
        [sys.executable, "-m", "rlconform.conformance.cli", "gate",
         str(found[0].with_name("report.json"))], capture_output=True, text=True, cwd=ROOT)
    assert "· transport: FAIL" in gate_out.stdout, gate_out.stdout + gate_out.stderr
    assert "not scored (not implemented by the backend" in gate_out.stdout


def test_the_surfaces_a_clause_touches_cover_every_surface_fixture_its_tests_request(tmp_path):
    """catalogue/docs.surfaces_by_clause reads the clause modules without importing them; every
    surface fixture pytest resolves for a clause test (the closure of what it requests) is among
    the surfaces it derives for the test's clauses."""
    from rlconform.conformance.catalogue.docs import surfaces_by_clause
    from rlconform.conformance.engine.items import SURFACE_FIXTURES
    from rlconform.conformance.engine.runner import pytest_args

    (tmp_path / "fixture_dump.py").write_text(textwrap.dedent("""
        import json, os

        def pytest_collection_finish(session):
            out = {it.nodeid: [[i for m in it.iter_markers("clause") for i in m.args],
                               sorted(set(it.fixturenames))] for it in session.items}
            with open(os.environ["FIXTURE_DUMP"], "w") as f:
                json.dump(out, f)
    """))
    dump = tmp_path / "dump.json"
    args = pytest_args("reference", ["--collect-only", "-q", "-p", "fixture_dump",
                                     "--report-dir", str(tmp_path / "out")], None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *args], capture_output=True, text=True, cwd=tmp_path,
        env={**os.environ, "FIXTURE_DUMP": str(dump),
             "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"},
        timeout=600)
    assert dump.is_file(), proc.stdout[-2000:] + proc.stderr[-2000:]
    derived = surfaces_by_clause()
    items = json.loads(dump.read_text())
    assert len(items) > 100
    missing = []
    for nodeid, (ids, fixtures) in items.items():
        need = {s for f in fixtures for s in SURFACE_FIXTURES.get(f, ())}
        for cid in ids:
            if need - set(derived[cid]):
                missing.append(f"{nodeid} ({cid}): {sorted(need - set(derived[cid]))}")
    assert not missing, missing[:10]
    assert set(derived["TRAIN-RATIO-ONE"]) >= {"transport", "codec", "meta", "trainer"}
    assert "trainer" in derived["RANK-DP-PARITY"]  # built in the rank processes: backend.trainer
    # the engine's global-effects test builds no trainer and asks nothing of one
    assert derived["GEN-NO-GLOBAL-EFFECTS"] == ("rollout",)


def test_a_backend_from_the_reference_lends_the_surfaces_it_did_not_replace():
    from rlconform.conformance.backend import Backend
    from rlconform.conformance.backends.reference import backend as reference
    from rlconform.reference_impl.dataplane import InMemoryDataPlane

    store = Backend.from_reference("my-store", transport=InMemoryDataPlane)
    assert store.lent == ("codec", "meta", "batch_ops", "trainer", "rollout")
    assert store.describe()["lent_surfaces"] == list(store.lent)
    assert reference.lent == () and "lent_surfaces" not in reference.describe()
    plain = Backend(name="plain-store", transport=InMemoryDataPlane)
    assert plain.lent == () and plain.surfaces == ("transport",)


def test_a_waiver_is_not_matched_in_the_reproduction_of_a_failure():
    """The store machine ends a failure with its runnable sequence, which repeats earlier steps
    and the messages of the waived ones: a waiver matched there took a new defect for the one it
    names (NeMo-RL's DP-STORE-MODEL waiver of an accepted get took `get raised KeyError`)."""
    import datetime as dt

    from rlconform.conformance.engine.verdicts import CoveringWaivers
    from rlconform.conformance.engine.waivers import Waiver

    w = Waiver("DP-STORE-MODEL", "backend-bug", "r", dt.date(2099, 1, 1),
               match="get was accepted", index=1)
    ctx = CoveringWaivers([w])
    snippet = "\nshortest failing sequence (2 calls), runnable:\n    t.get('p', [], ['f'])" \
              "  # waived: get was accepted; the contract refuses it"
    new = AssertionError("get raised KeyError: 'p%x'" + snippet)
    new.reproduction = snippet
    assert ctx.find(new) is None
    old = AssertionError("get was accepted; the contract refuses it" + snippet)
    old.reproduction = snippet
    assert ctx.find(old) is not None
