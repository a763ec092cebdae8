"""Untrusted input and persistent stores: the contract's validators, the untrusted-input
clauses' mutants (killed by clause assertions), the clean-up of what clause tests write, an
unreachable store, `--backend all`'s exit codes, the author's path (capabilities, progress
lines, notes in the terminal, a closed pipe, requirements in nox, bench loading first) and the
Redis example."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _helpers import load_noxfile

from rlconform.conformance import catalogue
from rlconform.conformance.backend import Backend
from rlconform.reference_impl.dataplane import (
    MAX_NAME_BYTES,
    InMemoryDataPlane,
    check_name,
    check_tags,
)

ROOT = Path(__file__).resolve().parents[1]
NEW_CLAUSES = ("DP-NAMES", "DP-NAME-ISOLATION", "DP-TAG-VALUES", "DP-LAYOUT-CONFLICT",
               "DP-EMPTY", "DP-ORDER", "DP-ARGS-INTACT", "DP-MULTIPROCESS", "DP-CLEAN-SLATE")
STORE_MACHINE = ("DP-STORE-MODEL", "DP-STORE-ATOMIC", "DP-STORE-CLIENTS")


def _cli(*args, env=None, timeout=600, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "rlconform.conformance.cli", *args],
                          capture_output=True, text=True, cwd=cwd, timeout=timeout,
                          env={**os.environ, **(env or {})})


# -- the contract's validators --------------------------------------------------------------------
@pytest.mark.parametrize("name", ["p:a/b.c|d", "__keys__", " x ", "*", "\u00e9", "e\u0301",
                                  "\U0001f642" * (MAX_NAME_BYTES // 4), "a\nb"])
def test_allowed_names_pass_unchanged(name):
    assert check_name("key", name) == name


@pytest.mark.parametrize("name, error, words", [
    ("", ValueError, "empty"), ("a\x00b", ValueError, "NUL"), ("\ud800", ValueError, "surrogate"),
    ("x" * (MAX_NAME_BYTES + 1), ValueError, "bytes"), (3, TypeError, "int"),
    (b"k", TypeError, "bytes"), (None, TypeError, "NoneType")])
def test_refused_names_say_why(name, error, words):
    with pytest.raises(error, match=words) as exc:
        check_name("partition", name)
    assert "partition" in str(exc.value)


def test_tags_the_contract_allows_and_refuses():
    check_tags([{"t": (1, [2.5, None]), 3: {"n": float("nan")}, "b": True}, {}], 2)
    check_tags(None, 5)
    for bad, words in (({"s": {1}}, "set"), ({1.5: 1}, "dict key"), ({True: 1}, "dict key"),
                       ({"i": 2**64}, "int64"), ({"t": torch.ones(1)}, "Tensor"),
                       ({"s": "\ud800"}, "surrogate")):
        with pytest.raises((TypeError, ValueError), match=words) as exc:
            check_tags([{}, bad], 2)
        assert "tags[1]" in str(exc.value), exc.value
    deep: dict = {}
    deep["self"] = deep
    with pytest.raises(ValueError, match="deeper"):
        check_tags([deep], 1)
    with pytest.raises(ValueError, match="1 tags for 2 keys"):
        check_tags([{}], 2)


def test_reference_store_of_no_keys_and_refused_input_changes_nothing():
    dp = InMemoryDataPlane()
    dp.put("p", ["a"], {"x": torch.zeros(1, 2)}, [{"k": (1,)}])
    dp.put("q", [], {"x": torch.zeros(0, 3)}, [])
    assert dp.list("q") == []
    cols, tags = dp.get("p", [], ["x"])
    assert cols["x"].shape == (0, 2) and tags == []
    with pytest.raises(ValueError, match="'x'"):
        dp.put("p", ["b"], {"y": torch.ones(1), "x": torch.zeros(1, 3)})
    assert dp.list("p") == ["a"] and dp.fields("p") == ["x"]
    with pytest.raises(TypeError, match="set"):
        dp.put("p", ["b"], {"x": torch.zeros(1, 2)}, [{"s": {1}}])
    assert dp.list("p") == ["a"]
    assert dp.get("p", ["a"], ["x"])[1] == [{"k": (1,)}]


# -- the mutants: each killed by a clause assertion of the clause that claims it -----------------
def _new_mutants() -> list[str]:
    return sorted({m for cid in (*NEW_CLAUSES, "DP-NO-ALIAS") for m in catalogue.BY_ID[cid].mutants
                   if m not in ("aliasing_put", "aliasing_get")})


def test_every_untrusted_input_clause_has_mutants():
    for cid in NEW_CLAUSES:
        assert len(catalogue.BY_ID[cid].mutants) >= 2, f"{cid} names fewer than two mutants"


@pytest.mark.slow
def test_untrusted_input_mutants_die_by_clause_assertions(tmp_path):
    from rlconform.conformance.engine.kill_matrix import kill_matrix

    names = _new_mutants()
    assert len(names) >= 25
    m = kill_matrix(tmp_path, jobs=2, only=names)
    survivors = [r["name"] for r in m["mutants"] if not r["killed"]]
    assert not survivors and not m["claims_not_killed"] and not m["errors"], m
    for name in names:
        report = json.loads((tmp_path / "mutants" / f"mutant_{name}" / "report.json").read_text())
        for c in report["clauses"]:
            if c["status"] == "failed":
                # the clause's own assertion (several at once arrive as one group)
                bad = [t["message"][:200] for t in c["tests"] if t["outcome"] == "failed"
                       and t["failure_kind"] != "assertion"]
                assert not bad, f"{name} killed by {c['id']} without a clause assertion: {bad}"


# -- clean-up, the end-of-run sweep, an unreachable store ---------------------------------------
SHARED_STORE = '''
import contextlib, json, os
from rlconform.conformance.backend import Backend, StoreUnreachable
from rlconform.reference_impl.dataplane import InMemoryDataPlane

STORE = InMemoryDataPlane()  # one store behind every instance: what a server is


class View:
    def put(self, *a, **k): return STORE.put(*a, **k)
    def get(self, *a, **k): return STORE.get(*a, **k)
    def list(self, *a, **k): return STORE.list(*a, **k)
    def clear(self, *a, **k): return STORE.clear(*a, **k)
    def close(self): pass


class Leaky(View):
    def clear(self, partition, keys=None): pass  # "clears", keeps everything


@contextlib.contextmanager
def session():
    yield
    with open(os.environ["LEFT_FILE"], "w") as f:
        json.dump({p: list(rows) for p, rows in STORE._rows.items() if rows}, f)


@contextlib.contextmanager
def down():
    raise StoreUnreachable("127.0.0.1:1 refused the connection")
    yield


shared = Backend(name="shared", transport=View, capabilities={"partitions"}, session=session)
leaky = Backend(name="leaky", transport=Leaky, capabilities={"partitions"}, session=session)
unreachable = Backend(name="down", transport=View, capabilities={"partitions"}, session=down,
                      notes={"object_columns": "no dict rows in this store"})
'''


@pytest.fixture
def shared_module(tmp_path):
    (tmp_path / "shared_store.py").write_text(SHARED_STORE)
    return {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "LEFT_FILE": str(tmp_path / "left.json")}


def _report(folder: Path) -> dict:
    return json.loads(next(folder.glob("*/report.json")).read_text())


def test_a_run_leaves_a_shared_store_as_it_found_it(tmp_path, shared_module):
    # these tests write partitions and never clear them: the fixture does, even on failure
    select = "test_layout_preserved or test_tags_follow_keys or test_names_the_contract"
    out = _cli("run", "--backend", "shared_store:shared", "--workers", "0", "--report-dir",
               str(tmp_path / "a"), "-q", "--partial-ok", "-k", select, env=shared_module)
    assert out.returncode == 0, out.stdout[-3000:]
    assert json.loads(Path(shared_module["LEFT_FILE"]).read_text()) == {}, \
        "the run left partitions in the store"
    assert _report(tmp_path / "a")["problems"] == []
    out = _cli("run", "--backend", "shared_store:leaky", "--workers", "0", "--report-dir",
               str(tmp_path / "b"), "-q", "--partial-ok", "-k", "test_layout_preserved",
               env=shared_module)
    problems = _report(tmp_path / "b")["problems"]
    assert any("the run left data in the store" in p for p in problems), problems
    assert out.returncode != 0


def test_an_unreachable_store_is_one_run_level_error(tmp_path, shared_module):
    out = _cli("run", "--backend", "shared_store:unreachable", "--workers", "0",
               "--report-dir", str(tmp_path), "-q", "--surfaces", "transport",
               env=shared_module)
    assert out.returncode == 69, out.stdout[-3000:]
    report = _report(tmp_path)
    assert report["problems"][0].startswith("store unreachable: 127.0.0.1:1 refused"), \
        report["problems"]
    assert len(report["problems"]) <= 2, report["problems"]  # + "no clause test ran"
    bad = [c["id"] for c in report["clauses"] if c["status"] in ("failed", "error")]
    assert not bad, f"an unreachable store failed clauses one by one: {bad}"
    assert out.stdout.count("refused the connection") <= 3, out.stdout[-3000:]


def test_fixture_clean_up_clears_even_after_a_failure():
    from rlconform.conformance.engine.fixtures import clear_written, track_writes

    store = InMemoryDataPlane()
    written = track_writes(store)
    with pytest.raises(RuntimeError):
        store.put("a:b", ["k"], {"x": torch.zeros(1)})
        store.put(partition="c", keys=["k"], columns={"x": torch.zeros(1)})
        raise RuntimeError("the test failed")
    assert written == {"a:b", "c"}
    assert clear_written(store, written | {"never-written"}) == []
    for p in ("a:b", "c"):
        assert store.list(p) == []


# -- --backend all ----------------------------------------------------------------------------
@pytest.mark.parametrize("codes, missing, want", [
    ({"a": 0, "b": 0}, [], 0), ({"a": 0, "b": 1}, [], 1), ({"a": 0}, ["b"], 69),
    ({"a": 1}, ["b"], 1), ({"a": 0, "b": 69}, [], 69)])
def test_run_all_exit_code_tells_failed_from_unavailable(monkeypatch, capsys, codes, missing,
                                                         want):
    from rlconform.conformance import backend as backend_mod
    from rlconform.conformance.engine import runner

    def load(name):
        if name in missing:
            raise LookupError(f"cannot import {name}_lib: put a checkout on PYTHONPATH")
        return None

    monkeypatch.setattr(backend_mod, "load_backend", load)
    monkeypatch.setattr(runner.subprocess, "call", lambda cmd: codes[cmd[cmd.index(
        "--backend") + 1]])
    assert runner.run_all(sorted({*codes, *missing}), [], "0") == want
    out = capsys.readouterr().out
    for name in missing:
        assert f"backend {name} not available" in out and f"cannot import {name}_lib" in out
    for name, code in codes.items():
        assert f"{name}: " in out and f"(exit {code})" in out


# -- the author's path --------------------------------------------------------------------------
def test_from_reference_adds_capabilities_and_removes_on_request():
    ref = Backend.from_reference("kept", codec=lambda pixel_dtype=None: None)
    assert {"dp", "batch_algebra", "micro_batching", "multiprocess"} <= ref.capabilities
    mine = Backend.from_reference("mine", transport=InMemoryDataPlane,
                                  capabilities={"partitions"}, without={"micro_batching"})
    assert {"dp", "batch_algebra", "bfloat16", "partitions"} <= mine.capabilities
    assert not {"multiprocess", "object_columns", "micro_batching"} & mine.capabilities
    with pytest.raises(ValueError, match="warp"):
        Backend.from_reference("x", without={"warp"})


def test_progress_lines_and_notes_in_the_terminal(tmp_path, shared_module):
    out = _cli("run", "--backend", "mutant:tags_dropped_on_get", "--workers", "0",
               "--report-dir", str(tmp_path), "-q", "-k",
               "test_tags_follow_keys or test_layout_preserved")
    text = out.stdout
    assert "rlconform: DP-TAGS: test_tags_follow_keys_in_request_order FAILED (1 failed" in text
    # what failed, when it fails (the report comes only at the end of the run)
    line = next(x for x in text.splitlines() if "test_tags_follow_keys_in_request_order FAILED" in x)
    assert re.search(r"so far\): AssertionError: .*tag", line), line
    assert "\nrlconform: DP-LAYOUT done: 4 tests, 0 failed" in text, text[-3000:]
    # the same backend's note on a capability it leaves out, in the terminal as in the report
    from rlconform.conformance.engine.collection import applicability

    sys.path.insert(0, str(Path(shared_module["LEFT_FILE"]).parent))
    try:
        from shared_store import unreachable
    finally:
        sys.path.pop(0)
    assert "no dict rows in this store" in applicability(unreachable,
                                                         catalogue.BY_ID["DP-OBJECT"])


def test_a_closed_pipe_ends_without_a_traceback():
    proc = subprocess.Popen([sys.executable, "-m", "rlconform.conformance.cli", "clauses"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    proc.stdout.readline()
    proc.stdout.close()  # `| head -1`
    err = proc.stderr.read().decode()
    proc.wait(timeout=60)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_bench_loads_the_backend_before_measuring():
    out = subprocess.run([sys.executable, "bench/bench_dataplane.py", "--backend",
                          "no_such_module:backend"], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode != 0
    assert "no_such_module" in out.stdout + out.stderr
    assert "payload:" not in out.stdout, "the bench measured before loading the backend"


def test_nox_takes_an_out_of_tree_backends_requirements(monkeypatch):
    nox_mod = load_noxfile()

    class S:
        posargs = ["--backend", "my_pkg.adapter:backend", "--requirements", "redis,./my_pkg",
                   "--profile", "ci"]

    monkeypatch.setenv("RLCONFORM_REQUIREMENTS", "numpy  /opt/x")
    assert nox_mod._author_requirements(S()) == ["numpy", "/opt/x", "redis", "./my_pkg"]
    assert nox_mod._posargs(S()) == ["--backend", "my_pkg.adapter:backend", "--profile", "ci"]


# -- the Redis example ----------------------------------------------------------------------------
def test_redis_example_passes_and_leaves_the_server_empty(tmp_path):
    if shutil.which("redis-server") is None or importlib_missing("redis"):
        if os.environ.get("CI"):
            raise AssertionError("CI must have redis-server and the redis client (nox -s tests)")
        pytest.skip("needs redis-server (apt-get install redis-server) and `pip install redis`")
    out = subprocess.run(
        [sys.executable, "examples/redis_store.py", "--workers", "0", "--report-dir",
         str(tmp_path), "-q", "--partial-ok", "-k",
         "test_transport_untrusted or test_layout_preserved or test_store_machine"],
        capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "held 0 keys before the run and 0 after it" in out.stdout
    report = _report(tmp_path)
    statuses = {c["id"]: c["status"] for c in report["clauses"]}
    # the store machine found the example's jagged rows of no bytes (a trailing dim 0) unreadable
    assert all(statuses[c] == "passed" for c in (*NEW_CLAUSES, *STORE_MACHINE)), statuses


def importlib_missing(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is None


def test_redis_example_refuses_an_unreachable_server(tmp_path):
    if importlib_missing("redis"):
        if os.environ.get("CI"):
            raise AssertionError("CI must have the redis client (nox -s tests)")
        pytest.skip("needs `pip install redis`")
    out = _cli("run", "--backend", "examples.redis_store:backend", "--workers", "0",
               "--report-dir", str(tmp_path), "-q",
               env={"RLCONFORM_REDIS_URL": "redis://127.0.0.1:1/0"})
    assert out.returncode == 69, out.stdout[-2000:]
    assert "store unreachable: Redis at redis://127.0.0.1:1/0" in out.stdout
