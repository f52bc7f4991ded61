"""``shardprop.experimental``: the names of ``torch.distributed.tensor.experimental``.

``local_map`` (run a plain-tensor function on DTensors' shards), ``implicit_replication`` (plain
tensors join DTensor ops as Replicate, inside the context only) and ``register_sharding`` with
torch's contract: the rule returns ``(output_placements, input_placements)`` pairs, so code written
for torch switches by its import alone. shardprop's own ``register_sharding`` (top level) takes the
same rules with the pair the other way round, ``(inputs, outputs)``; the two names never share a
module, so neither hides the swap.

Example:
    >>> from shardprop.experimental import implicit_replication, local_map, register_sharding
"""
from shardprop.dispatch.implicit import implicit_replication
from shardprop.dispatch.registry import register_sharding as _register_sharding
from shardprop.parallel.local_map import local_map

__all__ = ["implicit_replication", "local_map", "register_sharding"]


def register_sharding(op):
    """torch's ``register_sharding``: register ``fn`` as the sharding rule of ``op`` (or a list of ops).

    ``fn`` is called with the op's arguments, DTensors replaced by their specs (keyword
    ``out=`` tensors too), and returns ``[(output_placements, input_placements), ...]``:
    one placement per output, and per argument (None for a non-tensor one). It overrides
    shardprop's built-in rule; ``shardprop.unregister_sharding(op)`` removes it.

    Example:
        >>> @register_sharding(torch.ops.mylib.tag.default)  # tag(str name, Tensor x)  # doctest: +SKIP
        ... def tag_rule(name, x):
        ...     return [([Replicate()], [None, Replicate()]), ([Shard(0)], [None, Shard(0)])]

        Overriding a built-in rule, then removing the override:

        >>> @register_sharding(torch.ops.aten.tanh.default)
        ... def gathering_tanh(x):                  # (outputs, inputs): always run replicated
        ...     return [([Replicate()], [Replicate()])]
        >>> x = distribute_tensor(torch.randn(8), init_device_mesh("cpu", (4,)), [Shard(0)])
        >>> torch.tanh(x).placements
        (R,)
        >>> shardprop.unregister_sharding(torch.ops.aten.tanh.default)
        >>> torch.tanh(x).placements                # the built-in rule again
        (S(0),)
    """
    def deco(fn):
        def swapped(*args, **kwargs):
            return [(ins, outs) for outs, ins in fn(*args, **kwargs)]
        swapped.__qualname__ = getattr(fn, "__qualname__", "torch_order_rule")
        _register_sharding(op)(swapped)
        return fn
    return deco
