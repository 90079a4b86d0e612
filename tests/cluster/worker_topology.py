"""Cluster worker: where each rank runs, the KMP_* settings it got, and its data shard.

argv[1]: output directory (shared by every host); argv[2]: the TFDS data directory.
Each rank writes rank{R}.json.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import kmp
from kmp import data

world = kmp.distributed.init()
out, data_dir = Path(sys.argv[1]), sys.argv[2]
unbatched = data.load("kmp_digits", "train", batch_size=None, data_dir=data_dir, with_ids=True)
ids = [bytes(x[2].numpy()).decode() for x in unbatched]
total = int(kmp.distributed.allreduce(len(ids), op="sum"))
payload = {
    "rank": world.rank,
    "size": world.size,
    "local_rank": world.local_rank,
    "local_size": world.local_size,
    "cross_rank": world.cross_rank,
    "cross_size": world.cross_size,
    "hostname": socket.gethostname(),
    "kmp_env": {k: v for k, v in os.environ.items() if k.startswith("KMP_PROBE")},
    "ids": ids,
    "total": total,
}
tmp = out / f".rank{world.rank}.tmp"
tmp.write_text(json.dumps(payload))
tmp.replace(out / f"rank{world.rank}.json")
