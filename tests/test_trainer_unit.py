"""Unit tests of the reference loss, rollout, trainer and GRPO step (no plugin needed).

Loss metrics are checked against hand-computed values (log 2 and log 3 differences, so every
expected number is a closed form); the rollout against its sampling restriction, determinism
and the one pixel cast; the two trainer paths against each other, bitwise.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlconform.reference_impl.codec import ReferenceCodec
from rlconform.reference_impl.dataplane import InMemoryDataPlane
from rlconform.reference_impl.grpo import (
    dataplane_step,
    dp_rows,
    group_advantages,
    legacy_step,
    mint_keys,
)
from rlconform.reference_impl.loss import (
    LossConfig,
    generation_metrics,
    grpo_loss,
    k3,
    summarize,
)
from rlconform.reference_impl.meta import BatchMeta
from rlconform.reference_impl.packed import PackedTensor
from rlconform.reference_impl.registry import Stage
from rlconform.reference_impl.trainer import (
    DataPlaneTrainer,
    LegacyTrainer,
    TrainerSettings,
    micro_batch_rows,
)

LN2, LN3 = math.log(2.0), math.log(3.0)


pytestmark = pytest.mark.usefixtures("one_thread")


# -- loss and metrics ---------------------------------------------------------------------
def test_k3_is_zero_at_zero_and_positive_elsewhere():
    x = torch.tensor([0.0, LN2, -LN2])
    assert torch.allclose(k3(x), torch.tensor([0.0, 1.0 - LN2, 0.5 - 1.0 + LN2]))


def test_generation_metrics_hand_computed():
    gen = torch.tensor([[0.0, -1.0, -1.0 + LN2, -2.0]])
    prev = torch.tensor([[0.0, -1.0, -1.0, -2.0 + LN3]])
    mask = torch.tensor([[0, 1, 1, 1]])  # position 0 is a prompt token: excluded
    m = generation_metrics(gen, prev, mask)
    # tokens: diff (gen - prev) = 0, ln 2, -ln 3
    assert torch.allclose(m["token_mult_prob_error"], torch.tensor([1.0, 2.0, 3.0]))
    assert torch.allclose(m["sampling_importance_ratio"], torch.tensor([1.0, 0.5, 3.0]))
    assert torch.allclose(m["gen_kl_error"], torch.tensor([0.0, 0.5 - 1 + LN2, 2.0 - LN3]))
    assert torch.allclose(m["policy_kl_error"], torch.tensor([0.0, 1.0 - LN2, 1 / 3 - 1 + LN3]))
    assert math.isclose(float(m["token_mult_prob_error"].mean()), 2.0, rel_tol=1e-6)


def test_grpo_loss_clips_and_normalizes_hand_computed():
    prev = torch.zeros(2, 3)
    logp = torch.tensor([[0.0, LN2, 0.0], [0.0, LN2, -LN2]])  # ratios 1, 2, 1 / 1, 2, 0.5
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[0, 1, 1], [0, 1, 1]])
    out = grpo_loss(logp, prev, adv, mask, normalizer=4.0,
                    config=LossConfig(clip_low=0.2, clip_high=0.2),
                    logp_reference=torch.zeros(2, 3))
    # row 0 (A=+1): ratio 2 -> clipped 1.2 -> -1.2; ratio 1 -> -1
    # row 1 (A=-1): ratio 2 -> max(2, 1.2) = 2 -> +2; ratio 0.5 -> max(0.5, 0.8) = 0.8 -> +0.8
    per_token = torch.tensor([-1.2, -1.0, 2.0, 0.8])
    assert torch.allclose(out.metrics["loss_per_token"], per_token)
    assert math.isclose(float(out.loss), float(per_token.sum()) / 4.0, rel_tol=1e-6)
    assert torch.allclose(out.metrics["probs_ratio"], torch.tensor([2.0, 1.0, 2.0, 0.5]))
    assert torch.allclose(out.metrics["probs_ratio_clamped"], torch.tensor([1.2, 1.0, 1.2, 0.8]))
    assert out.metrics["clipped"].tolist() == [1.0, 0.0, 1.0, 1.0]
    # KL(policy || reference) with x = ref - logp: k3(-ln 2) = 0.5 - 1 + ln 2, k3(ln 2) = 1 - ln 2
    assert torch.allclose(out.metrics["reference_kl"],
                          torch.tensor([0.5 - 1 + LN2, 0.0, 0.5 - 1 + LN2, 1 - LN2]))


def test_grpo_loss_gradient_is_the_policy_gradient():
    logp = torch.zeros(1, 2, requires_grad=True)
    out = grpo_loss(logp, torch.zeros(1, 2), torch.tensor([2.0]), torch.tensor([[0, 1]]), 1.0)
    out.loss.backward()
    assert logp.grad.tolist() == [[0.0, -2.0]]  # d(-ratio * A)/dlogp at ratio 1, masked token


def test_summarize_reports_the_distribution():
    s = summarize(torch.tensor([1.0, 2.0, 3.0, 4.0, 100.0]))
    assert (s["min"], s["max"], s["count"]) == (1.0, 100.0, 5)
    assert s["mean"] == 22.0 and s["q0.5"] == 3.0
    assert math.isnan(summarize(torch.tensor([]))["mean"])


# -- splits, advantages, keys ---------------------------------------------------------------
def test_micro_batch_rows_fixed_and_dynamic():
    s = TrainerSettings("text", micro_batch_size=2)
    assert micro_batch_rows([5, 6, 7, 8, 9], s) == [[0, 1], [2, 3], [4]]
    d = TrainerSettings("text", max_tokens_per_micro_batch=20)
    # rows x longest <= 20: [5, 6, 7] -> 21 > 20 so [5, 6]; [7, 8] -> 16; 30 alone; then 9
    assert micro_batch_rows([5, 6, 7, 8, 30, 9], d) == [[0, 1], [2, 3], [4], [5]]
    t = TrainerSettings("text", max_tokens_per_micro_batch=20, max_seq_len=6)
    assert micro_batch_rows([5, 6, 7, 8, 30, 9], t) == [[0, 1, 2], [3, 4, 5]]


def test_group_advantages_and_keys():
    adv = group_advantages(torch.tensor([1.0, 0.0, 2.0, 2.0]), 2)
    std = math.sqrt(0.5)
    assert torch.allclose(adv, torch.tensor([0.5 / std, -0.5 / std, 0.0, 0.0]), atol=1e-5)
    assert mint_keys(4, 2, "u") == ["u0_g0", "u0_g1", "u1_g0", "u1_g1"]
    assert sorted(i for r in dp_rows([3, 9, 4, 8], 2) for i in r) == [0, 1, 2, 3]


def test_completion_caps_vary_and_include_an_empty_row():
    from rlconform.fixtures.images import completion_caps

    assert completion_caps(6, 6, seed=0) == [6, 0, 4, 1, 3, 5]
    for seed in range(8):
        caps = completion_caps(7, 6, seed)
        assert {0, 6} <= set(caps[:6]) and all(a != b for a, b in zip(caps, caps[1:]))
    with pytest.raises(ValueError, match="max_new_tokens"):
        completion_caps(4, 3)


# -- rollout --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen():
    from rlconform.fixtures.families import build_family
    from rlconform.fixtures.images import make_prompts
    from rlconform.reference_impl.rollout import HFRollout

    fam = build_family("qwen2_vl")
    prompts, images, _ = make_prompts(3, [1, 0, 2], seed=0)
    engine = HFRollout(fam, TrainerSettings("qwen2_vl"))
    # per-row caps: row 0 runs to its cap, row 1 is empty, row 2 samples EOS as its 7th token
    return fam, engine, prompts, images, engine.generate(prompts, images, CAPS, seed=0)


CAPS = [8, 0, 8]


def test_rollout_samples_only_ordinary_tokens_and_is_seeded(qwen):
    fam, engine, prompts, images, batch = qwen
    allowed = set(fam.ordinary_token_ids().tolist())
    mask = batch["token_mask"].bool()
    rows = [batch["input_ids"][i][mask[i]].tolist() for i in range(3)]
    assert [len(r) for r in rows] == [8, 0, 7]
    assert rows[2][-1] in fam.eos_token_ids, "row 2 must have stopped on a sampled EOS"
    assert set(rows[0]) | set(rows[2][:-1]) <= allowed
    again = engine.generate(prompts, images, CAPS, seed=0)
    assert batch == again, "the same seed must give the same rollout"
    other = engine.generate(prompts, images, CAPS, seed=1)
    assert not torch.equal(other["input_ids"], batch["input_ids"])


def test_rollout_caps_per_row_and_rejects_bad_caps(qwen):
    fam, engine, prompts, images, batch = qwen
    lp = batch["generation_logprobs"]
    p, n = int(batch["prompt_lengths"][2]), int(batch["input_lengths"][2])
    assert bool(torch.isfinite(lp[2, p:n]).all() and (lp[2, p:n] < 0).all())  # EOS scored too
    assert int(batch["input_lengths"][1]) == int(batch["prompt_lengths"][1])  # empty row
    assert batch.extra["completions"][1] == ""
    one = engine.generate(prompts[:1], images[:1], 3, seed=0)  # an int caps every row
    assert torch.equal(one["input_ids"][0, :int(one["input_lengths"][0])],
                       batch["input_ids"][0, :int(one["input_lengths"][0])])
    for bad in ([8, 0], [8, -1, 8]):
        with pytest.raises(ValueError, match="max_new_tokens"):
            engine.generate(prompts, images, bad, seed=0)


def test_rollout_fields_masks_and_maps(qwen):
    _, _, _, _, batch = qwen
    lens, plens = batch["input_lengths"], batch["prompt_lengths"]
    assert batch.family == "qwen2_vl"
    assert isinstance(batch["pixel_values"], PackedTensor)
    assert [batch["pixel_values"].is_none(i) for i in range(3)] == [False, True, False]
    assert len(batch["pixel_values"].row_segments(2)) == 2  # two images, two segments
    for i in range(3):
        p, n = int(plens[i]), int(lens[i])
        assert bool((batch["generation_logprobs"][i, :p] == 0).all())
        assert bool((batch["generation_logprobs"][i, p:n] < 0).all())
        assert bool((batch["mm_token_type_ids"][i, p:] == 0).all())
    assert int(batch["mm_token_type_ids"].sum()) > 0  # image tokens marked in the prompts


def test_rollout_casts_pixels_once_to_the_policy_dtype():
    from rlconform.fixtures.families import build_family
    from rlconform.fixtures.images import make_prompts
    from rlconform.reference_impl.rollout import HFRollout

    prompts, images, _ = make_prompts(1, [1], seed=0)
    engine = HFRollout(build_family("qwen2_vl"), TrainerSettings("qwen2_vl",
                                                                 dtype=torch.bfloat16))
    batch = engine.generate(prompts, images, 2, seed=0)
    assert batch["pixel_values"].dtype == torch.bfloat16
    assert batch["image_grid_thw"].dtype == torch.int64  # geometry is never cast
    assert batch["generation_logprobs"].dtype == torch.float32


# -- trainer paths --------------------------------------------------------------------------
def _pair(family: str, batch, world: int = 1, **kw):
    s = TrainerSettings(family, **kw)
    store, codec = InMemoryDataPlane(), ReferenceCodec()
    rewards = torch.tensor([((7 * i) % 5) / 4 for i in range(len(batch))])
    dp = dataplane_step(batch, DataPlaneTrainer(s, store, codec), store, codec, BatchMeta, "p",
                        rewards=rewards, group_size=1 if len(batch) % 2 else 2, world=world)
    legacy = legacy_step(batch, LegacyTrainer(s), rewards=rewards,
                         group_size=1 if len(batch) % 2 else 2, world=world)
    return dp, legacy, store


@pytest.mark.parametrize("world", [1, 2])
def test_legacy_equals_data_plane_bitwise(qwen, world):
    _, _, _, _, batch = qwen
    batch = batch.select([0, 1, 2, 0])  # an even count: groups of two
    dp, legacy, store = _pair("qwen2_vl", batch, world)
    assert dp.loss == legacy.loss and dp.grad_norm == legacy.grad_norm and dp.grad_norm > 0
    for k in dp.metrics:
        assert torch.equal(dp.metrics[k], legacy.metrics[k]), k
    for k in dp.state_dict:
        assert torch.equal(dp.state_dict[k], legacy.state_dict[k]), k
    assert bool((dp.metrics["probs_ratio"] == 1).all())
    assert store.list("p") == []  # the step cleared its keys


def test_prev_logprobs_come_from_an_independent_forward(qwen):
    _, _, _, _, batch = qwen
    t = LegacyTrainer(TrainerSettings("qwen2_vl"))
    prev = t.compute_logprobs(batch, Stage.LOGPROB)
    mask = batch["token_mask"].bool()
    assert torch.equal(prev, t.compute_logprobs(batch, Stage.LOGPROB))  # repeatable, bitwise
    assert (prev[mask] - batch["generation_logprobs"][mask]).abs().max() < 1e-5
    shifted = batch.replace(prev_logprobs=prev + 0.5, advantages=torch.zeros(3),
                            reference_logprobs=prev)
    out = t.train(shifted)
    assert torch.allclose(out.metrics["probs_ratio"],
                          torch.full_like(out.metrics["probs_ratio"], math.exp(-0.5)))


def test_data_plane_stage_fetches_follow_the_registry():
    s = TrainerSettings("text")
    t = DataPlaneTrainer(s, InMemoryDataPlane(), ReferenceCodec())
    meta = BatchMeta("p", ["a"], ["input_ids", "attention_mask", "input_lengths", "token_mask",
                                  "pixel_values", "image_grid_thw", "mm_token_type_ids",
                                  "prompt_lengths", "advantages"], [3], [{}])
    lp = t.stage_fields(meta, Stage.LOGPROB)
    train = t.stage_fields(meta, Stage.TRAIN)
    media = {"pixel_values", "image_grid_thw", "mm_token_type_ids"}
    assert media <= set(lp) and media <= set(train)
    assert "token_mask" not in lp and {"token_mask", "advantages"} <= set(train)
    assert "prompt_lengths" not in lp + train  # consumed by no stage


def test_truncation_and_dynamic_micro_batches_keep_ratio_one(qwen):
    _, _, _, _, batch = qwen
    cut = int(batch["input_lengths"].max()) - 3
    s = TrainerSettings("qwen2_vl", max_seq_len=cut, max_tokens_per_micro_batch=2 * cut)
    store, codec = InMemoryDataPlane(), ReferenceCodec()
    out = dataplane_step(batch, DataPlaneTrainer(s, store, codec), store, codec,
                         advantages=torch.tensor([1.0, -1.0, 0.5]))
    assert out.metrics["probs_ratio"].numel() == int(batch["token_mask"][:, :cut].sum())
    assert bool((out.metrics["probs_ratio"] == 1).all())


def test_fused_attention_is_detected_in_any_sub_model():
    """The trainer's backward runs in strict deterministic mode exactly where a sub-model runs
    fused attention (production Gemma3's SigLIP tower); eager models keep the default mode."""
    from rlconform.fixtures.families import build_family
    from rlconform.reference_impl.trainer import fused_attention

    fam = build_family("gemma3")
    assert not fused_attention(fam.build_model(seed=0))
    vision_sdpa = fam.model_class._from_config(
        fam.config, attn_implementation={"vision_config": "sdpa", "text_config": "eager",
                                         "": "eager"})
    assert fused_attention(vision_sdpa)


def test_strict_determinism_is_scoped_and_restores_the_mode():
    from rlconform.reference_impl.trainer import strict_determinism

    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled())
    with strict_determinism():
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
    assert (torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled()) == before
    with pytest.raises(ValueError), strict_determinism():
        raise ValueError("the mode is restored on the way out of an error too")
    assert (torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled()) == before


def test_data_plane_trainer_fetches_object_columns():
    """A stage's fetch list names the `<field>.<key>` wire columns of an object field it uses,
    so media written as per-row dicts are not left behind (the text-only train fetch)."""
    from types import SimpleNamespace

    from _helpers import qwen as qwen_batch

    from rlconform.reference_impl.trainer import DataPlaneTrainer

    wire = ReferenceCodec().encode(qwen_batch().to_row_dicts())
    meta = SimpleNamespace(fields=list(wire.columns))
    for stage in Stage:
        got = DataPlaneTrainer.stage_fields(None, meta, stage)
        assert {"multi_modal_inputs.pixel_values", "multi_modal_inputs.image_grid_thw",
                "input_ids", "position_ids"} <= set(got), (stage, got)
