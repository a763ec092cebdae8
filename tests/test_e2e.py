"""The multi-step GRPO smoke run: legacy and data plane stay bitwise equal step after step."""

from __future__ import annotations

import torch

from rlconform.e2e.grpo_run import run


def test_two_steps_legacy_equals_data_plane():
    result = run("qwen2_vl", steps=2, prompts=2, group=2, world=2, max_new_tokens=4)
    assert result["ok"], result
    for step in result["steps"]:
        assert step["bitwise_equal"], f"step {step['step']}: legacy and data plane differ"
        assert step["probs_ratio_exactly_one"], f"step {step['step']}: probs_ratio != 1"
        assert step["left_in_transport"] == 0, "the step did not clear its keys"
        ratio = step["metrics"]["probs_ratio"]
        assert ratio["min"] == ratio["max"] == 1.0
    assert result["dtype"] == str(torch.float32).removeprefix("torch.")
