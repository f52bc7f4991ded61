"""local_map, implicit_replication and PrepareModuleInputOutput against torch.distributed.tensor (4 gloo ranks).

Each case runs the same inputs through shardprop and the reference of the running torch and
compares values, placements and the collectives each issues (shardprop's comm_counter, the
reference's CommDebugMode); autograd through local_map is checked against plain torch too, and
local_map is compiled (aot_eager, fullgraph) and compared with eager.
"""
import pytest
import torch

from tests.rankpool import run_on_ranks

pytestmark = pytest.mark.timeout(400)  # importing torch.distributed.tensor on a loaded machine is slow


def _pair(shape_mesh=(4,)):
    import shardprop as sp
    from torch.distributed.device_mesh import init_device_mesh as ref_init
    return sp.init_device_mesh("cpu", shape_mesh), ref_init("cpu", shape_mesh)


def _both(fn_ours, fn_ref):
    """(ours, our collectives) and (reference, its collectives) of two calls."""
    import shardprop as sp
    from torch.distributed.tensor.debug import CommDebugMode
    with sp.comm_counter() as c:
        a = fn_ours()
    with CommDebugMode() as cm:
        b = fn_ref()
    return a, sum(n for n, _ in c.counts.values()), b, cm.get_total_counts()


def _mm(w, x):
    return torch.mm(w, x)


def _scale_rows(x, w):  # x replicated, w column-sharded: the local grad of x is a partial sum
    return x @ w


def _local_map_cases():
    import shardprop as sp
    import torch.distributed.tensor as ref
    from torch.distributed.tensor.experimental import local_map as ref_local_map
    mesh, rmesh = _pair()
    errors = []
    torch.manual_seed(0)
    W, X = torch.randn(12, 8), torch.randn(8, 16)

    def dist_pair(t, pl):
        return (sp.distribute_tensor(t, mesh, [pl(sp)]), ref.distribute_tensor(t, rmesh, [pl(ref)]))

    w, rw = dist_pair(W, lambda m: m.Shard(1))
    x, rx = dist_pair(X, lambda m: m.Shard(0))
    # 1. checked inputs, Partial output: no collective inside, the same values as the reference.
    kw = dict(out_placements=None, in_placements=None)
    ours_f = sp.local_map(_mm, out_placements=[sp.Partial()], in_placements=([sp.Shard(1)], [sp.Shard(0)]))
    ref_f = ref_local_map(_mm, out_placements=[ref.Partial()], in_placements=([ref.Shard(1)], [ref.Shard(0)]))
    y, n_ours, ry, n_ref = _both(lambda: ours_f(w, x), lambda: ref_f(rw, rx))
    if n_ours or n_ref:
        errors.append(f"collectives inside local_map: ours {n_ours}, reference {n_ref}")
    if repr(list(y.placements)) != "[P(sum)]" or y.shape != ry.shape:
        errors.append(f"output {y.placements} {tuple(y.shape)} vs reference {ry.placements} {tuple(ry.shape)}")
    if not torch.equal(y.to_local(), ry.to_local()) or not torch.allclose(y.full_tensor(), W @ X, atol=1e-5):
        errors.append("local_map mm: values differ from the reference or from w @ x")
    # 2. a mismatch: a clear error, or a redistribution when asked (the same collectives as the reference).
    wr, rwr = dist_pair(W, lambda m: m.Shard(0))
    try:
        ours_f(wr, x)
        errors.append("mismatched placements accepted")
    except ValueError as e:
        if "input 0" not in str(e) or "S(0)" not in str(e) or "S(1)" not in str(e) or "redistribute_inputs" not in str(e):
            errors.append(f"unclear mismatch error: {e}")
    ours_r = sp.local_map(_mm, [sp.Partial()], ([sp.Shard(1)], [sp.Shard(0)]), redistribute_inputs=True)
    ref_r = ref_local_map(_mm, [ref.Partial()], ([ref.Shard(1)], [ref.Shard(0)]), redistribute_inputs=True)
    y2, n_ours, ry2, n_ref = _both(lambda: ours_r(wr, x), lambda: ref_r(rwr, rx))
    if n_ours != n_ref or n_ours == 0:
        errors.append(f"redistribute_inputs: {n_ours} collectives, reference {n_ref}")
    if not torch.allclose(y2.full_tensor(), ry2.full_tensor(), atol=1e-5):
        errors.append("redistribute_inputs: values differ from the reference")
    # 3. autograd with in_grad_placements: x replicated, its local gradient a partial sum.
    xs = torch.randn(4, 8)
    Wc = torch.randn(8, 16)
    grads = {}
    for tag, mod, m, lm in (("ours", sp, mesh, sp.local_map), ("ref", ref, rmesh, ref_local_map)):
        a = mod.distribute_tensor(xs, m, [mod.Replicate()]).requires_grad_()
        b = mod.distribute_tensor(Wc, m, [mod.Shard(1)]).requires_grad_()
        f = lm(_scale_rows, out_placements=[mod.Shard(1)], in_placements=([mod.Replicate()], [mod.Shard(1)]),
               in_grad_placements=([mod.Partial()], [mod.Shard(1)]))
        out = f(a, b)
        (out.full_tensor() ** 2).sum().backward()
        grads[tag] = (out.full_tensor().detach(), a.grad.full_tensor(), b.grad.full_tensor(), repr(list(a.grad.placements)))
    xp, wp = xs.clone().requires_grad_(), Wc.clone().requires_grad_()
    ((xp @ wp) ** 2).sum().backward()
    for tag, (o, ga, gb, pl) in grads.items():
        if not (torch.allclose(o, xs @ Wc, atol=1e-5) and torch.allclose(ga, xp.grad, atol=1e-4)
                and torch.allclose(gb, wp.grad, atol=1e-4)):
            errors.append(f"{tag}: local_map gradients differ from plain torch")
    # 4. decorator form, non-tensor outputs, no DTensor input (plain in, plain out).
    @sp.local_map(out_placements=([sp.Shard(0)], None), in_placements=([sp.Shard(0)], None))
    def twice(t, k):
        return t * k, "tag"
    out, tag = twice(x, 2)
    if tag != "tag" or not torch.equal(out.full_tensor(), X * 2):
        errors.append("decorator form: wrong outputs")
    plain = twice(torch.ones(2), 3)[0]
    if type(plain) is not torch.Tensor:
        errors.append(f"no DTensor input gave {type(plain)}")
    try:
        sp.local_map(_mm, [sp.Partial()], ([sp.Shard(1)],))(w, x)
        errors.append("wrong in_placements length accepted")
    except ValueError as e:
        if "in_placements has 1 entries for 2" not in str(e):
            errors.append(f"unclear length error: {e}")
    return errors


def test_local_map_matches_the_reference_with_autograd():
    for errors in run_on_ranks(4, _local_map_cases, timeout=240):
        assert not errors, "\n".join(errors)


def _local_map_compiled():
    import shardprop as sp
    torch._dynamo.reset()
    mesh = sp.init_device_mesh("cpu", (4,))
    torch.manual_seed(1)
    W, X = torch.randn(12, 8), torch.randn(8, 16)
    f = sp.local_map(_mm, out_placements=[sp.Partial()], in_placements=([sp.Shard(1)], [sp.Shard(0)]),
                     redistribute_inputs=True)

    def step(w, x):
        return f(w, x).redistribute(placements=[sp.Replicate()]).to_local().sum(0)

    w = sp.distribute_tensor(W, mesh, [sp.Shard(0)]).requires_grad_()  # redistributed inside: S(0) -> S(1)
    x = sp.distribute_tensor(X, mesh, [sp.Shard(0)]).requires_grad_()
    eager = step(w, x)
    eager.sum().backward()
    want_gw, want_gx = w.grad.full_tensor(), x.grad.full_tensor()
    w.grad = x.grad = None
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    got = compiled(w, x)
    got.sum().backward()
    errors = []
    if not torch.allclose(got, eager, atol=1e-5) or not torch.allclose(got, (W @ X).sum(0), atol=1e-4):
        errors.append("compiled local_map: output differs")
    if not (torch.allclose(w.grad.full_tensor(), want_gw, atol=1e-5) and torch.allclose(x.grad.full_tensor(), want_gx, atol=1e-5)):
        errors.append("compiled local_map: gradients differ from eager")
    return errors


def test_local_map_compiles_fullgraph_aot_eager():
    for errors in run_on_ranks(4, _local_map_compiled, timeout=240):
        assert not errors, "\n".join(errors)


def _implicit_cases():
    import shardprop as sp
    import torch.distributed.tensor as ref
    from torch.distributed.tensor.experimental import implicit_replication as ref_implicit
    from shardprop.dispatch.dispatcher import PlainTensorError
    mesh, rmesh = _pair()
    errors = []
    torch.manual_seed(0)  # the same X on every rank
    X, b = torch.randn(8, 4), torch.arange(1.0, 5.0)
    x, rx = sp.distribute_tensor(X, mesh, [sp.Shard(0)]), ref.distribute_tensor(X, rmesh, [ref.Shard(0)])

    def raises_outside(where):
        try:
            x + b
            errors.append(f"{where}: a plain float tensor was accepted outside implicit_replication")
        except PlainTensorError as e:
            if "plain torch.Tensor" not in str(e):
                errors.append(f"{where}: unclear error {e}")

    raises_outside("before")
    with sp.implicit_replication():
        with sp.comm_counter() as c:
            y = x + b
            z = torch.mm(x, torch.eye(4) * 2)
        if not sp.experimental.implicit_replication is sp.implicit_replication:
            errors.append("shardprop.experimental.implicit_replication is another object")
        with sp.implicit_replication():  # nests
            x * b
        y2 = x * b  # still active after the inner context closed
    with ref_implicit():
        ry = rx + b
        rz = torch.mm(rx, torch.eye(4) * 2)
    raises_outside("after")
    if c.total[0]:
        errors.append(f"implicit replication communicated: {c.counts}")
    if repr(list(y.placements)) != "[S(0)]" or not torch.equal(y.to_local(), ry.to_local()):
        errors.append(f"x + b: {y.placements} vs reference {ry.placements}, or values differ")
    if not torch.allclose(z.full_tensor(), rz.full_tensor()):
        errors.append(f"mm with a plain tensor: {z.full_tensor()} vs reference {rz.full_tensor()}")
    if not torch.equal(y2.full_tensor(), X * b):
        errors.append("mul with a plain tensor after a nested context: values differ")
    # A gradient flows to the DTensor operand (the plain one is a constant).
    xg = sp.distribute_tensor(X, mesh, [sp.Shard(0)]).requires_grad_()
    with sp.implicit_replication():
        (xg * b).sum().backward()
    if not torch.equal(xg.grad.full_tensor(), b.expand(8, 4)):
        errors.append("gradient through implicit replication is wrong")
    return errors


def test_implicit_replication_only_inside_the_context():
    for errors in run_on_ranks(4, _implicit_cases, timeout=240):
        assert not errors, "\n".join(errors)


def test_implicit_replication_flag_is_off_the_hot_path():
    # The flag is read only where a plain tensor was found (the exception path), never in _flatten/run.
    import inspect
    from shardprop.dispatch import dispatcher
    assert "implicit_replication" not in inspect.getsource(dispatcher._flatten)
    assert "implicit_replication" not in inspect.getsource(dispatcher.run)
    assert "implicit_replication" in inspect.getsource(dispatcher.same_on_every_rank)


class _Twice(torch.nn.Module):
    def forward(self, x, *, scale=None):
        return x * 2 if scale is None else x * scale


def _prepare_io_cases():
    import shardprop as sp
    import torch.distributed.tensor as ref
    import torch.distributed.tensor.parallel as ref_tp
    mesh, rmesh = _pair()
    errors = []
    rank = torch.distributed.get_rank()
    torch.manual_seed(2)
    full = torch.randn(8, 8)
    local = full.chunk(4)[rank]
    for use_local_input in (False, True):
        for use_local_output in (True, False):
            kw = dict(input_layouts=(sp.Shard(0),), desired_input_layouts=(sp.Replicate(),),
                      output_layouts=sp.Replicate(), desired_output_layouts=sp.Shard(1),
                      use_local_input=use_local_input, use_local_output=use_local_output)
            rkw = dict(input_layouts=(ref.Shard(0),), desired_input_layouts=(ref.Replicate(),),
                       output_layouts=ref.Replicate(), desired_output_layouts=ref.Shard(1),
                       use_local_input=use_local_input, use_local_output=use_local_output)
            m = sp.parallelize_module(_Twice(), mesh, sp.PrepareModuleInputOutput(**kw))
            rm = ref_tp.parallelize_module(_Twice(), rmesh, ref_tp.PrepareModuleInputOutput(**rkw))
            out, n_ours, rout, n_ref = _both(lambda: m(local), lambda: rm(local))
            where = f"use_local_input={use_local_input} use_local_output={use_local_output}"
            if type(out).__name__ != type(rout).__name__:
                errors.append(f"{where}: output type {type(out).__name__} vs reference {type(rout).__name__}")
            lo = out if not isinstance(out, sp.DTensor) else out.to_local()
            lr = rout if not isinstance(rout, ref.DTensor) else rout.to_local()
            if not torch.equal(lo, lr) or not torch.equal(lo, (full * 2).chunk(4, dim=1)[rank]):
                errors.append(f"{where}: output values differ")
            if n_ours != n_ref:
                errors.append(f"{where}: {n_ours} collectives, reference {n_ref}")
    # kwarg inputs
    m = sp.parallelize_module(_Twice(), mesh, sp.PrepareModuleInputOutput(
        input_kwarg_layouts={"scale": sp.Shard(0)}, desired_input_kwarg_layouts={"scale": sp.Replicate()},
        output_layouts=sp.Replicate(), desired_output_layouts=sp.Replicate(), use_local_output=False))
    scale = torch.full((2, 8), 3.0 + rank)  # this rank's rows of the (8, 8) scale
    out = m(sp.distribute_tensor(full, mesh, [sp.Replicate()]), scale=scale)
    if not torch.equal(out.full_tensor(), full * (3.0 + torch.arange(4.0)).repeat_interleave(2)[:, None]):
        errors.append("kwarg layouts: wrong output")
    if "use_local_input=False" not in repr(sp.PrepareModuleInputOutput(output_layouts=sp.Replicate(),
                                                                       desired_output_layouts=sp.Replicate())):
        errors.append("repr lacks use_local_input")
    return errors


def test_prepare_module_input_output_matches_the_reference():
    for errors in run_on_ranks(4, _prepare_io_cases, timeout=240):
        assert not errors, "\n".join(errors)


def test_prepare_module_input_output_checks_its_pairs():
    import shardprop as sp
    with pytest.raises(ValueError, match="PrepareModuleInput"):
        sp.PrepareModuleInputOutput(input_layouts=(sp.Shard(0), None), desired_input_layouts=(sp.Replicate(),),
                                    output_layouts=sp.Replicate(), desired_output_layouts=sp.Replicate())
    with pytest.raises(ValueError, match="PrepareModuleOutput"):
        sp.PrepareModuleInputOutput(output_layouts=(sp.Replicate(), None), desired_output_layouts=sp.Replicate())
