"""Collection: ties every clause test to its clauses, deselects what the run leaves out
(`--surfaces`, families without the model size), marks tests of clauses the backend does not
declare as not applicable, gives each test the waivers that cover it (verdicts.scope_item) and,
on a GPU, groups the model-building tests so that few of them share the device at once."""

from __future__ import annotations

import pytest

from rlconform.conformance import catalogue
from rlconform.conformance.backend import SURFACES, Backend
from rlconform.conformance.engine import cells, verdicts
from rlconform.conformance.engine.items import (
    CLAUSE_PROP,
    DEVICE_GROUP,
    GROUP_PREFIX,
    MODEL_SURFACES,
    NA_PREFIX,
    clause_ids,
)
from rlconform.conformance.engine.session import state


def applicability(backend: Backend, clause) -> str | None:
    """Why `clause` does not apply to `backend`, or None when it does."""
    if not any(backend.provides(s) for s in clause.surfaces):
        why = _noted(backend, clause.surfaces)
        return f"backend provides no {' or '.join(repr(s) for s in clause.surfaces)} " \
               f"surface{why}"
    lacking = [c for c in clause.capabilities if c not in backend.capabilities]
    if lacking:
        return f"backend does not declare {lacking}{_noted(backend, lacking)}"
    return None


def _noted(backend: Backend, names) -> str:
    """': <the backend's notes on names>' (what the report's "not tested" shows), or ''."""
    notes = [backend.notes[n] for n in names if backend.notes.get(n)]
    return f": {'; '.join(notes)}" if notes else ""


@pytest.hookimpl(tryfirst=True)  # before xdist reads the xdist_group markers we add
def pytest_collection_modifyitems(session, config: pytest.Config, items) -> None:
    st = state(config)
    replay = config.getoption("--replay")
    errors = []
    surfaces = config.getoption("--surfaces")
    if surfaces:
        keep_surfaces = set(surfaces.split(","))
        unknown = sorted(keep_surfaces - set(SURFACES))
        if unknown:
            raise pytest.UsageError(f"--surfaces names unknown surfaces {unknown}; "
                                    f"known: {', '.join(SURFACES)}")
        dropped = [item for item in items
                   if not any(i in catalogue.BY_ID
                              and set(catalogue.BY_ID[i].surfaces) & keep_surfaces
                              for i in clause_ids(item))]
        cells.drop(config, items, dropped, "surfaces", f"--surfaces {surfaces}")
    _deselect_sizeless_families(config, items)
    _one_device_group(config, items)
    _shared_fixture_groups(config, items)
    for item in items:
        ids = clause_ids(item)
        if not ids:
            errors.append(f"{item.nodeid} is tied to no clause (@pytest.mark.clause)")
            continue
        unknown = [i for i in ids if i not in catalogue.BY_ID]
        if unknown:
            errors.append(f"{item.nodeid} names unknown clauses {unknown}")
            continue
        item.user_properties.append((CLAUSE_PROP, ids))
        reasons = [r for r in (applicability(st.backend, catalogue.BY_ID[i]) for i in ids) if r]
        if reasons:
            item.add_marker(pytest.mark.skip(reason=NA_PREFIX + "; ".join(sorted(set(reasons)))))
            continue
        verdicts.scope_item(item, st.expectations.waivers, ids)
        if replay:
            _apply_replay(item, replay)
    if errors:
        raise pytest.UsageError("clause tests are misdeclared:\n  " + "\n  ".join(errors))


def _deselect_sizeless_families(config: pytest.Config, items) -> None:
    """At a model size a family lacks (production: the 7-8B families), its trainer and rollout
    tests are deselected, never skipped or silently run at another size; the report's
    provenance names the size and the models, and its cells name each family dropped (the
    run is partial)."""
    from rlconform.fixtures.sizes import has_size, model_size

    size = model_size()
    dropped = []
    for item in items:
        callspec = getattr(item, "callspec", None)
        family = callspec.params.get("family") if callspec else None
        ids = clause_ids(item)
        on_models = any(catalogue.BY_ID[i].surface in MODEL_SURFACES for i in ids
                        if i in catalogue.BY_ID)
        if isinstance(family, str) and on_models and not has_size(family, size):
            dropped.append(item)
    cells.drop(config, items, dropped, "model_size",
               lambda item: f"--model-size {size}: family {item.callspec.params['family']!r} "
                            f"has no {size} model (fixtures/sizes.py)")


def _one_device_group(config: pytest.Config, items) -> None:
    """On a GPU, tests that build models (trainer and rollout clauses) form DEVICE_GROUPS xdist
    groups by family, so under `--dist loadgroup` at most that many run at once while the
    data-plane tests spread over the other workers: a production-width trainer (policy, frozen
    reference, AdamW state, activations) peaks at 45-52 GiB (measured on an H200: Gemma3-4B,
    SmolVLM), so two fit one 139 GiB GPU and eight did not. The two largest families sit in
    different groups.

    The grouped tests move to the front: xdist hands out work units in collection order, and
    the two groups are the run's longest units (~500 s each at production widths, against
    ~400 s of every other test together spread over the other workers); collected after the
    data-plane modules they started only once those had been dealt out."""
    if not config.getoption("--device").startswith("cuda") or \
            not getattr(config.option, "loadgroup", False):  # set in xdist workers
        return
    grouped, rest = [], []
    for item in items:
        ids = clause_ids(item)
        if any(i in catalogue.BY_ID and catalogue.BY_ID[i].surface in MODEL_SURFACES
               for i in ids):
            callspec = getattr(item, "callspec", None)
            family = callspec.params.get("family") if callspec else None
            _suffix_nodeid(item, f"{DEVICE_GROUP}-{_device_group(family)}")
            grouped.append(item)
        else:
            rest.append(item)
    items[:] = grouped + rest


# module-scoped fixtures whose tests must share one worker, and the xdist group that keeps them
# there: `rank_runs` (clauses/test_ranks.py) generates rollouts, starts the rank processes (each
# imports torch and transformers) and runs every (family, case, world) step that its clause
# tests read; split over two workers, both paid all of that (~17 s of CPU on 2 cores)
SHARED_FIXTURE_GROUPS = {"rank_runs": GROUP_PREFIX + "ranks"}


def _shared_fixture_groups(config: pytest.Config, items) -> None:
    """Under `--dist loadgroup`, the tests of each SHARED_FIXTURE_GROUPS fixture form one xdist
    group, moved to the front: it is the run's longest unit (on 2 cores ~35 s against ~120 s
    per worker), and dealt out last it would leave the other worker idle at the end. Tests
    already in a device group (a GPU run) stay there."""
    if not getattr(config.option, "loadgroup", False):  # set in xdist workers
        return
    grouped, rest = [], []
    for item in items:
        group = next((g for f, g in SHARED_FIXTURE_GROUPS.items()
                      if f in getattr(item, "fixturenames", ())), None)
        if group is not None and "@" + GROUP_PREFIX not in item.nodeid:
            _suffix_nodeid(item, group)
            grouped.append(item)
        else:
            rest.append(item)
    items[:] = grouped + rest


DEVICE_GROUPS = 2
# family -> group, balanced by the model tests' measured cost (tests per family x seconds per
# production step on the H200: qwen2_vl 17 x 4.6, gemma3 12 x 8.4 | text 14 x 5.0, smolvlm
# 12 x 5.1, qwen2_5_vl 4 x 7.1, qwen3_vl 4 x 4.7); the two largest (gemma3 50 GiB, smolvlm
# 52 GiB per step) in different groups
_GROUP_OF = {"qwen2_vl": 0, "gemma3": 0, "text": 1, "smolvlm": 1, "qwen2_5_vl": 1, "qwen3_vl": 1}


def _device_group(family) -> int:
    if not isinstance(family, str):
        return 0
    if family in _GROUP_OF:
        return _GROUP_OF[family]
    return sum(map(ord, family)) % DEVICE_GROUPS


def _suffix_nodeid(item, group: str) -> None:
    """What an `xdist_group` marker does under --dist loadgroup: append "@group" to the test's
    id, which the controller's scheduler reads. Done here, in a tryfirst hook, because
    pytest-xdist's own hook can read the markers before ours has added them (then the model
    tests of every worker build their models at once and a GPU runs out of memory), and because
    it writes the suffix to `item._nodeid`, which pytest >= 9.2 no longer reads (`item._id`).
    pytest has no public way to change an item's id, so this writes the private attribute the
    installed pytest reads."""
    new = f"{item.nodeid}@{group}"
    if hasattr(item, "_id"):  # pytest >= 9.2
        from _pytest.nodeid import coerce_node_id

        item._id = coerce_node_id(new)
    else:
        item._nodeid = new


def _apply_replay(item, replay: str) -> None:
    version, _, blob = replay.partition(":")
    if not blob:
        raise pytest.UsageError("--replay takes VERSION:BLOB as printed in the report")
    fn = getattr(item, "obj", None)
    if fn is not None and getattr(fn, "is_hypothesis_test", False):
        fn._hypothesis_internal_use_reproduce_failure = (version, blob)
