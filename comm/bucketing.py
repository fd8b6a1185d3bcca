"""Buckets: which consecutive arrays travel in one collective. The one plan behind
``Communicator.allreduce_many`` and ``broadcast_many``, the data-parallel gradient buckets
(``fleetmpi.strategies.gradient_allreduce``) and sharding's from stage 2 on
(``fleetmpi.strategies.sharding``); each caller states its differences as arguments.

Walking the arrays in order, a bucket takes the next array unless that would change the dtype,
pass ``bucket_bytes`` (``fuse_grad_size_in_MB``; an array larger than that is a bucket of its
own) or bring in a layer beyond ``max_layers`` (``fuse_grad_size_in_TFLOPS``, which the
collective guide defines as the most layers per fused allreduce: its whole part, at least
one). ``bucket_bytes=None`` gives one bucket per array (``fuse_all_reduce_ops`` off).

``shard_bytes`` (sharding from stage 2 on): a bucket also holds at most ``1 /
BUCKETS_PER_SHARD`` of a shard of that many bytes, so the few buckets holding storage at once
stay small beside the shard (docs/sharding.md, "Gradient buckets").

``last_bucket_bytes`` (``last_comm_group_size_MB``, Paddle's "last communication group"): the
plan's last bucket is reduced last, after backward has finished (the flat buffers hold the
model's first parameters last, and backward completes them last), so its reduction is the
communication nothing overlaps. The longest tail of that bucket within ``last_bucket_bytes``
(at least its last array) becomes a bucket of its own; every bucket before it stays as
without the bound.
"""
from collections import namedtuple

BUCKETS_PER_SHARD = 4

Extent = namedtuple("Extent", "nbytes dtype")
Extent.__doc__ = "What the plan reads of an array: its bytes and dtype (for a parameter whose "\
                 "storage may be elsewhere)."


def megabytes(value):
    """Bytes of a size given in MiB, as the strategy fields give them."""
    return int(value * 2 ** 20)


def plan_buckets(arrays, bucket_bytes, layers=None, max_layers=None, shard_bytes=None,
                 last_bucket_bytes=None):
    """Index lists of the buckets of ``arrays`` (anything with ``nbytes`` and ``dtype``), in
    order; ``layers``: each array's layer, read with ``max_layers`` (module docstring)."""
    limit = bucket_bytes
    if limit is not None and shard_bytes is not None:
        limit = max(1, min(limit, shard_bytes // BUCKETS_PER_SHARD))
    max_layers = None if max_layers is None or layers is None else max(1, int(max_layers))
    buckets, current, current_bytes, seen = [], [], 0, set()
    for i, a in enumerate(arrays):
        layer = None if layers is None else layers[i]
        if current and (limit is None or a.dtype != arrays[current[0]].dtype
                        or current_bytes + a.nbytes > limit
                        or (max_layers is not None and layer not in seen
                            and len(seen) >= max_layers)):
            buckets.append(current)
            current, current_bytes, seen = [], 0, set()
        current.append(i)
        current_bytes += a.nbytes
        seen.add(layer)
    if current:
        buckets.append(current)
    if last_bucket_bytes is not None and buckets:
        buckets[-1:] = _cut_tail(buckets[-1], [arrays[i].nbytes for i in buckets[-1]],
                                 last_bucket_bytes)
    return buckets


def _cut_tail(bucket, sizes, most):
    """``bucket`` as one or two buckets, the second its longest tail of at most ``most`` bytes
    (at least its last array)."""
    keep, tail = len(bucket) - 1, sizes[-1]
    while keep > 0 and tail + sizes[keep - 1] <= most:
        keep -= 1
        tail += sizes[keep]
    return [bucket[:keep], bucket[keep:]] if keep else [bucket]
