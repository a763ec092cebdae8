"""A report's provenance: what made it (rlconform, the packages that matter, git commit, device,
Python, platform), under which catalogue (its fingerprint), with which settings and when."""

from __future__ import annotations

import datetime as dt
import functools
import os
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

from rlconform.conformance import catalogue

KEY_PACKAGES = ("rlconform", "torch", "transformers", "tokenizers", "hypothesis", "pytest",
                "pytest-xdist", "tensordict", "ray", "TransferQueue", "vllm", "numpy", "verl")


def _version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


@functools.cache  # once per process (a kill-matrix worker writes one report per mutant)
def _git_commit() -> str | None:
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True,
                             text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _device_info(device: str) -> dict:
    info = {"type": "cuda" if device.startswith("cuda") else "cpu", "name": None,
            "driver": None, "cuda": None}
    if info["type"] == "cuda" and "torch" in sys.modules:
        import torch

        if torch.cuda.is_available():
            info["name"] = torch.cuda.get_device_name(0)
            info["cuda"] = torch.version.cuda
            try:
                out = subprocess.run(
                    ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                    capture_output=True, text=True, timeout=10)
                info["driver"] = out.stdout.strip().splitlines()[0] if out.stdout else None
            except (OSError, subprocess.TimeoutExpired, IndexError):
                pass
    else:
        info["name"] = platform.processor() or platform.machine()
    return info


@functools.cache
def _fingerprint() -> str:
    """The catalogue's fingerprint, once per process: it parses every clause module, and a
    kill-matrix worker writes one report per mutant (the clause modules do not change during
    a run)."""
    return catalogue.fingerprint()


def provenance(st, config) -> dict:
    now = time.time()
    return {
        "rlconform_version": _version("rlconform") or "not installed (source tree)",
        "git_commit": os.environ.get("RLCONFORM_GIT_COMMIT") or _git_commit(),
        "catalogue": _fingerprint(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": {p: v for p in KEY_PACKAGES if (v := _version(p))},
        "device": _device_info(config.getoption("--device")),
        "cpu_count": os.cpu_count(),
        "profile": config.getoption("--profile"),
        "dtype": config.getoption("--dtype"),
        "seed": config.getoption("--seed"),
        **_model_size(),
        "started_at": st.started_at,
        "finished_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "duration_s": round(now - st.started, 3),
        "command": " ".join(sys.argv),
    }


def _model_size() -> dict:
    from rlconform.fixtures.sizes import PRODUCTION, PRODUCTION_MODELS, model_size

    size = model_size()
    out: dict = {"model_size": size}
    if size == PRODUCTION:
        out["models"] = {f: f"{m} widths, random weights" for f, m in PRODUCTION_MODELS.items()}
    return out
