"""The nemo-rl waiver files load cleanly and stay narrow; runs without a NeMo-RL checkout (the
adapter's own tests, tests/test_backends_nemo_rl.py, need one)."""

from __future__ import annotations

import pytest

from rlconform.conformance.catalogue import BY_ID
from rlconform.conformance.engine.waivers import BUNDLED_DIR, load_expectations


@pytest.mark.parametrize("stem", ["nemo-rl", "nemo-rl-pr2957"])
def test_nemo_rl_waivers_are_valid_and_narrow(stem):
    expectations, problems = load_expectations(stem, BUNDLED_DIR / f"{stem}.toml", set(BY_ID))
    assert not problems, problems
    assert expectations.waivers, f"{stem}.toml holds no waiver"
    for w in expectations.waivers:
        where = f"{stem}.toml {w.label}"
        assert w.match, f"{where}: no message pattern; name the failure it covers"
        assert w.tests, f"{where}: no tests named"
        assert w.function and w.input, f"{where}: say the NeMo-RL function and the input"


def test_the_pr_waives_nothing_it_fixed():
    """What PR #2957 fixes (the rollout write dropping media) is waived only for 7ea279a."""
    main, _ = load_expectations("nemo-rl", None, set(BY_ID))
    pr, _ = load_expectations("nemo-rl-pr2957", BUNDLED_DIR / "nemo-rl-pr2957.toml", set(BY_ID))
    assert any("is missing" in (w.match or "") for w in main.waivers)
    assert not any("is missing" in (w.match or "") for w in pr.waivers)
    assert not any(w.clause == "WIRE-UNKNOWN-FIELD" for w in pr.waivers)
