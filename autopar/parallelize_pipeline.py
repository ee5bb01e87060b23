"""autoparallelize with pipeline stages: split, plan and lower each stage, run torch's schedule.

Every rank captures the model at the MICROBATCH's shapes (the global batch's first
``batch / microbatches`` rows), splits the graph at the pipeline's cuts
(:func:`autopar.capture.stages.split_stages`), and rank 0 plans every stage with the ordinary
planner on the stage's submesh (the mesh without the pipeline axis; a 1-D mesh gets a
size-1 data axis) and broadcasts the plans. Each rank lowers its own stage(s), with each
stage's outputs laid out as the next stage plans its inputs, and wraps them in a
:class:`autopar.runtime.pipeline.PipelineModule`, which runs torch.distributed.pipelining's
schedule (see its docstring for the training step and the loss on every rank).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map

from autopar.api import plan_stage_graphs, stage_plan_options, with_stage_axis
from autopar.capture.blocks import STACK_NAMES
from autopar.capture.export import capture
from autopar.capture.stages import StageGraph, block_indices, split_stages
from autopar.comm.process_groups import (
    AxisGroups,
    axis_groups,
    cached_subgroup,
    register_axis_groups,
)
from autopar.errors import PlanMismatchError, PlanningError, UnsupportedModelError
from autopar.lowering import lower
from autopar.lowering.checkpointing import checkpoint_lowered
from autopar.mesh import Mesh
from autopar.options import PlanOptions
from autopar.parallelize import (
    _ERRORS,
    _agree,
    _from_rank0,
    _mesh_groups,
    _meta_skeleton,
    _parallel_module,
    _runtime_device,
    capture_mode,
    check_plan,
    choices_with_layouts,
)
from autopar.plan.document import Plan
from autopar.plan.stage_copies import stage_plans_from_stored, stored_stage_plans
from autopar.planner.driver import memory_budget_bytes
from autopar.planner.stages import (
    MULTI_STAGE_SCHEDULES,
    SCHEDULES,
    V_SCHEDULES,
    PipelinePlan,
    even_stages,
    stage_rank,
)
from autopar.planner.tying import stack_blocks
from autopar.runtime.pipeline import PipelineModule, StageModule
from autopar.runtime.pipeline_tied import tied_weight_groups

__all__ = ["autoparallelize_pipeline", "check_pipeline_mesh", "find_stack"]


def find_stack(gm: Any) -> tuple[str, int]:
    """(module path, number of blocks) of the longest stack of repeated blocks in ``gm``."""
    found = stack_blocks(gm)
    if not found:
        raise UnsupportedModelError(
            f"cannot pipeline: the model has no stack of repeated blocks (a module list named one "
            f"of {STACK_NAMES}); pipeline stages are cut between such blocks"
        )
    stack = max(found, key=lambda name: len(found[name]))
    return stack, len(found[stack])


def check_pipeline_mesh(pipeline: PipelinePlan, mesh_shape: tuple[int, ...], world: int) -> None:
    """Refuse a pipeline that does not fit the mesh or the world size (one line each)."""
    size = 1
    for n in mesh_shape:
        size *= n
    if size != world:
        raise PlanMismatchError(
            f"the pipelined plan is for mesh {mesh_shape} ({size} ranks) but the world size is "
            f"{world}; launch {size} ranks or plan again for {world}"
        )
    if not 0 <= pipeline.axis < len(mesh_shape):
        raise PlanMismatchError(
            f"pipeline axis {pipeline.axis} is not an axis of mesh {mesh_shape}"
        )
    ranks = mesh_shape[pipeline.axis]
    if pipeline.num_stages != ranks * pipeline.virtual_stages:
        raise PlanMismatchError(
            f"{pipeline.num_stages} pipeline stages do not fit {ranks} ranks along pipeline axis "
            f"{pipeline.axis} of mesh {mesh_shape} with {pipeline.virtual_stages} stage(s) per rank"
        )
    if pipeline.schedule not in MULTI_STAGE_SCHEDULES and pipeline.virtual_stages != 1:
        raise ValueError(
            f"virtual_stages > 1 needs one of the schedules {MULTI_STAGE_SCHEDULES}, got "
            f"{pipeline.schedule!r}"
        )
    if pipeline.schedule in V_SCHEDULES and pipeline.virtual_stages != 2:
        raise ValueError(
            f"schedule {pipeline.schedule!r} runs exactly 2 stages per pipeline rank (a V), got "
            f"virtual_stages={pipeline.virtual_stages}"
        )
    placed = [s.pp_rank for s in pipeline.stages]
    wanted = [stage_rank(pipeline.schedule, s, ranks) for s in range(pipeline.num_stages)]
    if placed != wanted:
        raise PlanMismatchError(
            f"schedule {pipeline.schedule!r} runs stages on pipeline ranks {wanted}, but the "
            f"plan places them on {placed}"
        )


def _pipeline_plan(spec: Any, mesh: Mesh, stack: str, num_blocks: int) -> PipelinePlan:
    """A PipelinePlan from ``pipeline=`` (a PipelinePlan, or a dict of ``stages`` (default: the
    pipeline axis's size), ``microbatches``, ``schedule``, ``virtual_stages``, ``axis``)."""
    if isinstance(spec, PipelinePlan):
        return spec
    if not isinstance(spec, Mapping):
        raise TypeError(f"pipeline= takes a PipelinePlan or a dict, got {type(spec).__name__}")
    unknown = set(spec) - {"stages", "microbatches", "schedule", "virtual_stages", "axis"}
    if unknown:
        raise ValueError(f"unknown pipeline= keys {sorted(unknown)}")
    axis = spec.get("axis", "pp" if "pp" in mesh.axis_names else 0)
    axis = mesh.axis_index(axis)
    virtual = int(spec.get("virtual_stages", 1))
    schedule = spec.get("schedule", "1f1b")
    if schedule in MULTI_STAGE_SCHEDULES and "virtual_stages" not in spec:
        virtual = 2
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose from {SCHEDULES}")
    num_stages = int(spec.get("stages", mesh.shape[axis])) * virtual
    if num_stages > num_blocks:
        raise UnsupportedModelError(
            f"more pipeline stages than blocks: {num_stages} stages for {num_blocks} blocks of "
            f"{stack!r}; use at most {num_blocks} stages"
        )
    return even_stages(
        stack=stack,
        num_blocks=num_blocks,
        num_stages=num_stages // virtual,
        axis=axis,
        virtual_stages=virtual,
        microbatches=int(spec.get("microbatches", mesh.shape[axis])),
        schedule=schedule,
    )


def _submesh(mesh: Mesh, groups: AxisGroups, axis: int) -> tuple[Mesh, AxisGroups, AxisGroups]:
    """(planning mesh of one stage, its live groups, the whole mesh's groups): the mesh without
    the pipeline axis; a 1-D mesh gets a size-1 data axis (the ILP needs one axis)."""
    if mesh.ndim == 1:
        mesh = with_stage_axis(mesh)
        groups = axis_groups(
            mesh.shape, mesh.axis_names, key=f"{groups.key}+stage-axis", shared=True
        )
    keep = [a for a in range(mesh.ndim) if a != axis]
    names = tuple(mesh.axis_names[a] for a in keep)
    sub_groups = AxisGroups(
        key=f"{groups.key}/stage",
        mesh_shape=tuple(mesh.shape[a] for a in keep),
        axis_names=names,
        groups=tuple(groups.groups[a] for a in keep),
        coordinate=tuple(groups.coordinate[a] for a in keep),
        device_mesh=groups.device_mesh[names if len(names) > 1 else names[0]],
    )
    register_axis_groups(sub_groups.key, sub_groups)
    sub_mesh = dataclasses.replace(
        mesh,
        shape=sub_groups.mesh_shape,
        axis_names=names,
        links=tuple(mesh.links[a] for a in keep),
        groups=sub_groups,
    )
    return sub_mesh, sub_groups, groups


def _microbatch(args: tuple, kwargs: dict, microbatches: int) -> tuple[tuple, dict]:
    """The first microbatch of the global batch (rows ``[0, batch / microbatches)``)."""
    for leaf in tree_flatten((args, kwargs))[0]:
        if hasattr(leaf, "shape") and (leaf.ndim == 0 or leaf.shape[0] % microbatches):
            raise ValueError(
                f"{microbatches} microbatches do not divide the batch: an input has shape "
                f"{tuple(leaf.shape)} (batch dim 0); choose a microbatch count that divides it"
            )
    return tree_map(
        lambda x: x[: x.shape[0] // microbatches] if hasattr(x, "shape") else x, (args, kwargs)
    )


def autoparallelize_pipeline(
    model: nn.Module,
    mesh: Mesh,
    args: tuple,
    kwargs: dict,
    pipeline: Any,
    options: PlanOptions,
    plan: Plan | None = None,
    timeout_s: float | None = None,
    model_name: str | None = None,
) -> PipelineModule:
    """``autoparallelize(..., pipeline=...)`` (module docstring); call on every rank.

    Args:
        pipeline: a PipelinePlan, or a dict (``stages``, ``microbatches``, ``schedule``,
            ``virtual_stages``, ``axis``; the blocks are split evenly), or None to take
            ``plan``'s ``pipeline`` entry.
        plan: a pipelined Plan (its ``pipeline`` entry and mesh are used); each stage is
            lowered with the plan's stored stage plan (``pipeline.stage_plans``: no solve
            here), or, in a plan without them, planned on its submesh at the microbatch's
            shapes.

    Raises:
        PlanMismatchError: the pipeline does not fit the mesh or the world size.
        UnsupportedModelError: no stack of blocks, one block, more stages than blocks.
        ValueError: the microbatches do not divide the batch; an unsupported schedule.
    """
    from_plan = pipeline is None and plan is not None
    if from_plan:
        if "pipeline" not in plan.data:
            raise ValueError("the plan has no pipeline entry; pass pipeline=")
        pipeline = PipelinePlan.from_json(plan.data["pipeline"])
        check_pipeline_mesh(pipeline, tuple(plan.data["mesh"]["shape"]), dist.get_world_size())
    groups = _mesh_groups(mesh, timeout_s)
    microbatches = (
        pipeline.microbatches
        if isinstance(pipeline, PipelinePlan)
        else int(dict(pipeline).get("microbatches", 1))
    )
    mb_args, mb_kwargs = _microbatch(tuple(args), dict(kwargs), microbatches)
    captured = capture(model, mb_args, mb_kwargs)
    stack, num_blocks = find_stack(captured.gm)
    if isinstance(pipeline, PipelinePlan):
        stack, num_blocks = (
            pipeline.stack,
            len(set(block_indices(captured.gm, pipeline.stack).values())),
        )
    if num_blocks < 2:
        raise UnsupportedModelError(
            f"cannot pipeline a model with one block ({stack}.0): stages are cut between blocks"
        )
    pipeline = _pipeline_plan(pipeline, mesh, stack, num_blocks)
    check_pipeline_mesh(pipeline, tuple(mesh.shape), dist.get_world_size())
    stages = split_stages(captured, pipeline)
    sub_mesh, sub_groups, groups = _submesh(mesh, groups, pipeline.axis)
    name = model_name or type(model).__name__
    plans = _stage_plans(
        plan if from_plan else None, pipeline, stages, mesh, sub_mesh, options, name
    )
    _agree(
        lambda: [check_plan(p, s.captured, sub_mesh) for p, s in zip(plans, stages, strict=True)]
    )
    pp_rank = groups.coordinate[pipeline.axis]
    inputs = list(captured.input_nodes)
    mine = [s for s in pipeline.stages if s.pp_rank == pp_rank]
    modules = [
        (s.index, _stage_module(model, stages, plans, s.index, sub_mesh, sub_groups, inputs))
        for s in mine
    ]
    # The stages' point-to-point traffic gets its own group: under TORCH_DISTRIBUTED_DEBUG=DETAIL
    # collectives check sequence numbers, which sends and receives advance unevenly per rank.
    grid = groups.device_mesh.mesh.movedim(pipeline.axis, -1)
    p2p_group = cached_subgroup(grid.reshape(-1, grid.shape[-1]).tolist())
    pmodel = PipelineModule(
        modules,
        num_stages=pipeline.num_stages,
        pp_group=groups.groups[pipeline.axis],
        p2p_group=p2p_group,
        last_pp_rank=pipeline.stages[-1].pp_rank,
        schedule=pipeline.schedule,
        microbatches=pipeline.microbatches,
        num_inputs=len(captured.input_nodes),
        shared=tied_weight_groups(stages, plans, pipeline, groups, [m for _, m in modules]),
        device=_runtime_device(),
        training=model.training,
    )
    pmodel.plan = plans
    pmodel.pipeline = pipeline
    pmodel.prepare_mode = _mode_preparer(
        model,
        (mb_args, mb_kwargs),
        pipeline,
        sub_mesh,
        sub_groups,
        modules,
        _leaders(pipeline, groups),
    )
    return pmodel


def _mode_preparer(
    model: nn.Module,
    inputs: tuple[tuple, dict],
    pipeline: PipelinePlan,
    sub_mesh: Mesh,
    sub_groups: AxisGroups,
    modules: list[tuple[int, StageModule]],
    leaders: dict[int, int],
) -> Any:
    """``prepare(training)``: capture ``skeleton`` in that train/eval mode at the microbatch's
    shapes, split it at the pipeline's cuts and lower this rank's stages with every parameter,
    buffer, input and output kept in its layout in the stage's graph of the other mode (the
    ILP restricted to those layouts, solved once per stage by its leader in ``leaders`` and
    gathered on every rank: every holder of a stage lowers the same choices by construction;
    collectives in the graph-hash check and the gather). Each stage's ParallelModule then
    switches to the prepared graph. ``model`` is captured from a meta-device copy (holding
    none of its memory) where it can be copied."""
    try:
        skeleton = _meta_skeleton(model)
    except Exception:  # an attribute deepcopy refuses (a lock, a handle): keep the model itself
        skeleton = model
    graphs: dict[tuple[int, bool], Any] = {}
    for index, module in modules:
        module.pmodule.attach_mode_lowering(
            lambda mode, index=index: graphs[(index, mode)]  # type: ignore[misc]
        )

    held = dict(modules)

    def prepare(training: bool) -> None:
        other = capture_mode(skeleton, training, *inputs)
        stages = split_stages(other, pipeline)

        def solve(index: int) -> dict:
            module = held[index]
            chosen = module.pmodule.plan
            plan_mesh = Mesh.from_dict(chosen.data["mesh"])
            plan_options = PlanOptions.from_kwargs(chosen.data["options"])
            return choices_with_layouts(
                stages[index].captured, plan_mesh, plan_options, module.pmodule.lowered
            )

        solved = _solved_by_leaders(
            solve, leaders, what=f"planning the {'train' if training else 'eval'}-mode stages"
        )
        for index, module in modules:
            reference = module.pmodule.lowered
            graphs[(index, training)] = lower(
                stages[index].captured,
                solved[index],
                sub_mesh.shape,
                sub_groups.key,
                output_placements=None if module.is_last else reference.output_placements,
            )

    return prepare


def _leaders(pipeline: PipelinePlan, groups: AxisGroups) -> dict[int, int]:
    """Per stage index, the lowest global rank holding it (its pipeline coordinate)."""
    grid = groups.device_mesh.mesh
    return {
        s.index: int(grid.select(pipeline.axis, s.pp_rank).min().item()) for s in pipeline.stages
    }


def _solved_by_leaders(solve: Any, leaders: dict[int, int], *, what: str) -> dict[int, Any]:
    """``solve(index)`` for every stage, run on the stage's leader and gathered on every rank;
    an error on any leader is raised on every rank (as ``_from_rank0`` does)."""
    rank = dist.get_rank()
    mine: dict[int, tuple] = {}
    for index, leader in leaders.items():
        if leader != rank:
            continue
        try:
            mine[index] = ("ok", solve(index), "")
        except Exception as exc:  # every rank must learn of it, or they wait in the gather
            mine[index] = ("error", type(exc).__name__, str(exc))
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    out: dict[int, Any] = {}
    for leader, part in enumerate(gathered):
        for index, (status, value, detail) in part.items():
            if status == "error":
                cls = _ERRORS.get(value, PlanningError)
                raise cls(f"rank {leader} failed {what} (stage {index}): {detail}")
            out[index] = value
    return out


def _stage_plans(
    plan: Plan | None,
    pipeline: PipelinePlan,
    stages: tuple[StageGraph, ...],
    mesh: Mesh,
    sub_mesh: Mesh,
    options: PlanOptions,
    name: str,
) -> list[Plan]:
    """Every stage's intra-op plan: ``plan``'s stored ones, else planned on rank 0 with the
    options the stage search priced (:func:`autopar.api.stage_plan_options`)."""
    stored = stored_stage_plans(plan, mesh, pipeline.num_stages)
    if stored is not None:
        return stage_plans_from_stored(stored, stages)
    budget = plan.data["memory_budget_bytes"] if plan else memory_budget_bytes(mesh, options)
    per_stage = stage_plan_options(options, pipeline, budget)
    return _plan_on_rank0(stages, sub_mesh, per_stage, name, pipeline.stack)


def _plan_on_rank0(
    stages: tuple[StageGraph, ...],
    mesh: Mesh,
    options: Sequence[PlanOptions],
    name: str,
    stack: str,
) -> list[Plan]:
    """Rank 0 plans every stage (twin stages solved once), every rank gets the plans."""
    texts = _from_rank0(
        lambda: [
            p.to_json()
            for p in plan_stage_graphs(stages, mesh, options, model_name=name, stack=stack)
        ],
        what="planning the pipeline stages",
    )
    return [Plan.from_json(text) for text in texts]


def _stage_module(
    model: nn.Module,
    stages: tuple[StageGraph, ...],
    plans: list[Plan],
    index: int,
    sub_mesh: Mesh,
    sub_groups: AxisGroups,
    inputs: list[str],
) -> StageModule:
    """Stage ``index`` lowered on the submesh, its outputs laid out as the next stage's inputs."""
    stage, chosen = stages[index], plans[index]
    output_placements = None
    if index + 1 < len(stages):
        following = plans[index + 1].choices()
        output_placements = [following[name].outputs[0] for name in stage.outputs]
    lowered = lower(
        stage.captured,
        chosen.choices(),
        sub_mesh.shape,
        sub_groups.key,
        output_placements=output_placements,
    )
    if model.training:
        lowered = checkpoint_lowered(lowered, chosen.checkpoint_segments())
    plan_mesh = Mesh.from_dict(chosen.data["mesh"])
    plan_options = PlanOptions.from_kwargs(chosen.data["options"])
    # Only this stage's tensors (a ParallelModule registers every tensor of its source).
    captured = stage.captured
    names = {*captured.param_nodes.values(), *captured.buffer_nodes.values()}
    names |= {
        other
        for fqn in captured.param_nodes.values()
        for other in captured.tied_params.get(fqn, ())
    }
    state = {
        name: tensor
        for name, tensor in (
            *model.named_parameters(remove_duplicate=False),
            *model.named_buffers(remove_duplicate=False),
        )
        if name in names
    }
    # A weight tied across stages: a ZeRO chunk of its own, its shards aligned (pipeline_tied).
    tied = captured.tied_params
    alone = tuple(n for fqn in stage.shared_params for n in (fqn, *tied.get(fqn, ())))
    args = (lowered, state, sub_groups, chosen, plan_mesh, plan_options, None, alone)
    pmodule = _parallel_module(*args)
    pmodule.plan = chosen
    model_inputs = [inputs.index(n) for n in stage.model_inputs]
    return StageModule(pmodule, model_inputs, is_last=index == len(stages) - 1)
