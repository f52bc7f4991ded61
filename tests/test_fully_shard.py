"""fully_shard (FSDP) on real gloo ranks against one process on the full batch.

dp=4 (and dp x tp on a 2x2 mesh): losses per step and parameters after 5 AdamW
steps match plain torch; mixed precision within bf16 tolerance; per-rank bytes
shrink with dp; one all-gather and one reduce-scatter per unit per step; uneven
shapes; gradient clipping; gradient accumulation; the error cases.
"""
import gc

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tests.rankpool import run_on_ranks

STEPS = 5


class Block(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    """Uneven shapes on purpose: 13 and 7 rows do not split over 4 ranks."""

    def __init__(self, dim=13, hidden=7, layers=3, vocab=11):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, hidden) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)
        self.mix = nn.Parameter(torch.tensor([1.0, 0.5]))  # 2 rows over 4 ranks: two ranks hold none

    def forward(self, tokens):
        h = self.emb(tokens)
        for layer in self.layers:
            h = layer(h)
        logits = self.head(h)
        return logits * self.mix[0] + logits.square() * (0.1 * self.mix[1])


def _batches(n, batch=8, seq=5, vocab=11):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, vocab, (batch, seq), generator=g), torch.randint(0, vocab, (batch, seq), generator=g))
            for _ in range(n)]


def _loss(model, x, y):
    return F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())


def _reference(steps=STEPS, clip=None, accumulate=False):
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    losses = []
    for x, y in _batches(steps):
        if accumulate:  # two half-batches, each loss halved: the gradient of the full-batch mean
            for part in (slice(0, 4), slice(4, 8)):
                (_loss(model, x[part], y[part]) / 2).backward()
            loss = _loss(model, x, y).detach()
        else:
            loss = _loss(model, x, y)
            loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _shard_model(model, mesh, **kw):
    from shardprop import fully_shard
    for block in model.layers:
        fully_shard(block, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def _rows(t, mesh):
    n, i = mesh.size(), mesh.get_local_rank()
    return t.chunk(n)[i]


def _fsdp_train(reshard=True, mp=None, clip=None, accumulate=False):
    from shardprop import MixedPrecisionPolicy, init_device_mesh
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    kw = dict(reshard_after_forward=reshard)
    if mp:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = _shard_model(Net(), mesh, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    losses = []
    for x, y in _batches(STEPS):
        x, y = _rows(x, mesh), _rows(y, mesh)
        if accumulate:
            model.set_requires_gradient_sync(False)
            (_loss(model, x[:1], y[:1]) / 2).backward()
            model.set_requires_gradient_sync(True)
            (_loss(model, x[1:], y[1:]) / 2).backward()
            with torch.no_grad():
                loss = _loss(model, x, y)
        else:
            loss = _loss(model, x, y)
            loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        t = loss.detach().reshape(1).clone()
        dist.all_reduce(t)
        losses.append(t.item() / mesh.size())
    params = {n: p.full_tensor() for n, p in model.named_parameters()}
    placements = {n: p.placements for n, p in model.named_parameters()}
    return losses, params, placements


def _check(out, ref, atol):
    ref_losses, ref_params = ref
    for losses, params, placements in out:
        assert losses == pytest.approx(ref_losses, abs=atol)
        assert set(params) == set(ref_params)
        for n, p in params.items():
            torch.testing.assert_close(p, ref_params[n], atol=atol, rtol=0, msg=n)
        assert all(str(pl) == "(S(0),)" for pl in placements.values()), placements


@pytest.mark.parametrize("reshard", [True, False])
def test_dp4_matches_single_process(reshard):
    _check(run_on_ranks(4, _fsdp_train, reshard), _reference(), 1e-5)


def test_mixed_precision_bf16_within_tolerance():
    ref = _reference()
    for losses, params, _ in run_on_ranks(4, _fsdp_train, True, True):
        assert losses == pytest.approx(ref[0], abs=3e-2)
        for n, p in params.items():
            torch.testing.assert_close(p, ref[1][n], atol=3e-2, rtol=0, msg=n)


def test_grad_clipping_and_accumulation():
    # clip_grad_norm_ over the sharded DTensor gradients (its norm is a global one)
    _check(run_on_ranks(4, _fsdp_train, True, None, 0.05), _reference(clip=0.05), 1e-5)
    # set_requires_gradient_sync(False): the first micro-batch's gradient stays local, the second reduces the sum
    _check(run_on_ranks(4, _fsdp_train, True, None, None, True), _reference(accumulate=True), 1e-5)


def _live_bytes():
    """Bytes of every live tensor storage in this process (a DTensor counts its local shard)."""
    from shardprop import DTensor
    seen, total = set(), 0
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor):
            continue
        if issubclass(type(obj), DTensor):
            obj = obj._local_tensor
        if type(obj) in (torch.Tensor, nn.Parameter):
            try:
                st = obj.untyped_storage()
            except Exception:
                continue
            if st.data_ptr() and st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
    return total


def _memory_and_counts(reshard):
    from shardprop import comm_counter, init_device_mesh
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    big = dict(dim=40, hidden=64, layers=3, vocab=32)
    x, y = torch.randint(0, 32, (2, 5)), torch.randint(0, 32, (2, 5))
    # replicated run, for its parameter + gradient + optimizer state bytes
    gc.collect()
    base = _live_bytes()
    rep = Net(**big)
    opt = torch.optim.AdamW(rep.parameters())
    _loss(rep, x, y).backward()
    opt.step()
    gc.collect()
    replicated = _live_bytes() - base
    del rep, opt
    gc.collect()
    base = _live_bytes()
    model = _shard_model(Net(**big), mesh, reshard_after_forward=reshard)
    opt = torch.optim.AdamW(model.parameters())
    counts = []
    from shardprop.dispatch import dispatcher
    before = sum(dispatcher.call_counts().values())
    for _ in range(2):
        with comm_counter() as c:
            _loss(model, x, y).backward()
        counts.append(dict(c.counts))
        assert sum(dispatcher.call_counts().values()) == before, "DTensor dispatch inside a unit's compute"
        opt.step()
        before = sum(dispatcher.call_counts().values())
    gc.collect()
    sharded = _live_bytes() - base
    unit_bytes = max(m._fsdp_unit.buffers.full_nbytes for m in model.modules() if hasattr(m, "_fsdp_unit"))
    return replicated, sharded, unit_bytes, counts


@pytest.mark.parametrize("reshard", [None, True, False])
def test_memory_and_one_collective_pair_per_unit(reshard):
    for replicated, sharded, unit_bytes, counts in run_on_ranks(4, _memory_and_counts, reshard):
        assert sharded <= replicated / 4 + unit_bytes, (replicated, sharded, unit_bytes)
        # 4 units (3 blocks + root): one all-gather and one reduce-scatter each, nothing else; units resharded
        # after forward are gathered again for backward. As torch's fully_shard: None reshards all but the
        # root (needed first thing in backward), an explicit True reshards the root too.
        gathers = 4 + {None: 3, True: 4, False: 0}[reshard]
        for c in counts:
            assert {k: n for k, (n, _) in c.items()} == {"all_gather": gathers, "reduce_scatter": 4}, c


def _errors():
    from shardprop import Replicate, distribute_tensor, fully_shard, init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out = []
    block = Block(4, 4)
    fully_shard(block, mesh=mesh["dp"])
    try:
        fully_shard(block, mesh=mesh["dp"])
    except ValueError as e:
        out.append(str(e))
    try:
        fully_shard(Block(4, 4), mesh=mesh, dim="pp")
    except ValueError as e:
        out.append(str(e))
    mixed = Block(4, 4)
    mixed.up.weight = nn.Parameter(distribute_tensor(mixed.up.weight.detach(), mesh["tp"], [Replicate()]))
    mixed.down.weight = nn.Parameter(distribute_tensor(mixed.down.weight.detach(), mesh["dp"], [Replicate()]))
    try:
        fully_shard(mixed, mesh=mesh["dp"])
    except ValueError as e:
        out.append(str(e))
    return out


def test_error_messages():
    for msgs in run_on_ranks(4, _errors):
        assert len(msgs) == 3, msgs
        assert "already fully_shard-ed" in msgs[0]
        assert "no dim 'pp'" in msgs[1] and "('dp', 'tp')" in msgs[1]
        assert "different meshes" in msgs[2]


# ---------------------------------------------------------------- 2-D: tp inside, dp over it


def _cfg():
    from shardprop.demo.model import LlamaConfig
    return LlamaConfig(dim=32, n_layers=2, n_heads=4, vocab_size=64, seq_len=8)


def _reference_2d(steps=STEPS):
    from shardprop.demo.model import Llama, lm_loss, synthetic_batch
    cfg = _cfg()
    model = Llama(cfg, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    losses = []
    for step in range(steps):
        x, y = synthetic_batch(cfg, 4, step, 0)
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _fsdp_tp_train(reshard=True, mp=False):
    from shardprop import MixedPrecisionPolicy, fully_shard, init_device_mesh, parallelize_module
    from shardprop.demo.model import Llama, lm_loss, synthetic_batch, tp_plan
    cfg = _cfg()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = parallelize_module(Llama(cfg, 0), mesh["tp"], tp_plan())
    kw = dict(reshard_after_forward=reshard)
    if mp:  # bf16 compute (the rope tables and mask are float32 buffers: the model casts them)
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"], **kw)
    fully_shard(model, mesh=mesh["dp"], **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    dp = mesh["dp"]
    losses = []
    for step in range(STEPS):
        x, y = (_rows(t, dp) for t in synthetic_batch(cfg, 4, step, 0))
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().reshape(1).clone()
        dist.all_reduce(t)
        losses.append(t.item() / 4)  # summed over 4 ranks: 2 tp copies of each dp rank's loss
    params = {n: p.full_tensor() for n, p in model.named_parameters()}
    placements = {n: str(list(p.placements)) for n, p in model.named_parameters()}
    return losses, params, placements


@pytest.mark.parametrize("reshard", [True, False])
def test_fsdp_tp_2x2_matches_single_process(reshard):
    ref_losses, ref_params = _reference_2d()
    for losses, params, placements in run_on_ranks(4, _fsdp_tp_train, reshard):
        assert losses == pytest.approx(ref_losses, abs=1e-5)
        for n, p in params.items():
            torch.testing.assert_close(p, ref_params[n], atol=1e-5, rtol=0, msg=n)
        assert placements["layers.0.attention.wq.weight"] == "[S(1), S(0)]"   # column-parallel: dp splits dim 1
        assert placements["layers.0.attention.wo.weight"] == "[S(0), S(1)]"   # row-parallel: dp splits dim 0
        assert placements["layers.0.attention_norm.weight"] == "[S(0), R]"


@pytest.mark.slow  # the 1-d bf16 test runs in CI; this adds the Llama under dp x tp
def test_fsdp_tp_2x2_mixed_precision_bf16_within_tolerance():
    ref_losses, ref_params = _reference_2d()
    for losses, params, _ in run_on_ranks(4, _fsdp_tp_train, True, True):
        assert losses == pytest.approx(ref_losses, abs=7e-2)  # a bf16 loss near 4: ulp 0.03
        for n, p in params.items():
            assert p.dtype == torch.float32, n  # sharded parameters stay float32; compute was bf16
            # AdamW moves each entry by ~lr=1e-2 per step whatever the gradient's size, so a wrong
            # gradient shows in the mean difference (~3e-2 after 5 steps); bf16 noise gives ~1e-3.
            diff = (p - ref_params[n]).abs()
            assert diff.mean() < 3e-3 and diff.max() < 8e-2, (n, diff.mean().item(), diff.max().item())


def _gather_mode(into_views, async_gather, fn, *args):
    """Run ``fn`` with units gathering the given way (by default gloo gathers flat and synchronously)."""
    from shardprop import config
    with config.patch(fsdp_gather_into_views=into_views, fsdp_async_gather=async_gather):
        return fn(*args)


def _into_views(fn, *args):
    """Run ``fn`` the NCCL way on gloo: async gathers straight into the parameters' views."""
    return _gather_mode(True, True, fn, *args)


def test_async_flat_gather_path():
    # async flat gathers (prefetch overlapping compute): the path a non-cpu backend gets with views off
    _check(run_on_ranks(4, _gather_mode, False, True, _fsdp_train, True), _reference(), 1e-5)


def test_gather_into_views_path():
    _check(run_on_ranks(4, _into_views, _fsdp_train, True), _reference(), 1e-5)
    ref_losses, ref_params = _reference_2d()
    for losses, params, _ in run_on_ranks(4, _into_views, _fsdp_tp_train, True):
        assert losses == pytest.approx(ref_losses, abs=1e-5)
        for n, p in params.items():
            torch.testing.assert_close(p, ref_params[n], atol=1e-5, rtol=0, msg=n)
    ref = _mlp_reference()
    for params, _ in run_on_ranks(4, _into_views, _mlp_fsdp_tp):
        for n, p in params.items():
            torch.testing.assert_close(p, ref[n], atol=1e-5, rtol=0, msg=n)


def _mlp():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 6))


def _mlp_reference():
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(4))
    for _ in range(3):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


def _mlp_fsdp_tp():
    from shardprop import ColwiseParallel, RowwiseParallel, fully_shard, init_device_mesh, parallelize_module
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = parallelize_module(_mlp(), mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = _rows(torch.randn(8, 6, generator=torch.Generator().manual_seed(4)), mesh["dp"])
    for _ in range(3):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return ({n: p.full_tensor() for n, p in model.named_parameters()},
            {n: str(list(p.placements)) for n, p in model.named_parameters()})


def test_column_parallel_bias_stays_whole_over_dp():
    ref = _mlp_reference()
    for params, placements in run_on_ranks(4, _mlp_fsdp_tp):
        assert placements["0.bias"] == "[R, S(0)]" and placements["0.weight"] == "[S(1), S(0)]", placements
        assert placements["2.bias"] == "[S(0), R]", placements
        for n, p in params.items():
            torch.testing.assert_close(p, ref[n], atol=1e-5, rtol=0, msg=n)


def _dcp_round_trip(path):
    import torch.distributed.checkpoint as dcp
    from shardprop import init_device_mesh
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    model = _shard_model(Net(), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = (_rows(t, mesh) for t in _batches(1)[0])
    _loss(model, x, y).backward()
    opt.step()
    dcp.save({"model": model.state_dict()}, checkpoint_id=path)
    fresh = _shard_model(Net(dim=13, hidden=7), mesh, reshard_after_forward=False)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    state = {"model": fresh.state_dict()}
    dcp.load(state, checkpoint_id=path)
    fresh.load_state_dict(state["model"])
    same = all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(model.parameters(), fresh.parameters()))
    with torch.no_grad():  # the loaded shards are what the units gather
        return same, _loss(model, x, y).item(), _loss(fresh, x, y).item()


def test_dcp_save_and_load(tmp_path):
    for same, a, b in run_on_ranks(4, _dcp_round_trip, str(tmp_path / "ckpt")):
        assert same and a == b
