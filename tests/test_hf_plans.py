"""parallelize_hf: tiny transformers models laid out from their own plans, on 4 gloo ranks, against one process.

Every rank builds the same randomly initialised model from its config (one seed, no download);
a copy on each rank runs the whole batch as the reference. Llama, Qwen2 and Qwen3 (GQA: 8 query
heads, 4 key/value heads) on tp=4 from ``model.tp_plan`` (embedding_rowwise, colwise, rowwise,
colwise_gather_output; Qwen3's replicated_with_grad_allreduce q_norm / k_norm); Mixtral's experts on
tp=4 from its tp plan (moe_tp_experts); Mixtral from ``model.ep_plan`` (ep_dispatch_experts, grouped_gemm) on ep=4,
and on ep=2 x tp=2 with its tp plan on attention (GQA 4/2) and the experts split over ep x tp.
With ep each rank (or tp pair) runs its share of the batch, and the parameters outside the
experts are data parallel over ep (their gradients summed here by hand). Losses over 3 AdamW
steps and every parameter after each step (``full_tensor()``) must match.
"""
import copy

import pytest
import torch
import torch.distributed as dist

from tests.closeness import Closeness
from tests.rankpool import run_on_ranks

transformers = pytest.importorskip("transformers", reason="transformers (a test extra) is not installed")

pytestmark = pytest.mark.timeout(240)
ATOL, RTOL = 2e-4, 2e-4
STEPS, BATCH, SEQ, VOCAB = 3, 4, 8, 128


def _config(kind):
    common = dict(num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=64, tie_word_embeddings=False)
    kv = 4 if kind == "mixtral-kv4" else 2  # tp=4 needs 4 key/value heads
    if kind == "llama":
        return transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                        num_key_value_heads=4, **common), transformers.LlamaForCausalLM
    if kind == "qwen3":  # q_norm / k_norm on this rank's heads: replicated_with_grad_allreduce
        return transformers.Qwen3Config(hidden_size=64, intermediate_size=128, num_attention_heads=8, head_dim=8,
                                        num_key_value_heads=4, **common), transformers.Qwen3ForCausalLM
    if kind == "qwen2":
        return transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_attention_heads=8,
                                        num_key_value_heads=4, **common), transformers.Qwen2ForCausalLM
    return transformers.MixtralConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                      num_key_value_heads=kv, num_local_experts=8, num_experts_per_tok=2,
                                      **common), transformers.MixtralForCausalLM


def _loss(model, ids, tgt, total):
    logits = model(input_ids=ids).logits
    # Summed over this rank's tokens, over the global count: the ep ranks' losses add up to the whole.
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tgt.reshape(-1), reduction="sum") / total


def _train(kind, shape, names, ac=False):
    from shardprop import DTensor, comm_counter, expert_load, explain, init_device_mesh, parallelize_hf
    cfg, cls = _config(kind)
    torch.manual_seed(0)
    ref = cls(cfg)
    model = copy.deepcopy(ref)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    has_ep = "ep" in names
    n_ep = mesh["ep"].size() if len(names) == 2 else (mesh.size() if has_ep else 1)
    me = (mesh.get_local_rank("ep") if len(names) == 2 else dist.get_rank()) if has_ep else 0
    ep_group = (mesh.get_group("ep") if len(names) == 2 else mesh.get_group()) if has_ep else None
    parallelize_hf(model, mesh)
    if ac:  # transformers' own activation checkpointing: the MoE layers dispatch again in backward
        model.gradient_checkpointing_enable()
        model.train()

    placements = {n: tuple(p.placements) for n, p in model.named_parameters() if isinstance(p, DTensor)}
    moves = None
    if names == ("ep",):  # explain() shows each MoE layer's token moves
        with explain() as ex, torch.no_grad():
            model(input_ids=torch.zeros(1, 4, dtype=torch.long))
        moves = [(r.op, [k for _, k, _, _ in r.collectives]) for r in ex.records if r.is_fast_path]
    close, losses = Closeness(ATOL, RTOL, lines=4), []

    # eps well above float noise: Adam's first step is lr * g / (|g| + eps), so a gradient near zero
    # (1e-9 here, 1.1e-9 there: float rounding) would otherwise move a weight by up to lr either way.
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-5)
    ref_params = dict(ref.named_parameters())
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 + step)
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        tgt = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        ref_loss = _loss(ref, ids, tgt, tgt.numel())
        ref_loss.backward()
        with comm_counter() as c:
            loss = _loss(model, ids.chunk(n_ep)[me], tgt.chunk(n_ep)[me], tgt.numel())
            comms = {k: v[0] for k, v in c.counts.items()}
            loss.backward()
        comms["backward all_to_all"] = c.counts.get("all_to_all", (0, 0))[0] - comms.get("all_to_all", 0)
        if has_ep:  # every (token, slot) pair of the whole batch reached one expert
            comms["tokens routed"] = sum(expert_load(model.model.layers[1].mlp.experts).tokens_per_expert)
        whole = loss.detach().clone()
        if has_ep:
            dist.all_reduce(whole, group=ep_group)
            for name, p in model.named_parameters():
                if ".experts." not in name:  # data parallel over ep: sum the batch shares' gradients
                    dist.all_reduce(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad, group=ep_group)
        close(f"step {step} loss", whole, ref_loss)
        losses.append(float(whole))
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
        for name, p in model.named_parameters():
            close(f"step {step} param {name}", p.full_tensor() if isinstance(p, DTensor) else p, ref_params[name])
    return close.errors, close.checked, losses, placements, len(ref_params), comms, moves


def _check(out, comms, moves=None):
    """No mismatch on any rank; the model trained; the last forward's collectives are ``comms``."""
    for errors, checked, losses, _, n, got, seen in out:
        assert seen == moves, seen
        assert not errors, "\n".join(errors[:20])
        assert checked == STEPS * (1 + n)
        assert losses[0] != losses[-1]  # it trained
        assert {k: v for k, v in got.items() if v} == comms, got
    return out[0][3]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_dense_model_on_tp4_from_its_plan(kind):
    # Forward: all-reduces of the embedding lookup and of o_proj and down_proj in each of the 2 layers;
    # one all-gather of the vocab-sharded logits (colwise_gather_output).
    placements = _check(run_on_ranks(4, _train, kind, (4,), ("tp",)), {"all_reduce": 5, "all_gather": 1})
    from shardprop import Replicate, Shard
    assert placements["model.embed_tokens.weight"] == (Shard(0),)
    assert placements["model.layers.0.self_attn.k_proj.weight"] == (Shard(0),)
    assert placements["model.layers.1.self_attn.o_proj.weight"] == (Shard(1),)
    assert placements["model.layers.1.mlp.down_proj.weight"] == (Shard(1),)
    assert placements["lm_head.weight"] == (Shard(0),)
    if kind == "qwen2":
        assert placements["model.layers.0.self_attn.q_proj.bias"] == (Shard(0),)
    assert "model.norm.weight" not in placements and Replicate()  # norms stay plain


@pytest.mark.parametrize("shape,names,ac", [((4,), ("ep",), False), ((2, 2), ("ep", "tp"), False),
                                            ((2, 2), ("ep", "tp"), True)], ids=["ep4", "ep2xtp2", "ep2xtp2-checkpointed"])
def test_mixtral_from_its_plans(shape, names, ac):
    # Forward, per MoE layer (2): counts, tokens there, tokens back (all-to-alls over ep). ep x tp also
    # has tp's all-reduces: the embedding, o_proj and the experts' partial outputs per layer, and the
    # logits' all-gather.
    # Backward: the two token moves of each layer inverted; checkpointed, the layer's forward first (3 more).
    comms = {"all_to_all": 6} if names == ("ep",) else {"all_to_all": 6, "all_reduce": 5, "all_gather": 1}
    comms["backward all_to_all"] = 10 if ac else 4
    comms["tokens routed"] = BATCH * SEQ * 2  # top-2
    # explain() (ep=4): per layer, the dispatch (counts and tokens all-to-alls) and the combine.
    moves = [("moe_dispatch", ["all_to_all", "all_to_all"]), ("moe_combine", ["all_to_all"])] * 2
    placements = _check(run_on_ranks(4, _train, "mixtral", shape, names, ac=ac), comms,
                        moves if names == ("ep",) else None)
    from shardprop import Replicate, Shard
    experts = "model.layers.0.mlp.experts."
    if names == ("ep",):
        assert placements[experts + "gate_up_proj"] == (Shard(0),)
        assert placements[experts + "down_proj"] == (Shard(0),)
        assert not any(".self_attn." in n for n in placements)  # attention is data parallel over ep
    else:
        assert placements[experts + "gate_up_proj"] == (Shard(0), Replicate())
        assert placements[experts + "down_proj"] == (Shard(0), Shard(2))
        assert placements["model.layers.1.self_attn.q_proj.weight"] == (Shard(0),)


def test_mixtral_experts_on_tp4_from_its_tp_plan():
    """moe_tp_experts (with packed_colwise gate_up_proj and rowwise down_proj): each expert's hidden dim over tp."""
    placements = _check(run_on_ranks(4, _train, "mixtral-kv4", (4,), ("tp",)), {"all_reduce": 5, "all_gather": 1})
    from shardprop import Replicate, Shard
    assert placements["model.layers.1.mlp.experts.gate_up_proj"] == (Replicate(),)
    assert placements["model.layers.1.mlp.experts.down_proj"] == (Shard(2),)


def _refusals():
    from shardprop import init_device_mesh, parallelize_hf
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    cfg, cls = _config("llama")
    torch.manual_seed(0)
    msgs = []
    small = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_hidden_layers=1, vocab_size=VOCAB)
    for plan_cfg, plan in ((cfg, {"model.layers.*.self_attn.q_proj": "sequence_parallel"}),
                           # GQA: 2 key/value heads cannot split over tp=4
                           (transformers.LlamaConfig(num_key_value_heads=2, **small), None),
                           # lm_head and embed_tokens share one weight, under two entries
                           (transformers.LlamaConfig(tie_word_embeddings=True, **small), None)):
        try:
            parallelize_hf(cls(plan_cfg), mesh, tp_plan=plan)
            msgs.append(None)
        except ValueError as e:
            msgs.append(str(e))
    return msgs


def test_unsupported_plans_are_refused_by_name():
    for unknown, heads, tied in run_on_ranks(4, _refusals):
        assert unknown and "'sequence_parallel'" in unknown and "model.layers.0.self_attn.q_proj" in unknown, unknown
        assert heads and "num_key_value_heads=2" in heads and "tp=4" in heads, heads
        assert tied and "tied weights" in tied and "lm_head.weight" in tied, tied


def _bad_expert_ids():
    from shardprop import DTensor, init_device_mesh, parallelize_hf
    cfg, cls = _config("mixtral")
    torch.manual_seed(0)
    model = cls(cfg)
    parallelize_hf(model, init_device_mesh("cpu", (4,), mesh_dim_names=("ep",)))
    experts = model.model.layers[0].mlp.experts
    x, w = torch.randn(3, 32), torch.full((3, 2), 0.5)
    idx = torch.tensor([[0, 1], [2, 3], [4, 5]])
    bad = idx.clone()
    if dist.get_rank() == 1:
        bad[1, 0] = 8  # 8 experts: ids 0..7
    try:
        experts(x, bad, w)
        msg = None
    except ValueError as e:
        msg = str(e)
    restored = all(isinstance(p, DTensor) for p in experts.parameters())
    return msg, restored, tuple(experts(x, idx, w).shape)  # and the module still works


def test_an_expert_id_out_of_range_on_one_rank_raises_on_every_rank():
    for msg, restored, shape in run_on_ranks(4, _bad_expert_ids, timeout=60):
        assert msg and "rank 1" in msg and "wrong number of experts" in msg and "outside 0..7" in msg, msg
        assert restored and shape == (3, 32)
