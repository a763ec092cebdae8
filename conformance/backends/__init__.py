"""Backends bundled with rlconform, by name (`--backend NAME`)."""

BUNDLED = {
    "reference": "rlconform.conformance.backends.reference:backend",
    "transferqueue-simple": "rlconform.conformance.backends.transferqueue:simple_backend",
    "transferqueue-mooncake": "rlconform.conformance.backends.transferqueue:mooncake_backend",
    "ray-objectstore": "rlconform.conformance.backends.ray_objectstore:backend",
}
