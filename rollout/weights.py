"""The weight sync's wire format: a published version is a `Manifest` of buckets in Ray's object store.

The learner cuts its state dict into buckets of at most `bucket_mb` MiB (`publish`); a rollout
worker fetches them one at a time while its engine loads them (`iter_weights`). How the driver
orchestrates a sync (deadlines, lost workers, the GPU/NCCL path) is rl/sync.py; this module is the
record both sides share, so it lives below both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator

import numpy as np
import ray


@dataclass
class Manifest:
    """One published version: what a rollout worker needs to fetch and load it."""

    version: int
    buckets: list  # ObjectRefs, each to a list of (name, array)
    bucket_bytes: list[int]
    names: list[list[str]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return int(sum(self.bucket_bytes))


def bucketize(named: Iterable[tuple[str, np.ndarray]], max_bytes: int) -> Iterator[list[tuple[str, np.ndarray]]]:
    """Consecutive (name, array) pairs grouped so each group holds at most `max_bytes` (a single
    array larger than that is a group of its own). Order is kept: every array appears exactly once.
    Lazy: a group is yielded as soon as it is full, so a streamed source (a sharded learner
    gathering one tensor at a time) is never held whole."""
    cur, size = [], 0
    for name, arr in named:
        if cur and size + arr.nbytes > max_bytes:
            yield cur
            cur, size = [], 0
        cur.append((name, arr))
        size += arr.nbytes
    if cur:
        yield cur


def publish(named: Iterable[tuple[str, np.ndarray]], version: int, bucket_mb: float) -> Manifest:
    """Put the weights into the object store, bucket by bucket (runs inside the learner)."""
    m = Manifest(version=version, buckets=[], bucket_bytes=[], names=[])
    for g in bucketize(named, max(1, int(bucket_mb * (1 << 20)))):  # each bucket into the store as it fills
        m.buckets.append(ray.put(g))
        m.bucket_bytes.append(int(sum(a.nbytes for _, a in g)))
        m.names.append([n for n, _ in g])
    return m


def iter_weights(manifest: Manifest) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) pairs of a manifest, fetching one bucket at a time (runs inside a rollout worker).
    The previous bucket's arrays are released before the next is fetched."""
    for ref in manifest.buckets:
        bucket = ray.get(ref)
        yield from bucket
        del bucket
