"""Programs written for torch's DTensor stack, run on shardprop: the names they import and how they are redirected.

``shardprop.launch`` runs a program with :func:`redirect_torch_imports` on; :mod:`torch_names` is the table of
what each redirected torch module gives.

Example:
    >>> from shardprop.interop import redirect_torch_imports
    >>> program = {"__name__": "train"}  # a module of the program (shardprop's own are never redirected)
    >>> with redirect_torch_imports():
    ...     exec("from torch.distributed.fsdp import fully_shard", program)
    >>> program["fully_shard"] is __import__("shardprop").fully_shard
    True
"""
from shardprop.interop.redirect import install, redirect_torch_imports, uninstall
from shardprop.interop.torch_names import TABLE, describe

__all__ = ["install", "uninstall", "redirect_torch_imports", "TABLE", "describe"]
