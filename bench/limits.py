"""The physical limits of a data-parallel job: compute, wire, and the two ways they combine.

Pure arithmetic, read by ``peers_report.py`` (and described in ``docs/performance.md``):

* **compute limit**: the images/s of N independent processes on the same hosts (each
  trains alone, nothing is exchanged): no data-parallel job can beat it.
* **wire limit**: the images/s at which each rank's bytes per step fill its link:
  ``N x batch / (bytes sent per rank / link rate)``. A ring allreduce sends
  ``2 (N - 1) / N`` of the payload per rank; an allgather (kmp's ``bf16``
  compression, and sparse rows) sends ``N - 1`` payloads per rank.
* **non-overlapped limit**: compute and communication one after the other:
  ``N x batch / (t_compute + t_wire)``.
* **overlapped limit**: communication fully hidden behind compute (or the reverse):
  ``N x batch / max(t_compute, t_wire)``.

A job at its non-overlapped limit wastes nothing but overlap; one above it overlaps; none
can pass the overlapped limit.
"""

from __future__ import annotations

import re

ALGORITHMS = ("ring_allreduce", "allgather")
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}


def rate_bits(rate: str) -> float:
    """A ``tc`` rate such as ``"1gbit"`` or ``"500mbit"`` in bits per second."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.strip().lower())
    if not m:
        raise ValueError(f"not a tc rate: {rate!r} (for example '1gbit', '500mbit')")
    return float(m.group(1)) * _UNITS[m.group(2)]


def bytes_sent_per_rank(payload: float, n: int, algorithm: str) -> float:
    """Bytes one rank sends per step to reduce ``payload`` bytes over ``n`` ranks."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; one of {ALGORITHMS}")
    if n < 2:
        return 0.0
    return payload * (2 * (n - 1) / n if algorithm == "ring_allreduce" else n - 1)


def job_traffic(job: str, float32_bytes: float) -> tuple[float, str]:
    """What a peers job exchanges per step: (payload bytes, algorithm).

    fp16 compression halves a ring allreduce's payload; kmp's bf16 compression gathers
    the bfloat16 payload from every rank (Horovod has no bfloat16 sum); every other job
    (buckets, Horovod's tape, MultiWorkerMirroredStrategy) ring-allreduces float32.
    """
    if "bf16" in job:
        return float32_bytes / 2, "allgather"
    if "fp16" in job:
        return float32_bytes / 2, "ring_allreduce"
    return float32_bytes, "ring_allreduce"


def limits(
    independent_images_per_s: float, batch: int, n: int, sent_bytes: float, rate: float
) -> dict[str, float]:
    """The four limits (images/s over all ranks) and the step times behind them.

    Args:
        independent_images_per_s: N independent processes' images/s together.
        batch: Images per rank and step.
        n: Ranks.
        sent_bytes: Bytes each rank sends per step (:func:`bytes_sent_per_rank`).
        rate: The link's rate in bits per second (:func:`rate_bits`).
    """
    images = batch * n
    t_compute = images / independent_images_per_s
    t_wire = sent_bytes * 8 / rate
    return {
        "t_compute_s": t_compute,
        "t_wire_s": t_wire,
        "compute": independent_images_per_s,
        "wire": images / t_wire if t_wire else float("inf"),
        "non_overlapped": images / (t_compute + t_wire),
        "overlapped": images / max(t_compute, t_wire),
    }
