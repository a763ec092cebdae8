"""Hidden-effect mutants: the reference with one operation per surface that changes process-global
state (an RNG, grad or anomaly mode, the environment) and is otherwise correct. All but one
change state that leaves every result as it was, so only the *-NO-GLOBAL-EFFECTS clauses can
see them. The exception is grad mode left off: a later test's in-memory train in the same
process then raises (TRAIN-LEGACY-PARITY fails by that exception, not by an assertion), which
is the defect's real consequence. (A default dtype left changed breaks the next clause's batch
building everywhere, so no mutant here sets it.)"""

from __future__ import annotations

import os
import random

import torch

from rlconform.conformance.backends.reference import build
from rlconform.reference_impl.batch import BatchOps
from rlconform.reference_impl.codec import ReferenceCodec
from rlconform.reference_impl.dataplane import InMemoryDataPlane
from rlconform.reference_impl.meta import BatchMeta

from . import mutant


@mutant("store_client_exports_env", "the store client exported its session into the "
        "environment on each put (os.environ['STORE_SESSION'] = the partition), as clients "
        "that hand their settings to worker processes through the environment do",
        "transport")
def _exports_env():
    class T(InMemoryDataPlane):
        def put(self, partition, keys, columns, tags=None):
            os.environ["STORE_SESSION"] = partition
            return super().put(partition, keys, columns, tags)

    return build(transport=T)


@mutant("codec_draws_numpy_rng", "encode tagged each wire batch with a random id drawn from "
        "NumPy's global RNG (np.random.randint): every encode moves the RNG the caller's own "
        "sampling draws from", "codec")
def _draws_numpy():
    import numpy as np

    class C(ReferenceCodec):
        def encode(self, batch):
            self.last_batch_id = int(np.random.randint(2**31))  # for its logs
            return super().encode(batch)

    return build(codec=lambda pixel_dtype=None: C(pixel_dtype))


@mutant("dp_shard_seeds_python_random", "DP sharding seeded Python's global random with the "
        "world size (random.seed) to break ties between rows of equal length", "meta")
def _seeds_random():
    class M(BatchMeta):
        def shard_for_dp(self, world):
            random.seed(world)
            return super().shard_for_dp(world)

    return build(meta=lambda: M)


@mutant("micro_batches_seed_torch_rng", "micro_batches seeded torch's global RNG with the "
        "shuffle seed (torch.manual_seed before its permutation) instead of a generator of its "
        "own", "batch_ops")
def _seeds_torch():
    class Ops(BatchOps):
        def micro_batches(self, batch, n, shuffle_seed=None):
            if shuffle_seed is not None:
                torch.manual_seed(int(shuffle_seed))
            return super().micro_batches(batch, n, shuffle_seed)

    return build(batch_ops=Ops)


@mutant("train_leaves_grad_disabled", "the train pass turned grad mode off for its metrics "
        "(torch.set_grad_enabled(False)) and never back on: the caller's next backward records "
        "nothing", "trainer")
def _grad_off():
    from rlconform.conformance.mutants.trainer import _backend
    from rlconform.reference_impl.trainer import DataPlaneTrainer

    class T(DataPlaneTrainer):
        def train(self, meta):
            torch.set_grad_enabled(True)  # its own steps still train
            try:
                return super().train(meta)
            finally:
                torch.set_grad_enabled(False)

    return _backend(T)


@mutant("train_leaves_anomaly_detection_on", "the train pass switched on autograd anomaly "
        "detection (torch.autograd.set_detect_anomaly(True)) to trace NaN gradients and left "
        "it on: every later backward in the process records a stack per op, several times "
        "slower", "trainer")
def _anomaly_on():
    from rlconform.conformance.mutants.trainer import _backend
    from rlconform.reference_impl.trainer import DataPlaneTrainer

    class T(DataPlaneTrainer):
        def train(self, meta):
            torch.autograd.set_detect_anomaly(True)
            return super().train(meta)

    return _backend(T)


@mutant("generate_seeds_global_rngs", "generate seeded every global RNG with the request seed "
        "(transformers.set_seed: Python's, NumPy's, torch's) before sampling", "rollout")
def _set_seed():
    from transformers import set_seed

    from rlconform.conformance.mutants.rollout import _backend
    from rlconform.reference_impl.rollout import HFRollout

    class R(HFRollout):
        def generate(self, prompts, images, max_new_tokens, seed=0):
            set_seed(seed)
            return super().generate(prompts, images, max_new_tokens, seed)

    return _backend(R)
