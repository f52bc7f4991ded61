"""Run a program written for torch's DTensor stack on shardprop, unchanged.

    python -m shardprop.launch SCRIPT [ARGS...]
    python -m shardprop.launch -m MODULE [ARGS...]
    torchrun --nproc-per-node 4 -m shardprop.launch -m torchtitan.train --job.config_file ...
    python -m shardprop.launch --list            # what is redirected, name by name

The program runs exactly as ``python SCRIPT`` (or ``python -m MODULE``) would run it (``sys.argv``,
``__main__``, ``sys.path[0]``), with its imports of ``torch.distributed.tensor`` (and the submodules
in the table), ``torch.distributed._tensor``, ``torch.distributed.device_mesh``,
``torch.distributed.fsdp`` and ``torch.distributed._functional_collectives`` pointed at shardprop
(``shardprop.interop``). torch's own modules keep importing torch's. Nothing in the program's files
changes.

Example:
    >>> main(["--list"])  # doctest: +ELLIPSIS
    torch.distributed._composable.fsdp -> shardprop
    ...
    0
"""
from __future__ import annotations

import os
import runpy
import sys
from typing import List, Optional

from shardprop.interop import describe, install

__all__ = ["main"]

_USAGE = "usage: python -m shardprop.launch [--list] (SCRIPT | -m MODULE) [ARGS...]"


def main(argv: Optional[List[str]] = None) -> int:
    """Run the program ``argv`` names with the imports redirected; returns the exit code for ``--list`` / usage.

    Example:
        >>> main([])
        usage: python -m shardprop.launch [--list] (SCRIPT | -m MODULE) [ARGS...]
        2
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--list"]:
        print(describe())
        return 0
    if not argv or (argv[0] == "-m" and len(argv) < 2):
        print(_USAGE)
        return 2
    install()
    if argv[0] == "-m":
        module, rest = argv[1], argv[2:]
        sys.argv = [module] + rest  # runpy puts the module's file here, as python -m does
        sys.path.insert(0, os.getcwd())
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        script, rest = argv[0], argv[1:]
        sys.argv = [script] + rest
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
