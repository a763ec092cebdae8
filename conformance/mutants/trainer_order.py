"""Trainer mutants for the kinds of check that hold whatever the step: order-free passes and
intact pass inputs (TRAIN-ORDER-FREE, TRAIN-INPUT-INTACT)."""

from __future__ import annotations

from rlconform.conformance.mutants import mutant
from rlconform.reference_impl.codec import WireBatch
from rlconform.reference_impl.trainer import OUTPUT_FIELD, DataPlaneTrainer


def _backend(dataplane_cls: type):
    from rlconform.conformance.backends.reference import build
    from rlconform.conformance.backends.reference_trainer import trainer_factory

    return build(trainer=trainer_factory(dataplane_cls=dataplane_cls))


@mutant("trainer_fetches_in_put_order", "the trainer fetched its rows in the store's key order "
        "(list, filtered to the meta's keys) and paired them with the meta's keys by position: "
        "right whenever the meta is in put order", "trainer")
def _put_order():
    class T(DataPlaneTrainer):
        def fetch(self, meta, stage):
            wanted = set(meta.keys)
            order = [k for k in self.transport.list(meta.partition) if k in wanted]
            cols, tags = self.transport.get(meta.partition, order,
                                            select_fields=self.stage_fields(meta, stage))
            return self.codec.decode(WireBatch(cols, tags))

    return _backend(T)


@mutant("trainer_extends_caller_meta", "a logprob pass appended its output column to the "
        "caller's meta.fields and returned that same meta (with_fields in place)", "trainer")
def _extends_meta():
    class T(DataPlaneTrainer):
        def compute_logprobs(self, meta, stage):
            name = OUTPUT_FIELD[stage]
            batch = self.fetch(meta, stage)
            self.put_column(meta, batch, name, self.core.logprobs(batch, stage))
            if name not in meta.fields:
                meta.fields.append(name)
            return meta

    return _backend(T)
