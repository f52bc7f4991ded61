"""DTensor factories (zeros, ones, empty, full, rand, randn, linspace, logspace) on 4 gloo ranks.

Deterministic ones are compared with torch.distributed.tensor's (the reference of the running torch)
on the same arguments: placements, global and local shapes, dtype, values, and no collective on
either side. rand/randn are compared with one device's ``torch.rand``/``torch.randn`` after the same
seed (the reference's raise AssertionError on a CPU mesh: that is checked and reported, not copied).
"""
import pytest
import torch

from tests.rankpool import run_on_ranks

pytestmark = pytest.mark.timeout(400)  # importing torch.distributed.tensor on a loaded machine is slow

SHAPES = [(10, 6), (2, 5), (0, 3), (7, 5, 3), (13,)]
PLACEMENTS_1D = [("S0",), ("S1",), ("R",), ("S-1",)]
PLACEMENTS_2D = [("S0", "S1"), ("S0", "S0"), ("R", "S0"), ("S1", "R")]


def _pl(names, mod, ndim=None):
    """Placements from short names; with ``ndim``, shard dims made non-negative (the reference needs that)."""
    out = []
    for n in names:
        d = None if n in ("R", "P") else int(n[1:]) % ndim if ndim else int(n[1:])
        out.append(mod.Replicate() if n == "R" else mod.Partial() if n == "P" else mod.Shard(d))
    return out


def _fits(shape, names):
    return all(n in ("R", "P") or -len(shape) <= int(n[1:]) < len(shape) for n in names)


def _meshes():
    import shardprop as sp
    from torch.distributed.device_mesh import init_device_mesh as ref_init
    return [(sp.init_device_mesh("cpu", (4,)), ref_init("cpu", (4,)), PLACEMENTS_1D),
            (sp.init_device_mesh("cpu", (2, 2)), ref_init("cpu", (2, 2)), PLACEMENTS_2D)]


def _deterministic_vs_reference():
    import shardprop as sp
    import torch.distributed.tensor as ref
    from torch.distributed.tensor.debug import CommDebugMode
    errors, checked = [], 0
    calls = [("zeros", lambda f, s: f(*s), {}), ("ones", lambda f, s: f(s), {"dtype": torch.float64}),
             ("empty", lambda f, s: f(list(s)), {}), ("full", lambda f, s: f(s, 7), {}),
             ("full", lambda f, s: f(s, 2.5), {"dtype": torch.bfloat16, "requires_grad": True}),
             ("zeros", lambda f, s: f(torch.Size(s)), {"requires_grad": True})]
    for mesh, rmesh, plist in _meshes():
        for shape in SHAPES[:3]:
            for names in plist:
                if not _fits(shape, names):
                    continue
                for name, call, kw in calls:
                    with sp.comm_counter() as c:
                        ours = call(lambda *a: getattr(sp, name)(*a, device_mesh=mesh, placements=_pl(names, sp), **kw), shape)
                    with CommDebugMode() as cm:
                        want = call(lambda *a: getattr(ref, name)(*a, device_mesh=rmesh, placements=_pl(names, ref, len(shape)), **kw), shape)
                    where = f"{name}{shape} {names} {kw}"
                    checked += 1
                    if c.total[0] or cm.get_total_counts():
                        errors.append(f"{where}: collectives ours {c.counts} reference {cm.get_total_counts()}")
                    if repr(list(ours.placements)) != repr([sp.Shard(p.dim % len(shape)) if p.is_shard() else sp.Replicate()
                                                            for p in want.placements]):
                        errors.append(f"{where}: placements {ours.placements} vs {want.placements}")
                    for attr in ("shape", "dtype", "requires_grad", "stride"):
                        a, b = getattr(ours, attr), getattr(want, attr)
                        a, b = (a(), b()) if callable(a) else (a, b)
                        if a != b:
                            errors.append(f"{where}: {attr} {a} vs {b}")
                    lo, lw = ours.to_local(), want.to_local()
                    if lo.shape != lw.shape:
                        errors.append(f"{where}: local shape {tuple(lo.shape)} vs {tuple(lw.shape)}")
                    elif name != "empty" and not torch.equal(lo, lw):
                        errors.append(f"{where}: local values differ")
    return errors, checked


def test_deterministic_factories_match_the_reference():
    for errors, checked in run_on_ranks(4, _deterministic_vs_reference, timeout=240):
        assert checked > 60
        assert not errors, "\n".join(errors[:20])


def _spaced_vs_reference():
    import shardprop as sp
    import torch.distributed.tensor as ref
    errors = []
    if not hasattr(ref, "linspace"):  # older torch: compare with plain torch only
        ref = None
    mesh, rmesh, _ = _meshes()[0]
    cases = [("linspace", (0, 1, 10), {}), ("linspace", (-3.5, 7.25, 11), {"dtype": torch.float32}),
             ("linspace", (0, 100, 7), {"dtype": torch.int64}), ("linspace", (2, 5, 1), {}),
             ("linspace", (torch.tensor(1.0), torch.tensor(4.0), 3), {}), ("linspace", (0, 1, 0), {}),
             ("logspace", (0, 3, 4), {}), ("logspace", (-2, 2, 9), {"base": 2.0, "dtype": torch.float64})]
    for name, args, kw in cases:
        for names in (("S0",), ("R",)):
            ours = getattr(sp, name)(*args, device_mesh=mesh, placements=_pl(names, sp), **kw)
            plain = getattr(torch, name)(*args, **kw)
            where = f"{name}{args} {kw} {names}"
            full = ours.full_tensor()
            if full.dtype != plain.dtype or full.shape != plain.shape:
                errors.append(f"{where}: {full.dtype}{tuple(full.shape)} vs torch {plain.dtype}{tuple(plain.shape)}")
                continue
            if not torch.allclose(full.double(), plain.double(), rtol=1e-6, atol=1e-6):
                errors.append(f"{where}: {full} vs torch {plain}")
            if ref is not None:
                want = getattr(ref, name)(*args, device_mesh=rmesh, placements=_pl(names, ref), **kw)
                if want.to_local().shape != ours.to_local().shape:
                    errors.append(f"{where}: local shape {tuple(ours.to_local().shape)} vs reference {tuple(want.to_local().shape)}")
    try:
        sp.linspace(torch.zeros(2), 1, 3, device_mesh=mesh)
        errors.append("a 1-d start tensor was accepted")
    except ValueError as e:
        if "0-dim" not in str(e):
            errors.append(f"unclear error {e}")
    return errors


def test_linspace_logspace_match_torch_and_reference_layout():
    for errors in run_on_ranks(4, _spaced_vs_reference, timeout=240):
        assert not errors, "\n".join(errors[:20])


def _random_exact():
    import torch.distributed as dist
    import shardprop as sp
    import torch.distributed.tensor as ref
    errors, ref_outcome = [], None
    for mesh, rmesh, plist in _meshes():
        for shape in SHAPES:
            for names in plist:
                if not _fits(shape, names):
                    continue
                for fn, plain, dtype in (("rand", torch.rand, torch.float32), ("randn", torch.randn, torch.float32),
                                         ("randn", torch.randn, torch.float64), ("rand", torch.rand, torch.bfloat16)):
                    where = f"{fn}{shape} {names} {dtype}"
                    torch.manual_seed(1234)
                    with sp.comm_counter() as c:
                        x = getattr(sp, fn)(*shape, device_mesh=mesh, placements=_pl(names, sp), dtype=dtype)
                    after = torch.rand(4)
                    torch.manual_seed(1234)
                    want = plain(*shape, dtype=dtype)
                    want_after = torch.rand(4)
                    if c.total[0]:
                        errors.append(f"{where}: collectives {c.counts}")
                    if not torch.equal(x.full_tensor(), want):
                        errors.append(f"{where}: not the shards of one device's draw")
                    if not torch.equal(after, want_after):
                        errors.append(f"{where}: the generator is not where one device's would be")
                    # Replicas agree, shards differ: compare raw locals across ranks.
                    locals_ = [None] * dist.get_world_size()
                    dist.all_gather_object(locals_, (tuple(mesh.get_coordinate()), x.to_local()))
                    shard_dims = [m for m, n in enumerate(names) if n != "R"]
                    for ca, la in locals_:
                        for cb, lb in locals_:
                            same_piece = all(ca[m] == cb[m] for m in shard_dims)
                            if same_piece and not torch.equal(la, lb):
                                errors.append(f"{where}: replicas {ca} and {cb} differ")
                            if not same_piece and la.shape == lb.shape and la.numel() > 1 and torch.equal(la, lb):
                                errors.append(f"{where}: shards {ca} and {cb} are equal")
        # The reference on a CPU mesh: recorded (it raises AssertionError on torch 2.11 .. 2.15).
        try:
            ref.rand(8, 4, device_mesh=rmesh, placements=[ref.Replicate()] * rmesh.ndim)
            ref_outcome = ref_outcome or "works"
        except AssertionError:
            ref_outcome = "AssertionError"
    # Big enough for several pieces of the default size on every rank (uneven: 301 rows over 4).
    mesh = _meshes()[0][0]
    for fn, plain in (("rand", torch.rand), ("randn", torch.randn)):
        for names in (("S0",), ("S1",)):
            torch.manual_seed(99)
            x = getattr(sp, fn)(301, 70, device_mesh=mesh, placements=_pl(names, sp))
            after = torch.randn(3)
            torch.manual_seed(99)
            if not torch.equal(x.full_tensor(), plain(301, 70)) or not torch.equal(after, torch.randn(3)):
                errors.append(f"{fn}(301, 70) {names}: not one device's draw")
    # Partial: the value is the factory's, as distribute_tensor makes it (index 0 holds it for sum).
    mesh = _meshes()[0][0]
    torch.manual_seed(5)
    p = sp.randn(6, 4, device_mesh=mesh, placements=[sp.Partial()])
    torch.manual_seed(5)
    if not torch.equal(p.full_tensor(), torch.randn(6, 4)):
        errors.append("randn with Partial(sum): wrong value")
    o = sp.ones(3, device_mesh=mesh, placements=[sp.Partial("sum")])
    if not torch.equal(o.full_tensor(), torch.ones(3)) or (mesh.get_local_rank() and o.to_local().any()):
        errors.append("ones with Partial(sum): wrong value or layout")
    return errors, ref_outcome


def test_rand_randn_reproduce_one_device_on_a_cpu_mesh():
    for errors, ref_outcome in run_on_ranks(4, _random_exact, timeout=240):
        assert not errors, "\n".join(errors[:20])
        assert ref_outcome in ("AssertionError", "works")  # the reference's behaviour, for the record


def test_draw_shard_equals_a_slice_of_one_draw_with_many_pieces(monkeypatch):
    # Single process: small pieces so that every box crosses many piece boundaries.
    import random
    from shardprop.tensor import random_shards as R
    monkeypatch.setattr(R, "_MIN_PIECE", 32)
    rng = random.Random(0)
    for trial in range(150):
        shape = tuple(rng.randint(0, 9) for _ in range(rng.randint(1, 4)))
        off, box = [], []
        for s in shape:
            o = rng.randint(0, s)
            off.append(o)
            box.append(rng.randint(0, s - o))
        kind = rng.choice(["uniform", "normal"])
        dtype = rng.choice([torch.float32, torch.float64, torch.bfloat16, torch.complex64])
        torch.manual_seed(trial)
        got = R.draw_shard(kind, shape, off, box, dtype, torch.device("cpu"))
        state = torch.get_rng_state()
        torch.manual_seed(trial)
        full = (torch.rand if kind == "uniform" else torch.randn)(shape, dtype=dtype)
        want = full[tuple(slice(o, o + b) for o, b in zip(off, box))]
        assert torch.equal(got, want), (shape, off, box, kind, dtype)
        assert torch.equal(state, torch.get_rng_state()), (shape, off, box, kind, dtype)


def test_draw_shard_steps_aside_where_pieces_do_not_compose(monkeypatch):
    from shardprop.tensor import random_shards as R
    monkeypatch.setattr(R, "composable", lambda *a: False)
    torch.manual_seed(3)
    got = R.draw_shard("normal", (9, 7), (2, 1), (3, 5), torch.float32, torch.device("cpu"))
    torch.manual_seed(3)
    assert torch.equal(got, torch.randn(9, 7)[2:5, 1:6])


def test_factory_errors_name_the_factory():
    import shardprop as sp
    with pytest.raises(RuntimeError, match="No device mesh is currently active"):  # torch's error too
        sp.zeros(2, 3)
    with pytest.raises(TypeError, match="shape of ints"):
        sp.ones("a", device_mesh=object())


def test_draw_shard_never_allocates_the_full_tensor(monkeypatch):
    from shardprop.tensor import random_shards as R
    sizes, real_empty = [], torch.empty

    def counting_empty(*a, **k):
        t = real_empty(*a, **k)
        sizes.append(t.numel())
        return t

    monkeypatch.setattr(R.torch, "empty", counting_empty)
    for kind in ("uniform", "normal"):
        sizes.clear()
        torch.manual_seed(0)
        got = R.draw_shard(kind, (200, 100), (50, 0), (50, 100), torch.float32, torch.device("cpu"))
        assert sizes and max(sizes) <= 5000 + 32, sizes  # the shard and one buffer of about its size
        torch.manual_seed(0)
        assert torch.equal(got, (torch.rand if kind == "uniform" else torch.randn)(200, 100)[50:100])
