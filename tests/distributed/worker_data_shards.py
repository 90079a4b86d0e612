"""Worker: each rank reads its shard with rank/size taken from kmp.distributed.

argv[1]: the TFDS data directory with kmp_digits prepared.
"""

from __future__ import annotations

import sys

import keras
from _common import write_result

import kmp
from kmp import data

world = kmp.distributed.init()
keras.config.set_dtype_policy("mixed_bfloat16")
data_dir = sys.argv[1]
unbatched = data.load("kmp_digits", "train", batch_size=None, data_dir=data_dir, with_ids=True)
ids = [bytes(x[2].numpy()).decode() for x in unbatched]
batched = data.load("kmp_digits", "train", batch_size=32, data_dir=data_dir)
batches = list(batched)
write_result(
    world.rank,
    {
        "rank": world.rank,
        "size": world.size,
        "ids": ids,
        "steps": len(batches),
        "dtype": batches[0][0].dtype.name,
    },
)
