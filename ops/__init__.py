"""shardprop.ops: sharding rules, one module per op family."""
