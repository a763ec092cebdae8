"""Trainer mutants for the kinds of check that hold whatever the step: order-free passes and
intact pass inputs (TRAIN-ORDER-FREE, TRAIN-INPUT-INTACT)."""

from __future__ import annotations

from rlconform.conformance.mutants import mutant
from rlconform.reference_impl.codec import WireBatch
from rlconform.reference_impl.registry import Stage
from rlconform.reference_impl.trainer import OUTPUT_FIELD, DataPlaneTrainer


def _backend(dataplane_cls: type):
    from rlconform.conformance.backends.reference import build
    from rlconform.conformance.backends.reference_trainer_rollout import trainer_factory

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


@mutant("trainer_train_consumes_caller_fields", "the train pass took the logprob columns it "
        "consumed off the fields of the metas it was given (meta.fields.remove), in place",
        "trainer")
def _consumes_fields():
    class T(DataPlaneTrainer):
        def train(self, meta):
            result = super().train(meta)
            for m in list(meta) if isinstance(meta, (list, tuple)) else [meta]:
                for name in OUTPUT_FIELD.values():
                    if name in m.fields:
                        m.fields.remove(name)
            return result

    return _backend(T)


@mutant("train_consumes_meta_list", "the train pass took the shard metas off the list it was "
        "given as it went (a work queue): the driver's list came back empty", "trainer")
def _consumes_list():
    class T(DataPlaneTrainer):
        def train(self, meta):
            if not isinstance(meta, list):
                return super().train(meta)
            queue = []
            while meta:
                queue.append(meta.pop(0))
            return super().train(queue)

    return _backend(T)


@mutant("advantages_fetched_in_put_order", "the train pass fetched the advantages column on its "
        "own, in the store's key order, and paired it with the meta's rows by position: a meta "
        "in another order trains each row on another row's advantage", "trainer")
def _advantages_in_put_order():
    class T(DataPlaneTrainer):
        def fetch(self, meta, stage):
            batch = super().fetch(meta, stage)
            if stage is not Stage.TRAIN or "advantages" not in batch.fields:
                return batch
            wanted = set(meta.keys)
            order = [k for k in self.transport.list(meta.partition) if k in wanted]
            cols, _ = self.transport.get(meta.partition, order, select_fields=["advantages"])
            return batch.replace(advantages=cols["advantages"])

    return _backend(T)
