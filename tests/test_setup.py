"""Set-up and speed plumbing: report file modes, parallel copies, the kill-matrix runner, the
nox sessions' system packages and the no-skip rule under CI."""

from __future__ import annotations

import functools
import json
import math
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from _helpers import load_noxfile

from rlconform.reference_impl import dataplane
from rlconform.reference_impl.dataplane import InMemoryDataPlane, copy_tags, gather

ROOT = Path(__file__).resolve().parents[1]


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# -- report files: the umask's mode, written atomically ------------------------------------------
@pytest.fixture
def umask():
    old = os.umask(0o022)
    yield lambda m: os.umask(m)
    os.umask(old)


@pytest.mark.parametrize("mask, want", [(0o022, 0o644), (0o027, 0o640), (0o077, 0o600)])
def test_report_files_get_the_umask_mode(tmp_path, umask, mask, want):
    from rlconform.reports import write_reports
    from rlconform.reports.sample import example_report

    umask(mask)
    paths = write_reports(example_report(), tmp_path)
    assert set(paths) == {"json", "markdown", "html", "junit"}
    for path in paths.values():
        assert _mode(path) == want, f"{path.name}: {oct(_mode(path))}, want {oct(want)}"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in paths.values()), \
        "a temporary file was left behind"


def test_write_text_replaces_atomically_and_keeps_the_mode_rule(tmp_path, umask):
    from rlconform.reports.write import write_text

    target = tmp_path / "kill_matrix.json"
    target.write_text("old")
    os.chmod(target, 0o600)  # an old file's mode does not stick: the new file is a new inode
    inode = target.stat().st_ino
    write_text(target, "new\n")
    assert target.read_text() == "new\n" and target.stat().st_ino != inode
    assert _mode(target) == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["kill_matrix.json"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, umask):
    from rlconform.reports.write import write_text

    target = tmp_path / "report.md"
    target.write_text("old")
    with pytest.raises(TypeError):
        write_text(target, object())  # not text: fails while writing the temporary file
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["report.md"]


# -- parallel copies: exact, bit for bit ------------------------------------------------------------
@pytest.fixture
def parallel(monkeypatch):
    """Force the threaded path on small data, with 3 threads whatever the machine has."""
    monkeypatch.setattr(dataplane, "PARALLEL_MIN_BYTES", 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    yield
    torch.set_num_threads(threads)


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


SPECIAL = [math.nan, -math.nan, math.inf, -math.inf, -0.0, 0.0, 1e-45, -1e-40, 3.5]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64,
                                   torch.int64, torch.int32, torch.uint8, torch.bool])
def test_gather_equals_cat_bit_for_bit(parallel, dtype):
    g = torch.Generator().manual_seed(0)
    sizes = [0, 1, 7, 0, 1000, 3, 4097, 1, 0, 255]
    pieces = []
    for n in sizes:
        x = torch.randn(n, 3, generator=g, dtype=torch.float64) * 100
        if dtype.is_floating_point and n:
            x.view(-1)[: len(SPECIAL)] = torch.tensor(SPECIAL[: x.numel()], dtype=torch.float64)
        pieces.append(x.to(dtype))
    got = gather(pieces)
    want = torch.cat(pieces)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert _bits(got) == _bits(want)
    assert all(got.untyped_storage().data_ptr() != p.untyped_storage().data_ptr()
               for p in pieces if p.numel()), "gather must copy"


def test_gather_falls_back_where_numpy_cannot_copy(parallel):
    base = torch.arange(24, dtype=torch.float32).view(4, 6)
    pieces = [base[:, :3], base[:, 3:]]  # not contiguous
    assert torch.equal(gather(pieces), torch.cat(pieces))
    assert gather([], torch.bfloat16, (3,)).shape == (0, 3)
    mixed = [torch.ones(2), torch.ones(2, dtype=torch.float64)]
    assert gather(mixed).dtype == torch.cat(mixed).dtype
    grad = [torch.ones(3, requires_grad=True), torch.zeros(2)]
    assert torch.equal(gather(grad), torch.cat(grad))
    for bad in ([torch.ones(2), torch.tensor(1.0)], [torch.ones(2, 3), torch.ones(2, 4)]):
        with pytest.raises(RuntimeError):
            gather(bad)  # what torch.cat rejects is rejected, not concatenated as bytes


def test_codec_and_transport_round_trip_exactly_on_the_parallel_path(parallel):
    from rlconform.fixtures.synthetic import realistic_qwen_batch
    from rlconform.reference_impl.codec import ReferenceCodec, WireBatch

    batch = realistic_qwen_batch(12, 16, dtype=torch.bfloat16)
    codec = ReferenceCodec()
    wire = codec.encode(batch)
    decoded = codec.decode(wire)
    assert batch.first_difference(decoded) is None
    # the decoded batch owns its bytes: scribbling on the wire changes nothing
    for col in wire.columns.values():
        (col.values() if col.is_nested else col).fill_(0)
    assert batch.first_difference(decoded) is None
    wire = codec.encode(batch)
    tp = InMemoryDataPlane()
    keys = [f"k{i}" for i in range(len(wire))]
    tp.put("p", keys, wire.columns, wire.tags)
    order = keys[::-1]  # out of put order: the gather path, not the contiguous span
    cols, tags = tp.get("p", order, list(wire.columns))
    back = codec.decode(WireBatch(cols, tags))
    assert back.first_difference(batch.select(list(range(len(keys)))[::-1])) is None


def test_tags_are_copied_per_row_and_share_nothing():
    shared = [1, 2]
    tags = [{"shapes": shared, "x": -0.0}, {"shapes": shared, "nan": math.nan}]
    out = copy_tags(tags)
    assert out[0]["shapes"] == [1, 2] and out[0]["shapes"] is not out[1]["shapes"]
    assert math.copysign(1, out[0]["x"]) == -1 and math.isnan(out[1]["nan"])
    unpicklable = [{"f": lambda: 1}]
    assert copy_tags(unpicklable)[0]["f"] is unpicklable[0]["f"]  # deepcopy keeps functions


# -- the kill matrix ---------------------------------------------------------------------------------
def test_claims_map_every_mutant_to_the_clauses_naming_it_whatever_their_surface():
    from rlconform.conformance import catalogue
    from rlconform.conformance.engine.kill_matrix import claims
    from rlconform.conformance.mutants import load_all

    got = claims()
    assert set(got) == set(load_all())
    for name, ids in got.items():
        assert ids == [c.id for c in catalogue.CLAUSES if name in c.mutants]


def test_mutants_command_prints_each_mutant_as_it_finishes(tmp_path, umask):
    only = ["aliasing_put", "tags_in_storage_order", "fp32_pixels"]
    proc = subprocess.Popen([sys.executable, "-m", "rlconform.conformance.cli", "mutants",
                             "--report-dir", str(tmp_path), "--jobs", "1", "--only", *only],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT)
    lines = []
    for line in proc.stdout:
        lines.append(line.rstrip())
        if line.startswith("[1/3"):
            assert proc.poll() is None, "the first result arrived only when the run was over"
    assert proc.wait(timeout=600) == 0, "\n".join(lines)
    progress = [ln for ln in lines if ln.startswith("[")]
    assert [int(ln[1:].split("/")[0]) for ln in progress] == [1, 2, 3], lines
    assert all("/3 " in ln and "killed" in ln and "s)" in ln for ln in progress), progress
    matrix = json.loads((tmp_path / "mutants" / "kill_matrix.json").read_text())
    assert {r["name"] for r in matrix["mutants"]} == set(only)
    for r in matrix["mutants"]:
        assert r["killed"] and not r["missed"] and set(r["ran"]) == set(r["expected"]), r
    assert _mode(tmp_path / "mutants" / "kill_matrix.json") == 0o644


@pytest.mark.slow
def test_a_mutant_runs_against_claims_on_other_surfaces(tmp_path):
    """image_blind_logprob_fetch breaks the trainer; GEN-LOGPROB-AGREEMENT (a rollout clause)
    claims it too, and must run against it and kill it."""
    from rlconform.conformance.engine.kill_matrix import kill_matrix

    seen = []
    m = kill_matrix(tmp_path, jobs=1, only=["image_blind_logprob_fetch"],
                    on_result=lambda row, done, total, t: seen.append((row["name"], done, total)))
    (row,) = m["mutants"]
    assert seen == [("image_blind_logprob_fetch", 1, 1)]
    assert row["surface"] == "trainer"
    assert "GEN-LOGPROB-AGREEMENT" in row["ran"] and "GEN-LOGPROB-AGREEMENT" in row["failed"]
    assert not row["missed"], row


def test_a_mutant_run_collects_only_the_modules_of_its_claims():
    """A kill-matrix run of a mutant collects the clause modules holding a test of the clauses
    that claim it, every module that does, and none other; --full (no claims) the package."""
    from rlconform.conformance.catalogue.docs import tests_by_clause
    from rlconform.conformance.engine.mutant_worker import clause_modules

    tests = tests_by_clause()
    for ids in (["DP-TAGS"], ["DP-TAGS", "TRAIN-RATIO-ONE"], ["RANK-DP-PARITY"]):
        want = {t.split("::")[0] for i in ids for t in tests[i]}
        assert clause_modules(ids) == want and want, ids
    assert clause_modules(None) is None


def test_the_rank_clauses_share_one_xdist_worker_and_go_first():
    """Under --dist loadgroup the tests of test_ranks.py's module-scoped rank_runs (rollouts,
    rank processes, the steps they read) form one xdist group, collected first; others do not.
    Collection only."""
    from rlconform.conformance.engine.runner import pytest_args

    ids: list[str] = []

    class AsAWorker:
        def pytest_configure(self, config):
            config.option.loadgroup = True  # what xdist sets in each worker

        @pytest.hookimpl(trylast=True)
        def pytest_collection_modifyitems(self, items):
            ids.extend(i.nodeid for i in items)

    pytest.main(pytest_args("reference", ["--no-report", "--co", "-q", "-k",
                                          "one_row_roundtrip or rank"], None),
                plugins=[AsAWorker()])
    grouped = [i for i in ids if i.endswith("@rlconform-ranks")]
    assert any("test_ranks_step_equals_world_1" in i for i in grouped), ids
    assert any("test_a_rank_killed_mid_step" in i for i in grouped), ids
    assert all("test_ranks.py" in i for i in grouped), grouped
    assert any("test_codec" in i for i in ids), ids
    assert ids[:len(grouped)] == grouped, ids


def test_report_ids_drop_every_xdist_group_of_the_plugin():
    from rlconform.conformance.engine.items import plain_nodeid

    for group in ("rlconform-device-0", "rlconform-ranks"):
        assert plain_nodeid(f"a/clauses/test_ranks.py::test_x[q-2]@{group}") == \
            "test_ranks.py::test_x[q-2]"


@pytest.mark.slow
def test_write_bytecode_writes_where_the_environment_says_not_to(tmp_path):
    """nox installs the main job's packages without compiling them, then write_bytecode
    compiles what the suite imports, also under PYTHONDONTWRITEBYTECODE (set on some boxes)."""
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", PYTHONPYCACHEPREFIX=str(tmp_path))
    code = "from rlconform.conformance.engine.mutant_worker import write_bytecode; print(write_bytecode())"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    written = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.pyc")}
    for module in ("torch/__init__", "transformers/models/qwen2_vl/modeling_qwen2_vl",
                   "hypothesis/core", "conformance/engine/plugin", "reference_impl/ranks"):
        assert any(f"/{module}." in "/" + w for w in written), (module, len(written))


# -- nox: Debian packages the tests need ----------------------------------------------------------
class _Session:
    def __init__(self):
        self.ran, self.logs, self.warnings = [], [], []

    def run(self, *args, **kw):
        self.ran.append(args)

    def log(self, msg):
        self.logs.append(msg)

    def warn(self, msg):
        self.warnings.append(msg)


@pytest.fixture
def noxfile(monkeypatch):
    pytest.importorskip("nox")
    mod = load_noxfile()
    monkeypatch.setattr(mod, "DEBIAN", {
        "present-pkg": (lambda: True, "already here"),
        "missing-pkg": (lambda: False, "the widget test")})
    return mod


def test_nox_installs_missing_debian_packages_as_root(noxfile, monkeypatch):
    monkeypatch.setattr(noxfile.os, "geteuid", lambda: 0)
    monkeypatch.setattr(noxfile.shutil, "which", lambda name: f"/usr/bin/{name}")
    s = _Session()
    noxfile._debian(s, ("present-pkg", "missing-pkg"))
    assert s.ran == [("/usr/bin/apt-get", "update", "-qq"),
                     ("/usr/bin/apt-get", "install", "-y", "-qq", "-o",
                      "APT::Keep-Downloaded-Packages=false", "missing-pkg")]
    assert "missing-pkg" in s.logs[0] and "the widget test" in s.logs[0]


@pytest.mark.parametrize("euid, apt", [(1000, "/usr/bin/apt-get"), (0, None)])
def test_nox_says_what_it_cannot_install(noxfile, monkeypatch, euid, apt):
    monkeypatch.setattr(noxfile.os, "geteuid", lambda: euid)
    monkeypatch.setattr(noxfile.shutil, "which", lambda name: apt)
    s = _Session()
    noxfile._debian(s, ("present-pkg", "missing-pkg"))
    assert not s.ran and "missing-pkg" in s.warnings[0] and "present-pkg" not in s.warnings[0]


def test_mooncake_requirement_brings_libibverbs(noxfile):
    assert noxfile._debian_for(("ray", "mooncake-transfer-engine-non-cuda")) == ("libibverbs1",)


# -- CI: nothing may skip ----------------------------------------------------------------------------
def test_a_skip_fails_the_run_under_ci_only(tmp_path):
    (tmp_path / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    (tmp_path / "test_x.py").write_text(textwrap.dedent("""
        import pytest
        def test_ok():
            pass
        def test_needs_a_browser():
            pytest.skip("no Chromium here")
    """))
    (tmp_path / "test_y.py").write_text(textwrap.dedent("""
        import pytest
        pytest.skip("no checkout of the library", allow_module_level=True)
    """))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
           str(tmp_path)]
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    local = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path)
    assert local.returncode == 0, local.stdout
    ci = subprocess.run(cmd, capture_output=True, text=True, env={**env, "CI": "true"},
                        cwd=tmp_path)
    assert ci.returncode == 1, ci.stdout
    assert "CI is set: 2 skipped tests fail the run" in ci.stdout
    assert "no Chromium here" in ci.stdout and "no checkout of the library" in ci.stdout


# -- the data-plane bench: it runs, and it prints the ratios the targets read ---------------------
@functools.cache
def _load_bench():
    import importlib.util

    spec = importlib.util.spec_from_file_location("rlconform_bench",
                                                  ROOT / "bench" / "bench_dataplane.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


SMALL = ["--allow-small", "--samples", "6", "--patches", "16", "--repeat", "1"]


def test_bench_copies_give_the_codec_and_in_memory_targets(tmp_path, capsys):
    bench = _load_bench()
    out = tmp_path / "bench.json"
    assert bench.main(["--only", "copies", *SMALL, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [(t["target"], t["operation"]) for t in doc["targets"]] == [
        ("codec", "encode+decode"), ("transport", "put+get")]
    assert all(t["ratio_per_copy"] > 0 for t in doc["targets"])
    assert doc["round_trip_failures"] == {}
    text = capsys.readouterr().out
    assert "ratio/copy" in text and "target codec" in text and "target transport" in text


class _Events(list):
    def wrap(self, obj, name: str, label: str):
        fn = getattr(obj, name)

        def wrapped(*a, **kw):
            self.append(label)
            return fn(*a, **kw)

        setattr(obj, name, wrapped)


def test_bench_times_the_library_while_the_adapter_transport_is_open(monkeypatch, capsys):
    """`--backend NAME` for a bundled real transport: our adapter's put/get and the library's
    own on the same columns, all before the adapter's transport is closed and its session
    left; an overhead verdict for put and get each."""
    import contextlib

    import rlconform.conformance.backend as backend_mod

    bench = _load_bench()
    events = _Events()
    real = backend_mod.load_backend("reference")

    class Library:  # the "library": an in-memory data plane of its own
        def __init__(self, wire):
            self.dp, self.wire = InMemoryDataPlane(), wire

        def put(self, keys):
            events.append("library put")
            self.dp.put("lib", keys, self.wire.columns, self.wire.tags)

        def get(self, keys, fields):
            events.append("library get")
            return self.dp.get("lib", keys, fields)

        def clear(self, keys):
            self.dp.clear("lib")

    def transport():
        tr = InMemoryDataPlane()
        events.wrap(tr, "put", "adapter put")
        events.wrap(tr, "close", "adapter close")
        return tr

    @contextlib.contextmanager
    def session():
        events.append("session enter")
        yield
        events.append("session exit")

    fake = backend_mod.Backend.from_reference("fake-real", transport=transport, session=session)
    assert fake.provides("transport") and real.provides("transport")
    monkeypatch.setattr(backend_mod, "load_backend", lambda name: fake)
    monkeypatch.setitem(bench.LIBRARIES, "fake-real", Library)
    assert bench.main(["--only", "copies", *SMALL, "--backend", "fake-real"]) == 0
    assert events[0] == "session enter" and events[-2:] == ["adapter close", "session exit"]
    assert events.count("adapter close") == 1
    assert "library put" in events and "library get" in events
    text = capsys.readouterr().out
    for op in ("put", "get"):
        for side in ("adapter", "library"):
            assert f"{op} [fake-real, {side}]" in text
        assert f"target adapter   {op} [fake-real]" in text


@pytest.mark.slow
def test_bench_grpo_step_compares_data_plane_and_in_memory(tmp_path, capsys):
    bench = _load_bench()
    out = tmp_path / "grpo.json"
    assert bench.main(["--only", "grpo", "--device", "cpu", "--grpo-families", "qwen2_vl",
                       "--grpo-rows", "4", "--grpo-repeat", "1", "--grpo-warmup", "0",
                       "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["grpo"]
    assert row["bitwise_equal_weights"] and row["ratio"] > 0 and row["need"] == 1.0
    assert {"transport put", "transport get", "codec encode"} <= set(
        row["breakdown_s"]["data plane"])
    assert "target grpo" in capsys.readouterr().out
