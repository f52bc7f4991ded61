"""Uneven tensor-parallel shards (issue 30, item 1): every style on sizes tp does not divide.

torch lays a dim of size 10 out over 4 ranks in ``torch.chunk`` order, (3, 3, 3, 1); size 2 leaves two
ranks empty (1, 1, 0, 0). Each case builds one small module from one seed and runs forward, backward and
3 AdamW steps four ways on the same ranks:

* one process (the oracle, always);
* shardprop with its eager fast paths on, and with them off (``shardprop.fast_paths(False)``): the two
  must agree in values, placements and local shapes;
* ``torch.distributed.tensor.parallel`` (the reference) where torch supports the case: same values,
  placements and local shapes.

Compared: the output (value, placements, local shape), the input gradient, every parameter's gradient
and, after the steps, every parameter (value, placements, local shape). Meshes: 4 ranks (tp=4) and a 2x2
(dp, tp) mesh with tp=2 (the dp ranks of a tp group feed the same data).

Where torch does not support a case it is checked against one process only (``torch_ok=False``):
a column-parallel Linear feeding a row-parallel one through plain local tensors (torch's from_local
assumes even pieces, so its row-parallel matmul sees a global shape of 12 for a hidden dim of 10 and
fails in sharding propagation; shardprop takes the row-parallel input's global size from the weight).
"""
import dataclasses
import functools
from types import SimpleNamespace
from typing import Callable, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.rankpool import run_on_ranks

pytestmark = pytest.mark.timeout(600)  # importing torch.distributed.tensor on a loaded machine is slow

D, B, SEQ = 8, 3, 7  # model dim, batch, sequence (7: not divisible by 2 or 4)
STEPS = 3
ATOL = dict(atol=1e-5, rtol=1e-4)
TWIN = dict(atol=1e-6, rtol=1e-5)  # fast paths on vs off: the same math, maybe another summation order


# ---------------------------------------------------------------- models
class MLP(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.up, self.down = nn.Linear(D, hidden), nn.Linear(hidden, D)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class TinyLM(nn.Module):
    """Embedding -> sequence-parallel norm -> MLP (residual) -> norm -> vocabulary head."""

    def __init__(self, n):
        super().__init__()
        self.emb = nn.Embedding(n, D)
        self.norm = nn.LayerNorm(D)
        self.mlp = MLP(n)
        self.out_norm = nn.RMSNorm(D)
        self.head = nn.Linear(D, n)

    def forward(self, tokens):
        h = self.emb(tokens)
        h = h + self.mlp(self.norm(h))
        return self.head(self.out_norm(h))


def _lm_plan(a):
    s1 = a.Shard(1)
    return {"emb": a.Rowwise(input_layouts=a.Replicate(), output_layouts=s1, use_local_output=False),
            "norm": a.Sequence(),
            "mlp.up": a.Colwise(input_layouts=s1, use_local_output=False),  # torch needs the global shape
            "mlp.down": a.Rowwise(output_layouts=s1, use_local_output=False),
            "out_norm": a.Sequence(),
            "head": a.Colwise(input_layouts=s1, use_local_output=False)}


@dataclasses.dataclass(frozen=True)
class Case:
    """One module and plan, parameterised by the uneven size ``n``."""
    make: Callable  # n -> module
    plan: Callable  # (api, n) -> plan (a style or a dict)
    data: Callable  # (n, generator) -> (input, output cotangent or targets)
    in_shard: Optional[int] = None  # feed the input as a DTensor sharded on this dim (None: plain, replicated)
    loss_parallel: bool = False  # cross-entropy on class-sharded logits under loss_parallel()
    torch_ok: Callable = lambda n, tp: True  # torch.distributed.tensor.parallel supports the case for n over tp
    between: int = 0  # DTensor ops the model runs outside its styled modules (the fast paths dispatch no others)


def _no_empty_piece(n, tp) -> bool:
    """torch's loss_parallel indexes an empty class shard ("index 0 is out of bounds for dimension 1
    with size 0") on the ranks that hold one, and the others then wait in a collective."""
    return n >= tp


def _x(shape):
    return lambda n, g: (torch.randn(*shape(n), generator=g), None)


def _ids(vocab, shape):
    return lambda n, g: (torch.randint(0, vocab(n), shape(n), generator=g), None)


def _tokens_targets(n, g):
    return torch.randint(0, n, (B, SEQ), generator=g), torch.randint(0, n, (B * SEQ,), generator=g)


def _feats_targets(n, g):
    return torch.randn(B, D, generator=g), torch.randint(0, n, (B,), generator=g)


CASES = {
    # Linear, column-parallel: weight and bias S(0) of size n
    "colwise_replicated_out": Case(lambda n: nn.Linear(D, n), lambda a, n: a.Colwise(output_layouts=a.Replicate()),
                                   _x(lambda n: (B, D))),
    "colwise_dtensor_out": Case(lambda n: nn.Linear(D, n), lambda a, n: a.Colwise(use_local_output=False),
                                _x(lambda n: (B, SEQ, D))),
    # Linear, row-parallel: weight S(1) of size n, bias replicated
    "rowwise_replicated_in": Case(lambda n: nn.Linear(n, D), lambda a, n: a.Rowwise(input_layouts=a.Replicate()),
                                  _x(lambda n: (B, n))),
    "rowwise_dtensor_in": Case(lambda n: nn.Linear(n, D), lambda a, n: a.Rowwise(), _x(lambda n: (B, SEQ, n)),
                               in_shard=-1),
    "rowwise_seq_out": Case(lambda n: nn.Linear(D, D), lambda a, n: a.Rowwise(
        input_layouts=a.Replicate(), output_layouts=a.Shard(1), use_local_output=False), _x(lambda n: (B, n, D))),
    # Colwise -> Rowwise through plain local tensors: torch's from_local takes the pieces as even
    "mlp_local": Case(MLP, lambda a, n: {"up": a.Colwise(), "down": a.Rowwise()}, _x(lambda n: (B, SEQ, D)),
                      torch_ok=lambda n, tp: False),
    # Colwise -> Rowwise around a sequence-sharded activation of length n (DTensors throughout), hidden 10
    "mlp_sequence": Case(lambda n: MLP(D + 2), lambda a, n: {
        "up": a.Colwise(input_layouts=a.Shard(1), use_local_output=False),
        "down": a.Rowwise(output_layouts=a.Shard(1), use_local_output=False)},
        _x(lambda n: (B, n, D)), in_shard=1, between=1),  # gelu
    # Embedding: vocabulary-sharded (masked lookup, a partial sum) and embedding-dim sharded
    "embedding_rowwise": Case(lambda n: nn.Embedding(n, D), lambda a, n: a.Rowwise(input_layouts=a.Replicate()),
                              _ids(lambda n: n, lambda n: (B, SEQ))),
    "embedding_rowwise_seq_out": Case(lambda n: nn.Embedding(n, D), lambda a, n: a.Rowwise(
        input_layouts=a.Replicate(), output_layouts=a.Shard(1), use_local_output=False),
        _ids(lambda n: n, lambda n: (B, n))),
    "embedding_colwise": Case(lambda n: nn.Embedding(11, n), lambda a, n: a.Colwise(output_layouts=a.Replicate()),
                              _ids(lambda n: 11, lambda n: (B, SEQ))),
    "embedding_colwise_dtensor_out": Case(lambda n: nn.Embedding(11, n),
                                          lambda a, n: a.Colwise(use_local_output=False),
                                          _ids(lambda n: 11, lambda n: (B, SEQ))),
    # SequenceParallel: a sequence of length n
    "sequence_layernorm": Case(lambda n: nn.LayerNorm(D), lambda a, n: a.Sequence(), _x(lambda n: (B, n, D)),
                               in_shard=1),
    "sequence_rmsnorm": Case(lambda n: nn.RMSNorm(D), lambda a, n: a.Sequence(), _x(lambda n: (B, n, D)),
                             in_shard=1),
    # loss_parallel: n classes
    "loss_parallel": Case(lambda n: nn.Linear(D, n), lambda a, n: a.Colwise(use_local_output=False),
                          _feats_targets, loss_parallel=True, torch_ok=_no_empty_piece),
    # all of it: vocabulary and hidden size n, sequence 7
    "tiny_lm": Case(TinyLM, lambda a, n: _lm_plan(a), _tokens_targets, loss_parallel=True, torch_ok=_no_empty_piece,
                    between=2),  # gelu, residual add
}


# ---------------------------------------------------------------- rank side
def _api(kind):
    if kind == "torch":
        import torch.distributed.tensor as t
        import torch.distributed.tensor.parallel as tp
        from torch.distributed.device_mesh import init_device_mesh
        return SimpleNamespace(DTensor=t.DTensor, Shard=t.Shard, Replicate=t.Replicate,
                               distribute_tensor=t.distribute_tensor, init_device_mesh=init_device_mesh,
                               parallelize_module=tp.parallelize_module, Colwise=tp.ColwiseParallel,
                               Rowwise=tp.RowwiseParallel, Sequence=tp.SequenceParallel, loss_parallel=tp.loss_parallel)
    import shardprop as sp
    return SimpleNamespace(DTensor=sp.DTensor, Shard=sp.Shard, Replicate=sp.Replicate,
                           distribute_tensor=sp.distribute_tensor, init_device_mesh=sp.init_device_mesh,
                           parallelize_module=sp.parallelize_module, Colwise=sp.ColwiseParallel,
                           Rowwise=sp.RowwiseParallel, Sequence=sp.SequenceParallel, loss_parallel=sp.loss_parallel)


def _tp_mesh(api, shape):
    if len(shape) == 1:
        return api.init_device_mesh("cpu", shape, mesh_dim_names=("tp",))
    return api.init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))["tp"]


def _placements(t) -> tuple:
    """Placements by kind and non-negative dim, comparable between torch's classes and ours."""
    out = []
    for p in t.placements:
        kind = type(p).__name__
        out.append(f"{kind}({p.dim % t.ndim})" if kind == "Shard" else kind)
    return tuple(out)


def _dispatches() -> int:
    """Ops that went through shardprop's dispatcher so far (the fast paths send none)."""
    from shardprop.dispatch.dispatcher import call_counts
    return sum(call_counts().values())


def _record(t):
    """(full value, placements, local shape) of a DTensor; (value, None, None) of a plain tensor."""
    if t is None:
        return None
    t = t.detach()
    if hasattr(t, "full_tensor"):
        return t.full_tensor(), _placements(t), tuple(t.to_local().shape)
    return t.clone(), None, None


class StepFailed(Exception):
    """The optimizer step failed (torch's AdamW on a parameter with an empty piece); carries what was recorded."""

    def __init__(self, rec, error):
        super().__init__(f"{type(error).__name__}: {str(error).splitlines()[0]}")
        self.rec = rec


def _run(case: Case, n: int, api, mesh):
    """Forward, backward and STEPS AdamW steps; what each step and the end looked like."""
    torch.manual_seed(0)
    model = case.make(n)
    if api is not None:
        api.parallelize_module(model, mesh, case.plan(api, n))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    rec = {}
    for step in range(STEPS):
        x, targets = case.data(n, g)
        floating = x.is_floating_point()
        xin = x.clone().requires_grad_(floating)
        if api is not None and case.in_shard is not None:
            xin = api.distribute_tensor(x, mesh, [api.Shard(case.in_shard)]).requires_grad_(floating)
        opt.zero_grad()
        before = _dispatches() if api is not None else 0
        out = model(xin)
        if api is not None and step == 0:
            rec["forward dispatches"] = _dispatches() - before  # not a tensor: checked by the caller
        if case.loss_parallel:
            logits = out.flatten(0, -2) if out.ndim > 2 else out
            if api is None:
                loss = F.cross_entropy(logits, targets)
                loss.backward()
            else:
                with api.loss_parallel():
                    loss = F.cross_entropy(logits, targets)
                    loss.backward()
            rec[f"step{step} loss"] = _record(loss)
        else:
            cot = torch.randn(out.shape, generator=g)
            full = out.full_tensor() if hasattr(out, "full_tensor") else out
            (full * cot).sum().backward()
        rec[f"step{step} output"] = _record(out)
        if floating:
            rec[f"step{step} input grad"] = _record(xin.grad)
        for name, p in model.named_parameters():
            rec[f"step{step} grad {name}"] = _record(p.grad)
        try:
            opt.step()
        except Exception as e:  # noqa: BLE001
            raise StepFailed(rec, e) from e
    for name, p in model.named_parameters():
        rec[f"param {name}"] = _record(p)
    return rec


def _torch_layouts(tp, key, got, want) -> bool:
    """Whether to compare placements and local shapes of our record ``got`` with torch's ``want``.

    Values are always compared. Layouts are not where torch chooses differently on purpose:
    * parameter gradients: shardprop lays each out like its parameter; torch leaves a sequence-parallel
      norm's weight gradient ``Partial`` and makes a vocabulary-sharded embedding's ``Replicate`` (even
      vocabularies too). A sharded torch gradient is compared.
    * a dim smaller than the mesh: torch skips strategies that shard it and replicates (a sequence of 2
      over 4 ranks, a parameter of 2 rows: then its AdamW fails on lerp_), where shardprop keeps the shard
      with empty pieces.
    """
    if "grad" in key and "input grad" not in key and not any(p.startswith("Shard") for p in want[1] or ()):
        return False
    if set(want[1] or ()) == {"Replicate"}:
        dims = [int(p[6:-1]) for p in got[1] or () if p.startswith("Shard")]
        if any(got[0].shape[d] < tp for d in dims):
            return False
    return True


def _compare(errors, where, got, want, tol, layouts):
    """Values of every record in ``want``; placements and local shapes too where ``layouts`` says
    (a bool, or ``(key, want record) -> bool``). Records missing from ``want`` are not compared."""
    for key, w in want.items():
        if key == "forward dispatches":
            continue
        gv = got.get(key)
        if (gv is None) != (w is None):
            errors.append(f"{where} {key}: {'missing' if gv is None else 'unexpected'}")
            continue
        if w is None:
            continue
        try:
            torch.testing.assert_close(gv[0], w[0], **tol)
        except AssertionError as e:
            errors.append(f"{where} {key}: {str(e).splitlines()[0]} {str(e).splitlines()[-1]}")
        if (layouts(key, gv, w) if callable(layouts) else layouts) and gv[1:] != w[1:]:
            errors.append(f"{where} {key}: placements/local shape {gv[1:]} vs {w[1:]}")


def _piece_sizes(n: int, tp: int) -> list:
    """torch.chunk order: (3, 3, 3, 1) for 10 over 4; trailing ranks may be empty."""
    pieces = [len(c) for c in torch.arange(n).chunk(tp)]
    return pieces + [0] * (tp - len(pieces))


def _last_frames() -> str:
    import traceback
    frames = traceback.extract_tb(__import__("sys").exc_info()[2])[-3:]
    return " <- ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno}" for f in reversed(frames))


def _cases_on(shape, sizes, names):
    import shardprop as sp
    ours, ref = _api("shardprop"), _api("torch")
    mesh, ref_mesh = _tp_mesh(ours, shape), _tp_mesh(ref, shape)
    errors, notes, checked = [], [], 0
    for name in names:
        case = CASES[name]
        for n in sizes:
            where = f"{name} n={n}"
            try:
                one = _run(case, n, None, None)
                fast = _run(case, n, ours, mesh)
                with sp.fast_paths(False):
                    slow = _run(case, n, ours, mesh)
            except Exception as e:  # noqa: BLE001  (report every case, not the first failure)
                errors.append(f"{where}: {type(e).__name__}: {e} at {_last_frames()}")
                continue
            # The fast paths take the uneven pieces (they do not step aside to the engine path).
            if fast["forward dispatches"] != case.between or slow["forward dispatches"] <= case.between:
                errors.append(f"{where}: forward dispatches {fast['forward dispatches']} with the fast paths, "
                              f"{slow['forward dispatches']} without; expected {case.between} and more")
            _compare(errors, f"{where} vs one process:", fast, one, ATOL, layouts=False)
            _compare(errors, f"{where} fast paths on vs off:", fast, slow, TWIN, layouts=True)
            if case.torch_ok(n, ref_mesh.size()):
                try:
                    theirs = _run(case, n, ref, ref_mesh)
                except StepFailed as e:
                    # torch's AdamW fails on a parameter with an empty piece ("in-place operations that
                    # require placement changes are not supported" for lerp_): compare up to there.
                    assert 0 in _piece_sizes(n, ref_mesh.size()), f"{where}: torch's step failed: {e}"
                    notes.append(f"{where}: torch's optimizer step fails: {e}")
                    theirs = e.rec
                except Exception as e:  # noqa: BLE001
                    if "view size is not compatible" in str(e):
                        # torch 2.11's DTensor fails uneven sequence-sharded outputs this way (2.13 and 2.15
                        # run them); ours is still checked against one process above.
                        notes.append(f"{where}: torch fails: {e}")
                        continue
                    errors.append(f"{where} torch: {type(e).__name__}: {e} at {_last_frames()}")
                    continue
                _compare(errors, f"{where} vs torch:", fast, theirs, ATOL, layouts=functools.partial(_torch_layouts, ref_mesh.size()))
            checked += len(one)
    return checked, errors, notes


SIZES = {(4,): (10, 7, 13, 2), (2, 2): (7, 13, 1)}


@pytest.mark.parametrize("shape", [(4,), (2, 2)], ids=["tp4", "dp2xtp2"])
@pytest.mark.parametrize("names", [
    ("colwise_replicated_out", "colwise_dtensor_out", "rowwise_replicated_in", "rowwise_dtensor_in",
     "rowwise_seq_out", "mlp_local", "mlp_sequence"),
    ("embedding_rowwise", "embedding_rowwise_seq_out", "embedding_colwise", "embedding_colwise_dtensor_out"),
    ("sequence_layernorm", "sequence_rmsnorm", "loss_parallel", "tiny_lm"),
], ids=["linear", "embedding", "sequence_loss"])
def test_uneven_styles_match_one_process_and_torch(shape, names):
    world = 4
    results = run_on_ranks(world, _cases_on, shape, SIZES[shape], names, timeout=500)
    for rank, (checked, errors, _notes) in enumerate(results):
        assert not errors, f"rank {rank}: {len(errors)} mismatches:\n" + "\n".join(errors[:40])
        assert checked >= 7 * len(names) * len(SIZES[shape]), f"rank {rank} checked only {checked} records"


def test_strict_check_still_names_uneven_dims():
    """``check_divisible`` keeps the old error for a strict mode to raise (the styles no longer do by default)."""
    from shardprop import ColwiseParallel, RowwiseParallel, SequenceParallel
    from shardprop.parallel.tp.styles import check_divisible
    mesh = SimpleNamespace(size=lambda: 4)  # the check reads only the mesh size
    uneven = [(ColwiseParallel(), nn.Linear(16, 10), "weight dim 0 of size 10"),
              (RowwiseParallel(), nn.Linear(10, 16), "weight dim 1 of size 10"),
              (ColwiseParallel(), nn.Embedding(16, 6), "weight dim 1 of size 6"),
              (RowwiseParallel(), nn.Embedding(6, 16), "weight dim 0 of size 6")]
    for style, module, needle in uneven:
        with pytest.raises(ValueError, match=needle):
            check_divisible(style, module, mesh, "m")
    for style, module in [(ColwiseParallel(), nn.Linear(10, 16)), (RowwiseParallel(), nn.Linear(16, 10)),
                          (ColwiseParallel(), nn.Linear(16, 8, bias=False)), (SequenceParallel(), nn.LayerNorm(7))]:
        check_divisible(style, module, mesh, "m")
    assert ColwiseParallel().sharded_dims(nn.Linear(4, 4)) == (("weight", 0), ("bias", 0))
    assert ColwiseParallel().sharded_dims(nn.Linear(4, 4, bias=False)) == (("weight", 0),)
    assert RowwiseParallel().sharded_dims(nn.Linear(4, 4)) == (("weight", 1),)


def _strict_uneven():
    import warnings
    from torch import nn
    import shardprop
    mesh = shardprop.init_device_mesh("cpu", (4,))
    out = {}
    try:
        shardprop.parallelize_module(nn.Linear(16, 10), mesh, shardprop.ColwiseParallel(), strict=True)
        out["strict"] = None
    except ValueError as e:
        out["strict"] = str(e)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m = shardprop.parallelize_module(nn.Linear(16, 10), mesh, shardprop.ColwiseParallel())
    out["lenient"] = tuple(m.weight.to_local().shape)
    return out


def test_strict_mode_refuses_uneven_dims_and_the_default_splits_them():
    for rank, out in enumerate(run_on_ranks(4, _strict_uneven)):
        assert out["strict"] and "10" in out["strict"] and "ColwiseParallel" in out["strict"], out["strict"]
        assert out["lenient"] == ((3, 16), (3, 16), (3, 16), (1, 16))[rank]
