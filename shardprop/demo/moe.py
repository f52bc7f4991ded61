"""A small DeepSeek-style MoE layer: the demo's (``--moe``) and the expert-parallel tests' model (plain torch).

Router: a linear gate, softmax scores, top-k experts per token. Routed experts: a module
with torchtitan's ``GroupedExperts`` contract (stacked ``w1``/``w3`` ``[experts, dim, hidden]``,
``w2`` ``[experts, hidden, dim]``, ``forward(x, num_tokens_per_expert)`` on tokens sorted by
expert, weights read through ``.to_local()`` when they are DTensors), computed by one
``torch._grouped_mm`` per weight where it runs on the device and dtype, else by a loop over its experts. One shared expert, a plain SwiGLU MLP, sees every token.

Example:
    >>> import torch
    >>> moe = MoE(dim=16, hidden=24, num_experts=8, top_k=2)
    >>> moe(torch.randn(2, 5, 16)).shape
    torch.Size([2, 5, 16])
"""
import torch
import torch.nn.functional as F
from torch import nn

from shardprop.mesh.compat import grouped_mm_runs
from shardprop import DTensor

__all__ = ["GroupedExperts", "MoE", "SharedExpert", "TopKRouter", "expert_swiglu", "synthetic_batch"]


def _local(w):
    # isinstance, not hasattr(w, "to_local"): under torch.compile dynamo answers hasattr for a
    # tensor subclass's own methods with False, and the DTensor would be used whole.
    return w.to_local() if isinstance(w, DTensor) else w


# Whether compiled code may use torch._grouped_mm, per dtype, probed eagerly at import: a probe
# traced by dynamo would run on fake tensors.
_TRACED_OK = {dt: grouped_mm_runs("meta", dt, True) for dt in (torch.float32, torch.bfloat16)}


def _grouped_mm_fits(x, w1, w2) -> bool:
    # Its kernels want 16-byte-aligned rows: the widths must be multiples of 16 bytes.
    aligned = all((n * x.element_size()) % 16 == 0 for n in (x.shape[-1], w1.shape[-1], w2.shape[-1]))
    if torch.compiler.is_compiling():
        return aligned and _TRACED_OK.get(x.dtype, False)
    return aligned and grouped_mm_runs(x.device.type, x.dtype)


def expert_swiglu(x, num_tokens_per_expert, w1, w2, w3, grouped_mm=None):
    """SwiGLU of each expert on its rows of ``x`` (sorted by expert), on plain stacked weights.

    ``grouped_mm``: one ``torch._grouped_mm`` per weight (True), a loop over the experts (False),
    or the kernel where it runs on this device and dtype (None).

    Example:
        >>> w = lambda *s: torch.randn(*s)
        >>> expert_swiglu(w(3, 4), torch.tensor([1, 2]), w(2, 4, 8), w(2, 8, 4), w(2, 4, 8)).shape
        torch.Size([3, 4])
    """
    if grouped_mm is None:
        grouped_mm = _grouped_mm_fits(x, w1, w2)
    if grouped_mm:
        # One kernel for all experts: groups of rows cut at the running token counts.
        offs = torch.cumsum(num_tokens_per_expert, 0).to(torch.int32)
        h = F.silu(torch._grouped_mm(x, w1, offs=offs)) * torch._grouped_mm(x, w3, offs=offs)
        return torch._grouped_mm(h, w2, offs=offs)
    outs = [(F.silu(xe @ w1[e]) * (xe @ w3[e])) @ w2[e]
            for e, xe in enumerate(torch.split(x, num_tokens_per_expert.tolist()))]
    return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[-1])


class GroupedExperts(nn.Module):
    """Stacked experts (torchtitan's contract): ``forward(x, num_tokens_per_expert)`` on tokens sorted by expert.

    Example:
        >>> GroupedExperts(4, 6, 2)(torch.randn(3, 4), torch.tensor([1, 2])).shape
        torch.Size([3, 4])
    """

    def __init__(self, dim, hidden, num_experts, grouped_mm=None):
        super().__init__()
        self.num_experts = num_experts
        self.grouped_mm = grouped_mm  # see expert_swiglu
        self.w1 = nn.Parameter(torch.randn(num_experts, dim, hidden) / dim ** 0.5)
        self.w2 = nn.Parameter(torch.randn(num_experts, hidden, dim) / hidden ** 0.5)
        self.w3 = nn.Parameter(torch.randn(num_experts, dim, hidden) / dim ** 0.5)

    def forward(self, x, num_tokens_per_expert):
        # Under expert parallelism the local pieces: this rank's experts and the tokens routed to them.
        w1, w2, w3 = _local(self.w1), _local(self.w2), _local(self.w3)
        assert num_tokens_per_expert.shape[0] == w1.shape[0], (num_tokens_per_expert.shape, w1.shape)
        return expert_swiglu(x, num_tokens_per_expert, w1, w2, w3, self.grouped_mm)


class TopKRouter(nn.Module):
    """Softmax scores over a linear gate; each token's top-k experts, their scores, and tokens per expert.

    ``expert_bias=True``: DeepSeek-V3's balancing without an auxiliary loss. A per-expert bias
    (a buffer, no gradient) is added to the scores for choosing the experts only; the gate
    weights stay the unbiased scores. :meth:`update_expert_bias` moves it after each step.
    """

    def __init__(self, dim, num_experts, top_k, expert_bias=False):
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.num_experts, self.top_k = num_experts, top_k
        self.register_buffer("expert_bias", torch.zeros(num_experts) if expert_bias else None)

    def forward(self, x):
        scores = torch.softmax(self.gate(x), dim=-1)
        if self.expert_bias is None:
            top_scores, selected = torch.topk(scores, self.top_k, dim=-1)
        else:
            selected = torch.topk(scores + self.expert_bias, self.top_k, dim=-1).indices
            top_scores = scores.gather(-1, selected)
        counts = torch.bincount(selected.reshape(-1), minlength=self.num_experts)
        return top_scores, selected, counts

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert, rate=1e-3):
        """Raise the bias of experts below the mean load, lower it above (sign update, DeepSeek-V3).

        ``tokens_per_expert``: the step's counts summed over every rank that routes its own tokens
        (all-reduce them over the data-parallel and ep ranks first), so every rank moves alike.

        Example:
            >>> r = TopKRouter(4, 3, 1, expert_bias=True)
            >>> r.update_expert_bias(torch.tensor([5, 1, 0]), rate=0.1); r.expert_bias
            tensor([-0.1000,  0.1000,  0.1000])
        """
        load = tokens_per_expert.to(self.expert_bias.dtype)
        self.expert_bias += rate * torch.sign(load.mean() - load)


class SharedExpert(nn.Module):
    """A SwiGLU MLP every token goes through."""

    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """Router, routed experts (``experts``, the module expert parallelism shards) and a shared expert."""

    def __init__(self, dim=16, hidden=24, num_experts=8, top_k=2, expert_bias=False):
        super().__init__()
        self.top_k = top_k
        self.router = TopKRouter(dim, num_experts, top_k, expert_bias)
        self.tokens_per_expert = None  # the last forward's, for load statistics and the bias update
        self.experts = GroupedExperts(dim, hidden, num_experts)
        self.shared_expert = SharedExpert(dim, hidden)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        top_scores, selected, counts = self.router(x)
        self.tokens_per_expert = counts.detach()
        # Token copies sorted by expert (stable: ties keep token order).
        order = torch.argsort(selected.reshape(-1), stable=True)
        token = order // self.top_k
        routed = self.experts(x[token], counts)
        routed = routed * top_scores.reshape(-1)[order].unsqueeze(-1)
        out = torch.zeros_like(x).index_add(0, token, routed)
        return (out + self.shared_expert(x)).reshape(shape)


def synthetic_batch(step: int, batch: int, seq: int, dim: int, seed: int = 0):
    """Inputs and regression targets of one step, the same on every rank (each takes its rows).

    Example:
        >>> x, y = synthetic_batch(0, 2, 3, 4); x.shape
        torch.Size([2, 3, 4])
    """
    g = torch.Generator().manual_seed(1000 * seed + step)
    return torch.randn(batch, seq, dim, generator=g), torch.randn(batch, seq, dim, generator=g)
