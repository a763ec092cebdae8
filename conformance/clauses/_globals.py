"""Process-global state an operation may change behind its caller's back, and what changed.

A library call that seeds torch's global RNG (`torch.manual_seed`, `transformers.set_seed`),
turns grad mode off without restoring it, sets the default dtype, the thread counts or the
deterministic-algorithm flags, or writes the environment changes every later computation of the
process: the next sampling step draws other numbers, the next backward silently records nothing,
the next allocation gets another dtype. None of it raises, and none of it shows in the call's
result. `snapshot()` records the state; `changes(before, after)` names what differs, as
`"name: before -> after"`; `saved()` and `restore()` put back what an operation changed, so a
failing backend's change does not spread into the clauses that run after it in the process.

Names are stable (a backend declares the ones it must change by these names: `Backend.
changes_globals`); each environment variable is its own name, `env.<VARIABLE>`.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
from collections.abc import Callable

import torch

ENV_PREFIX = "env."


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:12]


def _torch_rng() -> str:
    # the initial seed says what a `manual_seed` set; the digest catches draws as well
    return f"seed {torch.initial_seed()}, state {_digest(torch.get_rng_state().numpy().tobytes())}"


def _cuda_rng() -> str | None:
    # read only once CUDA is initialised: reading would initialise it (a context on every GPU
    # of the host, in a run that may be on the CPU); an operation that initialises it starts
    # the generators at their default state, which `changes` does not count as a change
    if not torch.cuda.is_initialized():
        return None
    return ", ".join(f"cuda:{i} {_digest(s.numpy().tobytes())}"
                     for i, s in enumerate(torch.cuda.get_rng_state_all()))


def _python_random() -> str:
    return _digest(repr(random.getstate()).encode())


def _numpy_random() -> str | None:
    try:
        import numpy as np
    except ImportError:
        return None
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return f"{kind} {_digest(keys.tobytes())} at {pos}, gauss {has_gauss} {cached!r}"


def _cudnn(flag: str) -> Callable[[], object]:
    return lambda: getattr(torch.backends.cudnn, flag)


# name -> reader; every reader is cheap (microseconds) and changes nothing
READERS: dict[str, Callable[[], object]] = {
    "torch_rng": _torch_rng,
    "cuda_rng": _cuda_rng,
    "python_random": _python_random,
    "numpy_random": _numpy_random,
    "default_dtype": torch.get_default_dtype,
    "default_device": lambda: str(torch.get_default_device()),
    "grad_mode": torch.is_grad_enabled,
    "inference_mode": torch.is_inference_mode_enabled,
    "anomaly_mode": torch.is_anomaly_enabled,
    "deterministic_algorithms": lambda: (torch.are_deterministic_algorithms_enabled(),
                                         torch.is_deterministic_algorithms_warn_only_enabled()),
    "cudnn.enabled": _cudnn("enabled"),
    "cudnn.benchmark": _cudnn("benchmark"),
    "cudnn.deterministic": _cudnn("deterministic"),
    "cudnn.allow_tf32": _cudnn("allow_tf32"),
    "matmul.allow_tf32": lambda: torch.backends.cuda.matmul.allow_tf32,
    "float32_matmul_precision": torch.get_float32_matmul_precision,
    "intra_op_threads": torch.get_num_threads,
    "inter_op_threads": torch.get_num_interop_threads,
}


def known(name: str) -> bool:
    """Whether `name` names a piece of state `snapshot` records (a reader's name, or
    `env.<VARIABLE>`)."""
    return name in READERS or (name.startswith(ENV_PREFIX) and len(name) > len(ENV_PREFIX))


def snapshot() -> dict[str, object]:
    """The process-global state now: every reader's value, and each environment variable."""
    out = {name: read() for name, read in READERS.items()}
    out.update({ENV_PREFIX + k: v for k, v in os.environ.items()})
    return out


# environment variables whose values a report must not carry (CI hosts hold credentials there)
_SECRET = re.compile(r"TOKEN|SECRET|PASSW|KEY|CREDENTIAL|AUTH", re.IGNORECASE)


def _shown(name: str, value: object) -> str:
    if value is None:
        return "unset"
    if name.startswith(ENV_PREFIX) and _SECRET.search(name):
        return f"<{len(str(value))} characters, sha256 {_digest(str(value).encode())[:8]}>"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def changes(before: dict[str, object], after: dict[str, object]) -> dict[str, str]:
    """What differs between two snapshots: name -> `"before -> after"` (an environment variable
    added or removed shows as unset on that side; the value of one whose name looks like a
    credential's is shown by its length and a digest only)."""
    out = {}
    for name in sorted(before.keys() | after.keys()):
        a, b = before.get(name), after.get(name)
        if a != b and not (name == "cuda_rng" and a is None):
            out[name] = f"{_shown(name, a)} -> {_shown(name, b)}"
    return out


def saved() -> dict[str, object]:
    """What `restore` needs to put the settable state back as it is now (RNG states whole)."""
    import numpy as np

    return {
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
        "python_random": random.getstate(),
        "numpy_random": np.random.get_state(),
        "default_dtype": torch.get_default_dtype(),
        "grad_mode": torch.is_grad_enabled(),
        "anomaly_mode": torch.is_anomaly_enabled(),
        "deterministic_algorithms": (torch.are_deterministic_algorithms_enabled(),
                                     torch.is_deterministic_algorithms_warn_only_enabled()),
        "cudnn": {f: getattr(torch.backends.cudnn, f)
                  for f in ("enabled", "benchmark", "deterministic", "allow_tf32")},
        "matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "intra_op_threads": torch.get_num_threads(),
        "environ": dict(os.environ),
    }


def restore(state: dict[str, object]) -> None:
    """Put back what `saved()` recorded (torch allows no later change of the inter-op thread
    count or of inference mode outside a context: those two stay as they are)."""
    import numpy as np

    torch.set_rng_state(state["torch_rng"])
    if state["cuda_rng"] is not None:
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    random.setstate(state["python_random"])
    np.random.set_state(state["numpy_random"])
    torch.set_default_dtype(state["default_dtype"])
    torch.set_grad_enabled(state["grad_mode"])
    torch.autograd.set_detect_anomaly(state["anomaly_mode"])
    enabled, warn_only = state["deterministic_algorithms"]
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
    for flag, value in state["cudnn"].items():
        setattr(torch.backends.cudnn, flag, value)
    torch.set_float32_matmul_precision(state["float32_matmul_precision"])  # sets tf32 too
    torch.backends.cuda.matmul.allow_tf32 = state["matmul.allow_tf32"]
    torch.set_num_threads(state["intra_op_threads"])
    if dict(os.environ) != state["environ"]:
        os.environ.clear()
        os.environ.update(state["environ"])
