"""The distributed tensor itself: placements, specs, shard layout, ``DTensor``, ``distribute_tensor``,
differentiable conversions, and redistribution planning and execution.

Imports only ``shardprop.mesh``. Nothing here knows how ops are dispatched.
"""
from shardprop.tensor import conversions  # noqa: F401  (attaches from_local/to_local/redistribute/full_tensor)
