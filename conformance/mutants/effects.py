"""How strongly each trainer and rollout mutant moves the numeric metrics, at a given width.

For every mutant of the trainer and rollout surfaces and every family, one GRPO step runs on the
data plane with the mutant's surfaces (the reference for the rest), from the mutant's own rollout,
and the step's per-token distributions are recorded: probs_ratio (min, max, mean),
token_mult_prob_error and sampling_importance_ratio (mean, max). The reference's own step is the
first row of each family. A reader then sees, next to the exact clauses that kill each mutant,
whether the numeric gates alone would have caught it: at tiny widths an image-blind train fetch
moves probs_ratio by a few percent, where the field measured maxima of 216-2661.

    python -m rlconform.conformance.mutants.effects --device cuda --dtype bfloat16 --model-size production \
        --out reports/out/mutant_effects.json

The JSON (and a Markdown table beside it) lands in the report directory; `rlconform run` puts it
into the reference backend's report when it finds it there, as it does the kill matrix.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

from rlconform.conformance.catalogue.generation import GEN_SIR_TOL, GEN_TMPE_TOL
from rlconform.conformance.clauses import _globals

# the numeric gates a trainer or nightly job would apply on these metrics alone (named by
# their source): probs_ratio with one inner step (BACKGROUND s5: exactly 1; a loose gate would
# allow the clip range), token_mult_prob_error (BACKGROUND s4 strict bf16 gate) and the
# sampling importance ratio (1 +- 0.02)
RATIO_GATE = 0.2  # |probs_ratio - 1| beyond the PPO clip range


def _summary(t: torch.Tensor | None) -> dict:
    if t is None or not t.numel():
        return {}
    t = t.detach().double().flatten()
    return {"min": t.min().item(), "max": t.max().item(), "mean": t.mean().item()}


def _step(backend, family: str, settings, prompts, images, seed: int):
    from rlconform.conformance.backend import Backend
    from rlconform.conformance.backends.reference import build
    from rlconform.fixtures.families import build_family
    from rlconform.reference_impl.grpo import dataplane_step

    ref = build()

    def part(name):
        return getattr(backend, name) if isinstance(backend, Backend) and \
            backend.provides(name) else getattr(ref, name)

    rollout = part("rollout")(build_family(family), settings)
    batch = rollout.generate(prompts, images, 6, seed=seed)
    del rollout
    transport, codec = part("transport")(), part("codec")()
    trainer = part("trainer")(settings, transport, codec)
    rewards = torch.tensor([((7 * i) % 5) / 4 for i in range(len(batch))])
    try:
        out = dataplane_step(batch, trainer, transport, codec, part("meta")(), "effects",
                             rewards=rewards, group_size=2)
    finally:
        transport.close()
        del trainer
    return out.metrics


def _free() -> None:
    """Give back what the last step held: a crashed step's traceback keeps the trainer in a
    reference cycle, so collect before emptying CUDA's cache (production models are 5-9 GB)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def killers_from_run(kill_matrix: Path | None) -> dict[str, dict[str, list[str]]] | None:
    """mutant -> family -> clauses that killed it there, from a kill matrix written by
    `rlconform mutants` (its kills, not the catalogue's claims); None without one."""
    if kill_matrix is None or not Path(kill_matrix).is_file():
        return None
    from rlconform.conformance.engine.kill_matrix import kills_by_family

    return kills_by_family(json.loads(Path(kill_matrix).read_text()))


def measure(families: list[str], mutants: list[str], device: str, dtype: torch.dtype,
            seed: int = 0, on_row=None, kill_matrix: Path | None = None) -> dict:
    from rlconform.conformance.mutants import get_mutant, load_all
    from rlconform.fixtures.images import make_prompts
    from rlconform.reference_impl.trainer import TrainerSettings

    load_all()
    killers = killers_from_run(kill_matrix)
    rows: list[dict] = []
    result = {"device": device, "dtype": str(dtype).removeprefix("torch."),
              "model_size": os.environ.get("RLCONFORM_MODEL_SIZE", "tiny"),
              "gates": {"probs_ratio": f"|ratio - 1| > {RATIO_GATE}",
                        "token_mult_prob_error": f"mean > {GEN_TMPE_TOL[dtype]:g}",
                        "sampling_importance_ratio": f"|mean - 1| > {GEN_SIR_TOL:g}"},
              "killed_by_source": str(kill_matrix) if killers is not None else None,
              "rows": rows}
    for family in families:
        settings = TrainerSettings(family, dtype=dtype, device=device, seed=seed)
        pattern = [0] if family == "text" else [1, 0, 2]
        prompts, images, _ = make_prompts(3, pattern, seed=seed)
        prompts = [p for p in prompts for _ in range(2)]
        images = [i for i in images for _ in range(2)]
        for name in ["reference", *mutants]:
            t0 = time.time()
            row: dict = {"family": family, "mutant": name}
            if name != "reference" and killers is not None:
                # the kill matrix's own kills on this family's tests (and tests of no family)
                kills = killers.get(name, {})
                row["killed_by"] = sorted({*kills.get(family, ()), *kills.get("*", ())})
            if device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats()
            keep = _globals.saved()  # a hidden-effect mutant's grad mode etc. stays in its row
            try:
                backend = "reference" if name == "reference" else get_mutant(name).backend()
                metrics = _step(backend, family, settings, prompts, images, seed)
                for key in ("probs_ratio", "token_mult_prob_error",
                            "sampling_importance_ratio"):
                    row[key] = _summary(metrics.get(key))
            except Exception as exc:  # noqa: BLE001 - a mutant that crashes the step is a row
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                traceback.print_exc(limit=2)
            finally:
                _globals.restore(keep)
                if device.startswith("cuda"):
                    row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
                _free()
            row["numeric_gate_catches"] = _caught(row, dtype)
            row["seconds"] = round(time.time() - t0, 2)
            rows.append(row)
            print(_line(row), flush=True)
            if on_row is not None:  # a long GPU run keeps what it measured if it is cut short
                on_row(result)
    return result


def _caught(row: dict, dtype) -> bool | None:
    """Whether a metric-only gate (RATIO_GATE, GEN_TMPE_TOL, GEN_SIR_TOL) flags this step."""
    if "error" in row:
        return None  # a crash is caught, but not by a numeric gate
    r, e, s = (row.get(k) or {} for k in ("probs_ratio", "token_mult_prob_error",
                                          "sampling_importance_ratio"))
    flags = []
    if r:
        flags.append(r["max"] - 1 > RATIO_GATE or 1 - r["min"] > RATIO_GATE)
    if e:
        flags.append(e["mean"] > GEN_TMPE_TOL[dtype])
    if s:
        flags.append(abs(s["mean"] - 1) > GEN_SIR_TOL)
    return any(flags)


def _line(row: dict) -> str:
    r, e = row.get("probs_ratio") or {}, row.get("token_mult_prob_error") or {}
    f = lambda d, k: "—" if k not in d else f"{d[k]:.6g}"  # noqa: E731
    tail = row.get("error") or (f"ratio [{f(r, 'min')}, {f(r, 'max')}] mean {f(r, 'mean')}; "
                                f"tmpe mean {f(e, 'mean')} max {f(e, 'max')}")
    peak = f", peak {row['peak_gib']} GiB" if "peak_gib" in row else ""
    return f"{row['family']:>10} {row['mutant']:36} {tail} ({row['seconds']} s{peak})"


def markdown(result: dict) -> str:
    from rlconform.reports._common import (
        EFFECT_HEADER,
        mutant_effect_caption,
        mutant_effect_rows,
    )

    lines = [mutant_effect_caption(result), "", "| " + " | ".join(EFFECT_HEADER) + " |",
             "|" + "---|" * len(EFFECT_HEADER)]
    lines += ["| " + " | ".join(row) + " |" for row in mutant_effect_rows(result)]
    return "\n".join(lines) + "\n"


def _runs_the_default_point(mutant) -> bool:
    """Whether a mutant's trainer takes the default GRPO configuration (the one this step
    runs): a mutant of another configuration axis declares only its axis's points, and a
    default step shows nothing of it."""
    from rlconform.reference_impl.loss import LossConfig

    backend = mutant.backend()
    options = getattr(backend.trainer, "loss_options", None) if backend.trainer else None
    if options is None:
        return True
    try:
        options(LossConfig())
    except NotImplementedError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    from rlconform.fixtures.sizes import PRODUCTION_MODELS, SIZE_ENV

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--model-size", default=None, choices=["tiny", "production"])
    p.add_argument("--families", default="qwen2_vl,gemma3,smolvlm,text")
    p.add_argument("--mutants", default="", help="comma-separated (default: every trainer and "
                                                   "rollout mutant)")
    p.add_argument("--out", default="reports/out/mutant_effects.json")
    p.add_argument("--kill-matrix", default=None,
                   help="the kill matrix whose kills fill the 'killed by' column (default: "
                        "mutants/kill_matrix.json beside --out; the column says 'no kill "
                        "matrix run' without one)")
    a = p.parse_args(argv)
    if a.model_size:
        os.environ[SIZE_ENV] = a.model_size
    from rlconform.conformance.mutants import load_all

    mutants = [m for m in a.mutants.split(",") if m] or sorted(
        n for n, m in load_all().items() if m.surface in ("trainer", "rollout")
        and _runs_the_default_point(m))
    families = [f for f in a.families.split(",") if f]
    if os.environ.get(SIZE_ENV) == "production":
        families = [f for f in families if f in PRODUCTION_MODELS]
    torch.set_grad_enabled(True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def write(result: dict) -> None:
        out.write_text(json.dumps(result, indent=2))
        out.with_suffix(".md").write_text(markdown(result))

    km = Path(a.kill_matrix) if a.kill_matrix else out.parent / "mutants" / "kill_matrix.json"
    write(measure(families, mutants, a.device, getattr(torch, a.dtype), on_row=write,
                  kill_matrix=km))
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
