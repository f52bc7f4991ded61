"""torch's private context-parallel helpers, ours against torch's own (torch 2.13's ``_context_parallel``).

- the load balancers' orders (head-tail, per-document head-tail, PTRR from causal and document masks);
- ``_context_parallel_shard`` of tensors and BlockMasks on 2 gloo ranks: the same local tensors, the
  same local block masks (block tables and element masks);
- flex attention over the sharded mask and ``flex_cp_allgather``'d keys/values equals the
  one-process attention, forward and backward;
- the SDPA dispatcher: SDPA on DTensors ``Shard(seq)`` after a head-tail sharding equals one process.
"""
import pytest
import torch

from tests.rankpool import run_on_ranks

pytestmark = pytest.mark.filterwarnings("ignore")


def _torch_lb():
    from torch.distributed.tensor.experimental._context_parallel import _load_balancer
    return _load_balancer


def _doc_mask_mod(doc_ids):
    """Causal inside documents: ``doc_ids`` ``(B, S)`` says which document each position belongs to."""
    def mask_mod(b, h, q, kv):
        return (doc_ids[b, q] == doc_ids[b, kv]) & (q >= kv)
    return mask_mod


def _causal(b, h, q, kv):
    return q >= kv


def _doc_ids(batch, seq, seed):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        cuts = torch.sort(torch.randperm(seq - 1, generator=g)[:5] + 1).values
        ids = torch.zeros(seq, dtype=torch.int64)
        ids[cuts] = 1
        rows.append(ids.cumsum(0))
    return torch.stack(rows)


def _masks(seq, batch=2):
    from torch.nn.attention.flex_attention import create_block_mask
    docs = _doc_ids(batch, seq, seed=seq)
    return {
        "causal": create_block_mask(_causal, 1, 1, seq, seq, device="cpu"),
        "document": create_block_mask(_doc_mask_mod(docs), batch, 1, seq, seq, device="cpu"),
        "document_b1": create_block_mask(_doc_mask_mod(docs[:1]), 1, 1, seq, seq, device="cpu"),
    }


@pytest.mark.parametrize("seq,n", [(8, 2), (16, 2), (24, 3), (64, 4), (96, 8)])
def test_head_tail_orders_equal_torchs(seq, n):
    from shardprop.parallel.cp.load_balance import HeadTailLoadBalancer
    for restore in (False, True):
        ours = HeadTailLoadBalancer(seq, n, "cpu")._generate_indices(restore=restore)
        theirs = _torch_lb()._HeadTailLoadBalancer(seq, n, "cpu")._generate_indices(restore=restore)
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), (restore, ours, theirs)


def _rank_by_rank(lengths, n):
    """torch 2.15's per-document head-tail order, written out: for each rank, each document's head and tail chunk."""
    out, start = [[] for _ in range(n)], 0
    for length in lengths:
        c = length // (2 * n)
        for r in range(n):
            out[r] += list(range(start + r * c, start + (r + 1) * c))
            out[r] += list(range(start + (2 * n - 1 - r) * c, start + (2 * n - r) * c))
        start += length
    return [i for rank in out for i in rank]


def test_per_document_head_tail_orders_equal_torchs():
    """torch 2.15's order (rank by rank); torch 2.13 ordered document by document, so before 2.15 the order is
    checked against 2.15's written out."""
    from shardprop.mesh import compat
    from shardprop.parallel.cp.load_balance import PerDocumentHeadTailLoadBalancer
    for docs, n in (([[8, 16]], 2), ([[12, 12], [24, 0]], 3), ([[8, 8, 16], [16, 8, 8]], 2)):
        docs = [[d for d in row if d] for row in docs]
        want = torch.tensor([_rank_by_rank(row, n) for row in docs])
        for restore in (False, True):
            ours = PerDocumentHeadTailLoadBalancer(docs, n, "cpu")._generate_indices(restore=restore)
            if compat.torch_release() >= (2, 15):
                theirs = _torch_lb()._PerDocumentHeadTailLoadBalancer(docs, n, "cpu")._generate_indices(restore=restore)
            else:
                theirs = torch.argsort(want, dim=1) if restore else want
            assert torch.equal(ours, theirs.to(ours.dtype)), (docs, n, restore, ours, theirs)


def test_ptrr_orders_equal_torchs():
    from shardprop.parallel.cp.load_balance import PTRRLoadBalancer, ptrr_groups
    for seq in (512, 1024, 2048):
        for name, mask in _masks(seq).items():
            for n in (1, 2, 4):
                for restore in (False, True):
                    ours = PTRRLoadBalancer(mask, n)._generate_indices(restore=restore)
                    theirs = _torch_lb()._PTRRLoadBalancer(mask, n)._generate_indices(restore=restore)
                    assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), (seq, name, n, restore)
    g = torch.Generator().manual_seed(0)
    for size, n in ((16, 4), (24, 3), (12, 2)):
        cost = torch.randint(0, 5, (size,), generator=g)  # many ties: the stable order decides
        assert torch.equal(ptrr_groups(cost, n), _torch_lb()._PTRRLoadBalancer.ptrr_scheduling(cost, n))


def test_block_mask_by_bands_equals_create_block_mask():
    from torch.nn.attention.flex_attention import create_block_mask
    from shardprop.parallel.cp.block_mask import block_mask_by_bands
    docs = _doc_ids(2, 700, seed=1)
    mod = _doc_mask_mod(docs)
    for b, h, q, kv, budget in ((2, 1, 512, 700, 1), (2, 2, 384, 700, 1 << 17), (1, 1, 640, 640, 1 << 26)):
        head_mod = (lambda b_, h_, q_, kv_: mod(b_, h_, q_, kv_) & ((q_ + h_) % 7 != 0)) if h > 1 else mod
        want = create_block_mask(head_mod, b, h, q, kv, device="cpu")
        got = block_mask_by_bands(head_mod, b, h, q, kv, "cpu", max_elements=budget)
        assert got.seq_lengths == want.seq_lengths and got.BLOCK_SIZE == want.BLOCK_SIZE
        for x, y in zip(_block_tables(got), _block_tables(want)):
            assert x.dtype == y.dtype and torch.equal(x, y), (b, h, q, kv, budget)


# ------------------------------------------------------------------ on 2 gloo ranks
def _meshes():
    import shardprop
    from torch.distributed.device_mesh import init_device_mesh
    return shardprop.init_device_mesh("cpu", (2,), mesh_dim_names=("cp",)), init_device_mesh("cpu", (2,))


def _balancers(ours: bool, seq, mask):
    from shardprop.parallel.cp import load_balance as mine
    lb = mine if ours else _torch_lb()
    return {"none": None,
            "headtail": (mine.HeadTailLoadBalancer if ours else lb._HeadTailLoadBalancer)(seq, 2, "cpu"),
            "ptrr": (mine.PTRRLoadBalancer if ours else lb._PTRRLoadBalancer)(mask, 2)}


def _block_tables(m):
    return [t for t in (m.kv_num_blocks, m.kv_indices, m.full_kv_num_blocks, m.full_kv_indices, m.q_num_blocks,
                        m.q_indices, m.full_q_num_blocks, m.full_q_indices) if t is not None]


def _shard_cases():
    from torch.distributed.tensor.experimental._context_parallel import _attention as torch_attention
    from torch.nn.attention.flex_attention import create_block_mask, create_mask
    from shardprop.parallel.cp.shard import context_parallel_shard_buffers
    ours_mesh, torch_mesh = _meshes()
    # torch compiles create_block_mask for the sharded masks; the eager one builds the same masks, faster
    torch_attention._compiled_create_block_mask = create_block_mask
    seq, results = 512, []
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 1000, (2, seq), generator=g)
    hidden = torch.randn(2, 3, seq, 4, generator=g)
    positions = torch.arange(seq)
    masks = _masks(seq)
    for mask_name, mask in ((n, masks[n]) for n in ("causal", "document")):  # B = 1, and per-sample orders
        for lb_name in ("none", "headtail", "ptrr"):
            bufs = lambda: [tokens, hidden, positions, mask]
            dims = [1, 2, 0, 2]
            if lb_name == "ptrr" and mask.kv_num_blocks.shape[0] == 2:
                bufs, dims = (lambda: [tokens, hidden, mask]), [1, 2, 2]  # per-sample orders: batched buffers
            ours = context_parallel_shard_buffers(ours_mesh, bufs(), dims, _balancers(True, seq, mask)[lb_name])
            theirs = torch_attention._context_parallel_shard(torch_mesh, bufs(), dims,
                                                             _balancers(False, seq, mask)[lb_name])
            key = (mask_name, lb_name)
            for a, b in zip(ours[:-1], theirs[:-1]):
                results.append((key, "tensor", a.shape == b.shape and torch.equal(a, b)))
            om, tm = ours[-1], theirs[-1]
            b_, h_ = om.kv_num_blocks.shape[:2]
            tables = all(torch.equal(x, y) for x, y in zip(_block_tables(om), _block_tables(tm)))
            results.append((key, "block tables", tables and om.seq_lengths == tm.seq_lengths))
            dense = torch.equal(create_mask(om.mask_mod, b_, h_, seq // 2, seq, device="cpu"),
                                create_mask(tm.mask_mod, b_, h_, seq // 2, seq, device="cpu"))
            results.append((key, "element mask", dense))
            # and not trivially: this rank's mask is the full mask's rows at this rank's positions
            order = _balancers(True, seq, mask)[lb_name]
            order = order._generate_indices()[0] if order is not None else torch.arange(seq)
            full = create_mask(mask.mask_mod, b_, h_, seq, seq, device="cpu")
            rows = order[ours_mesh.get_local_rank() * seq // 2:][: seq // 2]
            if lb_name == "ptrr" and b_ == 2:
                per = _balancers(True, seq, mask)[lb_name]._generate_indices()
                want = torch.stack([full[i][:, per[i][ours_mesh.get_local_rank() * seq // 2:][: seq // 2]]
                                    [:, :, per[i]] for i in range(2)])
            else:
                want = full[:, :, rows][:, :, :, order]
            results.append((key, "rows of the full mask",
                            torch.equal(create_mask(om.mask_mod, b_, h_, seq // 2, seq, device="cpu"), want)))
    return results


def test_context_parallel_shard_equals_torchs():
    for rank_results in run_on_ranks(2, _shard_cases, timeout=120):
        bad = [(k, what) for k, what, ok in rank_results if not ok]
        # 6 cases x (3 tensors + 3 mask checks), one tensor fewer for per-sample PTRR
        assert not bad and len(rank_results) == 35, bad


def _flex_cp(dtype):
    """Flex attention (forward; eager flex has no CPU backward) and SDPA over the sharded mask's elements
    (forward and backward) on gathered keys/values, against the one-process attention."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import create_block_mask, create_mask, flex_attention
    from shardprop.parallel.cp.flex import flex_cp_allgather
    from shardprop.parallel.cp.load_balance import HeadTailLoadBalancer, PTRRLoadBalancer
    from shardprop.parallel.cp.shard import context_parallel_shard_buffers
    mesh, _ = _meshes()
    seq, errs = 512, {}
    docs = _doc_ids(1, seq, seed=11)
    g = torch.Generator().manual_seed(5)
    q, k, v, do = (torch.randn(1, 2, seq, 8, generator=g, dtype=dtype) for _ in range(4))
    pg_name = dist.distributed_c10d._get_process_group_name(mesh.get_group())
    for mask_name, mod in (("causal", _causal), ("document", _doc_mask_mod(docs))):
        mask = create_block_mask(mod, 1, 1, seq, seq, device="cpu")
        flex_ref = flex_attention(q, k, v, block_mask=mask)
        fq, fk, fv = (t.clone().requires_grad_() for t in (q, k, v))
        ref = F.scaled_dot_product_attention(fq, fk, fv, attn_mask=create_mask(mod, 1, 1, seq, seq, device="cpu"))
        ref.backward(do)
        for lb_name, lb in (("headtail", HeadTailLoadBalancer(seq, 2, "cpu")), ("ptrr", PTRRLoadBalancer(mask, 2)),
                            ("none", None)):
            lq, lk, lv, ldo, lref, lflex, gq, gk, gv, lmask = context_parallel_shard_buffers(
                mesh, [q, k, v, do, ref.detach(), flex_ref, fq.grad, fk.grad, fv.grad, mask], [2] * 10, lb)
            lq, lk, lv = (t.requires_grad_() for t in (lq, lk, lv))
            # torchtitan gathers [B, S, H, D] on dim 1; here the same on [B, H, S, D]'s dim 2
            ak, av = flex_cp_allgather(lk, lv, 2, pg_name)
            with torch.no_grad():
                flex_out = flex_attention(lq.detach(), ak.detach(), av.detach(), block_mask=lmask)
            elements = create_mask(lmask.mask_mod, 1, 1, seq // 2, seq, device="cpu")
            out = F.scaled_dot_product_attention(lq, ak, av, attn_mask=elements)
            out.backward(ldo)
            errs[(mask_name, lb_name)] = max((a - b).abs().max().item() / b.abs().max().item() for a, b in (
                (flex_out, lflex), (out, lref), (lq.grad, gq), (lk.grad, gk), (lv.grad, gv)))
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():  # what torch.compile sees: the fake implementations' shapes, forward and backward
        fk = torch.empty(1, 3, 256, 4, requires_grad=True)
        ak, av = flex_cp_allgather(fk, torch.empty(1, 3, 256, 4), 2, pg_name)
        gk, = torch.autograd.grad(ak.sum(), fk)
        errs[("fake", "shapes")] = float(tuple(ak.shape) != (1, 3, 512, 4) or tuple(gk.shape) != (1, 3, 256, 4))
    return errs


def test_flex_attention_over_gathered_kv_equals_one_process():
    for errs in run_on_ranks(2, _flex_cp, torch.float64, timeout=120):
        assert len(errs) == 7
        for key, e in errs.items():
            assert e < 1e-12, (key, e)


def _sdpa_dispatcher():
    import torch.nn.functional as F
    import shardprop
    from shardprop.parallel.cp.dispatcher import disable_context_parallel_dispatcher, enable_context_parallel_dispatcher
    from shardprop.parallel.cp.load_balance import HeadTailLoadBalancer
    from shardprop.parallel.cp.shard import context_parallel_shard_buffers
    mesh, _ = _meshes()
    seq, errs = 64, {}
    g = torch.Generator().manual_seed(9)
    q, k, v, do = (torch.randn(2, 4, seq, 8, generator=g, dtype=torch.float64) for _ in range(4))
    fq, fk, fv = (t.clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(fq, fk, fv, is_causal=True)
    ref.backward(do)
    before = F.scaled_dot_product_attention
    enable_context_parallel_dispatcher()
    try:
        for lb_name, lb in (("headtail", HeadTailLoadBalancer(seq, 2, "cpu")), ("none", None)):
            lq, lk, lv, ldo, lref, gq, gk, gv = context_parallel_shard_buffers(
                mesh, [q, k, v, do, ref.detach(), fq.grad, fk.grad, fv.grad], [2] * 8, lb)
            lq, lk, lv = (t.requires_grad_() for t in (lq, lk, lv))
            dq, dk, dv = (shardprop.DTensor.from_local(t, mesh, [shardprop.Shard(2)]) for t in (lq, lk, lv))
            out = F.scaled_dot_product_attention(dq, dk, dv, is_causal=True)
            assert isinstance(out, shardprop.DTensor) and tuple(out.placements) == (shardprop.Shard(2),)
            out.to_local().backward(ldo)
            errs[lb_name] = max((a - b).abs().max().item() for a, b in
                                ((out.to_local(), lref), (lq.grad, gq), (lk.grad, gk), (lv.grad, gv)))
        plain = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # plain tensors: torch's own
        errs["plain"] = (plain - ref).abs().max().item()
    finally:
        disable_context_parallel_dispatcher()
    errs["restored"] = 0.0 if F.scaled_dot_product_attention is before else 1.0
    return errs


def test_sdpa_dispatcher_runs_ring_attention():
    for errs in run_on_ranks(2, _sdpa_dispatcher, timeout=120):
        assert set(errs) == {"headtail", "none", "plain", "restored"}
        for key, e in errs.items():
            assert e < 1e-12, (key, e)
