"""How an aten op on DTensors runs: the dispatcher (the hot path), op schemas, cached sharding
propagation, the rule registry, decomposition of rule-less ops, random ops, and cache control.

Imports ``shardprop.tensor`` and ``shardprop.mesh``; tools observe it through hooks it calls
(``hooks.hooks.recorder``, ``propagate.add_no_rule_hint``), never by being imported here.
"""
