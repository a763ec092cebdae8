"""Backends bundled with rlconform, by name (`--backend NAME`), and what each one needs.

This module imports nothing, so the noxfile can read the requirements before rlconform is
installed (`nox -s conformance -- --backend NAME` installs them).
"""

# a requirement with this prefix is installed with `pip install --no-deps`
NO_DEPS = "--no-deps "

BUNDLED = {
    "reference": ("rlconform.conformance.backends.reference:backend", ()),
    "transferqueue-simple": (
        "rlconform.conformance.backends.transferqueue:simple_backend",
        ("TransferQueue==0.1.11", "tensordict", "ray"),
    ),
    "transferqueue-mooncake": (
        "rlconform.conformance.backends.transferqueue:mooncake_backend",
        ("TransferQueue==0.1.11", "tensordict", "ray", "mooncake-transfer-engine-non-cuda"),
    ),
    "ray-objectstore": ("rlconform.conformance.backends.ray_objectstore:backend", ("ray",)),
    # verl pins transformers<5.11 (its data path runs with ours) and GPU packages: --no-deps
    "verl": (
        "rlconform.conformance.backends.verl:backend",
        (NO_DEPS + "verl==0.9.1", "tensordict==0.10.0", "TransferQueue==0.1.11", "ray",
         "omegaconf", "numpy", "packaging"),
    ),
    # NeMo-RL itself is not on the registry: its checkout must be on PYTHONPATH or NEMO_RL_SRC
    "nemo-rl": ("rlconform.conformance.backends.nemo_rl:backend", ("tensordict", "datasets")),
    # OpenRLHF's full dependency list pins deepspeed and flash-attn (GPU builds); its data path
    # (ppo_utils.experience, utils.vlm_utils) needs only pylatexenc beyond rlconform's own
    "openrlhf": ("rlconform.conformance.backends.openrlhf:backend",
                 (NO_DEPS + "openrlhf==0.11.2", "pylatexenc")),
}


def requirements(name: str) -> tuple[str, ...]:
    """pip requirements of a bundled backend (or of all of them for `all`)."""
    names = list(BUNDLED) if name == "all" else [name]
    reqs = [r for n in names if n in BUNDLED for r in BUNDLED[n][1]]
    return tuple(dict.fromkeys(reqs))
