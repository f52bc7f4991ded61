"""Expert parallelism for mixtures of experts: expert weights sharded over an "ep" mesh dim, tokens routed to them.

``routing`` holds token dispatch and combine (a redistribution of tokens from "this rank's
batch" to "grouped by the experts this rank holds" and back, by uneven all-to-alls whose
split sizes are exchanged at run time); ``style`` the ``ExpertParallel`` and ``ExpertTensorParallel`` (ep x tp) styles that
``parallelize_module`` applies to a module with torchtitan's ``GroupedExperts`` contract
(``tensor_parallel``: the all-reduces of the tp region);
``hf_experts`` the ``HFExperts`` style for transformers' experts modules (``gate_up_proj``/``down_proj``,
``forward(hidden_states, top_k_index, top_k_weights)``) on the same routing;
``stats`` the tokens per expert and the load imbalance of the last forward.

Example:
    >>> parallelize_module(moe.experts, mesh["ep"], ExpertParallel())  # doctest: +SKIP
"""
from shardprop.parallel.ep.routing import Route, combine, dispatch
from shardprop.parallel.ep.stats import ExpertLoad, expert_load, local_load
from shardprop.parallel.ep.style import ExpertParallel, ExpertTensorParallel
from shardprop.parallel.ep.hf_experts import HFExperts

__all__ = ["HFExperts", "ExpertLoad", "ExpertParallel", "ExpertTensorParallel", "Route", "combine", "dispatch", "expert_load", "local_load"]
