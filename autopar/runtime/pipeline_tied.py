"""Weights tied across pipeline stages (an embedding tied to the output layer): which ranks
hold a copy, and whether their copies can be summed as they are held.

Each stage holds its own copy; after the schedule, the copies' gradients are summed over the
ranks holding them (:meth:`autopar.runtime.pipeline.PipelineModule._sum_shared_grads`), so every
copy takes the same optimizer step. Copies the stages hold in different tensor-parallel layouts
(say the embedding split by vocabulary in the first stage and the head replicated in the last)
are summed as full tensors: each gradient gathered over its own stage's submesh, the sum taken
over the holders, each copy's block cut from it. Under ZeRO each copy is a shard: every stage
packs the tied weight in a ZeRO chunk of its own (``ParallelModule(zero_alone=...)``), so equal
data-parallel coordinates hold the same elements in every stage, which
:func:`tied_weight_groups` checks (:meth:`autopar.runtime.zero.ZeroEngine.layout`) before any
gradient is summed; copies in different tensor-parallel layouts are refused under ZeRO.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist

from autopar.comm.process_groups import cached_subgroup
from autopar.errors import UnsupportedModelError
from autopar.placement import format_placements
from autopar.runtime.materialize import gather_full, local_block

if TYPE_CHECKING:
    from autopar.capture.stages import StageGraph
    from autopar.comm.process_groups import AxisGroups
    from autopar.plan.document import Plan
    from autopar.planner.stages import PipelinePlan
    from autopar.runtime.pipeline import StageModule

__all__ = ["TiedWeight", "sum_tied_whole", "tied_weight_groups"]


def tied_weight_groups(
    stages: tuple[StageGraph, ...],
    plans: list[Plan],
    pipeline: PipelinePlan,
    groups: AxisGroups,
    modules: list[StageModule],
) -> list[TiedWeight]:
    """Per parameter used by several stages, its :class:`TiedWeight`; a collective. Copies in
    different tensor-parallel layouts are summed as full tensors. Under ZeRO each copy's shard
    must hold the same elements (its own chunk, alike split, in the same layout), or the
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
    out: list[TiedWeight] = []
    for fqn in sorted(shared):
        layouts: dict[str, int] = {}  # per layout (as "R,S0"), the first stage holding it
        for s in shared[fqn]:
            node = next(n for n, f in stages[s].captured.param_nodes.items() if f == fqn)
            layouts.setdefault(format_placements(plans[s].choices()[node].outputs[0]), s)
        holders = sorted({pipeline.stages[s].pp_rank for s in shared[fqn]})
        rows_of = [[row[h] for h in holders] for row in rows]
        zero = [set().union(*(every[r].get(fqn, set()) for r in row)) for row in rows_of]
        zeroed = any(z != {None} for z in zero)
        if len(layouts) > 1 and zeroed:
            named = " and ".join(f"[{lay}] in stage {s}" for lay, s in layouts.items())
            raise UnsupportedModelError(
                f"parameter {fqn} is tied across pipeline stages {list(shared[fqn])} in "
                f"different tensor-parallel layouts ({named}) under ZeRO, whose shards cannot "
                f"be summed; give its copies one layout, untie it (e.g. tie_weights=False) or "
                f"plan without ZeRO"
            )
        if any(len(z) > 1 for z in zero):
            raise UnsupportedModelError(
                f"parameter {fqn} is used by pipeline stages {list(shared[fqn])} (tied weights) "
                f"and is split by ZeRO unlike in them; untie it (e.g. tie_weights=False) or "
                f"plan without ZeRO"
            )
        whole = len(layouts) > 1  # summed as full tensors (each copy gathered in its stage)
        if len(holders) == 1:
            out.append(TiedWeight(fqn, None, whole))
            continue
        group = cached_subgroup(rows_of)
        out.append(TiedWeight(fqn, group, whole))
    return out


class TiedWeight(NamedTuple):
    """A parameter used by several pipeline stages."""

    fqn: str
    group: Any
    """The group of its holders' ranks at this rank's submesh coordinate; None when this rank
    holds every copy."""
    whole: bool = False
    """Its stages hold it in different tensor-parallel layouts: each copy's gradient is
    gathered into the full tensor over its stage's submesh, the full gradients summed, and
    each copy takes its own block of the sum back (without ZeRO only)."""


def sum_tied_whole(fqn: str, copies: list[tuple[Any, torch.Tensor]], group: Any) -> None:
    """Sum the gradients of ``fqn``'s copies on this rank (``(ParallelModule, parameter)``
    pairs) with those of its holders in ``group`` (None: all on this rank) as full tensors,
    each copy's layout its own: gathered over its stage's submesh (collectives of that
    submesh, in the same order on its ranks), summed, and each copy's block copied back. A
    copy without a gradient (unused in this step) adds nothing and takes the sum."""
    total: torch.Tensor | None = None
    for pmodule, param in copies:
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        full = gather_full(grad, pmodule._param_placements[fqn], pmodule._axis_group)
        total = full if total is None else total + full
    assert total is not None
    if group is not None:
        dist.all_reduce(total, group=group)
    for pmodule, param in copies:
        block = local_block(
            total, pmodule._param_placements[fqn], pmodule.lowered.mesh_shape, pmodule.coords
        )
        if param.grad is None:
            param.grad = block.clone()
        else:
            param.grad.copy_(block)
