"""loss_parallel(): cross-entropy on class-sharded logits equals F.cross_entropy on the full logits
(loss and logits gradient, every reduction, ignore_index, class weights, 2-d and 3-d inputs), and
never creates a local tensor as large as the full logits.
"""

import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils._python_dispatch import TorchDispatchMode

from shardprop import (ColwiseParallel, DTensor, Replicate, Shard, distribute_tensor, init_device_mesh,
                       loss_parallel, parallelize_module)
from shardprop.dispatch import dispatcher as sp_dispatch
from shardprop.parallel.tp.loss_parallel import HANDLERS
from tests.rankpool import run_on_ranks

R = Replicate()
ATOL = dict(atol=1e-5, rtol=1e-5)


def _rand(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _targets(shape, classes, seed, ignore):
    t = torch.randint(0, classes, shape, generator=torch.Generator().manual_seed(seed))
    t.view(-1)[::5] = ignore if ignore >= 0 else 3  # some ignored entries (or plain class 3)
    return t


def _compare(full, placements, mesh, targets, where, prepare=lambda x: x, check_layout=True, **ce):
    """Loss and logits gradient under loss_parallel vs F.cross_entropy on the full logits."""
    dt = distribute_tensor(full, mesh, placements).requires_grad_()
    ref = full.clone().requires_grad_()
    with loss_parallel():
        loss = F.cross_entropy(prepare(dt), targets, **ce)
        ref_loss = F.cross_entropy(prepare(ref), targets.full_tensor() if isinstance(targets, DTensor) else targets,
                                   **ce)
        torch.testing.assert_close(loss.full_tensor(), ref_loss, **ATOL, msg=lambda m: f"{where}: loss: {m}")
        grad = _rand(ref_loss.shape, 99)
        loss.backward(distribute_tensor(grad, mesh, loss.placements) if loss.ndim else None)
    ref_loss.backward(grad if ref_loss.ndim else None)
    if check_layout:
        assert dt.grad.placements == dt.placements, f"{where}: grad laid out {dt.grad.placements}"
    torch.testing.assert_close(dt.grad.full_tensor(), ref.grad, **ATOL, msg=lambda m: f"{where}: grad: {m}")


def _loss_cases():
    mesh = init_device_mesh("cpu", (4,))
    n = 0
    for classes in (16, 10):  # 10: uneven shards (3, 3, 3, 1)
        full = _rand((12, classes), classes)
        for reduction in ("mean", "sum", "none"):
            for ignore in (-100, 3):
                t = _targets((12,), classes, 1, ignore)
                for as_dtensor in (False, True):
                    targets = distribute_tensor(t, mesh, [R]) if as_dtensor else t
                    _compare(full, [Shard(1)], mesh, targets, f"C={classes} {reduction} ignore={ignore}",
                             reduction=reduction, ignore_index=ignore)
                    n += 1
        w = torch.rand(classes, generator=torch.Generator().manual_seed(7)) + 0.5
        for reduction in ("mean", "sum", "none"):
            _compare(full, [Shard(1)], mesh, _targets((12,), classes, 2, 3), f"C={classes} weight {reduction}",
                     weight=w, reduction=reduction, ignore_index=3)
            n += 1

    # [B, S, C] logits sharded on the class dim: flattened to tokens, or transposed to [B, C, S].
    full = _rand((2, 6, 16), 5)
    t = _targets((2, 6), 16, 3, 3)
    for reduction in ("mean", "none"):
        _compare(full, [Shard(2)], mesh, t.flatten(), f"flatten {reduction}", lambda x: x.flatten(0, 1),
                 reduction=reduction, ignore_index=3)
        # (The leaf's grad comes back transposed; autograd copies it into the leaf's strides via
        # new_empty_strided, whose rule replicates, so only the values are compared here.)
        _compare(full, [Shard(2)], mesh, t, f"transpose {reduction}", lambda x: x.transpose(1, 2),
                 check_layout=False, reduction=reduction, ignore_index=3)
        n += 2

    # Class dim not sharded: the normal path, inside the context too.
    _compare(_rand((12, 16), 6), [Shard(0)], mesh, distribute_tensor(_targets((12,), 16, 4, 3), mesh, [Shard(0)]),
             "batch-sharded", ignore_index=3)
    _compare(_rand((12, 16), 6), [R], mesh, distribute_tensor(_targets((12,), 16, 4, 3), mesh, [R]), "replicated")
    n += 2

    # End to end: a vocab-sharded output projection feeding the loss; weight gradient vs single device.
    torch.manual_seed(0)
    head = nn.Linear(8, 16)
    ref = copy.deepcopy(head)
    parallelize_module(head, mesh, ColwiseParallel(use_local_output=False))
    x, t = _rand((2, 5, 8), 8), _targets((2, 5), 16, 5, -100)
    logits = head(x)
    assert logits.placements == (Shard(2),), logits.placements
    with loss_parallel():
        loss = F.cross_entropy(logits.flatten(0, 1), t.flatten())
        loss.backward()
    ref_loss = F.cross_entropy(ref(x).flatten(0, 1), t.flatten())
    ref_loss.backward()
    torch.testing.assert_close(loss.full_tensor(), ref_loss, **ATOL)
    for (name, p), (_, q) in zip(head.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, **ATOL, msg=lambda m: f"head {name}: {m}")
    return n + 1


def test_loss_parallel_matches_cross_entropy():
    assert run_on_ranks(4, _loss_cases) == [37] * 4


def _loss_cases_2d():
    """A 2x2 (dp, tp) mesh: batch sharded on dp (logits and targets alike), classes on tp."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    full = _rand((12, 10), 11)
    for reduction in ("mean", "sum", "none"):
        targets = distribute_tensor(_targets((12,), 10, 6, 3), mesh, [Shard(0), R])
        _compare(full, [Shard(0), Shard(1)], mesh, targets, f"2x2 {reduction}", reduction=reduction, ignore_index=3)
    return True


def test_loss_parallel_batch_and_class_sharded():
    assert run_on_ranks(4, _loss_cases_2d) == [True] * 4


# ---------------------------------------------------------------- memory
class LargestLocal(TorchDispatchMode):
    """Records the largest real (non-meta) plain tensor any op outputs, including the local ops the DTensor
    dispatcher runs (a DTensor op is re-dispatched with this mode still active)."""

    def __init__(self):
        super().__init__()
        self.largest = 0
        self.largest_op = None  # for the failure message
        self.dtensor_ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            self.dtensor_ops += 1
            with self:
                return DTensor.__torch_dispatch__(func, types, args, kwargs)
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            # Meta tensors (shape propagation) allocate nothing; DTensor wrappers neither.
            if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and t.device.type != "meta":
                if t.numel() > self.largest:
                    self.largest, self.largest_op = t.numel(), str(func)
        return out


def _memory_case():
    mesh = init_device_mesh("cpu", (4,))
    tokens, vocab = 64, 256
    full = _rand((tokens, vocab), 1)
    t = _targets((tokens,), vocab, 2, 3)
    sizes = {}
    for name in ("loss_parallel", "gathered"):
        dt = distribute_tensor(full, mesh, [Shard(1)]).requires_grad_()
        rec = LargestLocal()
        with rec:
            if name == "loss_parallel":
                with loss_parallel():
                    F.cross_entropy(dt, t, ignore_index=3).backward()
            else:  # the control: gathering the logits first must show up as a full-size tensor
                F.cross_entropy(dt.full_tensor(), t, ignore_index=3).backward()
        assert rec.dtensor_ops > 0, "the recorder saw no DTensor op"
        sizes[name] = rec.largest
        sizes[name + " op"] = rec.largest_op
    return sizes, tokens * vocab


def test_loss_parallel_never_materialises_full_logits():
    sizes, full = run_on_ranks(4, _memory_case)[0]
    local = full // 4
    # The recorder sees the local ops (the local log-probs are a full shard) ...
    assert sizes["loss_parallel"] >= local, sizes
    # ... none larger than this rank's shard of the logits, while gathering shows the full size.
    assert sizes["loss_parallel"] <= local, sizes
    assert sizes["gathered"] >= full, sizes


def test_handlers_installed_only_inside_the_context():
    assert not any(sp_dispatch.special_handler(op) is not None for op in HANDLERS)
    with loss_parallel():
        with loss_parallel():  # nesting keeps them until the outermost exit
            pass
        assert all(sp_dispatch.special_handler(op) is h for op, h in HANDLERS.items())
    assert not any(sp_dispatch.special_handler(op) is not None for op in HANDLERS)
