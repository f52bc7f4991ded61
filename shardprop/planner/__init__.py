"""Automatic parallelism plans: the engine's own rules, a measured cost model and an integer program.

``autoplan(model, mesh_or_world, example_inputs)`` traces the model once on the meta device,
asks the registered sharding rules which placements each aten op accepts, prices the
redistributions and compute with a calibrated cost model, and solves one repeated block (and
the layers around it) with HiGHS (``scipy.optimize.milp``) for each mesh shape it tries. The
answer is a :class:`~shardprop.planner.plan.Plan`: printable, editable, and applied with the
public styles and ``fully_shard``. See docs/guides/autoplan.md.
"""
from shardprop.planner.calibrate import calibrate
from shardprop.planner.costs import CostModel
from shardprop.planner.plan import NoPlanFits, Plan
from shardprop.planner.search import autoplan, mesh_shapes
from shardprop.planner.solve import Shape

__all__ = ["autoplan", "calibrate", "Plan", "NoPlanFits", "CostModel", "Shape", "mesh_shapes"]
