"""The embedded reference backend: every surface, in process, no server."""

from __future__ import annotations

from rlconform.conformance.backend import CAPABILITIES, Backend, package_version


def _transport(address=None):
    """The in-memory data plane; servable to rank processes (`address()`), which reopen it
    with `_transport(address=...)` (reference_impl/served.py)."""
    from rlconform.reference_impl.served import ServedDataPlane, StoreClient

    return ServedDataPlane() if address is None else StoreClient(address)


def _codec(pixel_dtype=None):
    from rlconform.reference_impl.codec import ReferenceCodec

    return ReferenceCodec(pixel_dtype)


def _meta():
    from rlconform.reference_impl.meta import BatchMeta

    return BatchMeta


def _batch_ops():
    from rlconform.reference_impl.batch import BatchOps

    return BatchOps()


def _trainer(*args, **kwargs):
    from rlconform.conformance.backends.reference_trainer_rollout import make_trainer

    return make_trainer(*args, **kwargs)


def _loss_options(config):
    from rlconform.conformance.backends.reference_trainer_rollout import loss_options

    return loss_options(config)


_trainer.loss_options = _loss_options  # every point of the GRPO family (reference_trainer_rollout.py)


def _rollout(*args, **kwargs):
    from rlconform.conformance.backends.reference_trainer_rollout import make_rollout

    return make_rollout(*args, **kwargs)


def build(name: str = "reference", description: str = "", **overrides) -> Backend:
    """The reference backend, or a variant of it with some parts replaced.

    Out-of-tree code calls `Backend.from_reference(name, ...)`, which insists on a name of its
    own; mutants call this and are renamed `mutant:<name>` by their registry."""
    parts = dict(
        name=name,
        description=description or "rlconform's reference implementation (in-memory data "
        "plane, flattened-jagged codec, HF trainer and rollout)",
        transport=_transport,
        codec=_codec,
        meta=_meta,
        batch_ops=_batch_ops,
        trainer=_trainer,
        rollout=_rollout,
        capabilities=frozenset(CAPABILITIES),
    )
    if "transport" in overrides and "capabilities" not in overrides:
        # a replaced transport cannot be reopened by rank processes unless it says so
        parts["capabilities"] = parts["capabilities"] - {"multiprocess"}
    parts.update(overrides)
    return Backend(**parts)


# The reference's capabilities that belong to one surface: a part that replaces the surface
# declares its own (the reference's in-memory store reopens across processes and holds object
# columns; an author's store need not). Every other capability stays with the parts kept.
SURFACE_CAPABILITIES = {
    "transport": frozenset({"object_columns", "partitions", "multiprocess"}),
    "meta": frozenset({"dp"}),
    "batch_ops": frozenset({"batch_algebra", "micro_batching", "truncation", "padding"}),
}


def derive(name: str, description: str = "", capabilities=(), without=(), **overrides
           ) -> Backend:
    """`Backend.from_reference`: the reference with some parts replaced. Capabilities add up:
    the reference's, less those of each surface replaced (SURFACE_CAPABILITIES), plus
    `capabilities`, less `without` (the explicit way to leave one out, with a note saying why
    where the report should show it)."""
    base = backend.capabilities
    for surface, caps in SURFACE_CAPABILITIES.items():
        if surface in overrides:
            base = base - caps
    unknown = sorted(set(without) - set(CAPABILITIES))
    if unknown:
        raise ValueError(f"backend {name!r}: `without` names unknown capabilities {unknown}; "
                         f"known: {sorted(CAPABILITIES)}")
    caps = (base | frozenset(capabilities)) - frozenset(without)
    return build(name=name, description=description, capabilities=caps, **overrides)


backend = build(version=package_version("rlconform"))
