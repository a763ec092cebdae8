"""A synthetic, schema-valid report: for the suite's own tests, for docs, and for trying renderers.

`example_report()` is all green (the gate passes); `example_report(failing=True)` adds the
things a reader must find fast: a required failure with a hypothesis example, an advisory
failure, a waiver and a metric with a heavy tail. Numbers come from a seeded generator, so the
output is identical run to run.
"""

from __future__ import annotations

import copy
import random
from typing import Any

from .model import SCHEMA_VERSION, summarize_clauses, summarize_series, summarize_values

_CLAUSES = [
    # id, surface, capabilities, title
    ("DP-ROUNDTRIP", "transport", [], "put/get MUST return every field of every family exactly"),
    (
        "DP-JAGGED-LAYOUT",
        "transport",
        ["jagged_columns"],
        "get MUST return a jagged column in the layout it was written",
    ),
    ("DP-MERGE-PUT", "transport", [], "a later put of the same key MUST add columns, not replace"),
    ("DP-NO-ALIAS", "transport", [], "stored data MUST NOT alias caller tensors"),
    (
        "DP-OBJECT-COLUMNS",
        "transport",
        ["object_columns"],
        "object columns MUST round-trip by value",
    ),
    (
        "DP-MEDIA-DEDUP",
        "transport",
        ["media_dedup"],
        "rows sharing a media segment MUST each read it back",
    ),
    ("WIRE-ROUNDTRIP", "codec", [], "decode(encode(batch)) MUST equal batch, None rows included"),
    (
        "WIRE-DIM1-PACKING",
        "codec",
        ["dim1_packing"],
        "dim-1 packed media MUST keep per-row tile counts",
    ),
    ("META-SHARD-TAGS", "transport", ["dp"], "DP sharding MUST carry every row's tags"),
    ("BATCH-TRUNCATE-MEDIA", "codec", [], "truncation MUST NOT cut media rows"),
    (
        "TRAIN-FIELD-PARITY",
        "trainer",
        [],
        "the train fetch MUST see the fields the logprob pass saw",
    ),
    (
        "TRAIN-RATIO-ONE",
        "trainer",
        [],
        "probs_ratio MUST be exactly 1.0 for one inner step on the same batch",
    ),
    ("TRAIN-PIXEL-DTYPE", "trainer", ["bfloat16"], "pixels MUST reach the model in its dtype"),
    ("GEN-LOGPROB-PARITY", "rollout", [], "rollout logprobs MUST match trainer logprobs"),
    ("E2E-GRPO-SMOKE", "trainer", [], "a 4-step GRPO run MUST keep ratios and rewards finite"),
]
_MUTANTS = {
    "dropped_packed_on_write": ["DP-ROUNDTRIP", "WIRE-ROUNDTRIP"],
    "densified_uniform_rows": ["DP-JAGGED-LAYOUT"],
    "replace_on_put": ["DP-MERGE-PUT"],
    "aliasing_put": ["DP-NO-ALIAS"],
    "tags_dropped_by_dp_shard": ["META-SHARD-TAGS"],
    "truncated_wire_tensors": ["BATCH-TRUNCATE-MEDIA", "WIRE-ROUNDTRIP"],
    "image_blind_train_fetch": ["TRAIN-FIELD-PARITY"],
    "forced_on_policy_ratio": ["TRAIN-RATIO-ONE"],
    "fp32_pixels": ["TRAIN-PIXEL-DTYPE"],
    "tile_count_lost": ["WIRE-DIM1-PACKING"],
}


def _tests(cid: str, rng: random.Random, n: int = 3) -> list[dict[str, Any]]:
    module = {
        "DP": "transport",
        "WIRE": "codec",
        "META": "meta",
        "BATCH": "batch",
        "TRAIN": "trainer",
        "GEN": "rollout",
        "E2E": "e2e",
    }[cid.split("-")[0]]
    func = "test_" + cid.split("-", 1)[1].lower().replace("-", "_")
    families = ["qwen2_vl", "idefics3", "gemma3", "llava_next"][:n]
    return [
        {
            "nodeid": f"conformance/clauses/test_{module}.py::{func}[{fam}]",
            "outcome": "passed",
            "duration_s": round(rng.uniform(0.01, 0.4), 3),
            "message": "",
            "hypothesis": None,
        }
        for fam in families
    ]


def example_report(failing: bool = False, seed: int = 0) -> dict[str, Any]:
    rng = random.Random(seed)
    clauses = []
    for cid, surface, caps, title in _CLAUSES:
        tests = _tests(cid, rng)
        clauses.append(
            {
                "id": cid,
                "title": title,
                "surface": surface,
                "capabilities": caps,
                "required": True,
                "status": "passed",
                "message": "",
                "defect": f"the field defect {cid} guards (BACKGROUND.md section 3)",
                "mutants": [m for m, ids in _MUTANTS.items() if cid in ids],
                "duration_s": round(sum(t["duration_s"] for t in tests), 3),
                "tests": tests,
                "waivers": [],
                "metrics": {},
            }
        )
    by_id = {c["id"]: c for c in clauses}

    na = by_id["DP-OBJECT-COLUMNS"]
    na.update(
        status="not_applicable",
        tests=[],
        duration_s=None,
        message="backend does not declare capability object_columns",
    )
    by_id["TRAIN-RATIO-ONE"]["metrics"] = {
        "probs_ratio": summarize_values([1.0] * 812),
        "grad_norm": {"kind": "scalar", "value": 0.1234},
    }
    by_id["GEN-LOGPROB-PARITY"]["metrics"] = {
        "token_mult_prob_error": summarize_series(
            {s: [1.0 + abs(rng.gauss(0, 0.004)) for _ in range(400)] for s in range(8)}
        ),
        "logprob_abs_diff": summarize_values([abs(rng.gauss(0, 0.01)) for _ in range(2000)]),
    }
    by_id["E2E-GRPO-SMOKE"]["metrics"] = {
        "probs_ratio": summarize_series(
            {s: [rng.lognormvariate(0, 0.02 * s) for _ in range(300)] for s in range(4)}
        ),
        "reward": summarize_series(
            {s: [rng.random() * (0.5 + s / 8) for _ in range(64)] for s in range(4)}
        ),
    }

    if failing:
        f = by_id["TRAIN-FIELD-PARITY"]
        f["tests"][1].update(
            outcome="failed",
            message="pixel_values missing from the train fetch: fetched ['input_ids', "
            "'attention_mask'] | expected ['input_ids', 'attention_mask', 'pixel_values']\n"
            "assert 'pixel_values' in fetched",
            hypothesis={
                "example": "batch=Batch(rows=2, pixel_values=PackedTensor(rows=[(0,), None]))",
                "blob": "@reproduce_failure('6.100.0', b'AXicY2BgYGBgZGBkYGQ=')",
            },
        )
        f.update(status="failed", message=f["tests"][1]["message"])
        ratio = [rng.lognormvariate(0, 1.6) for _ in range(812)]
        f["metrics"] = {"probs_ratio": summarize_values(ratio)}
        adv = by_id["E2E-GRPO-SMOKE"]
        adv.update(
            required=False,
            status="failed",
            message="reward mean fell 30% between step 0 and step 3",
        )
        adv["tests"][0].update(outcome="failed", message=adv["message"])
        w = by_id["DP-MEDIA-DEDUP"]
        w.update(status="passed_with_waivers", message="1 of 3 tests waived")
        w["tests"][2].update(outcome="waived", message="row 3 read back segment 0 twice",
                             waived_by=[1])
        w["waivers"] = [{
            "index": 1,
            "category": "backend-bug",
            "reason": "shared segments are copied per row on put",
            "function": "store.put_rows",
            "input": "4 rows, rows 2 and 3 sharing row 0's image",
            "link": "https://example.invalid/issues/42",
            "expires": "2099-03-01",
            "expired": False,
            "scope": {"tests": [w["tests"][2]["nodeid"].split("::")[-1]],
                      "match": "read back segment"},
            "covered": 1, "matched": 1, "xpass_tests": [], "unused": False,
        }]

    killed_ids = {c["id"] for c in clauses
                  if c["status"] in ("passed", "passed_with_waivers", "waived", "failed")}
    kill = []
    for name, expected in _MUTANTS.items():
        fails = [cid for cid in expected if cid in killed_ids]
        if name == "truncated_wire_tensors":
            fails.append("DP-ROUNDTRIP")  # a collateral kill: shown, not required
        if failing and name == "tile_count_lost":
            fails = []  # a surviving mutant: the clause cannot fail, so it proves nothing
        kill.append(
            {
                "name": name,
                "defect": name.replace("_", " "),
                "expected": expected,
                "failed": fails,
                "killed": bool(fails),
            }
        )
    report = {
        "schema_version": SCHEMA_VERSION,
        "backend": "reference",
        "backend_info": {
            "name": "reference",
            "description": "the embedded reference data plane and trainer (in process)",
            "surfaces": ["transport", "codec", "trainer", "rollout"],
            "capabilities": [
                "jagged_columns",
                "media_dedup",
                "dim1_packing",
                "dp",
                "bfloat16",
                "cpu",
            ],
        },
        "provenance": {
            "rlconform_version": "0.1.0",
            "git_commit": "0123456789abcdef0123456789abcdef01234567",
            "python": "3.11.7",
            "platform": "Linux-6.1-x86_64-with-glibc2.36",
            "packages": {"torch": "2.13.0", "transformers": "5.24.0", "hypothesis": "6.100.0"},
            "device": {"type": "cpu", "name": None, "driver": None, "cuda": None},
            "cpu_count": 2,
            "profile": "ci",
            "dtype": "float32",
            "seed": seed,
            "started_at": "2026-12-02T14:00:00+00:00",
            "finished_at": "2026-12-02T14:00:12+00:00",
            "duration_s": 12.3,
            "command": "rlconform run --backend reference --profile ci",
        },
        "summary": summarize_clauses(clauses),
        "clauses": clauses,
        "kill_matrix": {"mutants": kill},
        "problems": [],
    }
    return copy.deepcopy(report)
