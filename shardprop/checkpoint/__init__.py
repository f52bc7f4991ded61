"""Everything around the training step that moves or stores DTensors: pickling, torch.distributed.checkpoint
(DCP) protocol, full state dicts, and cross-mesh moves (one chunk-overlap routine for loading and moving).

Imports ``shardprop.tensor`` and ``shardprop.mesh``; it attaches protocol methods and hooks to the tensor room.
"""
from shardprop.checkpoint import cross_mesh, dcp  # noqa: F401,E402  (attach the DCP protocol and the cross-mesh hook)
