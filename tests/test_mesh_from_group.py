"""DeviceMesh.from_group and get_all_groups against torch's DeviceMesh (4 gloo ranks).

The meshes are compared by their ranks and groups, then used: the same redistributions on
the shardprop mesh and on the reference's mesh give the same values and collective counts.
"""
import pytest
import torch

from tests.rankpool import run_on_ranks

pytestmark = pytest.mark.timeout(400)  # importing torch.distributed.tensor on a loaded machine is slow


def _use(sp_mesh, ref_mesh, src, dst, shape=(8, 6)):
    """Redistribute the same tensor src -> dst on both meshes: (values equal, our count, reference count)."""
    import shardprop as sp
    import torch.distributed.tensor as ref
    from torch.distributed.tensor.debug import CommDebugMode

    def pl(names, mod):
        return [mod.Replicate() if n == "R" else mod.Partial() if n == "P" else mod.Shard(int(n[1:])) for n in names]

    torch.manual_seed(0)
    full = torch.randn(*shape)
    a = sp.distribute_tensor(full, sp_mesh, pl(src, sp))
    b = ref.distribute_tensor(full, ref_mesh, pl(src, ref))
    with sp.comm_counter() as c:
        a2 = a.redistribute(placements=pl(dst, sp))
    with CommDebugMode() as cm:
        b2 = b.redistribute(placements=pl(dst, ref))
    same = torch.equal(a2.to_local(), b2.to_local()) and torch.allclose(a2.full_tensor(), full)
    return same, c.total[0], cm.get_total_counts()


def _from_group_cases():
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh as RefMesh
    from shardprop import DeviceMesh
    rank = dist.get_rank()
    errors = []
    # 1-d over the whole world.
    world = dist.new_group([0, 1, 2, 3])
    m1, r1 = DeviceMesh.from_group(world, "cpu"), RefMesh.from_group(world, "cpu")
    if m1.mesh.tolist() != r1.mesh.tolist() or m1.get_all_groups() != [world] or r1.get_all_groups() != [world]:
        errors.append(f"1-d: {m1} vs reference {r1}, groups {m1.get_all_groups()}")
    same, n, rn = _use(m1, r1, ("S0",), ("R",))
    if not same or n != rn:
        errors.append(f"1-d S0 -> R: equal={same}, collectives {n} vs reference {rn}")
    # 1-d over half the world, named: each rank builds the mesh of its own group.
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = pairs[rank // 2]
    m2 = DeviceMesh.from_group(mine, "cpu", mesh_dim_names=("tp",))
    r2 = RefMesh.from_group(mine, "cpu", mesh_dim_names=("tp",))
    if m2.mesh.tolist() != r2.mesh.tolist() or m2.mesh_dim_names != ("tp",) or m2.get_group("tp") is not mine:
        errors.append(f"1-d half: {m2} vs reference {r2}")
    same, n, rn = _use(m2, r2, ("P",), ("R",))
    if not same or n != rn:
        errors.append(f"1-d half P -> R: equal={same}, collectives {n} vs reference {rn}")
    # 2-d from a (dp, tp) pair of groups and the mesh.
    cols = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    layout = [[0, 1], [2, 3]]
    groups = [cols[rank % 2], mine]
    m3 = DeviceMesh.from_group(groups, "cpu", layout, mesh_dim_names=("dp", "tp"))
    r3 = RefMesh.from_group(groups, "cpu", torch.tensor(layout), mesh_dim_names=("dp", "tp"))
    if m3.get_all_groups() != groups or r3.get_all_groups() != groups or m3.shape != tuple(r3.shape):
        errors.append(f"2-d: groups {m3.get_all_groups()} vs given {groups}")
    if m3.get_coordinate() != list(r3.get_coordinate()):
        errors.append(f"2-d: coordinate {m3.get_coordinate()} vs reference {r3.get_coordinate()}")
    for src, dst in ((("S0", "S1"), ("R", "R")), (("P", "S0"), ("R", "S1")), (("S0", "R"), ("R", "R")), (("R", "P"), ("R", "S0"))):
        same, n, rn = _use(m3, r3, src, dst)
        # S0,S1 -> R,R: shardprop gathers over both dims at once (the world group): 1 where the reference needs 2.
        if not same or not (n == rn or (src == ("S0", "S1") and (n, rn) == (1, 2))):
            errors.append(f"2-d {src} -> {dst}: equal={same}, collectives {n} vs reference {rn}")
    # Errors name what is wrong.
    for call, want in ((lambda: DeviceMesh.from_group(world, "cpu", [0, 1]), "does not list the group's ranks"),
                       (lambda: DeviceMesh.from_group(groups, "cpu"), "pass mesh= and mesh_dim_names="),
                       (lambda: DeviceMesh.from_group([mine, cols[rank % 2]], "cpu", layout, mesh_dim_names=("a", "b")),
                        "along mesh dim 0"),
                       (lambda: DeviceMesh.from_group(groups, "cpu", [0, 1, 2, 3], mesh_dim_names=("a", "b")),
                        "1-d mesh")):
        try:
            call()
            errors.append(f"accepted: expected {want!r}")
        except ValueError as e:
            if want not in str(e):
                errors.append(f"unclear error {e}; expected {want!r}")
    # Not collective: ranks 0 and 1 build and use a mesh of their group while 2 and 3 do nothing.
    if rank < 2:
        m4 = DeviceMesh.from_group(pairs[0], "cpu")
        same, n, _ = _use_ours_only(m4)
        if not same or n != 1:
            errors.append(f"subset-only mesh: equal={same}, {n} collectives")
    dist.barrier()
    return errors


def _use_ours_only(mesh):
    import shardprop as sp
    full = torch.arange(12.0).reshape(4, 3)
    a = sp.distribute_tensor(full, mesh, [sp.Shard(0)], src_data_rank=None)
    with sp.comm_counter() as c:
        b = a.redistribute(placements=[sp.Replicate()])
    return torch.equal(b.to_local(), full), c.total[0], None


def test_from_group_and_get_all_groups_match_the_reference():
    for errors in run_on_ranks(4, _from_group_cases, timeout=240):
        assert not errors, "\n".join(errors)
