"""Batches drawn within an aspect bucket, in a seeded, reproducible order.

For epoch ``e`` the order depends only on (seed, e): items of each bucket are
shuffled, cut into batches of ``batch_size`` (the last one of a bucket may be
smaller), and the batches of all buckets shuffled together. So the sampler's
position is fully described by (epoch, batch index), which is what a
checkpoint stores.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Sequence


class BucketBatchSampler:
    def __init__(self, buckets: Sequence[tuple[int, ...]], batch_size: int, seed: int):
        self.buckets = list(buckets)
        self.batch_size = batch_size
        self.seed = seed

    def epoch(self, epoch: int) -> list[list[int]]:
        rng = random.Random(f"difftrain:{self.seed}:{epoch}")
        groups: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for i, b in enumerate(self.buckets):
            groups[b].append(i)
        batches = []
        for b in sorted(groups):
            idx = groups[b]
            rng.shuffle(idx)
            batches += [idx[i : i + self.batch_size] for i in range(0, len(idx), self.batch_size)]
        rng.shuffle(batches)
        return batches

    def __len__(self) -> int:
        counts: dict[tuple[int, ...], int] = defaultdict(int)
        for b in self.buckets:
            counts[b] += 1
        return sum(-(-n // self.batch_size) for n in counts.values())
