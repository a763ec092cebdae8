"""Rank processes and the served reference store (reference_impl/ranks.py, served.py).

The store is checked directly against the transport semantics from this process and from a
child process; the rank group's start, step, failure and stop are checked by PID (every process
it starts must be gone after close, after a failed start, after a dead rank, and when its driver
is SIGKILLed). The last tests run the RANK-* clauses through the CLI: a run in which a rank is
killed still writes its report and leaves no process, and on the real backends the clauses pass
and their mutants die.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import pickle
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import torch
from _exact import nt, same

from rlconform.conformance.backends import _procs
from rlconform.reference_impl.ranks import (
    START_ENV,
    RankFailed,
    RankLaunch,
    dataplane_step_ranks,
    start_launcher,
)
from rlconform.reference_impl.served import ServedDataPlane, StoreClient, StoreUnavailable

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", autouse=True)
def _launcher():
    """The fork server that ranks start from lives as long as this process: start it before
    the tests count their child processes, so that only ranks are counted."""
    start_launcher()


def test_the_launcher_is_not_counted_as_a_sessions_process():
    """The fork server and resource tracker outlive every session of this process: a Ray
    session's cleanup leaves them out (it waited its whole grace for them, then killed them)."""
    from rlconform.reference_impl.ranks import launcher_pids

    pids = launcher_pids()
    assert pids and pids <= _procs.descendants(), (pids, _procs.descendants())
    assert _procs._rank_launcher() == pids


@pytest.fixture
def store():
    owner = ServedDataPlane()
    client = StoreClient(owner.address(), timeout_s=10)
    yield owner, client
    client.close()
    owner.close()


KEYS = [f"uid{i}_g0" for i in range(4)]


# -- the served store ----------------------------------------------------------------------------
def test_client_roundtrips_every_layout(store):
    owner, client = store
    g = torch.Generator().manual_seed(0)
    cols = {"dense": torch.randn(4, 3, 2, generator=g), "one_d": torch.arange(4),
            "bf16": torch.randn(4, 5, generator=g).to(torch.bfloat16),
            "jag": nt([torch.randn(k, generator=g) for k in (3, 0, 5, 0)]),
            "jag2": nt([torch.randn(k, 4, generator=g) for k in (1, 2, 0, 3)]),
            "flags": torch.tensor([True, False, True, True])}
    tags = [{"seq_len": i + 1, "pixel_values": {"shapes": None if i % 2 else [[i + 1, 2]]}}
            for i in range(4)]
    client.put("p", KEYS, cols, tags)
    for reader in (owner, client):  # what a rank wrote, the driver reads, and back
        got, got_tags = reader.get("p", [KEYS[2], KEYS[0]], list(cols))
        for name, col in cols.items():
            want = col[[2, 0]] if not col.is_nested else nt([col.unbind()[2], col.unbind()[0]])
            assert same(want, got[name]), name
        assert got_tags == [tags[2], tags[0]]
    from rlconform.reference_impl.objects import ObjectColumn

    obj = ObjectColumn([{"pixel_values": torch.randn(2, 3, generator=g)}, {}, None,
                        {"image_grid_thw": torch.tensor([[1, 2, 2]])}])
    client.put("p", KEYS, {"multi_modal_inputs": obj})
    got, _ = client.get("p", KEYS[::-1], ["multi_modal_inputs"])
    assert got["multi_modal_inputs"] == ObjectColumn(obj.rows[::-1])
    client.put("p", KEYS[:2], {"adv": torch.ones(2)}, [{"scored": True}] * 2)
    _, merged = owner.get("p", KEYS[:1], ["adv", "dense"])
    assert merged == [{**tags[0], "scored": True}]
    assert sorted(client.list("p")) == sorted(KEYS)
    client.clear("p", KEYS[:1])
    assert sorted(owner.list("p")) == sorted(KEYS[1:])


@pytest.mark.parametrize("rows", [1, 3])
def test_client_puts_every_view_a_caller_holds(store, rows):
    """Views a caller may hold (a storage offset, every other row, transposed, expanded), bf16
    and int64, one row or several, with and without trailing dims: found by DP-STORE-CLIENTS's
    nightly search, where a one-element `x[::2]` kept its stride through `.clone()` and could
    not be viewed as bytes."""
    owner, client = store
    keys = KEYS[:rows]
    for dtype in (torch.bfloat16, torch.int64):
        for trailing in ((), (2, 2)):
            base = torch.arange(2 * rows * math.prod(trailing)).reshape(2 * rows, *trailing)
            base = base.to(dtype)
            views = {"offset": base[1:rows + 1], "strided": base[::2],
                     "expanded": base[:1].expand(rows, *trailing)}
            if trailing:
                views["transposed"] = base[:rows].transpose(1, 2)
            part = f"{dtype}-{len(trailing)}"
            for name, view in views.items():
                client.put(part, keys, {name: view})
                got, _ = owner.get(part, keys, [name])
                assert same(view.contiguous(), got[name]), (dtype, trailing, name)


def test_client_errors_name_what_is_missing(store):
    owner, client = store
    owner.put("p", KEYS[:2], {"adv": torch.zeros(2)})
    with pytest.raises(KeyError, match="nope"):
        client.get("nope", KEYS[:1], ["adv"])
    with pytest.raises(KeyError, match="absent"):
        client.get("p", [KEYS[0], "absent"], ["adv"])
    with pytest.raises(KeyError, match="pixel_values"):
        client.get("p", KEYS[:2], ["adv", "pixel_values"])
    with pytest.raises(TypeError, match="select_fields"):
        client.get("p", KEYS[:2])
    with pytest.raises(TypeError, match="'bad'"):
        client.put("p", KEYS[:1], {"bad": [1.0]})
    with pytest.raises(ValueError, match="'adv'"):
        client.put("p", KEYS[:2], {"adv": torch.zeros(2, 3)})  # another layout


def test_client_never_aliases(store):
    owner, client = store
    col = torch.arange(8.0).reshape(4, 2)
    client.put("p", KEYS, {"c": col})
    col.fill_(-1)
    got, _ = client.get("p", KEYS, ["c"])
    got["c"].fill_(-2)
    again, _ = owner.get("p", KEYS, ["c"])
    assert torch.equal(again["c"], torch.arange(8.0).reshape(4, 2))


def test_closed_store_fails_the_client_fast(store):
    owner, client = store
    owner.put("p", KEYS[:1], {"adv": torch.zeros(1)})
    owner.close()
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable):
        client.get("p", KEYS[:1], ["adv"])
    assert time.monotonic() - t0 < 5
    with pytest.raises(RuntimeError):
        owner.address()


def test_store_is_reached_from_a_child_process(tmp_path):
    owner = ServedDataPlane()
    try:
        owner.put("p", KEYS[:2], {"x": nt([torch.arange(3.0), torch.zeros(0)])},
                  [{"r": 0}, {"r": 1}])
        addr = tmp_path / "address.pkl"
        addr.write_bytes(pickle.dumps(owner.address()))
        child = textwrap.dedent(f"""
            import pickle, torch
            from rlconform.reference_impl.served import StoreClient
            c = StoreClient(pickle.load(open({str(addr)!r}, "rb")))
            cols, tags = c.get("p", {KEYS[:2]!r}, ["x"])
            rows = [r.tolist() for r in cols["x"].unbind()]
            assert rows == [[0.0, 1.0, 2.0], []] and tags == [{{"r": 0}}, {{"r": 1}}], (rows, tags)
            c.put("p", {KEYS[:2]!r}, {{"y": torch.tensor([5.0, 6.0])}})
            c.close()
        """)
        proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        got, _ = owner.get("p", KEYS[:2], ["y"])
        assert got["y"].tolist() == [5.0, 6.0]
    finally:
        owner.close()


# -- the rank group ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_batch():
    """Two reference-rollout samples of the tiny Qwen2-VL (one image, one text). This process
    runs one intra-op thread, as the ranks do: gradients on CPU are bitwise only between
    processes with the same thread count."""
    from rlconform.fixtures.families import build_family
    from rlconform.fixtures.images import make_prompts
    from rlconform.reference_impl.rollout import HFRollout
    from rlconform.reference_impl.trainer import TrainerSettings

    prompts, images, _ = make_prompts(2, [1, 0], seed=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = HFRollout(build_family("qwen2_vl"), TrainerSettings("qwen2_vl"))
    yield engine.generate(prompts, images, 4, seed=0)
    torch.set_num_threads(threads)


def _settings(**kw):
    from rlconform.reference_impl.trainer import TrainerSettings

    return TrainerSettings("qwen2_vl", micro_batch_size=1, **kw)


def _group(transport, world=2, **kw):
    from rlconform.conformance.backends.reference_trainer_rollout import make_trainer
    from rlconform.reference_impl.codec import ReferenceCodec

    return make_trainer(_settings(), transport, ReferenceCodec(),
                        ranks=RankLaunch(world, timeout_s=120, **kw))


def test_group_needs_an_addressable_transport():
    from rlconform.reference_impl.dataplane import InMemoryDataPlane

    before = _procs.descendants()
    with pytest.raises(TypeError, match="address"):
        _group(InMemoryDataPlane())
    assert not _procs.wait_gone(_procs.descendants() - before, 5.0)


def test_failed_start_names_the_rank_and_leaves_no_process():
    before = _procs.descendants()
    store = ServedDataPlane()
    try:
        with pytest.raises(RankFailed) as err:
            _group(store, backend="no-such-backend")
    finally:
        store.close()
    msg = str(err.value)
    assert ("rank 0 (pid" in msg or "rank 1 (pid" in msg) and "no-such-backend" in msg, msg
    assert not _procs.wait_gone(_procs.descendants() - before, 5.0)


@pytest.mark.parametrize("start", ["forkserver", "exec"])
def test_step_with_an_empty_shard_then_a_dead_rank(small_batch, start, monkeypatch):
    """World 2 with one sample (rank 1 holds nothing and still joins the all-reduce), then a
    rank killed mid-step: RankFailed, every PID gone, the group refuses further steps; the
    same for ranks forked from the launcher and ranks started as fresh interpreters."""
    monkeypatch.setenv(START_ENV, start)
    from rlconform.conformance.backends.reference import backend
    from rlconform.reference_impl.codec import ReferenceCodec
    from rlconform.reference_impl.grpo import dataplane_step

    before = _procs.descendants()
    codec = ReferenceCodec()
    store = backend.transport()
    group = _group(store)
    try:
        pids = group.pids
        assert len(pids) == 2 and all(_procs.alive(p) for p in pids)
        one = small_batch.select([0])
        adv = torch.tensor([0.5])
        out = dataplane_step_ranks(one, group, store, codec, partition="a", advantages=adv)
        w1 = dataplane_step(one, backend.trainer(_settings(), store, codec), store, codec,
                            partition="b", advantages=adv)
        reports = out.extra["ranks"].ranks
        assert out.shards == [[0], []]
        assert reports[1].loss == 0.0 and not reports[1].metrics  # no rows, no tokens
        assert out.loss == w1.loss and out.grad_norm == w1.grad_norm
        assert all(torch.equal(out.state_dict[k], w1.state_dict[k]) for k in w1.state_dict)
        assert len({r.weights_digest for r in reports}) == 1
        assert store.list("a") == []  # the step cleared its keys
        t0 = time.monotonic()
        with pytest.raises(RankFailed) as err:
            dataplane_step_ranks(small_batch, group, store, codec, partition="c",
                                 advantages=torch.tensor([1.0, -1.0]), kill=(0, "logprob"))
        assert time.monotonic() - t0 < 10
        msg = str(err.value)
        assert f"rank 0 (pid {pids[0]}) killed by SIGKILL" in msg and "logprob" in msg, msg
        assert not _procs.wait_gone(pids, 5.0), "ranks left after a failed step"
        assert not group.alive
        with pytest.raises(RankFailed, match="dead"):
            group.step([one, one])
    finally:
        group.close()
        store.close()
    assert not _procs.wait_gone(_procs.descendants() - before, 10.0)


def test_ranks_die_with_their_driver(tmp_path):
    """PR_SET_PDEATHSIG: a driver SIGKILLed mid-run leaves no rank behind."""
    pids_file = tmp_path / "pids"
    driver = textwrap.dedent(f"""
        import time
        from rlconform.conformance.backends.reference_trainer_rollout import make_trainer
        from rlconform.reference_impl.ranks import RankLaunch
        from rlconform.reference_impl.served import ServedDataPlane
        from rlconform.reference_impl.trainer import TrainerSettings
        g = make_trainer(TrainerSettings("qwen2_vl"), ServedDataPlane(), None,
                         ranks=RankLaunch(2))
        open({str(pids_file)!r}, "w").write(" ".join(map(str, g.pids)))
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", driver], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while not pids_file.exists() or not pids_file.read_text():
            assert proc.poll() is None, "the driver exited before starting its ranks"
            assert time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.2)
        pids = [int(p) for p in pids_file.read_text().split()]
        assert all(_procs.alive(p) for p in pids)
        proc.kill()
        proc.wait()
        left = _procs.wait_gone(pids, 10.0)
        _procs.kill_pids(left)
        assert not left, f"ranks {sorted(left)} outlived their SIGKILLed driver"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- the clauses through the CLI (slow) --------------------------------------------------------
def _tagged(tag: str) -> list[int]:
    """PIDs of this user's processes whose environment carries `tag`."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if tag.encode() in Path(f"/proc/{entry}/environ").read_bytes():
                    found.append(int(entry))
            except OSError:
                continue
    return found


def _run(tmp_path: Path, backend: str, *extra: str, env: dict | None = None):
    tag = f"RLCONFORM_TEST_TAG=ranks-{uuid.uuid4().hex}"
    out_dir = tmp_path / f"run{len(list(tmp_path.glob('run*')))}"
    cmd = [sys.executable, "-m", "rlconform.conformance.cli", "run", "--backend", backend,
           "--workers", "0", "--report-dir", str(out_dir), "-q", "--surfaces", "transport",
           "--partial-ok", *extra]
    name, value = tag.split("=", 1)
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900,
                          env={**os.environ, **(env or {}), name: value})
    # the rank launcher (fork server, resource tracker) ends on its own once the run's
    # process is gone: a moment, not never
    left = sorted(_procs.wait_gone(set(_tagged(tag)), 5.0))
    _procs.kill_pids(set(left))
    found = sorted(out_dir.glob("*/report.json"))
    report = json.loads(found[0].read_text()) if found else None
    return proc.returncode, report, proc.stdout + proc.stderr, left


def _status(report: dict) -> dict:
    return {c["id"]: c for c in report["clauses"]}


@pytest.mark.slow
def test_a_killed_rank_still_gets_its_run_reported(tmp_path):
    for backend, code_want, status in (("reference", 0, "passed"),
                                       ("mutant:dead_rank_leaves_survivors", 1, "failed")):
        code, report, out, left = _run(tmp_path, backend, "-k", "killed_mid_step")
        assert report is not None, f"{backend}: no report written\n{out[-3000:]}"
        clause = _status(report)["RANK-FAILURE"]
        assert clause["status"] == status, f"{backend}: {clause}\n{out[-2000:]}"
        assert code == code_want, out[-2000:]
        assert not left, f"{backend}: processes of the run still alive: {left}"
        if status == "failed":
            assert "still running" in clause["message"], clause["message"]


REAL = {"transferqueue-simple": ("transfer_queue", "tensordict", "ray"),
        "ray-objectstore": ("ray",)}
# one mutant per place a defect can live: the in-rank trainer, the meta's pickling, the launcher
REAL_MUTANTS = ("rank_grad_mean", "rank_meta_keys_only", "dead_rank_leaves_survivors")


def _need(name: str) -> None:
    for mod in REAL[name]:
        if os.environ.get("CI"):  # CI installs every backend: never skip there
            importlib.import_module(mod)
        else:
            pytest.importorskip(mod, reason=f"{name} needs {mod}")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(REAL))
def test_rank_clauses_pass_on_real_backends_and_their_mutants_die(tmp_path, monkeypatch, name):
    from rlconform.conformance.engine.kill_matrix import kill_matrix
    from rlconform.conformance.mutants.ranks import TRANSPORT_ENV

    _need(name)
    code, report, out, left = _run(tmp_path, name, "-k", "test_ranks")
    assert report is not None, out[-3000:]
    ranks = {k: v["status"] for k, v in _status(report).items() if k.startswith("RANK-")}
    assert ranks and set(ranks.values()) == {"passed"}, f"{ranks}\n{out[-3000:]}"
    assert not left, f"processes of the run still alive: {left}"
    monkeypatch.setenv(TRANSPORT_ENV, name)
    m = kill_matrix(tmp_path / "mutants", jobs=1, only=list(REAL_MUTANTS),
                    extra=["-k", "test_ranks"])
    survivors = {r["name"]: r.get("error", r["failed"]) for r in m["mutants"] if not r["killed"]}
    assert not survivors, f"on {name}: mutants not killed: {survivors}"
    for r in m["mutants"]:
        path = tmp_path / "mutants" / "mutants" / f"mutant_{r['name']}" / "report.json"
        caps = json.loads(path.read_text())["backend_info"]["capabilities"]
        assert "object_columns" not in caps, f"{r['name']} did not run on {name}'s transport"


@pytest.mark.slow
def test_e2e_with_rank_processes_stays_bitwise_with_one_process(tmp_path):
    """`nox -s e2e`'s multi-process run: two GRPO steps, world 2 as rank processes, bitwise
    equal to the same shards in one process every step, nothing left running."""
    from rlconform.e2e.grpo_ranks import run

    threads = torch.get_num_threads()
    try:
        result = run("qwen2_vl", steps=2, prompts=2, group=2, world=2, max_new_tokens=4)
    finally:
        torch.set_num_threads(threads)
    assert result["ok"], result
    assert result["expect_bitwise_vs_one_process"]
    for step in result["steps"]:
        assert step["bitwise_vs_one_process"] and step["ranks_agree"], step
        assert step["seconds_ranks"] > 0 and step["seconds_one_process"] > 0
    assert not result["left_processes"]


def test_a_dead_ranks_last_stage_message_is_read_before_it_is_named(tmp_path):
    """A rank that reports a stage and dies at once can be seen dead before that message is
    read: the failure must still name the stage it died in."""
    import signal
    import subprocess
    import sys
    from multiprocessing import Pipe

    from rlconform.reference_impl.ranks import RankFailed, RankGroup, _send

    driver, rank = Pipe()
    _send(rank, ("stage", "train"))  # sent, not yet read by the driver
    proc = subprocess.Popen([sys.executable, "-c",
                             "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    proc.wait()
    group = object.__new__(RankGroup)
    group.world, group._procs, group._conns = 1, [proc], [driver]
    group._stage, group._logs, group._listener = ["reference_logprob"], [], None
    with pytest.raises(RankFailed) as err:
        group._fail("step 0", {0: "killed"})
    assert f"rank 0 (pid {proc.pid})" in str(err.value)
    assert "[stage: train]" in str(err.value), str(err.value)
    assert -proc.returncode == signal.SIGKILL
