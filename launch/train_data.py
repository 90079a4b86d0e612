"""launch/train.py's data: each rank's train split, the elastic split, the evaluation.

A sibling of train.py (imported as ``train_data``); kmp is passed in, so importing this
module is light.
"""

from __future__ import annotations

import workloads
from train_measure import inject_overflow
from train_options import data_options, in_memory_names, memory_datasets


def data_spec(args, kmp):
    """The ``kmp.data.ShardSpec`` of the train split, TFDS or in memory."""
    if args.dataset in in_memory_names():
        return memory_datasets().shard_spec(
            args.dataset, "train", batch_size=args.batch_size, **data_options(args)
        )
    return kmp.data.shard_spec(
        args.dataset, "train", batch_size=args.batch_size, data_dir=args.data_dir
    )


def load_split(args, kmp, split: str, **kwargs):
    """This rank's part of ``split``: ``kmp.data.load`` or ``memory_datasets().load``."""
    if args.dataset in in_memory_names():
        kwargs.pop("image_size", None)
        ds = memory_datasets().load(args.dataset, split, **kwargs, **data_options(args))
        return workloads.model_inputs(args.model, ds)
    return kmp.data.load(args.dataset, split, data_dir=args.data_dir, **kwargs)


def elastic_data(args, kmp, compute_dtype: str, overflow_rank: int):
    """The split in memory, dealt to the ranks epoch by epoch (``--elastic``).

    ``--inject-overflow STEP`` poisons step STEP of the first epoch's first plan
    on the overflow rank of the world that starts the job.
    """

    def transform(ds, plan):
        fresh = plan.epoch == 0 and plan.start == 0
        if args.inject_overflow is not None and fresh and plan.rank == overflow_rank:
            print(f"rank {plan.rank}: step {args.inject_overflow} will overflow", flush=True)
            return inject_overflow(ds, args.inject_overflow)
        return ds

    return kmp.elastic.ElasticData.from_tfds(
        args.dataset,
        "train",
        batch_size=args.batch_size,
        data_dir=args.data_dir,
        image_size=args.image_size,
        dtype=compute_dtype,
        seed=args.seed,
        transform=transform,
    )


def evaluate(model, args, kmp) -> dict:
    """The test accuracy, or a language model's validation loss (nats and bits per byte)."""
    if args.model in workloads.LM_MODELS:
        ds = (
            memory_datasets()
            .load(args.dataset, "validation", batch_size=None, shuffle=False, **data_options(args))
            .batch(64)
        )
        return workloads.lm_metrics(model, args.model, ds, kmp)
    return {"test_accuracy": test_accuracy(model, args, kmp)}


def test_accuracy(model, args, kmp) -> float:
    """Accuracy over the whole test split: each rank scores its shard, counts are summed."""
    import numpy as np

    ds = load_split(
        args, kmp, "test", batch_size=None, shuffle=False, image_size=args.image_size
    ).batch(256)
    correct = total = 0
    for images, labels in ds:
        predicted = np.argmax(np.asarray(model(images, training=False)), axis=-1)
        correct += int((predicted == labels.numpy()).sum())
        total += int(labels.shape[0])
    counts = kmp.distributed.allreduce(np.array([correct, total], dtype=np.float64), op="sum")
    correct, total = (float(c) for c in np.asarray(counts))
    return correct / total
