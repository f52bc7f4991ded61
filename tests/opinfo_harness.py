"""Cross-reference DTensor ops against plain torch with OpInfo sample inputs.

For an op of torch's ``op_db`` (``torch.testing._internal.common_methods_invocations``)
the harness draws float32 sample inputs on CPU (``reference_inputs``: the OpInfo samples
plus larger ones), turns every tensor of a sample into a
DTensor for several placement combinations, runs the op, gathers each output with
``full_tensor()`` and compares it with the op on the plain full tensors.

Mesh variants (``VARIANTS``):

- ``"1d"``: a 4-rank mesh; per tensor Replicate or an even Shard(d) (size % 4 == 0;
  empty dims are never sharded).
- ``"2d"``: a 2x2 mesh; [S(d), R], [R, S(d)], [S(d), S(e)] (sizes divisible by 2,
  by 4 for [S(d), S(d)]).
- ``"uneven"``: the 4-rank mesh with Shard(d) on dims whose size is not divisible by 4.
- ``"backward"``: the 4-rank mesh, even shards, gradients through the DTensor graph.
- ``"inference"``: as ``"1d"``, the op run under ``torch.inference_mode()``, where
  CompositeImplicitAutograd ops reach the engine whole instead of decomposed.

Outcomes: ``"pass"`` (every checked combination equal), ``"wrong"`` (a result differs
without raising: the worst), ``"error"`` (raised; the first exception is recorded),
``"skip"`` (nothing to check: no float32 or autograd support, results that depend on the
seed (random ops OpInfo does not reseed, uninitialized memory), samples that differ between
ranks). Ops that draw random numbers under a seed of their own (OpInfo's ``wrapper_set_seed``:
dropout, svd_lowrank, ...) are checked against what one process draws. Ranks agree after every sample and combination through a process
group of the harness's own, so an error on some ranks only is reported, not a hang. Rank side: ``check_opinfo`` / ``check_many`` run on every
rank of a gloo world of 4 (``tests.rankpool``); parent side: ``run_checks`` batches ops
into pool runs and isolates an op that hangs or kills a rank::

    from tests.rankpool import get_pool
    from tests.opinfo_harness import run_checks

    res = run_checks(get_pool(4), ["add", "mm"], "1d")
    res["mm"]["outcome"]          # "pass", "wrong", "error" or "skip"

The engine under test is reached only through a small adapter (``ENGINES``), so the
same checks run against shardprop or the reference ``torch.distributed.tensor``.
"""
from __future__ import annotations

import hashlib
import random
import time
import warnings
from datetime import timedelta
from typing import Callable, NamedTuple

PASS, WRONG, ERROR, SKIP = "pass", "wrong", "error", "skip"
OUTCOMES = (PASS, WRONG, ERROR, SKIP)
# An op's outcome is the worst over its samples and combinations (and its OpInfos).
_SEVERITY = {WRONG: 3, ERROR: 2, PASS: 1, SKIP: 0}

# variant -> mesh shape (placement_choices says what each variant shards)
VARIANTS = {
    "1d": (4,),
    "2d": (2, 2),
    "uneven": (4,),
    "backward": (4,),
    "inference": (4,),
}

# Sharded computation reorders float sums; real sharding bugs are off by far more.
DEFAULT_TOL = dict(rtol=1e-4, atol=1e-4)
# op key -> tolerances where the default is too tight for reordered float32 arithmetic.
TOLERANCES: dict = {}

_MAX_CANDIDATE_SAMPLES = 120  # samples drawn per op before choosing the most shardable
_MAX_SAMPLE_NUMEL = 1 << 16  # larger samples only slow the sweep down
_MSG_LEN = 240


# ------------------------------------------------------------------ engines
class Engine(NamedTuple):
    """What the checks need from a DTensor implementation."""

    name: str
    init_mesh: Callable  # (shape) -> mesh
    distribute: Callable  # (tensor, mesh, placements) -> DTensor, rank 0's data everywhere
    full_tensor: Callable  # (dtensor) -> torch.Tensor (differentiable)
    is_dtensor: Callable  # (x) -> bool
    shard: Callable  # (dim) -> Shard placement
    replicate: Callable  # () -> Replicate placement


def _shardprop_engine() -> Engine:
    import shardprop as sp

    return Engine(
        "shardprop",
        lambda shape: sp.init_device_mesh("cpu", shape),
        lambda t, mesh, pl: sp.distribute_tensor(t, mesh, pl, src_data_rank=0),
        lambda x: x.full_tensor(),
        lambda x: isinstance(x, sp.DTensor),
        sp.Shard,
        sp.Replicate,
    )


def _reference_engine() -> Engine:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    return Engine(
        "reference",
        lambda shape: init_device_mesh("cpu", shape),
        lambda t, mesh, pl: distribute_tensor(t, mesh, pl, src_data_rank=0),
        lambda x: x.full_tensor(),
        lambda x: isinstance(x, DTensor),
        Shard,
        Replicate,
    )


def _shardprop_cuda_engine() -> Engine:
    """shardprop with every DTensor on this rank's GPU (the CUDA tier): inputs drawn on the CPU are
    moved to the GPU before distributing, and gathered outputs come back to the CPU to compare."""
    import torch

    import shardprop as sp

    return Engine(
        "shardprop_cuda",
        lambda shape: sp.init_device_mesh("cuda", shape),
        lambda t, mesh, pl: sp.distribute_tensor(t.to("cuda"), mesh, pl, src_data_rank=0),
        lambda x: x.full_tensor().cpu(),
        lambda x: isinstance(x, sp.DTensor),
        sp.Shard,
        sp.Replicate,
    )


ENGINES = {"shardprop": _shardprop_engine, "reference": _reference_engine, "shardprop_cuda": _shardprop_cuda_engine}

# Per rank process: built once, since meshes and process groups are created collectively.
_engines: dict = {}
_meshes: dict = {}
_sync_group = None


def _engine(name: str) -> Engine:
    if name not in _engines:
        _engines[name] = ENGINES[name]()
    return _engines[name]


def _mesh(engine: Engine, shape):
    key = (engine.name, shape)
    if key not in _meshes:
        _meshes[key] = engine.init_mesh(shape)
    return _meshes[key]


def _group():
    """The harness's own process group, so its bookkeeping collectives never pair up
    with an engine collective that a failing rank left unfinished."""
    global _sync_group
    if _sync_group is None:
        import torch.distributed as dist

        _sync_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=90))
    return _sync_group


# ------------------------------------------------------------------ op lookup
def opinfo_key(op) -> str:
    """``name`` or ``name.variant_test_name``, unique over op_db (e.g. ``div.trunc_rounding``)."""
    return op.name + ("." + op.variant_test_name if op.variant_test_name else "")


def _op_db():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.testing._internal.common_methods_invocations import op_db
    return op_db


def find_opinfos(op_name: str) -> list:
    """The OpInfos for ``op_name``: the one whose key matches exactly, else every
    OpInfo of that name (``"div"`` gives its three rounding-mode variants)."""
    db = _op_db()
    exact = [op for op in db if opinfo_key(op) == op_name]
    return exact or [op for op in db if op.name == op_name]


def list_op_keys(dtype_name: str = "float32") -> list:
    """Keys of every op_db entry that supports ``dtype_name`` on CPU, in op_db order."""
    import torch

    dtype = getattr(torch, dtype_name)
    return [opinfo_key(op) for op in _op_db() if dtype in op.supported_dtypes("cpu")]


# ------------------------------------------------------------------ samples
def _seed_all(seed: int) -> None:
    import numpy as np
    import torch

    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def _leaves(sample):
    """(leaves, treespec) of (input, args, kwargs)."""
    from torch.utils import _pytree as pytree

    return pytree.tree_flatten((sample.input, tuple(sample.args), dict(sample.kwargs)))


def _is_tensor(x) -> bool:
    import torch

    return isinstance(x, torch.Tensor)


def placement_choices(shape, variant: str) -> list:
    """A tensor's placement choices for a variant, each a tuple of per-mesh-dim codes
    ("R" or "S<d>"); Replicate comes first.

    Example:
        >>> placement_choices((8, 5), "1d")
        [('R',), ('S0',)]
        >>> placement_choices((8, 5), "uneven")
        [('R',), ('S1',)]
    """
    # Empty dims are never sharded: every shard would be empty, so nothing would be checked.
    dims = [d for d in range(len(shape)) if shape[d] > 0]
    if variant in ("1d", "backward", "inference"):
        return [("R",)] + [(f"S{d}",) for d in dims if shape[d] % 4 == 0]
    if variant == "uneven":
        return [("R",)] + [(f"S{d}",) for d in dims if shape[d] % 4 != 0]
    if variant == "2d":
        halves = [d for d in dims if shape[d] % 2 == 0]
        out = [("R", "R")]
        out += [(f"S{d}", "R") for d in halves] + [("R", f"S{d}") for d in halves]
        out += [(f"S{d}", f"S{e}") for d in halves for e in halves if d != e]
        out += [(f"S{d}", f"S{d}") for d in dims if shape[d] % 4 == 0]
        return out
    raise ValueError(f"unknown variant {variant!r}; expected one of {sorted(VARIANTS)}")


def placement_combos(choices: list, variant: str, max_combos: int, rng: random.Random) -> list:
    """Deterministic placement combinations for a sample's tensors (one choice list each):
    all-Replicate (not for "uneven", which is about shards), the same placement on every
    tensor that allows it, each single sharded tensor (round-robin over tensors), then
    random mixes; at most ``max_combos``.

    Example:
        >>> placement_combos([[("R",), ("S0",)], [("R",), ("S0",)]], "1d", 8, random.Random(0))
        [(('R',), ('R',)), (('S0',), ('S0',)), (('S0',), ('R',)), (('R',), ('S0',))]
    """
    n = len(choices)
    rep = tuple(c[0] for c in choices)
    out = [] if variant == "uneven" else [rep]
    sharded = []  # distinct non-R placements, first-seen order
    for cs in choices:
        sharded += [c for c in cs[1:] if c not in sharded]
    for p in sharded:  # aligned: the op's natural no-communication path
        combo = tuple(p if p in cs else cs[0] for cs in choices)
        if sum(c == p for c in combo) >= 2:
            out.append(combo)
    depth = max((len(cs) for cs in choices), default=1)
    singles = [rep[:i] + (choices[i][j],) + rep[i + 1:] for j in range(1, depth) for i in range(n)
               if j < len(choices[i])]
    mixes = []
    total = 1
    for cs in choices:
        total *= len(cs)
    if n >= 2 and total > 1:
        for _ in range(4 * max_combos):  # rejection sampling; the product may be huge
            combo = tuple(rng.choice(cs) for cs in choices)
            if sum(c != r for c, r in zip(combo, rep)) >= 2 and combo not in mixes:
                mixes.append(combo)
            if len(mixes) >= 2:
                break
    room = max(0, max_combos - len(mixes))
    seen, result = set(), []
    for combo in out + singles:
        if combo not in seen and len(result) < room:
            seen.add(combo)
            result.append(combo)
    for combo in mixes:
        if combo not in seen and len(result) < max_combos:
            seen.add(combo)
            result.append(combo)
    return result


def _sample_choices(sample, variant):
    leaves, _ = _leaves(sample)
    return [placement_choices(tuple(t.shape), variant) for t in leaves if _is_tensor(t)]


def _candidates(inputs_fn, seed: int, requires_grad: bool) -> list:
    """The first strided, not too large samples of ``inputs_fn``, reseeded before each."""
    import torch

    samples = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _seed_all(seed)
        # set_seed=False: OpInfo would reseed from the test's name; ``seed`` is ours to choose.
        it = iter(inputs_fn("cpu", torch.float32, requires_grad=requires_grad, set_seed=False))
        for i in range(_MAX_CANDIDATE_SAMPLES):
            _seed_all(seed + 1 + i)
            try:
                s = next(it)
            except StopIteration:
                break
            tensors = [t for t in _leaves(s)[0] if _is_tensor(t)]
            if tensors and all(t.layout == torch.strided for t in tensors) and \
                    sum(t.numel() for t in tensors) <= _MAX_SAMPLE_NUMEL:
                samples.append(s)
    return samples


def draw_samples(op, variant: str, seed: int, max_samples: int, requires_grad: bool) -> list:
    """Up to ``max_samples`` float32 CPU samples (OpInfo reference inputs), identical on every
    rank: the generator is reseeded before each sample. Samples that give the variant
    something to shard come first.
    """
    # reference_inputs = sample_inputs plus larger and extremal cases where the op has them.
    # OpInfo sizes are mostly 5 and 10, so without the larger ones even shards over 4 ranks
    # would hardly ever occur. Some reference inputs reject requires_grad: then the samples.
    try:
        samples = _candidates(op.reference_inputs, seed, requires_grad)
    except Exception:
        samples = _candidates(op.sample_inputs, seed, requires_grad)
    # Samples with something to shard first, but keep one slot for the op's first plain
    # sample (scalars, broadcasting, empty tensors), which every variant checks replicated.
    shardable = [s for s in samples if any(len(c) > 1 for c in _sample_choices(s, variant))]
    rest = [s for s in samples if not any(s is t for t in shardable)]
    picked = shardable[:max(1, max_samples - 1)] if rest else shardable[:max_samples]
    return picked + rest[:max_samples - len(picked)]


def sample_digest(samples) -> int:
    """A 63-bit digest of the samples' tensors (shape, dtype, bytes) and other arguments."""
    import torch

    h = hashlib.sha256()
    for s in samples:
        leaves, spec = _leaves(s)
        h.update(repr(spec).encode())
        for x in leaves:
            if _is_tensor(x):
                h.update(f"{tuple(x.shape)}{x.dtype}".encode())
                h.update(x.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            else:
                h.update(repr(x).encode())
    return int.from_bytes(h.digest()[:8], "little") >> 1


# ------------------------------------------------------------------ one check
class _Wrong(Exception):
    """A result differs from plain torch (raised by the checks, never by the engine)."""


def _short(e: BaseException) -> str:
    msg = " ".join(str(e).split())
    return f"{type(e).__name__}: {msg}"[:_MSG_LEN]


def _full_inputs(leaves):
    """Contiguous copies: a DTensor is a contiguous global tensor, so the reference is too."""
    import torch

    return [x.detach().clone(memory_format=torch.contiguous_format) if _is_tensor(x) else x for x in leaves]


def _call(op, spec, leaves):
    from torch.utils import _pytree as pytree

    inp, args, kwargs = pytree.tree_unflatten(leaves, spec)
    return op.op(inp, *args, **kwargs)


def _combo_str(leaves, combo) -> str:
    shapes = [tuple(t.shape) for t in leaves if _is_tensor(t)]
    text = ", ".join(f"t{i}{list(s)}:[{','.join(c)}]" for i, (s, c) in enumerate(zip(shapes, combo)))
    return text if len(text) <= _MSG_LEN else text[:_MSG_LEN - 3] + "..."


def _placements(engine: Engine, codes):
    return [engine.replicate() if c == "R" else engine.shard(int(c[1:])) for c in codes]


def _compare(actual, expected, tol, what: str) -> None:
    import torch

    try:
        torch.testing.assert_close(actual, expected, equal_nan=True, **tol)
    except AssertionError as e:
        raise _Wrong(f"{what}: {' '.join(str(e).split())}"[:_MSG_LEN]) from None


def _gather_outputs(engine: Engine, out):
    from torch.utils import _pytree as pytree

    return pytree.tree_map(lambda x: engine.full_tensor(x) if engine.is_dtensor(x) else x, out)


class _Reference(NamedTuple):
    leaves: list  # contiguous full inputs (fresh copies are made per combination)
    spec: object
    out: object  # plain torch's result
    mutated: tuple  # indices of tensor leaves the op wrote into
    after: dict  # leaf index -> value after the op (for mutated leaves)


def _reference(op, sample):
    """Plain torch on full tensors: (_Reference, do its results depend on the seed?)."""
    import torch

    leaves, spec = _leaves(sample)
    full = _full_inputs(leaves)
    runs = []
    for seed in (1, 2):
        copies = _full_inputs(full)
        torch.manual_seed(seed)
        runs.append((copies, _call(op, spec, copies)))
    copies, out = runs[0]
    mutated = tuple(i for i, x in enumerate(full) if _is_tensor(x) and not _same(copies[i], x))
    # A sample whose result changes with the seed (or with uninitialized memory: empty_like) has no
    # single right answer: the op is skipped. One that draws random numbers yet gives the same result under
    # two seeds (OpInfo reseeds inside: svd_lowrank, dropout, ...) is checked like any other, the
    # engine run after the same torch.manual_seed on every rank: the values one process draws are
    # the right answer (shardprop's random ops reproduce them; see dispatch/random_ops.py).
    seed_dependent = not (_same(runs[0][1], runs[1][1])
                          and all(_same(runs[0][0][i], runs[1][0][i]) for i in mutated))
    return _Reference(full, spec, out, mutated, {i: copies[i] for i in mutated}), seed_dependent


def _same(a, b) -> bool:
    try:
        _compare(a, b, dict(rtol=0, atol=0), "")
    except _Wrong:
        return False
    return True


def _distribute(engine, mesh, leaves, combo, grad: bool):
    """Replace each tensor leaf by a DTensor with its combination's placements."""
    out, k, dts = [], 0, []
    for x in leaves:
        if _is_tensor(x):
            dt = engine.distribute(x.detach(), mesh, _placements(engine, combo[k]))
            if grad and x.requires_grad:
                dt.requires_grad_(True)
            out.append(dt)
            dts.append((x, dt))
            k += 1
        else:
            out.append(x)
    return out, dts


def _check_forward(engine, mesh, op, ref: _Reference, combo, tol, inference: bool = False) -> None:
    import contextlib

    import torch

    leaves, _ = _distribute(engine, mesh, _full_inputs(ref.leaves), combo, grad=False)
    torch.manual_seed(1)
    # Inference: inputs made as a server makes its weights (outside), the op and gathering inside.
    with torch.inference_mode() if inference else contextlib.nullcontext():
        out = _call(op, ref.spec, leaves)
        _compare(_gather_outputs(engine, out), ref.out, tol, "output")
        for i in ref.mutated:
            got = engine.full_tensor(leaves[i]) if engine.is_dtensor(leaves[i]) else leaves[i]
            _compare(got, ref.after[i], tol, f"input t{i} after the op")


def _grad_outputs(sample, out):
    from torch.utils import _pytree as pytree

    return [o for o in pytree.tree_leaves(sample.output_process_fn_grad(out))
            if _is_tensor(o) and o.requires_grad]


def _backward_reference(op, sample):
    """(full inputs, spec, differentiable outputs, output grads, input grads) or None."""
    import torch

    leaves, spec = _leaves(sample)
    full = _full_inputs(leaves)
    ins = [x.requires_grad_(True) for x, orig in zip(full, leaves)
           if _is_tensor(x) and orig.requires_grad and x.is_floating_point()]
    if not ins:
        return None
    torch.manual_seed(1)
    outs = _grad_outputs(sample, _call(op, spec, full))
    if not outs:
        return None
    g = torch.Generator().manual_seed(7)
    grads_out = [torch.randn(o.shape, generator=g, dtype=o.dtype) for o in outs]
    grads_in = torch.autograd.grad(outs, ins, grads_out, allow_unused=True)
    return full, spec, [o.detach() for o in outs], grads_out, grads_in


def _check_backward(engine, mesh, op, sample, bref, combo, tol) -> None:
    import torch

    full, spec, outs_ref, grads_out, grads_ref = bref
    leaves, pairs = _distribute(engine, mesh, full, combo, grad=True)
    ins = [dt for x, dt in pairs if x.requires_grad]
    torch.manual_seed(1)
    outs = _grad_outputs(sample, _call(op, spec, leaves))
    if len(outs) != len(outs_ref):
        raise _Wrong(f"{len(outs)} differentiable outputs, plain torch has {len(outs_ref)}")
    fulls = [engine.full_tensor(o) if engine.is_dtensor(o) else o for o in outs]
    _compare([f.detach() for f in fulls], outs_ref, tol, "output")
    grads = torch.autograd.grad(fulls, ins, grads_out, allow_unused=True)
    for i, (got, want, x) in enumerate(zip(grads, grads_ref, ins)):
        got = torch.zeros(x.shape) if got is None else engine.full_tensor(got) if engine.is_dtensor(got) else got
        want = torch.zeros(x.shape) if want is None else want
        _compare(got, want, tol, f"grad of input {i}")


# ------------------------------------------------------------------ rank entry points
def _sync_codes(code: int) -> list:
    """Every rank's ``code`` (a small int: a sample's reference state, a combination's result)."""
    import torch
    import torch.distributed as dist

    mine = torch.tensor([code], dtype=torch.int64)
    out = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine, group=_group())
    return [int(t.item()) for t in out]


def _gather_obj(obj) -> list:
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=_group())
    return out


def _result(op_name, variant, engine, outcome, detail="", combo=None, desync=False, **extra) -> dict:
    return dict(op=op_name, variant=variant, engine=engine, outcome=outcome, detail=detail, combo=combo,
                desync=desync, **extra)


def check_opinfo(op_name: str, variant: str, engine: str = "shardprop", max_samples: int = 4,
                 max_combos: int = 8, seed: int = 0) -> dict:
    """Check one op (every OpInfo named ``op_name``) for one variant; run on every rank.

    Returns ``{"op", "variant", "engine", "outcome", "detail", "combo", "samples",
    "combos", "sharded_combos", "seconds", "desync"}``; ``outcome`` is one of OUTCOMES,
    ``combo`` names the first failing combination (``t0[5, 20]:[S1]`` = tensor 0 of the
    sample, its shape, its placements). ``desync`` is True when ranks failed differently,
    so the process groups may be out of step: stop using this pool.

    Example (inside ``run_on_ranks(4, ...)``):
        >>> check_opinfo("mm", "1d")["outcome"]  # doctest: +SKIP
        'pass'
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; expected one of {sorted(VARIANTS)}")
    t0 = time.perf_counter()
    eng = _engine(engine)
    _group()
    mesh = _mesh(eng, VARIANTS[variant])
    ops = find_opinfos(op_name)
    if not ops:
        return _result(op_name, variant, engine, SKIP, "not in op_db", samples=0, combos=0, sharded_combos=0,
                       seconds=0.0)
    with warnings.catch_warnings():  # deprecations and the like, from every op, on every rank
        warnings.simplefilter("ignore")
        results = [_check_one(op, op_name, variant, eng, mesh, max_samples, max_combos, seed, len(ops) > 1)
                   for op in ops]
    res = max(results, key=lambda r: _SEVERITY[r["outcome"]])
    for k in ("samples", "combos", "sharded_combos"):
        res[k] = sum(r[k] for r in results)
    res["desync"] = any(r["desync"] for r in results)
    res["seconds"] = round(time.perf_counter() - t0, 3)
    return res


_READY, _NOTHING, _RANDOM = 0, 1, 2  # what the reference run of a sample gave


def _check_one(op, op_name, variant, eng, mesh, max_samples, max_combos, seed, tag) -> dict:
    import torch

    key = opinfo_key(op)
    prefix = f"[{key}] " if tag else ""
    counts = dict(samples=0, combos=0, sharded_combos=0)

    def result(outcome, detail="", combo=None, desync=False):
        return _result(op_name, variant, eng.name, outcome, prefix + detail if detail else "", combo, desync,
                       **counts)

    backward = variant == "backward"
    if torch.float32 not in op.supported_dtypes("cpu"):
        return result(SKIP, "no float32 support")
    if backward and not op.supports_autograd:
        return result(SKIP, "no autograd support")
    tol = TOLERANCES.get(key, DEFAULT_TOL)

    # Drawing samples is local work, but every rank must agree on whether it failed.
    try:
        samples, err = draw_samples(op, variant, seed, max_samples, requires_grad=backward), None
    except Exception as e:
        samples, err = [], f"sample inputs failed: {_short(e)}"
    digests = _gather_obj(None if err else sample_digest(samples))
    if err:
        return result(SKIP, err)
    if len(set(digests)) > 1:
        return result(SKIP, "nondeterministic samples (they differ between ranks)")
    if not samples:
        return result(SKIP, f"no sample of strided tensors with at most {_MAX_SAMPLE_NUMEL} elements")

    worst, first_error, first_wrong = PASS, None, None
    rng = random.Random(seed)
    for si, sample in enumerate(samples):
        # The reference is plain torch on this rank's full copy (no collectives).
        try:
            ref, random_op = _reference(op, sample)
            if backward and not random_op:
                ref = _backward_reference(op, sample)
            state = _RANDOM if random_op else _NOTHING if ref is None else _READY
        except Exception:
            state = _NOTHING  # plain torch rejects this sample: nothing to compare with
        # Every rank must take the same path through the collectives below, and plain torch
        # need not agree with itself across ranks (uninitialized memory: empty_like, ...).
        states = _sync_codes(state)
        if len(set(states)) > 1:
            return result(SKIP, "results differ between ranks (random or uninitialized memory)")
        if state == _RANDOM:  # one sample reading the seed or uninitialized memory: the op's others
            # may agree with plain torch by chance (an empty_like that happened to get zeros)
            return result(SKIP, "results differ between runs (random or uninitialized memory)")
        if state == _NOTHING:
            continue
        counts["samples"] += 1
        choices = _sample_choices(sample, variant)
        for combo in placement_combos(choices, variant, max_combos, rng):
            code, msg = 0, ""
            try:
                if backward:
                    _check_backward(eng, mesh, op, sample, ref, combo, tol)
                else:
                    _check_forward(eng, mesh, op, ref, combo, tol, inference=variant == "inference")
            except _Wrong as e:
                code, msg = 1, str(e)
            except Exception as e:
                code, msg = 2, _short(e)
            codes = _sync_codes(code)
            counts["combos"] += 1
            counts["sharded_combos"] += any(c != "R" for p in combo for c in p)
            if max(codes) == 0:
                continue
            leaves, _ = _leaves(sample)
            where = f"sample {si}: {_combo_str(leaves, combo)}"
            if max(codes) == 1:
                if first_wrong is None:
                    first_wrong = (msg or "differs on another rank", where)
                worst = WRONG
                continue
            msgs = _gather_obj(msg)
            failed = [r for r, c in enumerate(codes) if c == 2]
            if len(failed) < len(codes) or len(set(msgs[r] for r in failed)) > 1:
                # Ranks failed differently: some may have left a collective half done.
                what = (f"only ranks {failed} raised" if len(failed) < len(codes)
                        else "ranks raised different errors")
                detail = f"{what}: " + " | ".join(f"rank {r}: {msgs[r]}" for r in failed)
                if first_wrong is not None:
                    return result(WRONG, first_wrong[0], first_wrong[1], desync=True)
                return result(ERROR, detail[:2 * _MSG_LEN], where, desync=True)
            if first_error is None:
                first_error = (msgs[failed[0]], where)
            if worst == PASS:
                worst = ERROR
    if counts["combos"] == 0:
        return result(SKIP, "no sample that plain torch runs" if not backward
                      else "no sample with a differentiable output")
    if worst == WRONG:
        return result(WRONG, *first_wrong)
    if worst == ERROR:
        return result(ERROR, *first_error)
    if variant == "uneven" and counts["sharded_combos"] == 0:
        return result(SKIP, "no dim with a size not divisible by 4")
    return result(PASS)


def check_many(op_names, variant: str, engine: str = "shardprop", **kwargs) -> dict:
    """``{op: check_opinfo(op, variant, engine, **kwargs)}`` for each op in order; stops
    after an op whose ranks fell out of step (its result has ``desync``), so the caller
    can restart the pool and go on with the rest. Runs on every rank."""
    out = {}
    for name in op_names:
        try:
            res = check_opinfo(name, variant, engine, **kwargs)
        except Exception as e:  # the harness itself, or a collective that timed out
            res = _result(name, variant, engine, ERROR, f"harness: {_short(e)}", desync=True,
                          samples=0, combos=0, sharded_combos=0, seconds=0.0)
        out[name] = res
        if res["desync"]:
            break
    return out


# ------------------------------------------------------------------ parent side
def run_checks(pool, op_names, variant: str, engine: str = "shardprop", *, chunk: int = 50,
               timeout_per_op: float = 30.0, progress: Callable | None = None, **kwargs) -> dict:
    """Check ``op_names`` for ``variant`` on a 4-rank ``tests.rankpool.RankPool``: ``chunk``
    ops per pool run; a chunk that hangs or kills a rank is rerun one op at a time (the pool
    restarts itself), and an op that does it alone is recorded as an "error" (hang or crash).
    ``progress(result)`` is called after each op. Returns ``{op: result}``.

    Example:
        >>> run_checks(get_pool(4), ["add", "mm"], "2d")["add"]["outcome"]  # doctest: +SKIP
        'pass'
    """
    from tests.rankpool import RankError

    results = {}
    todo = list(op_names)
    while todo:
        batch = todo[:chunk]
        if len(batch) == 1:
            got = _run_alone(pool, batch[0], variant, engine, timeout_per_op, kwargs)
        else:
            try:
                got = _run_batch(pool, batch, variant, engine, 60.0 + 5.0 * len(batch), kwargs)
            except RankError:  # the workers were killed: find the culprit in a fresh pool
                got = {}
                for name in batch:
                    got.update(_run_alone(pool, name, variant, engine, timeout_per_op, kwargs))
        for name, res in got.items():
            results[name] = res
            if progress is not None:
                progress(res)
        todo = [n for n in todo if n not in got]
    return results


def _run_batch(pool, batch, variant, engine, limit, kwargs) -> dict:
    got = pool.run(check_many, batch, variant, engine, timeout=limit, **kwargs)[0]
    if any(r["desync"] for r in got.values()):
        pool.shutdown()  # process groups may be out of step; the next run restarts the workers
    return got


def _run_alone(pool, name, variant, engine, limit, kwargs) -> dict:
    from tests.rankpool import RankError, RankTimeout

    try:
        return _run_batch(pool, [name], variant, engine, limit, kwargs)
    except RankError as e:
        kind = "hang (timed out)" if isinstance(e, RankTimeout) else "a rank failed"
        last = next((ln.strip() for ln in reversed(str(e).splitlines())
                     if ln.strip() and not ln.startswith(("-", " "))), "")
        return {name: _result(name, variant, engine, ERROR, f"{kind}: {last}"[:_MSG_LEN], desync=True,
                              samples=0, combos=0, sharded_combos=0, seconds=limit)}
