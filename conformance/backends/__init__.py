"""Backends bundled with rlconform, by name (`--backend NAME`), and what each one needs.

This module imports nothing, so the noxfile can read the requirements before rlconform is
installed (`nox -s conformance -- --backend NAME` installs them).
"""

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
    # NeMo-RL itself is not on the registry: its checkout must be on PYTHONPATH or NEMO_RL_SRC
    "nemo-rl": ("rlconform.conformance.backends.nemo_rl:backend", ("tensordict", "datasets")),
    "trl": ("rlconform.conformance.backends.trl:backend", ("trl==1.16.0",)),
    "trl-independent-passes": (
        "rlconform.conformance.backends.trl:independent_backend", ("trl==1.16.0",)),
}


def requirements(name: str) -> tuple[str, ...]:
    """pip requirements of a bundled backend (or of all of them for `all`)."""
    names = list(BUNDLED) if name == "all" else [name]
    reqs = [r for n in names if n in BUNDLED for r in BUNDLED[n][1]]
    return tuple(dict.fromkeys(reqs))
