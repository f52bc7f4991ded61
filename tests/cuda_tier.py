"""Helpers of the CUDA tier (tests/test_cuda_*.py, run by ``make test-gpu``).

Two ways to put ranks on GPUs, both from ``tests.rankpool``:

- ``shared(fn, ...)``: 4 ranks of the ordinary gloo pool, each with its tensors on
  ``cuda:(rank % GPUs)`` (one GPU: all on cuda:0). A ``"cuda"`` mesh in a gloo world gets
  gloo groups, so this runs the staging paths of mesh/transport/staging.py for real.
- ``nccl(n, fn, ...)``: ``n`` ranks over NCCL, one GPU per rank (``n = 1`` on one GPU).

Nothing here imports torch at module level beyond what the tests need; every test module of
the tier carries ``pytestmark = pytest.mark.cuda`` (or ``gpu``), so a CPU machine skips it.
"""
import torch

from tests.rankpool import run_on_backend, run_on_ranks

RTOL = ATOL = 1e-4


def shared(fn, *args, world=4, **kwargs):
    """``fn`` on ``world`` gloo ranks whose tensors live on the GPU(s)."""
    return run_on_ranks(world, fn, *args, **kwargs)


def nccl(n, fn, *args, **kwargs):
    """``fn`` on ``n`` NCCL ranks, one GPU each."""
    return run_on_backend("nccl", n, fn, *args, **kwargs)


def device() -> torch.device:
    """This rank's GPU (init_device_mesh("cuda", ...) sets it)."""
    return torch.device("cuda", torch.cuda.current_device())


def close(got, want, what, rtol=RTOL, atol=ATOL):
    """None if ``got`` matches ``want`` (both moved to the CPU), else a message naming ``what``."""
    got, want = got.detach().cpu(), want.detach().cpu()
    if got.shape != want.shape:
        return f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if not torch.allclose(got.float(), want.float(), rtol=rtol, atol=atol, equal_nan=True):
        return f"{what}: max abs diff {(got.float() - want.float()).abs().max().item():.3g}"
    return None


def rel_close(got, want, what, tol):
    """None if ``||got - want|| <= tol * ||want||`` (for bf16 results, whose elements round apart), else a message."""
    got, want = got.detach().cpu().float(), want.detach().cpu().float()
    if got.shape != want.shape:
        return f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    rel = ((got - want).norm() / want.norm().clamp_min(1e-12)).item()
    return None if rel <= tol else f"{what}: relative difference {rel:.3g} > {tol}"


def no_problems(per_rank):
    """Assert every rank returned an empty list of problems (messages of the first failing rank otherwise)."""
    for rank, problems in enumerate(per_rank):
        assert not problems, f"rank {rank}:\n" + "\n".join(map(str, problems[:10]))
