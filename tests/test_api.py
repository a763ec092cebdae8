"""The plugin API as an out-of-tree backend author meets it: help, building on the reference,
report folders that never mix two backends, what a run did not test, required capabilities,
and meta subclasses that survive the algebra."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlconform.conformance.backend import Backend, load_backend
from rlconform.conformance.backends.reference import build
from rlconform.reference_impl.dataplane import InMemoryDataPlane
from rlconform.reference_impl.meta import BatchMeta

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "rlconform.conformance.cli"]


def _cli(*args: str, env: dict | None = None, cwd: Path = ROOT):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, cwd=cwd, timeout=600,
                          env={**os.environ, **(env or {})})


def test_run_help_lists_the_pass_through_options():
    out = _cli("run", "--help")
    assert out.returncode == 0, out.stderr
    for flag in ("--surfaces", "--profile", "--report-dir", "--device", "--dtype", "--require",
                 "--expectations", "--replay", "--wandb"):
        assert flag in out.stdout, f"`rlconform run --help` does not show {flag}"


def test_from_reference_needs_a_name_of_its_own():
    b = Backend.from_reference("my-store", transport=InMemoryDataPlane)
    assert b.name == "my-store" and b.transport is InMemoryDataPlane
    assert b.provides("trainer"), "the other surfaces come from the reference"
    for bad in ("", "reference"):
        with pytest.raises(ValueError, match="own name"):
            Backend.from_reference(bad, transport=InMemoryDataPlane)


NAMESAKE = '''
from rlconform.conformance.backends.reference import build
from rlconform.reference_impl.dataplane import InMemoryDataPlane

class Store(InMemoryDataPlane):
    pass

forgot_name = build(transport=Store)   # the old way: silently named "reference"
'''


def test_a_backend_named_like_the_reference_is_refused(tmp_path, monkeypatch):
    (tmp_path / "namesake_backend.py").write_text(NAMESAKE)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="calls itself 'reference'"):
        load_backend("namesake_backend:forgot_name")
    assert load_backend("reference").source.endswith("reference:backend")


TWINS = '''
from rlconform.conformance.backend import Backend
from rlconform.reference_impl.dataplane import InMemoryDataPlane

one = Backend(name="twin", transport=InMemoryDataPlane, capabilities={"partitions"})
two = Backend(name="twin", transport=InMemoryDataPlane, capabilities={"partitions"})
'''


def test_two_backends_never_share_a_report_folder(tmp_path):
    (tmp_path / "twin_backends.py").write_text(TWINS)
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    common = ["--workers", "0", "--report-dir", str(tmp_path / "out"), "-q", "-k",
              "test_tags_follow_keys"]
    first = _cli("run", "--backend", "twin_backends:one", *common, env=env)
    report = json.loads((tmp_path / "out" / "twin" / "report.json").read_text())
    assert report["backend_info"]["source"] == "twin_backends:one", first.stdout[-2000:]
    again = _cli("run", "--backend", "twin_backends:one", *common, env=env)
    assert "holds the report" not in again.stdout + again.stderr, "a re-run was refused"
    clash = _cli("run", "--backend", "twin_backends:two", *common, env=env)
    assert clash.returncode != 0
    assert "twin_backends:one" in clash.stdout + clash.stderr, clash.stdout[-2000:]
    kept = json.loads((tmp_path / "out" / "twin" / "report.json").read_text())
    assert kept["backend_info"]["source"] == "twin_backends:one", "the folder was overwritten"


def test_reports_and_gate_say_what_was_not_tested(tmp_path):
    env = {"PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = _cli("run", "--backend", "examples.bytes_transport:backend", "--workers", "0",
               "--report-dir", str(tmp_path), "-q", "-k", "test_tags_follow_keys", env=env)
    folder = tmp_path / "bytes-transport"
    report = json.loads((folder / "report.json").read_text())
    untested = {(e["kind"], e["name"]): e for e in report["not_tested"]}
    assert ("surface", "trainer") in untested, report["not_tested"]
    assert "TRAIN-RATIO-ONE" in untested[("surface", "trainer")]["clauses"]
    assert "Not tested" in (folder / "report.md").read_text()
    assert 'id="not-tested"' in (folder / "report.html").read_text()
    gate = _cli("gate", str(folder / "report.json"))
    assert "not tested" in gate.stdout and "surface trainer" in gate.stdout, \
        gate.stdout + out.stdout[-2000:]


def test_notes_say_why_a_surface_is_left_out():
    from rlconform.conformance.engine.report_builder import not_tested

    b = Backend(name="store-only", transport=InMemoryDataPlane, capabilities={"partitions"},
                notes={"trainer": "a data plane trains nothing"})
    entries = {e["name"]: e["why"] for e in not_tested(b)}
    assert entries["trainer"] == "a data plane trains nothing"
    assert "gave no reason" in entries["codec"]
    with pytest.raises(ValueError, match="neither"):
        Backend(name="x", transport=InMemoryDataPlane, notes={"warp_drive": "?"})


def test_a_required_capability_that_is_not_declared_fails_the_run(tmp_path):
    env = {"PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = _cli("run", "--backend", "examples.bytes_transport:backend", "--require", "dp",
               "--workers", "0", "--report-dir", str(tmp_path), "-q", "-k",
               "test_tags_follow_keys", env=env)
    report = json.loads((tmp_path / "bytes-transport" / "report.json").read_text())
    assert any("requires capabilities ['dp']" in p for p in report["problems"]), \
        report["problems"]
    assert out.returncode != 0
    bad = _cli("run", "--require", "warp_drive", "--workers", "0", "--no-report", "-q")
    assert bad.returncode != 0 and "warp_drive" in bad.stdout + bad.stderr


def test_the_nightly_profile_requires_bfloat16():
    from rlconform.conformance.engine.options import PROFILE_REQUIRES

    assert "bfloat16" in PROFILE_REQUIRES["nightly"]


class MyMeta(BatchMeta):
    """A backend's meta: its methods must keep returning MyMeta."""


def test_meta_subclass_survives_the_algebra():
    m = MyMeta("p", ["a", "b", "c"], ["input_ids"], [3, 1, 2], [{}, {}, {}])
    shards, _ = m.shard_for_dp(2)
    produced = [m.subset([0]), m.slice(0, 2), m.subset([1, 0]).subset([0]),
                MyMeta.concat([m.slice(0, 1), m.slice(1, 3)]), m.drop("input_ids"),
                m.with_fields("advantages"), m.stamp_tags({"x": 1}), *shards]
    assert all(type(x) is MyMeta for x in produced), [type(x).__name__ for x in produced]


def test_build_keeps_the_reference_name_only_for_the_reference():
    assert build().name == "reference"
    assert build(name="variant", transport=InMemoryDataPlane).name == "variant"
