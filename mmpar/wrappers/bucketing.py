"""Bucket layout shared by the bucketed wrapper and ``forced_sync``.

Kept free of wrapper imports so :mod:`mmpar.wrappers.base` can use it.
"""
from typing import List, Sequence

import torch


def check_bucket_cap_mb(bucket_cap_mb) -> float:
    """Return ``bucket_cap_mb`` if it is a number > 0.

    Raises:
        ValueError: naming the bad value.
    """
    if (isinstance(bucket_cap_mb, bool)
            or not isinstance(bucket_cap_mb, (int, float))
            or not bucket_cap_mb > 0):
        raise ValueError(f'bucket_cap_mb={bucket_cap_mb!r} is not supported; '
                         'allowed: a number of MiB > 0')
    return float(bucket_cap_mb)


def assign_buckets(params: Sequence[torch.Tensor], cap_bytes: float,
                   itemsize: int) -> List[List[int]]:
    """Group parameter indices into buckets of at most ``cap_bytes``.

    Buckets are filled in reverse order of ``params`` (registration order),
    which is roughly the order backward produces gradients, so the first
    bucket fills and launches first. A parameter larger than the cap gets a
    bucket of its own.
    """
    buckets, current, size = [], [], 0
    for index in reversed(range(len(params))):
        nbytes = params[index].numel() * itemsize
        if current and size + nbytes > cap_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(index)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets
