"""What the plugin's hook modules share about a test: the clauses it is tied to, its id as reports
show it, and the names of the properties its reports carry (xdist-safe: everything the controller
needs travels in the test reports' user_properties)."""

from __future__ import annotations

from rlconform.conformance import catalogue

# user_properties of a test's reports
CLAUSE_PROP = "rlconform_clauses"  # the clause IDs it is tied to (collection)
METRIC_PROP = "rlconform_metric"  # one record_metric call (fixtures)
GPU_PEAK_PROP = "rlconform_gpu_peak_gib"  # its peak GPU memory on CUDA (fixtures)
HYPOTHESIS_PROP = "rlconform_hypothesis"  # hypothesis' notes on a failure (outcomes)
# the skip reason of a test whose clauses the backend does not declare
NA_PREFIX = "not_applicable: "

MODEL_SURFACES = ("trainer", "rollout")
# the plugin's fixtures that hand a test a surface of the backend (the reference's where the
# backend lends it: fixtures.py); catalogue/docs.surfaces_by_clause reads which tests use them
SURFACE_FIXTURES = {"transport": ("transport",), "codec_factory": ("codec",),
                    "meta_cls": ("meta",), "batch_ops": ("batch_ops",)}
# the xdist groups the plugin makes (an "@rlconform-..." suffix of a test's id under loadgroup)
GROUP_PREFIX = "rlconform-"
# the xdist group of the model-building tests on a GPU (collection.one_device_group)
DEVICE_GROUP = GROUP_PREFIX + "device"


def needs_device(ids: list[str]) -> bool:
    """Whether a test tied to clauses `ids` uses the run's --device: it builds trainer or
    rollout models, or starts the RANK clauses' rank processes (each builds the trainer's model
    on the device and joins NCCL there). Every other clause test handles data structures of CPU
    tensors, whatever --device says (`--placement host`)."""
    from rlconform.conformance.catalogue.ranks import RANK_CLAUSES

    ranks = {c.id for c in RANK_CLAUSES}
    return any(i in ranks or (i in catalogue.BY_ID and catalogue.BY_ID[i].surface in
                              MODEL_SURFACES) for i in ids)


def clause_ids(item) -> list[str]:
    return [i for m in item.iter_markers("clause") for i in m.args]


def plain_nodeid(nodeid: str) -> str:
    """A test's id as reports show it: relative to the clause package (`test_codec.py::test_x[a]`,
    wherever rlconform is installed) and without the "@<group>" that xdist's loadgroup (and
    collection.suffix_nodeid) append."""
    nodeid = nodeid.split("@" + GROUP_PREFIX)[0]
    path, sep, rest = nodeid.partition("::")
    return f"{path.rsplit('clauses/', 1)[-1]}{sep}{rest}"


def tied_clauses(item) -> list[str] | None:
    return next((v for k, v in item.user_properties if k == CLAUSE_PROP), None)


def is_model_test(item) -> bool:
    return any(i in catalogue.BY_ID and catalogue.BY_ID[i].surface in MODEL_SURFACES
               for i in clause_ids(item))
