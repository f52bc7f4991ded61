"""Duck typing of DTensor parameters, and mesh reads, inside compiled modules answer as in eager.

User code often asks a tensor what it is (``hasattr(w, "full_tensor")``, ``getattr(w, "to_local", None)``)
instead of importing DTensor. dynamo answers ``hasattr`` False for every method of a tensor subclass
(torch's own DTensor too), so such code took its plain-tensor branch only when compiled. Here every
public method and property is asked about, in eager and under ``torch.compile(fullgraph=True)``, on
parameters of modules under each of our styles' hooks (column- and row-parallel, sequence-parallel
norm, expert parallel, ``fully_shard``, a plain ``distribute_tensor``), and the branch the answer picks
(``w.to_local()`` / ``w.full_tensor()`` inside the graph) must compute what eager computes. A module
holding a mesh reads ``size``, ``ndim``, ``shape``, ``get_local_rank`` and ``get_coordinate`` in a
``fullgraph=True`` forward, on a root mesh and on a slice.
"""
import pytest
import torch

from tests.rankpool import run_on_ranks

pytestmark = pytest.mark.timeout(300)

NAMES = ("to_local", "full_tensor", "redistribute", "placements", "device_mesh", "from_local")


def _answers(w):
    """What user code may ask of a parameter, and a value that depends on the branch it takes."""
    flags = [hasattr(w, n) for n in NAMES] + [getattr(w, "to_local", None) is not None, hasattr(w, "no_such_method")]
    value = w.full_tensor().sum() if hasattr(w, "full_tensor") else w.sum()
    local = w.to_local().sum() if hasattr(w, "to_local") else w.sum()
    return flags, value, local


class _Probe(torch.nn.Module):
    """Runs ``inner`` and reports what duck typing says about ``param`` (a dotted name into ``inner``)."""

    def __init__(self, inner, param: str):
        super().__init__()
        self.inner, self.param = inner, param

    def forward(self, x):
        w = self.inner.get_parameter(self.param)
        flags, value, local = _answers(w)
        out = self.inner(x)
        return out, flags, value, local


def _case(style: str):
    import shardprop as P
    from shardprop.demo.moe import MoE
    torch.manual_seed(0)
    mesh = P.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    if style == "expert":
        inner, param, x = MoE(dim=8, hidden=8, num_experts=4, top_k=2), "experts.w1", torch.randn(2, 3, 8)
        P.parallelize_module(inner.experts, mesh, P.ExpertParallel())
    elif style == "sequence_norm":
        inner, param, x = torch.nn.RMSNorm(8), "weight", torch.randn(2, 4, 8)
        P.parallelize_module(inner, mesh, P.SequenceParallel())
    else:
        inner, param, x = torch.nn.Sequential(torch.nn.Linear(8, 8)), "0.weight", torch.randn(4, 8)
        if style == "rowwise":
            x = torch.randn(4, 4)  # this rank's piece of the input features (the style's Shard(-1) input)
        if style in ("colwise", "rowwise"):
            P.parallelize_module(inner, mesh, {"0": P.ColwiseParallel() if style == "colwise" else P.RowwiseParallel()})
        elif style == "fully_shard":
            P.fully_shard(inner, mesh=mesh)
        else:  # parameters and input distributed by hand, no module hooks
            for name in ("weight", "bias"):
                value = getattr(inner[0], name).detach()
                setattr(inner[0], name, torch.nn.Parameter(P.distribute_tensor(value, mesh, [P.Shard(0)])))
            x = P.distribute_tensor(x, mesh, [P.Replicate()])
    probe = _Probe(inner, param)
    eager = probe(x)
    torch._dynamo.reset()
    # Expert routing reads split sizes on the host, and fully_shard's hooks are eager (as torch's): both run
    # outside the graph (a graph break there).
    compiled = torch.compile(probe, backend="aot_eager", fullgraph=style not in ("expert", "fully_shard"))(x)
    return eager[1], compiled[1], float(eager[2]), float(compiled[2]), float(eager[3]), float(compiled[3])


@pytest.mark.parametrize("style", ["colwise", "rowwise", "sequence_norm", "expert", "fully_shard", "distributed"])
def test_hasattr_of_dtensor_methods_answers_as_in_eager_under_compile(style):
    for eager, compiled, value, cvalue, local, clocal in run_on_ranks(2, _case, style):
        assert eager[:-1] == [True] * (len(NAMES) + 1) and eager[-1] is False, eager
        assert compiled == eager, dict(zip(NAMES + ("getattr", "no_such_method"), compiled))
        assert cvalue == pytest.approx(value, rel=1e-5) and clocal == pytest.approx(local, rel=1e-5)


# ---------------------------------------------------------------- mesh methods inside compiled code
_MESH_READS = {
    "size()": lambda m: m.size(), "size(0)": lambda m: m.size(0), "size('tp')": lambda m: m.size("tp"),
    "ndim": lambda m: m.ndim, "shape[-1]": lambda m: m.shape[-1], "get_local_rank()": lambda m: m.get_local_rank(),
    "get_local_rank('tp')": lambda m: m.get_local_rank("tp"), "get_coordinate()[1]": lambda m: m.get_coordinate()[1],
}


class _MeshReader(torch.nn.Module):
    """A module holding a mesh and reading it in its forward (torchtitan's sharding helpers do)."""

    def __init__(self, mesh, read):
        super().__init__()
        self.mesh, self.read = mesh, read

    def forward(self, x):
        return x * self.read(self.mesh) + 1


def _mesh_reads():
    import shardprop as P
    mesh = P.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out = {}
    for name, read in _MESH_READS.items():
        for which, m in (("root", mesh), ("slice", mesh["tp"])):
            if which == "slice" and name == "get_coordinate()[1]":
                continue  # a 1-d slice has one coordinate
            x = torch.ones(2)
            torch._dynamo.reset()
            try:
                got = torch.compile(_MeshReader(m, read), backend="aot_eager", fullgraph=True)(x)
                out[f"{which}.{name}"] = (float(_MeshReader(m, read)(x)[0]), float(got[0]))
            except Exception as e:  # noqa: BLE001 (reported per read)
                out[f"{which}.{name}"] = (float(_MeshReader(m, read)(x)[0]), f"{type(e).__name__}: {e}"[:200])
    return out


def test_mesh_methods_read_inside_compiled_code_as_in_eager():
    for reads in run_on_ranks(4, _mesh_reads):
        wrong = {k: v for k, v in reads.items() if v[0] != v[1]}
        assert not wrong, wrong
        assert len(reads) >= 14


# ---------------------------------------------------------------- placements read inside compiled code
class _PlacementReader(torch.nn.Module):
    """torchtitan's output check (protocols/module.py _redistribute_outputs): read the placements of a DTensor
    made inside the graph, compare them with expected ones, read ``dim``, and redistribute on the answer."""

    def __init__(self, P, mesh):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        P.parallelize_module(self, mesh, {"lin": P.ColwiseParallel(use_local_output=False)})
        self.P, self.mesh = P, mesh

    def forward(self, x):
        P, y = self.P, self.lin(x)
        p = y.placements
        answers = [isinstance(p[0], P.Shard), isinstance(p[0], P.Replicate), p[0] == P.Shard(1), p[0] != P.Shard(0),
                   p == (P.Shard(1),), p[0].is_shard(), p[0].is_shard(1), p[0].is_replicate(), p[0].is_partial(),
                   p[0].dim, len(p)]  # not hash(): 2.11's dynamo cannot trace hash() of any opaque value (torch's too)
        if isinstance(p[0], P.Shard) and p[0].dim == 1:
            y = y.redistribute(self.mesh, [P.Replicate()])
        return y.to_local() * 2, answers, [q == P.Replicate() for q in y.placements]


def _placement_reads():
    import shardprop as P
    torch.manual_seed(0)
    mesh = P.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    module, x = _PlacementReader(P, mesh), torch.randn(4, 8)
    eager = module(x)
    torch._dynamo.reset()
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True)(x)
    return eager[1:], compiled[1:], float((eager[0] - compiled[0]).detach().abs().max())


def test_placements_of_an_in_graph_dtensor_read_inside_compiled_code_as_in_eager():
    for eager, compiled, diff in run_on_ranks(2, _placement_reads):
        assert eager[0][:3] == [True, False, True] and eager[1] == [True], eager
        assert compiled == eager and diff == 0.0, (eager, compiled)
