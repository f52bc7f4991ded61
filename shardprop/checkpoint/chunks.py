"""Chunk arithmetic for checkpoints and cross-mesh moves.

The arithmetic itself lives in :mod:`shardprop.tensor.boxes` (redistribution within one mesh
uses it too, and the tensor room may not import this one); this module keeps the names the
checkpoint room has always used.

Example:
    >>> from shardprop.checkpoint.chunks import intersect
    >>> intersect(((0,), (4,)), ((2,), (4,)))
    ((2,), (2,))
"""
from shardprop.tensor.boxes import (Box, Transfer, intersect, mesh_ranks, narrow, numel, plan_transfers,  # noqa: F401
                                    rank_boxes, relative, shard_box)
