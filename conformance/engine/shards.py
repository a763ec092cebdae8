"""Shards: `--shard K/N` runs shard K's share of the selected tests (or of the mutants of a kill
matrix), so that a run too long for one machine splits over N, and `rlconform merge` joins the
shard reports into the report of one run (engine/merge.py).

The split is a partition, the same on every machine of one commit: tests are dealt longest
first to the shard with the least work so far (the LPT rule), each weighing its recorded
duration (`shard_durations.json` beside this file, per regime, refreshed from a report with
`rlconform shard-durations REPORT --write`), else its function's mean there, else a cost model
(a model test weighs its family's planned GPU peak in the memory plan; any other test one
unit). Ties break on the test id, never on the order of collection or the machine.

Tests that share an `xdist_group` marker must share a worker, so they stay in one shard. The
GPU's device groups (collection._one_device_group) are not such groups: they cap how many
model tests share one GPU at once, which holds per machine, so shards split them; that is what
lets the model tests, most of a nightly, spread over several GPUs.

`--placement device|host` keeps the clauses that use the run's --device (models, rank
processes: items.needs_device) or the rest, so that a nightly runs its data-structure clauses
on a CPU machine and only the rest on GPUs; each placement is a part of the run, sharded or
not, and the merge joins the parts.

The shard hook runs last among the collection hooks, after -k, -m, --surfaces and the model
size have deselected, and records the whole run's scope (every selected test id with its
shard and clauses), so a merge can tell which tests a missing shard would have run.
"""

from __future__ import annotations

import heapq
import json
import statistics
from pathlib import Path

import pytest

DURATIONS_PATH = Path(__file__).with_name("shard_durations.json")
SHARD_OUTPUT = "rlconform_shard"  # the key of an xdist worker's workeroutput
# cost model of a test without a record, in seconds
MODEL_TEST_S = 5.0
OTHER_TEST_S = 1.0


def parse(spec: str | None) -> tuple[int, int] | None:
    """'K/N' -> (K, N), 1 <= K <= N; None for no sharding. A bad spec raises ValueError."""
    if spec is None or spec == "":
        return None
    k, sep, n = str(spec).partition("/")
    try:
        k_i, n_i = int(k), int(n)
    except ValueError:
        k_i = n_i = 0
    if not sep or not 1 <= k_i <= n_i:
        raise ValueError(f"--shard takes K/N with 1 <= K <= N (shard K of N), got {spec!r}")
    return k_i, n_i


def regime_key(device: str, model_size: str, profile: str) -> str:
    """The regime a duration was measured in: the device type, model size and profile."""
    return f"{'cuda' if device.startswith('cuda') else 'cpu'}/{model_size}/{profile}"


def load_durations(path: Path = DURATIONS_PATH) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {"regimes": {}}


def assign(costs: dict[str, float], n: int, groups: dict[str, str] | None = None) -> dict[str, int]:
    """Each name -> its shard (1..n): names of one group together, heaviest unit first to the
    lightest shard (ties: the lower shard), units ordered by cost then name."""
    units: dict[str, list[str]] = {}
    for name in costs:
        g = (groups or {}).get(name)
        units.setdefault(f"group:{g}" if g else f"one:{name}", []).append(name)
    order = sorted(units.items(), key=lambda u: (-sum(costs[x] for x in u[1]), u[0]))
    heap = [(0.0, k) for k in range(1, n + 1)]
    out: dict[str, int] = {}
    for _, names in order:
        load, k = heapq.heappop(heap)
        for name in names:
            out[name] = k
        heapq.heappush(heap, (load + sum(costs[x] for x in names), k))
    return out


def test_costs(nodeids: dict[str, bool], regime: str, families: dict[str, str | None],
               record: dict | None = None) -> dict[str, float]:
    """Plain test id -> its weight: recorded seconds, else its function's mean in the record,
    else the cost model. `nodeids` maps each id to whether it builds models."""
    rec = ((record or load_durations()).get("regimes") or {}).get(regime, {}).get("tests", {})
    by_function: dict[str, list[float]] = {}
    for nodeid, s in rec.items():
        by_function.setdefault(nodeid.split("[", 1)[0], []).append(float(s))
    plan = None
    out = {}
    for nodeid, model in nodeids.items():
        if nodeid in rec:
            out[nodeid] = float(rec[nodeid])
            continue
        seen = by_function.get(nodeid.split("[", 1)[0])
        if seen:
            out[nodeid] = statistics.fmean(seen)
        elif model:
            if plan is None:
                from rlconform.conformance.engine.gpu_memory import load_plan

                plan = load_plan()
            fam = plan["families"].get(families.get(nodeid) or "", {})
            out[nodeid] = MODEL_TEST_S * float(fam.get("peak_gib", plan["default_gib"])) \
                / float(plan["default_gib"])
        else:
            out[nodeid] = OTHER_TEST_S
    return out


def mutant_costs(names: list[str], regime: str, fallback, record: dict | None = None
                 ) -> dict[str, float]:
    """Mutant -> its weight: its recorded seconds in the regime, else `fallback(name)` (the
    kill matrix's claim-based cost)."""
    rec = ((record or load_durations()).get("regimes") or {}).get(regime, {}).get("mutants", {})
    return {n: float(rec[n]) if n in rec else float(fallback(n)) for n in names}


def killers(regime: str, record: dict | None = None) -> dict[str, list[str]]:
    """Mutant -> the tests that killed it by assertion when its regime was last recorded: a
    kill-matrix run puts them first (mutant_worker._KillersFirst), so that a clause whose
    killing test is one of many reaches it before the others."""
    rec = ((record or load_durations()).get("regimes") or {}).get(regime, {})
    return {k: list(v) for k, v in (rec.get("killers") or {}).items()}


def fold(record: dict, regime: str, tests: dict[str, float] | None = None,
         mutants: dict[str, float] | None = None,
         killed_by: dict[str, list[str]] | None = None) -> dict:
    """The record with measured durations (and the mutants' killing tests) of one regime put
    in (newer values replace older)."""
    out = json.loads(json.dumps(record))
    reg = out.setdefault("regimes", {}).setdefault(regime, {})
    for key, new in (("tests", tests), ("mutants", mutants)):
        if new:
            merged = dict(reg.get(key, {}))
            merged.update({k: round(float(v), 2) for k, v in new.items()})
            reg[key] = dict(sorted(merged.items()))
    if killed_by:
        merged = dict(reg.get("killers", {}))
        merged.update({k: sorted(v) for k, v in killed_by.items()})
        reg["killers"] = dict(sorted(merged.items()))
    return out


def killers_from(doc: dict) -> dict[str, list[str]]:
    """Mutant -> its tests that failed by assertion, from a kill matrix ({} for a run report)."""
    return {m["name"]: sorted(t for t, v in (m.get("failed_tests") or {}).items()
                              if v.get("kind") == "assertion")
            for m in doc.get("mutants") or () if m.get("killed") and not m.get("error")}


def durations_from(doc: dict) -> tuple[str, dict[str, float], dict[str, float]]:
    """(regime, test durations, mutant durations) of a run report or a kill matrix."""
    if "clauses" in doc:
        p = doc["provenance"]
        if "merged_shards" in p:
            raise ValueError("a merged report holds parts run in different regimes: give "
                             "`rlconform shard-durations` the shard reports")
        regime = regime_key(p["device"]["type"], p.get("model_size") or "tiny", p["profile"])
        tests = {t["nodeid"]: t["duration_s"] for c in doc["clauses"] for t in c["tests"]
                 if t["outcome"] not in ("not_applicable", "skipped")}
        return regime, tests, {}
    r = doc.get("regime") or {}
    regime = regime_key(r.get("device", "cpu"), r.get("model_size", "tiny"),
                        r.get("profile", "ci"))
    return regime, {}, {m["name"]: m["duration_s"] for m in doc.get("mutants") or ()
                        if m.get("duration_s") and not m.get("error")}


# --- the collection hook ------------------------------------------------------------------------

def spec_of(config: pytest.Config) -> tuple[int, int] | None:
    """(K, N) of the run: `--shard K/N`; 1/1 for a `--placement` part given no shard (it is
    merged with the other part); None for a run that is neither."""
    spec = parse(config.getoption("--shard"))
    if spec is None and config.getoption("--placement"):
        return 1, 1
    return spec


@pytest.hookimpl(trylast=True)  # after -k / -m (pytest), --surfaces and model size (collection)
def pytest_collection_modifyitems(session, config: pytest.Config, items) -> None:
    try:
        spec = spec_of(config)
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from exc
    if spec is None:
        return
    from rlconform.conformance.engine import cells
    from rlconform.conformance.engine.items import (
        clause_ids,
        is_model_test,
        needs_device,
        plain_nodeid,
    )
    from rlconform.conformance.engine.session import state
    from rlconform.fixtures.sizes import model_size

    placement = config.getoption("--placement")
    if placement:
        other = "host" if placement == "device" else "device"
        cells.drop(config, items,
                   [i for i in items if needs_device(clause_ids(i)) != (placement == "device")],
                   "placement", f"--placement {placement} (the {other} part's share)")
    k, n = spec
    ids = {plain_nodeid(i.nodeid): i for i in items}
    families = {}
    for nodeid, item in ids.items():
        cs = getattr(item, "callspec", None)
        fam = cs.params.get("family") if cs else None
        families[nodeid] = fam if isinstance(fam, str) else None
    groups = {}
    for nodeid, item in ids.items():
        mark = item.get_closest_marker("xdist_group")
        if mark is not None:
            groups[nodeid] = str(mark.args[0] if mark.args else mark.kwargs.get("name"))
    regime = regime_key(config.getoption("--device"), model_size(),
                        config.getoption("--profile"))
    costs = test_costs({i: is_model_test(item) for i, item in ids.items()}, regime, families)
    where = assign(costs, n, groups)
    dropped = [i for i in items if where[plain_nodeid(i.nodeid)] != k]
    info = {
        "k": k, "n": n, "regime": regime, "placement": placement,
        "balance_s": [round(sum(c for i, c in costs.items() if where[i] == s), 1)
                      for s in range(1, n + 1)],
        "scope": {i: {"shard": where[i], "clauses": clause_ids(item)}
                  for i, item in ids.items()},
    }
    state(config).shard = info
    if hasattr(config, "workeroutput"):  # an xdist worker: the controller reads it at its end
        config.workeroutput[SHARD_OUTPUT] = info
    cells.drop(config, items, dropped, "shard",
               lambda item: f"--shard {k}/{n} (in shard {where[plain_nodeid(item.nodeid)]}/{n})")


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: the plugin loads without xdist
def pytest_testnodedown(node, error) -> None:
    """On the xdist controller (which collects nothing): the shard's scope, as a worker
    computed it. Every worker computes the same."""
    from rlconform.conformance.engine.session import state

    info = (getattr(node, "workeroutput", None) or {}).get(SHARD_OUTPUT)
    st = state(node.config)
    if info and st.shard is None:
        st.shard = info


def provenance_entry(st, config) -> dict | None:
    """The report's `provenance.shard` of a shard run: K, N, the whole run's scope, and what
    the merge needs to rebuild the run (see merge.py); None when the run is not sharded."""
    spec = spec_of(config)
    if spec is None:
        return None
    info = dict(st.shard or {"k": spec[0], "n": spec[1], "scope": None,
                             "placement": config.getoption("--placement")})
    surfaces = config.getoption("--surfaces")
    info.update(keyword_subset=bool(config.getoption("keyword", "")
                                    or config.getoption("markexpr", "")),
                surfaces=surfaces.split(",") if surfaces else None,
                exitstatus=None if st.exitstatus is None else int(st.exitstatus),
                run_problems=list(st.problems))
    if info.get("scope") is None:
        info["scope_unknown"] = "no worker reported the shard's scope (interrupted before " \
                                "collection ended?)"
    from rlconform.conformance.engine.cells import ledger_of

    ledger = ledger_of(st)
    if ledger is not None:  # what the split did not drop: the merge tells a partial run by it
        info["dropped"] = {n: {"clauses": ledger.scope.get(n, []), "by": kind, "why": why}
                           for n, (kind, why) in sorted(ledger.dropped.items())
                           if kind != "shard"}
    info["partial_ok"] = bool(config.getoption("--partial-ok"))
    return info


def record_fields(r: dict) -> dict:
    """What a shard report keeps of a test beyond a report's test entry, for the merge to
    rebuild its verdict: its clauses, metrics, every covering waiver's matches, and the rest
    of the result the report builder reads."""
    return {"clauses": r["clauses"], "metrics": r["metrics"], "waivers": r["waivers"],
            "waived_messages": r["waived_messages"],
            "waived_distinct": r.get("waived_distinct") or {},
            "waived_sites": r.get("waived_sites") or {}, "unimplemented": r["unimplemented"]}
