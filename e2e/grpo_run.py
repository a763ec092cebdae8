"""Multi-step GRPO, legacy (in memory) vs data plane, on one tiny VLM family.

Every step: the rollout samples with its generation logprobs, a verifiable reward scores the
completions, and the same batch trains two trainers that started from the same weights: one with
the batch in driver memory, one through a transport (rollout write, driver meta, DP shards each
fetching their fields). The run checks, per step, that both give bitwise the same loss, grad
norm and weights, that probs_ratio is exactly 1 (one inner step), and records the distributions
of BACKGROUND.md section 4. The rollout is refit with the trained weights after each step.

    python -m rlconform.e2e.grpo_run --family qwen2_vl --steps 3 [--device cuda --dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def _summary(t: torch.Tensor) -> dict:
    t = t.detach().float().flatten()
    if not t.numel():
        return {"count": 0}
    return {"count": t.numel(), "min": t.min().item(), "max": t.max().item(),
            "mean": t.mean().item()}


def run(family: str = "qwen2_vl", steps: int = 3, prompts: int = 4, group: int = 2,
        world: int = 2, max_new_tokens: int = 6, device: str = "cpu",
        dtype: torch.dtype = torch.float32, seed: int = 0) -> dict:
    from rlconform.conformance.backends.reference_trainer_rollout import make_rollout, make_trainer
    from rlconform.fixtures.families import build_family
    from rlconform.fixtures.images import make_prompts, reward
    from rlconform.reference_impl.codec import ReferenceCodec
    from rlconform.reference_impl.dataplane import InMemoryDataPlane
    from rlconform.reference_impl.grpo import dataplane_step, legacy_step
    from rlconform.reference_impl.trainer import TrainerSettings

    fam = build_family(family)
    settings = TrainerSettings(family=family, micro_batch_size=2, dtype=dtype, device=device,
                               seed=seed)
    transport, codec = InMemoryDataPlane(), ReferenceCodec(dtype)
    dp = make_trainer(settings, transport=transport, codec=codec)
    legacy = make_trainer(settings)
    rollout = make_rollout(fam, settings)
    per_step = []
    for step in range(steps):
        t0 = time.time()
        texts, images, answers = make_prompts(prompts, [1, 2, 0, 1], seed=seed + step)
        texts = [t for t in texts for _ in range(group)]
        images = [i for i in images for _ in range(group)]
        answers = [a for a in answers for _ in range(group)]
        batch = rollout.generate(texts, images, max_new_tokens, seed=seed + step)
        completions = batch.extra["completions"]
        # verifiable reward plus a small diversity term, so a random tiny policy still gets
        # non-zero group advantages
        rewards = torch.tensor([reward(a, c) + 0.01 * len(set(c.split())) / max(1, len(c.split()))
                                for a, c in zip(answers, completions)])
        out_dp = dataplane_step(batch, dp, transport, codec, partition=f"step{step}",
                                rewards=rewards, group_size=group, world=world)
        out_lg = legacy_step(batch, legacy, rewards=rewards, group_size=group, world=world)
        weights_equal = all(torch.equal(out_dp.state_dict[k], out_lg.state_dict[k])
                            for k in out_lg.state_dict)
        ratio = out_dp.metrics["probs_ratio"]
        row = {
            "step": step,
            "seconds": round(time.time() - t0, 3),
            "loss": out_dp.loss, "loss_legacy": out_lg.loss,
            "grad_norm": out_dp.grad_norm, "grad_norm_legacy": out_lg.grad_norm,
            "bitwise_equal": out_dp.loss == out_lg.loss and out_dp.grad_norm ==
            out_lg.grad_norm and weights_equal,
            "probs_ratio_exactly_one": bool((ratio == 1).all()),
            "left_in_transport": _left(transport, f"step{step}"),
            "metrics": {k: _summary(v) for k, v in out_dp.metrics.items()},
        }
        per_step.append(row)
        rollout.refit(dp.state_dict())
    ok = all(r["bitwise_equal"] and r["probs_ratio_exactly_one"] and not r["left_in_transport"]
             for r in per_step)
    return {"family": family, "device": device, "dtype": str(dtype).removeprefix("torch."),
            "steps": per_step, "ok": ok}


def _left(transport, partition: str) -> int:
    try:
        return len(transport.list(partition))
    except KeyError:
        return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", default="qwen2_vl")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--json", default="reports/out/e2e/grpo_run.json")
    a = p.parse_args(argv)
    result = run(a.family, a.steps, device=a.device, dtype=getattr(torch, a.dtype))
    print(f"{'step':>4} {'loss':>12} {'grad_norm':>10} {'bitwise':>8} {'ratio==1':>8} "
          f"{'tok_mult_err':>12} {'sampl_is':>9}")
    for r in result["steps"]:
        m = r["metrics"]
        tme = m.get("token_mult_prob_error", {}).get("mean", float("nan"))
        sir = m.get("sampling_importance_ratio", {}).get("mean", float("nan"))
        print(f"{r['step']:>4} {r['loss']:>12.6g} {r['grad_norm']:>10.4g} "
              f"{str(r['bitwise_equal']):>8} {str(r['probs_ratio_exactly_one']):>8} "
              f"{tme:>12.6f} {sir:>9.6f}")
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"{'OK' if result['ok'] else 'FAILED'}: {out}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
