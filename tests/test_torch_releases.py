"""shardprop on every torch release of its range: the declared range, op tables from the running
torch, and a compile registration that fails without breaking torch.

The last ones run in a fresh interpreter: what they check happens when ``torch._dynamo`` is first
imported, which a test process has usually done already.
"""
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from shardprop.mesh import compat
from tests.rankpool import REPO_ROOT


def test_range_is_checked_by_release():
    lo, hi = compat.SUPPORTED
    compat.check_torch_release(f"{lo[0]}.{lo[1]}.0+cu130")
    compat.check_torch_release(f"{hi[0]}.{hi[1]}.1")
    for outside in (f"{lo[0]}.{lo[1] - 1}.1", f"{hi[0]}.{hi[1] + 1}.0a0+git1234", "1.13.1"):
        with pytest.raises(ImportError, match=rf"supports torch {lo[0]}\.{lo[1]} to {hi[0]}\.{hi[1]}; this is torch {re.escape(outside)}"):
            compat.check_torch_release(outside)


def test_outside_range_can_be_allowed_with_a_warning(monkeypatch):
    from shardprop import config
    with config.patch(allow_any_torch=True), pytest.warns(RuntimeWarning, match="supports torch"):
        compat.check_torch_release("2.4.1")


def test_running_torch_is_in_range_and_pyproject_says_the_same_range():
    lo, hi = compat.SUPPORTED
    assert lo <= compat.torch_release() <= hi
    with open(os.path.join(REPO_ROOT, "pyproject.toml")) as f:
        text = f.read()
    assert f'"torch>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1] + 1}"' in text


def test_op_tables_skip_names_this_torch_lacks():
    ops = compat.aten_ops(["relu", "surely_not_an_aten_op"], ["default", "no_such_overload"])
    assert ops == [torch.ops.aten.relu.default]
    assert compat.aten_packets(["mm", "surely_not_an_aten_op"]) == [torch.ops.aten.mm]
    everything = compat.aten_ops(["add"])
    assert torch.ops.aten.add.Tensor in everything and torch.ops.aten.add.Scalar in everything


def test_no_module_reads_torch_version_or_probes_torch_outside_compat():
    # Differences between releases live in shardprop/mesh/compat.py; elsewhere, no release checks.
    pattern = re.compile(r"torch\.__version__|hasattr\((torch|dist|aten)\b|getattr\((dist|torch\._C), ")
    offenders = []
    for folder in ("shardprop", "ops", "mesh"):
        for root, _, files in os.walk(os.path.join(REPO_ROOT, folder)):
            for name in files:
                path = os.path.join(root, name)
                if not name.endswith(".py") or path.endswith(os.path.join("mesh", "compat.py")):
                    continue
                with open(path) as f:
                    for i, line in enumerate(f, 1):
                        if pattern.search(line):
                            offenders.append(f"{os.path.relpath(path, REPO_ROOT)}:{i}: {line.strip()}")
    assert not offenders, "release probes outside mesh/compat.py:\n" + "\n".join(offenders)


_FAILING_REGISTRATION = textwrap.dedent('''
    import os, sys
    import torch, torch.distributed as dist
    assert "torch._dynamo" not in sys.modules, "this check needs dynamo not yet imported"
    import shardprop
    from shardprop.mesh import compat
    from shardprop.tensor import compile_support

    def refuse(cls, *members):  # what torch 2.11 raised for a mesh that is not an OpaqueBase
        raise TypeError("Opaque type DeviceMesh must subclass torch._opaque_base.OpaqueBase (simulated)")
    compat.register_opaque_value = refuse

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
    dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = shardprop.init_device_mesh("cpu", (1,))
    x = shardprop.distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [shardprop.Shard(0)])
    print("relu", x.relu().full_tensor().sum().item())  # infers shapes on meta tensors

    import torch._dynamo  # runs the registrations: the failure must stay inside shardprop
    assert torch._dynamo.decorators is not None
    problems = compile_support.compile_problems()
    # both opaque registrations (the mesh, the placements) fail, each reported, nothing else
    assert len(problems) == 2 and all("simulated" in p for p in problems), problems
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p])
    p.sum().backward()
    opt.step()
    print("adamw", round(p.sum().item(), 4))
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh
    ref = distribute_tensor(torch.ones(4), init_device_mesh("cpu", (1,)), [Shard(0)])
    print("torch dtensor", (ref * 2).full_tensor().sum().item())
    print("eager after", (x * 2).full_tensor().sum().item())
    try:
        torch.compile(lambda t: t * 2, backend="eager", fullgraph=True)(x)
    except Exception as e:
        print("compile error:", type(e).__name__, str(e).replace(chr(10), " "))
    else:
        print("compile: no error")
    print("plain compile", torch.compile(lambda t: t + 1, backend="eager")(torch.zeros(2)).tolist())
    dist.destroy_process_group()
''')


def _free_port() -> str:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def test_failing_compile_registration_never_breaks_torch():
    out = subprocess.run([sys.executable, "-c", _FAILING_REGISTRATION, _free_port()], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = dict(line.split(" ", 1) if " " in line else (line, "") for line in out.stdout.splitlines())
    assert lines["relu"] == "28.0"
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p])
    p.sum().backward()
    opt.step()
    assert lines["adamw"] == str(round(p.sum().item(), 4))
    assert lines["torch"] == "dtensor 8.0"
    assert lines["eager"] == "after 56.0"
    error = lines["compile"]
    assert error.startswith("error:"), error
    for needed in ("torch.compile of DTensor programs does not work on torch", torch.__version__,
                   "DeviceMesh as an opaque value type", "simulated", "Eager DTensor code is unaffected"):
        assert needed in error, (needed, error)
    assert lines["plain"] == "compile [1.0, 1.0]"


def test_registration_run_at_once_when_dynamo_is_loaded_is_caught_too():
    import torch._dynamo  # noqa: F401
    from shardprop.tensor import compile_support
    before = compile_support.compile_problems()

    def broken(dynamo):
        raise RuntimeError("this torch lacks the thing")

    compile_support.when_dynamo_loads(broken, "a test registration")
    try:
        assert compile_support.compile_problems()[len(before):] == [
            "a test registration failed (RuntimeError: this torch lacks the thing)"]
        with pytest.raises(compile_support.CompileUnsupported, match="a test registration failed"):
            compile_support.check_compile()
    finally:
        compile_support._problems[:] = before
    compile_support.check_compile()


# op_db entries that some releases of the range have and others lack (2.15 adds the first five and
# drops cholesky and qr); each must pass where this torch has it.
RELEASE_OPS = {
    "linalg.polar": ("1d", "2d", "backward"),
    "linalg.matrix_sqrth": ("1d", "2d", "backward"),
    "nn.functional.linear_cross_entropy": ("1d", "2d", "uneven", "backward"),
    "nn.functional.linear_cross_entropy.chunked": ("1d", "2d", "backward"),
    "nn.functional.linear_cross_entropy.chunked_none": ("1d", "2d"),  # its backward makes plain tensors
    "cholesky": ("1d", "2d", "backward"),
    "qr": ("1d", "2d", "backward"),
}


def test_ops_that_come_and_go_with_releases_pass_where_present():
    from tests.opinfo_harness import PASS, SKIP, list_op_keys, run_checks
    from tests.rankpool import get_pool

    present = [k for k in RELEASE_OPS if k in set(list_op_keys())]
    assert present, "none of RELEASE_OPS on this torch: update the table"
    failures = []
    for variant in ("1d", "2d", "uneven", "backward"):
        ops = [k for k in present if variant in RELEASE_OPS[k]]
        for op, res in run_checks(get_pool(4), ops, variant, max_samples=3, max_combos=6).items():
            if res["outcome"] not in (PASS, SKIP):
                failures.append(f"{op} [{variant}]: {res['outcome']}: {res['detail']}")
    assert not failures, "\n".join(failures)
