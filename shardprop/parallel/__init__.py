"""Parallelism built on the engine: tensor-parallel styles, ``parallelize_module``, ``loss_parallel``,
and data-parallel gradient buckets.

Imports ``shardprop.tensor``, ``shardprop.dispatch`` and ``shardprop.mesh``.
"""
