"""Cross-mesh redistribution ``dt.redistribute(other_mesh, placements)`` on 4 real gloo ranks.

Same ranks (1-d 4 <-> 2x2), disjoint rank sets (0-1 -> 2-3), overlapping sets, a rank in
neither mesh, Partial sources and targets, uneven shapes (Hypothesis), bytes sent (exactly the
overlaps, each replica box sent once), autograd on the same ranks, and the clear error for a
backward across different rank sets. Values are checked against the plain global tensor.
"""

import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.rankpool import run_on_ranks

# name -> mesh rows (global ranks); every rank builds every mesh (group creation is collective).
MESHES = {
    "1d4": [0, 1, 2, 3],
    "2x2": [[0, 1], [2, 3]],
    "2x2t": [[0, 2], [1, 3]],
    "01": [0, 1],
    "23": [2, 3],
    "123": [1, 2, 3],
    "0": [0],
}


def _mesh(name):
    from shardprop import DeviceMesh
    return DeviceMesh("cpu", MESHES[name])


def _placements(codes):
    from shardprop import Partial, Replicate, Shard
    return [Replicate() if c == "R" else Partial(c[1:]) if c.startswith("P") else Shard(int(c[1:])) for c in codes]


def _source(full, name, codes):
    """The DTensor of ``full`` on mesh ``name`` (outside that mesh: the global spec over an empty shard)."""
    from shardprop import distribute_tensor
    return distribute_tensor(full, _mesh(name), _placements(codes))


def _expected_local(full, name, codes):
    """This rank's shard of ``full`` cut with torch.chunk (no shardprop collective involved)."""
    mesh = _mesh(name)
    coord = mesh.get_coordinate()
    if coord is None:  # as torch gives ranks outside a mesh
        return torch.empty(0)
    out = full
    for m, c in enumerate(codes):
        if c.startswith("S"):
            d = int(c[1:])
            out = torch.chunk(out, mesh.shape[m], dim=d)[coord[m]] if coord[m] < len(
                torch.chunk(out, mesh.shape[m], dim=d)) else out.narrow(d, out.shape[d], 0)
        elif c == "Psum" and coord[m] != 0:
            out = torch.zeros_like(out)
    return out


def _move_batch(batch):
    from shardprop import comm_counter
    failures, sent = [], []
    for i, (shape, src, src_codes, dst, dst_codes, seed) in enumerate(batch):
        try:
            full = torch.randint(-9, 9, shape, generator=torch.Generator().manual_seed(seed)).float()
            x = _source(full, src, src_codes)
            with comm_counter() as c:
                y = x.redistribute(_mesh(dst), _placements(dst_codes))
            sent.append(c.counts.get("send", (0, 0))[1])
            assert y.device_mesh == _mesh(dst) and list(y.placements) == _placements(dst_codes)
            got, want = y.to_local(), _expected_local(full, dst, dst_codes)
            if not torch.equal(got, want):
                failures.append((i, f"got {got.tolist()} want {want.tolist()}"))
        except Exception as e:
            failures.append((i, f"{type(e).__name__}: {e}"[:800]))
    return failures, sent


def _run(batch):
    results = run_on_ranks(4, _move_batch, batch, timeout=120)
    bad = {}
    for rank, (failures, _) in enumerate(results):
        for i, msg in failures:
            bad.setdefault(i, (rank, msg))
    if bad:
        raise AssertionError("\n".join(f"{batch[i][:5]} (rank {r}): {m}" for i, (r, m) in sorted(bad.items())[:8]))
    return [sent for _, sent in results]


def test_named_moves():
    _run([
        ((8, 6), "1d4", ["S0"], "2x2", ["S1", "S0"], 1),       # same ranks, 1-d -> 2-d
        ((7, 5), "2x2", ["S0", "S1"], "1d4", ["S1"], 2),       # and back, uneven
        ((5, 3), "2x2", ["S0", "S0"], "2x2t", ["R", "S1"], 3),  # nested uneven, transposed mesh
        ((6, 4), "01", ["S0"], "23", ["S1"], 4),               # disjoint: a pipeline hand-off
        ((6, 4), "01", ["R"], "23", ["R"], 5),
        ((6, 4), "23", ["S1"], "123", ["S0"], 6),              # overlapping; rank 0 is in neither
        ((6, 4), "1d4", ["Psum"], "01", ["S0"], 7),            # a Partial source is reduced first
        ((6, 4), "01", ["Pmax"], "2x2", ["Psum", "S1"], 8),    # a Partial target is made locally
        ((3,), "1d4", ["S0"], "0", ["R"], 9),                  # gather to one rank
        ((), "0", ["R"], "1d4", ["R"], 10),                    # a scalar
    ])


def test_bytes_sent_are_exactly_the_overlaps():
    # 8x4 floats = 128 B a row. 01 [S0] -> 23 [S0]: rank 0 sends rows 0-3 to rank 2, rank 1 rows 4-7 to 3.
    sent = _run([((8, 4), "01", ["S0"], "23", ["S0"], 1)])
    assert [s[0] for s in sent] == [4 * 16, 4 * 16, 0, 0]
    # A replicated source: each target box comes from one replica, spread over the replicas.
    sent = _run([((8, 4), "01", ["R"], "23", ["S0"], 1)])
    assert [s[0] for s in sent] == [4 * 16, 4 * 16, 0, 0]
    # Same ranks: what a rank already holds is copied, never sent.
    sent = _run([((8, 4), "1d4", ["S0"], "2x2", ["S0", "R"], 1)])
    # 2x2 [S0, R]: ranks 0,1 need rows 0-3 (ranks 0,1 hold 0-1 and 2-3), ranks 2,3 need rows 4-7.
    assert sum(s[0] for s in sent) == 4 * (2 * 16)  # each rank receives exactly the 2 rows it lacks
    assert all(s[0] == 2 * 16 for s in sent)


@st.composite
def _case(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=ndim, max_size=ndim)))
    names = sorted(MESHES)
    src = draw(st.sampled_from(names))
    dst = draw(st.sampled_from([n for n in names if n != src]))  # same mesh: plain redistribute
    kinds = [f"S{d}" for d in range(ndim)]
    src_codes = [draw(st.sampled_from(kinds + ["R", "Psum"])) for _ in range(_ndim(src))]
    dst_codes = [draw(st.sampled_from(kinds + ["R", "Pavg"])) for _ in range(_ndim(dst))]
    return shape, src, src_codes, dst, dst_codes, draw(st.integers(0, 999))


def _ndim(name):
    return 2 if isinstance(MESHES[name][0], list) else 1


@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck),
          phases=[Phase.explicit, Phase.generate])
@given(st.lists(_case(), min_size=15, max_size=25))
def test_random_moves(batch):
    _run(batch)


# ---------------------------------------------------------------- autograd
def _grad_same_ranks():
    from shardprop import Shard, distribute_tensor
    full = torch.arange(24.0).reshape(6, 4)
    x = distribute_tensor(full, _mesh("1d4"), _placements(["S0"]))
    x.requires_grad_(True)
    y = x.redistribute(_mesh("2x2"), _placements(["S1", "R"]))
    w = torch.arange(24.0).reshape(6, 4)
    (y * distribute_tensor(w, _mesh("2x2"), _placements(["S1", "R"]))).sum().backward()
    g = x.grad
    return list(g.placements) == [Shard(0)] and g.device_mesh == _mesh("1d4"), torch.equal(g.full_tensor(), w)


def _grad_disjoint():
    full = torch.arange(8.0).reshape(4, 2)
    x = _source(full, "01", ["S0"]).requires_grad_(True)
    y = x.redistribute(_mesh("23"), _placements(["R"]))
    try:
        y.to_local().sum().backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_backward_on_the_same_ranks_moves_the_gradient_back():
    assert run_on_ranks(4, _grad_same_ranks) == [(True, True)] * 4


def test_backward_across_different_rank_sets_raises_clearly():
    for msg in run_on_ranks(4, _grad_disjoint):
        assert "no backward from" in msg and "different ranks" in msg


def _without_hook():
    from shardprop.tensor import conversions
    hook = conversions._other_mesh[0] if conversions._other_mesh else None
    conversions.set_other_mesh_redistribute(None)
    try:
        _source(torch.ones(4), "1d4", ["S0"]).redistribute(_mesh("2x2"), _placements(["S0", "R"]))
    except ValueError as e:
        return hook is not None, str(e)
    finally:
        conversions.set_other_mesh_redistribute(hook)
    return hook is not None, "no error"


def test_without_the_hook_the_error_stays_clear():
    for installed, msg in run_on_ranks(4, _without_hook):
        assert installed  # importing shardprop installs the cross-mesh hook
        assert "different mesh" in msg


# ---------------------------------------------------------------- the overlap arithmetic agrees with DCP's
@st.composite
def _box_pair(draw):
    ndim = draw(st.integers(0, 3))
    shape = [draw(st.integers(1, 9)) for _ in range(ndim)]

    def box():
        offs = [draw(st.integers(0, n - 1)) for n in shape]
        return tuple(offs), tuple(draw(st.integers(1, n - o)) for n, o in zip(shape, offs))
    return shape, box(), box()


@settings(max_examples=200, deadline=None)
@given(_box_pair())
def test_intersect_agrees_with_dcp_resharding(case):
    """Our box overlap (used for cross-mesh moves) and DCP's read planning (used when loading) agree."""
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, TensorProperties,
                                                       TensorStorageMetadata)
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
    from shardprop.checkpoint.chunks import intersect, relative
    shape, saved, wanted = case
    md = TensorStorageMetadata(TensorProperties(), torch.Size(shape),
                               [ChunkStorageMetadata(torch.Size(saved[0]), torch.Size(saved[1]))])
    reads = create_read_items_for_chunk_list(
        "x", md, [ChunkStorageMetadata(torch.Size(wanted[0]), torch.Size(wanted[1]))])
    ours = intersect(saved, wanted)
    if ours is None:
        assert reads == []
        return
    (r,) = reads
    assert tuple(r.lengths) == ours[1]
    assert tuple(r.storage_offsets) == relative(ours, saved)[0]
    assert tuple(r.dest_offsets) == relative(ours, wanted)[0]


class _FakeMesh:
    """Enough of a DeviceMesh for the pure planning functions (no process groups)."""

    def __init__(self, rows):
        t = torch.tensor(rows)
        self.shape, self._flat = tuple(t.shape), tuple(t.flatten().tolist())

    def __hash__(self):
        return hash((self.shape, self._flat))

    def __eq__(self, other):
        return (self.shape, self._flat) == (other.shape, other._flat)


@settings(max_examples=150, deadline=None)
@given(_case())
def test_plan_transfers_tiles_every_target_box_from_holders(case):
    from shardprop.checkpoint.chunks import intersect, numel, plan_transfers, rank_boxes
    from shardprop.tensor.placement import Replicate
    shape, src, src_codes, dst, dst_codes, _ = case
    src_pl = tuple(Replicate() if c == "Psum" else p for c, p in zip(src_codes, _placements(src_codes)))
    dst_pl = tuple(Replicate() if c == "Pavg" else p for c, p in zip(dst_codes, _placements(dst_codes)))
    sm, dm = _FakeMesh(MESHES[src]), _FakeMesh(MESHES[dst])
    plan = plan_transfers(tuple(shape), sm, src_pl, dm, dst_pl)
    held = dict(rank_boxes(shape, sm, src_pl))
    for rank, box in rank_boxes(shape, dm, dst_pl):
        pieces = [t for t in plan if t.dst == rank]
        assert sum(numel(t.box) for t in pieces) == (numel(box) if all(box[1]) else 0)  # covered ...
        for i, a in enumerate(pieces):
            assert intersect(a.box, box) == a.box                                  # ... inside the box
            assert intersect(held[a.src], a.box) == a.box                          # ... from a holder
            assert all(intersect(a.box, b.box) is None for b in pieces[i + 1:])    # ... exactly once
            if rank in held and intersect(held[rank], a.box) == a.box:
                assert a.src == rank                                               # own data: no message
