"""Weights tied across pipeline stages (an embedding tied to the output layer): which ranks
hold a copy, and whether their copies can be summed as they are held.

Each stage holds its own copy; after the schedule, the copies' gradients are summed over the
ranks holding them (:meth:`autopar.runtime.pipeline.PipelineModule._sum_shared_grads`), so every
copy takes the same optimizer step. Under ZeRO each copy is a shard: every stage packs the tied
weight in a ZeRO chunk of its own (``ParallelModule(zero_alone=...)``), so equal data-parallel
coordinates hold the same elements in every stage, which :func:`tied_weight_groups` checks
(:meth:`autopar.runtime.zero.ZeroEngine.layout`) before any gradient is summed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from autopar.errors import UnsupportedModelError

if TYPE_CHECKING:
    from autopar.capture.stages import StageGraph
    from autopar.comm.process_groups import AxisGroups
    from autopar.plan.document import Plan
    from autopar.planner.stages import PipelinePlan
    from autopar.runtime.pipeline import StageModule

__all__ = ["tied_weight_groups"]


def tied_weight_groups(
    stages: tuple[StageGraph, ...],
    plans: list[Plan],
    pipeline: PipelinePlan,
    groups: AxisGroups,
    modules: list[StageModule],
) -> list[tuple[str, Any]]:
    """Per parameter used by several stages: (FQN, the group of its holders' ranks at this
    rank's submesh coordinate, None when this rank holds every copy); a collective. Under ZeRO
    each copy's shard must hold the same elements (its own chunk, alike split), or the
    gradients could not be summed shard by shard: refused on every rank otherwise."""
    shared: dict[str, tuple[int, ...]] = {}
    for stage in stages:
        shared.update(stage.shared_params)
    # Per rank, per FQN: the ZeRO layouts of this rank's copies (None: not under ZeRO).
    held = [(m.pmodule, dict(m.pmodule.named_parameters(remove_duplicate=False))) for m in modules]
    mine = {
        fqn: {p.zero.layout(named[fqn]) if p.zero else None for p, named in held if fqn in named}
        for fqn in shared
    }
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    grid = groups.device_mesh.mesh.movedim(pipeline.axis, -1)
    rows = grid.reshape(-1, grid.shape[-1]).tolist()
    out: list[tuple[str, Any]] = []
    for fqn in sorted(shared):
        layouts = set()
        for s in shared[fqn]:
            node = next(n for n, f in stages[s].captured.param_nodes.items() if f == fqn)
            layouts.add(tuple(plans[s].choices()[node].outputs[0]))
        holders = sorted({pipeline.stages[s].pp_rank for s in shared[fqn]})
        rows_of = [[row[h] for h in holders] for row in rows]
        zero = [set().union(*(every[r].get(fqn, set()) for r in row)) for row in rows_of]
        if len(layouts) > 1 or any(len(z) > 1 for z in zero):
            raise UnsupportedModelError(
                f"parameter {fqn} is used by pipeline stages {list(shared[fqn])} (tied weights) "
                f"and {'has different layouts' if len(layouts) > 1 else 'is split by ZeRO unlike'}"
                f" in them; untie it (e.g. tie_weights=False) or plan without ZeRO"
            )
        if len(holders) == 1:
            out.append((fqn, None))
            continue
        group, _ = dist.new_subgroups_by_enumeration(rows_of)
        out.append((fqn, group))
    return out
