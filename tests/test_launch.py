"""``python -m shardprop.launch``: a program written for torch's DTensor stack runs on shardprop unchanged.

In one process: a program module's imports of the redirected torch modules give shardprop's names (in
every import form), torch's own modules and ``importlib.import_module`` still get torch's, a name
shardprop lacks fails at import naming the table, a listed gap imports and raises when used, and the
hook comes off again. End to end: ``tests/programs/torch_tp_fsdp.py`` (TP x FSDP on 2x2, functional
collectives over a mesh, a DCP save; no shardprop in it) run by torchrun as it is and through the
launcher: the same losses, and the launched run computed with shardprop's DTensor.
"""
import builtins
import importlib
import json
import os
import subprocess
import sys
import tempfile

import pytest

import shardprop
from shardprop.interop import redirect_torch_imports
from shardprop.interop.torch_names import TABLE

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_as(module_name: str, code: str) -> dict:
    scope = {"__name__": module_name}
    exec(compile(code, f"<{module_name}>", "exec"), scope)  # noqa: S102 (a program's module, in miniature)
    return scope


_PROGRAM = """
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel
from torch.distributed.fsdp import fully_shard
import torch.distributed._functional_collectives as funcol
import torch.distributed.tensor
import torch.distributed.device_mesh
from torch.distributed.tensor.experimental._attention import _PTRRLoadBalancer
from torch.distributed.tensor.placement_types import _StridedShard
strided = isinstance(Shard(0), _StridedShard)
"""


def test_program_imports_get_shardprop_and_torch_keeps_its_own():
    import torch
    before = builtins.__import__
    with redirect_torch_imports():
        got = _run_as("user_program", _PROGRAM)
        torch_side = _run_as("torch.some_internal", "from torch.distributed.tensor import DTensor")
        by_importlib = importlib.import_module("torch.distributed.tensor")
        with pytest.raises(ImportError, match="torch_names"):
            _run_as("user_program", "from torch.distributed.tensor import no_such_name")
    assert builtins.__import__ is before
    assert got["DTensor"] is shardprop.DTensor and got["Shard"] is shardprop.Shard
    assert got["ColwiseParallel"] is shardprop.ColwiseParallel and got["fully_shard"] is shardprop.fully_shard
    assert got["funcol"].all_reduce.__module__ == "shardprop.mesh.functional_collectives"
    view = got["torch"]  # ``import torch.distributed.tensor`` binds torch: torch's, but the path leads to ours
    assert view.distributed.tensor.DTensor is shardprop.DTensor
    assert view.distributed.device_mesh.init_device_mesh is shardprop.init_device_mesh
    assert view.randn is torch.randn and view.distributed.get_rank is torch.distributed.get_rank
    assert torch_side["DTensor"] is not shardprop.DTensor and torch_side["DTensor"].__module__.startswith("torch.")
    assert by_importlib.DTensor is not shardprop.DTensor
    from shardprop.parallel.cp.load_balance import PTRRLoadBalancer
    assert got["_PTRRLoadBalancer"] is PTRRLoadBalancer  # torch's private context-parallel helpers: ours
    assert got["strided"] is False  # torchtitan's isinstance checks against a name we lack answer False
    # Outside the block, the same program imports torch's names again.
    assert _run_as("user_program", "from torch.distributed.tensor import DTensor")["DTensor"] is not shardprop.DTensor


def test_every_listed_name_resolves():
    from shardprop.interop.torch_names import NOT_PROVIDED, resolve
    for module, names in TABLE.items():
        for name, where in names.items():
            value = resolve(module, name)
            assert value is not None, (module, name)
            if where != NOT_PROVIDED:
                assert callable(value) or isinstance(value, type), (module, name, value)


def _torchrun(program, *args, launch: bool, port: int):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port", str(port)]
    if launch:
        cmd += ["-m", "shardprop.launch"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    out = subprocess.run(cmd + [program, *args], capture_output=True, text=True, timeout=240, env=env, cwd=REPO)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, f"no result (exit {out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
    return json.loads(line[len("RESULT "):])


@pytest.mark.timeout(600)
def test_torch_program_through_the_launcher_equals_torch():
    program = os.path.join(REPO, "tests", "programs", "torch_tp_fsdp.py")
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        torch_run = _torchrun(program, a, launch=False, port=29781)
        ours = _torchrun(program, b, launch=True, port=29782)
        assert os.path.exists(os.path.join(b, ".metadata"))  # torch's DCP wrote our DTensors
    assert torch_run["dtensor"].startswith("torch.") and ours["dtensor"].startswith("shardprop.")
    assert ours["is_dtensor"] and ours["replicate"]
    assert ours["losses"] == pytest.approx(torch_run["losses"], abs=1e-5), (ours["losses"], torch_run["losses"])


def _torch_manual_seed_per_stage():
    """A program's ``torch.distributed.tensor._random.manual_seed(seed + stage, world_mesh)``: torch's semantics."""
    import torch
    import torch.distributed as dist
    with redirect_torch_imports():
        got = _run_as("user_program", "from torch.distributed.tensor._random import manual_seed")
    mesh = shardprop.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage = mesh.get_local_rank("pp")
    got["manual_seed"](1234 + stage, mesh)  # seeds differ across the mesh: torch does not check, neither do we
    drawn = torch.rand(3).tolist()
    expected = torch.Generator().manual_seed(1234 + stage)
    mismatch_refused = False
    try:  # shardprop's own manual_seed keeps its check
        shardprop.manual_seed(1234 + stage, mesh)
    except RuntimeError as e:
        mismatch_refused = "different seeds" in str(e)
    return drawn == torch.rand(3, generator=expected).tolist(), mismatch_refused, dist.get_rank()


@pytest.mark.timeout(120)
def test_torch_manual_seed_name_does_not_require_equal_seeds():
    from tests.rankpool import run_on_ranks
    assert run_on_ranks(4, _torch_manual_seed_per_stage) == [(True, True, r) for r in range(4)]
