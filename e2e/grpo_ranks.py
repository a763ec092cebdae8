"""Multi-step GRPO with data-parallel ranks as processes, beside the same steps in one process.

Every step: the rollout samples with its generation logprobs, a verifiable reward scores the
completions, and the same batch trains three copies of the policy that started from the same
weights: `world` rank processes (reference_impl/ranks.py: each rank reopens the store by its
address, fetches its shard, writes its prev and reference logprobs, and the gradients meet in a
gloo/NCCL all-reduce), the same shards in one process (`grpo.dataplane_step(world=W)`), and
world 1 in one process. With micro_batch_size >= the largest shard (the default here), each rank
runs one micro-batch, so the ranks equal the one-process shards bitwise at world 2, step after
step (conformance/catalogue/ranks.py, RANK-DP-PARITY regime ii); world 1 is compared within the clause's
tolerances. The rollout is refit with the ranks' weights after each step. Prints the step time
of the ranks and of one process.

    python -m rlconform.e2e.grpo_ranks --world 2 --steps 3 [--backend ray-objectstore]
                                       [--device cuda --dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def _update_rdiff(got: dict, want: dict, w0: dict) -> float:
    num = sum(float(((got[k].double() - want[k].double()) ** 2).sum()) for k in want)
    den = sum(float(((want[k].double() - w0[k].double()) ** 2).sum()) for k in want)
    return (num / den) ** 0.5 if den else 0.0


def run(family: str = "qwen2_vl", steps: int = 3, prompts: int = 4, group: int = 2,
        world: int = 2, max_new_tokens: int = 6, device: str = "cpu",
        dtype: torch.dtype = torch.float32, seed: int = 0, backend: str = "reference",
        micro_batch_size: int | None = None) -> dict:
    from rlconform.conformance.backend import load_backend
    from rlconform.conformance.backends import _procs
    from rlconform.conformance.backends.reference_trainer_rollout import make_rollout, make_trainer
    from rlconform.conformance.catalogue.ranks import (
        RANK_GRAD_NORM_RTOL,
        RANK_LOSS_ATOL,
        RANK_UPDATE_RTOL,
    )
    from rlconform.fixtures.families import build_family
    from rlconform.fixtures.images import make_prompts, reward
    from rlconform.reference_impl.codec import ReferenceCodec
    from rlconform.reference_impl.grpo import dataplane_step
    from rlconform.reference_impl.ranks import RankLaunch, dataplane_step_ranks
    from rlconform.reference_impl.trainer import TrainerSettings

    if device == "cpu":
        torch.set_num_threads(1)
    n = prompts * group
    mbs = micro_batch_size or -(-n // world)  # one micro-batch per rank
    settings = TrainerSettings(family=family, micro_batch_size=mbs, dtype=dtype, device=device,
                               seed=seed)
    store = load_backend(backend)
    before = _procs.descendants()
    per_step = []
    with store.session():
        transport = (store.transport if store.provides("transport")
                     else load_backend("reference").transport)()
        codec = ReferenceCodec(dtype)
        t0 = time.monotonic()
        ranks = make_trainer(settings, transport, codec,
                             ranks=RankLaunch(world, backend=backend, device=device))
        start_s = time.monotonic() - t0
        try:
            shards_one = make_trainer(settings, transport, codec)  # the same shards, 1 process
            world1 = make_trainer(settings, transport, codec)
            rollout = make_rollout(build_family(family), settings)
            for step in range(steps):
                texts, images, answers = make_prompts(prompts, [1, 2, 0, 1], seed=seed + step)
                texts = [t for t in texts for _ in range(group)]
                images = [i for i in images for _ in range(group)]
                answers = [a for a in answers for _ in range(group)]
                batch = rollout.generate(texts, images, max_new_tokens, seed=seed + step)
                rewards = torch.tensor([reward(a, c) + 0.01 * len(set(c.split())) /
                                        max(1, len(c.split()))
                                        for a, c in zip(answers, batch.extra["completions"])])
                kw = dict(rewards=rewards, group_size=group)
                w0 = world1.state_dict()
                t0 = time.monotonic()
                out = dataplane_step_ranks(batch, ranks, transport, codec,
                                           partition=f"ranks{step}", **kw)
                t_ranks = time.monotonic() - t0
                t0 = time.monotonic()
                one = dataplane_step(batch, shards_one, transport, codec,
                                     partition=f"one{step}", world=world, **kw)
                t_one = time.monotonic() - t0
                t0 = time.monotonic()
                w1 = dataplane_step(batch, world1, transport, codec, partition=f"w1{step}", **kw)
                t_w1 = time.monotonic() - t0
                reports = out.extra["ranks"].ranks
                bitwise = (out.loss == one.loss and out.grad_norm == one.grad_norm and
                           all(torch.equal(out.state_dict[k], one.state_dict[k])
                               for k in one.state_dict))
                dl = abs(out.loss - w1.loss)
                dg = abs(out.grad_norm - w1.grad_norm) / max(w1.grad_norm, 1e-30)
                du = _update_rdiff(out.state_dict, w1.state_dict, w0)
                per_step.append({
                    "step": step, "shards": out.shards,
                    "seconds_ranks": round(t_ranks, 3), "seconds_one_process": round(t_one, 3),
                    "seconds_world1": round(t_w1, 3),
                    "rank_seconds": [round(r.seconds, 3) for r in reports],
                    "loss": out.loss, "grad_norm": out.grad_norm,
                    "bitwise_vs_one_process": bitwise,
                    "ranks_agree": len({r.weights_digest for r in reports}) == 1,
                    "loss_abs_diff_vs_world1": dl, "grad_norm_rel_diff_vs_world1": dg,
                    "update_rel_diff_vs_world1": du,
                    "within_tolerance_vs_world1": dl <= RANK_LOSS_ATOL and
                    dg <= RANK_GRAD_NORM_RTOL[dtype] and du <= RANK_UPDATE_RTOL[dtype],
                    "probs_ratio_exactly_one": bool((out.metrics["probs_ratio"] == 1).all()),
                })
                rollout.refit(out.state_dict)
                # world 1 follows the ranks' weights, so each step compares one update
                world1.core.model.load_state_dict(out.state_dict)
        finally:
            ranks.close()
            transport.close()
    left = sorted(_procs.wait_gone(_procs.descendants() - before, 10.0))
    expect_bitwise = world == 2 and mbs >= max(len(s) for r in per_step for s in r["shards"])
    ok = not left and all(r["ranks_agree"] and r["within_tolerance_vs_world1"] and
                          r["probs_ratio_exactly_one"] and
                          (r["bitwise_vs_one_process"] or not expect_bitwise)
                          for r in per_step)
    return {"family": family, "device": device, "dtype": str(dtype).removeprefix("torch."),
            "backend": backend, "world": world, "micro_batch_size": mbs,
            "start_seconds": round(start_s, 3), "steps": per_step, "left_processes": left,
            "expect_bitwise_vs_one_process": expect_bitwise, "ok": ok}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", default="qwen2_vl")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--backend", default="reference",
                   help="whose transport the ranks reopen: reference, transferqueue-simple, "
                   "ray-objectstore")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--micro-batch-size", type=int, default=None,
                   help="default: the largest shard (one micro-batch per rank)")
    p.add_argument("--json", default="reports/out/e2e/grpo_ranks.json")
    a = p.parse_args(argv)
    result = run(a.family, a.steps, world=a.world, device=a.device,
                 dtype=getattr(torch, a.dtype), backend=a.backend,
                 micro_batch_size=a.micro_batch_size)
    print(f"world {a.world} as rank processes over {a.backend} ({a.device}, {a.dtype}); "
          f"ranks started in {result['start_seconds']:.1f}s")
    print(f"{'step':>4} {'ranks s':>8} {'1-proc s':>8} {'world1 s':>8} {'loss':>12} "
          f"{'grad_norm':>10} {'bitwise':>8} {'|dw|/|upd|':>10}")
    for r in result["steps"]:
        print(f"{r['step']:>4} {r['seconds_ranks']:>8.3f} {r['seconds_one_process']:>8.3f} "
              f"{r['seconds_world1']:>8.3f} {r['loss']:>12.6g} {r['grad_norm']:>10.4g} "
              f"{str(r['bitwise_vs_one_process']):>8} {r['update_rel_diff_vs_world1']:>10.2e}")
    steps = result["steps"][1:] or result["steps"]  # step 0 warms up the ranks
    mean = {k: sum(r[k] for r in steps) / len(steps)
            for k in ("seconds_ranks", "seconds_one_process", "seconds_world1")}
    print(f"step time (mean of steps {steps[0]['step']}..{steps[-1]['step']}): "
          f"{a.world} rank processes {mean['seconds_ranks']:.3f}s, one process with "
          f"{a.world} shards {mean['seconds_one_process']:.3f}s, world 1 "
          f"{mean['seconds_world1']:.3f}s")
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    if result["left_processes"]:
        print(f"processes left behind: {result['left_processes']}")
    print(f"{'OK' if result['ok'] else 'FAILED'}: {out}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
