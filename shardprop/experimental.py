"""``shardprop.experimental``: the names of ``torch.distributed.tensor.experimental``.

``local_map`` (run a plain-tensor function on DTensors' shards) and ``implicit_replication`` (plain
tensors join DTensor ops as Replicate, inside the context only); both are also exported at the top
level. ``register_sharding`` is not re-exported here: shardprop's (top level) takes options as
(inputs, outputs) where torch's takes (outputs, inputs), so the same name must not hide the swap.

Example:
    >>> from shardprop.experimental import implicit_replication, local_map
"""
from shardprop.dispatch.implicit import implicit_replication
from shardprop.parallel.local_map import local_map

__all__ = ["implicit_replication", "local_map"]
