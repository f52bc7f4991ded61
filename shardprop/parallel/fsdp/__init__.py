"""Fully sharded data parallelism: ``fully_shard`` (FSDP2's API), its units, hooks, flat buffers and mixed precision."""
