"""The *-NO-GLOBAL-EFFECTS machinery: the snapshot names what changed and restores it, a
backend's declaration is checked, and a declared change passes and shows in the report."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
from test_suite import run_suite

from rlconform.conformance.backend import Backend
from rlconform.conformance.clauses import _globals
from rlconform.reference_impl.dataplane import InMemoryDataPlane


def test_changes_name_each_piece_of_state_and_restore_puts_it_back():
    keep, before = _globals.saved(), _globals.snapshot()
    threads = torch.get_num_threads()
    try:
        torch.manual_seed(11)
        random.seed(11)
        np.random.seed(11)
        torch.set_grad_enabled(False)
        torch.set_num_threads(threads + 1)
        os.environ["RLCONFORM_GLOBALS_PROBE"] = "1"
        changed = _globals.changes(before, _globals.snapshot())
    finally:
        _globals.restore(keep)
    assert set(changed) == {"torch_rng", "python_random", "numpy_random", "grad_mode",
                            "intra_op_threads", "env.RLCONFORM_GLOBALS_PROBE"}, changed
    assert changed["grad_mode"] == "True -> False"
    assert changed["env.RLCONFORM_GLOBALS_PROBE"] == "unset -> '1'"
    assert "seed 11" in changed["torch_rng"]
    assert _globals.changes(before, _globals.snapshot()) == {}, "restore left a change"


def test_reading_the_state_changes_nothing():
    before = _globals.snapshot()
    for _ in range(3):
        _globals.snapshot()
        _globals.saved()
    assert _globals.changes(before, _globals.snapshot()) == {}


@pytest.mark.parametrize("declared, problem", [
    ({"store": {"torch_rng": "x"}}, "names surface 'store'"),
    ({"transport": {"torch_seed": "x"}}, "not global state the suite reads"),
    ({"transport": {"env.": "x"}}, "not global state the suite reads"),
    ({"transport": {"env.STORE": " "}}, "say why"),
    ({"transport": ["torch_rng"]}, "must map each state to why"),
])
def test_a_declaration_names_known_state_on_a_surface_and_says_why(declared, problem):
    with pytest.raises((ValueError, TypeError), match=problem):
        Backend(name="declares", transport=InMemoryDataPlane, changes_globals=declared)


DECLARING_BACKEND = '''
import random

from rlconform.conformance.backend import Backend
from rlconform.reference_impl.meta import BatchMeta


class Meta(BatchMeta):
    def shard_for_dp(self, world):
        random.seed(world)
        return super().shard_for_dp(world)


backend = Backend.from_reference(
    "declares-random", meta=lambda: Meta, capabilities={"dp"},
    changes_globals={"meta": {"python_random": "the balancer breaks ties with a seeded random"}})
'''


def test_a_declared_change_passes_and_the_report_says_so(tmp_path):
    (tmp_path / "declaring_backend.py").write_text(DECLARING_BACKEND)
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    code, report, out = run_suite(tmp_path, "declaring_backend:backend", "--surfaces", "meta",
                                  "-k", "test_meta_operations_leave_global_state_alone", env=env)
    assert report is not None, out[-3000:]
    clause = next(c for c in report["clauses"] if c["id"] == "META-NO-GLOBAL-EFFECTS")
    assert clause["status"] == "passed", clause["message"]
    seen = clause["metrics"]["declared_global_change.python_random"]
    assert seen["value"] >= 2, seen  # shard_for_dp(1) and shard_for_dp(3)
    assert report["backend_info"]["changes_globals"] == {
        "meta": {"python_random": "the balancer breaks ties with a seeded random"}}


def test_a_changed_credential_is_named_but_its_value_is_not_shown():
    """A report may be published: an environment variable whose name looks like a credential's
    shows as its length and a digest, never its value; others show their values."""
    from rlconform.conformance.clauses import _globals

    before = {"env.HF_TOKEN": "hf_abcdefsecret", "env.CUBLAS_WORKSPACE_CONFIG": None}
    after = {"env.HF_TOKEN": "hf_other_secret", "env.CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    got = _globals.changes(before, after)
    assert set(got) == {"env.HF_TOKEN", "env.CUBLAS_WORKSPACE_CONFIG"}
    assert "secret" not in got["env.HF_TOKEN"] and "15 characters" in got["env.HF_TOKEN"]
    assert got["env.CUBLAS_WORKSPACE_CONFIG"] == "unset -> ':4096:8'"
