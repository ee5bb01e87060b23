"""autoparallelize(): one plan for all ranks, lowered and wrapped in a ParallelModule.

Every rank captures the model (the graph hash must agree); rank 0 plans (or reads the plan it
is given) and broadcasts the plan's JSON; every rank checks the plan against its own capture and
the mesh, lowers the graph with the plan's strategies and materializes only its own shards of
the parameters.

Train and eval: the mode is fixed at capture (``torch.export``). The returned module builds the
other mode's graph on its first forward in that mode: it captures the model again, and rank 0
chooses strategies for the new graph with every parameter, buffer and input pinned to the
layout it has in the first graph (the same ILP, restricted), so the parameter shards and the
inputs a rank is fed do not change.

Timeouts: a collective waits for a missing peer as long as its process group's timeout.
``Mesh.from_world`` gives the mesh's groups the world's timeout (the ``timeout=`` of
``torch.distributed.init_process_group``) or its own ``timeout_s=``; ``autoparallelize(...,
timeout_s=)`` overrides it for the mesh's groups. A collective whose peer died or stalled then
raises on the waiting ranks naming this rank, the op, the mesh axis and the group's ranks.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from autopar.api import plan_captured
from autopar.capture.export import Captured, capture
from autopar.comm.process_groups import AxisGroups, axis_groups
from autopar.errors import PlanMismatchError, PlanningError, UnsupportedModelError
from autopar.lowering import LoweredGraph, drop_capture_meta, lower
from autopar.lowering.checkpointing import checkpoint_lowered
from autopar.mesh import Mesh, set_groups_timeout
from autopar.options import PlanOptions
from autopar.placement import Placements, parse_placements, replicated
from autopar.plan.document import Plan
from autopar.planner.driver import Driver
from autopar.planner.problem import ZeroConfig
from autopar.planner.space import build_space
from autopar.runtime.module import ParallelModule
from autopar.runtime.state import StateSource
from autopar.strategies import Strategy

__all__ = ["autoparallelize", "choices_with_layouts"]


def autoparallelize(
    model: nn.Module,
    mesh: Mesh,
    example_inputs: Sequence[Any] = (),
    example_kwargs: dict[str, Any] | None = None,
    *,
    plan: Plan | str | os.PathLike[str] | None = None,
    timeout_s: float | None = None,
    model_name: str | None = None,
    price_baselines: bool = True,
    state_dict: Any = None,
    pipeline: Any = None,
    **options: Any,
) -> ParallelModule:
    """Plan, lower and shard ``model`` on a live mesh; call on every rank with the same model.

    Args:
        model: the single-device model (same initial weights on every rank, e.g. same seed, or
            load them later with ``load_state_dict``), in the mode to train (``.train()``).
        mesh: ``Mesh.from_world(...)`` (or an offline ``Mesh.spec`` inside an initialized process
            group: its groups are then built here). Its device figures are what the planner
            prices; they do not change how the plan runs.
        example_inputs, example_kwargs: the GLOBAL batch of one step (shapes are planned for it).
        plan: a Plan, or the path of a saved plan (read on rank 0 only); default: rank 0 plans.
        timeout_s: seconds a collective on the mesh waits for a peer before raising (default:
            the mesh groups' timeout, see the module docstring).
        model_name: the name the plan records (default: the model's class name).
        price_baselines: also price the standard recipes for ``plan.baselines`` (one ILP each
            on rank 0); False plans faster.
        state_dict: the weights of a model built on the meta device (``with
            torch.device("meta"): model = ...``): a full state dict, the path of a
            ``.safetensors`` file (read lazily, only this rank's slices), or a list of those
            (the first holding a name wins, e.g. ``[path, {"rope_cos": ...}]`` for
            non-persistent buffers the file lacks), or a :class:`autopar.runtime.state.StateSource`.
            Each rank materializes only its shards. None: take the weights from ``model``.
        pipeline: pipeline stages (a ``PipelinePlan`` or ``dict(stages=2, microbatches=4,
            schedule="1f1b")``); a Plan object with a ``pipeline`` entry implies it. Returns a
            :class:`autopar.runtime.pipeline.PipelineModule` (train with ``pmodel.step``), see
            :mod:`autopar.parallelize_pipeline`.
        options: fields of :class:`autopar.options.PlanOptions` (``recipe``, ``memory_budget``,
            ``output_placements``, ...), for planning and lowering.

    Returns:
        A ParallelModule taking this rank's LOCAL inputs (``pmodel.shard_inputs`` cuts a global
        batch), with ``pmodel.plan`` the Plan.

    Raises:
        PlanMismatchError: the plan was made for another graph (model, input shapes) or mesh.
        PlanningError: rank 0 could not plan (every rank raises it).
        ValueError: the mesh does not match the world size.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "autoparallelize runs inside torch.distributed: launch with torchrun and build the "
            "mesh with autopar.Mesh.from_world(...); for offline planning use autopar.plan(...)"
        )
    opts = PlanOptions.from_kwargs(options)
    plan = _read_plan(plan)
    if pipeline is not None or "pipeline" in getattr(plan, "data", {}):
        from autopar.parallelize_pipeline import autoparallelize_pipeline as pipelined

        args, kw = tuple(example_inputs), dict(example_kwargs or {})
        extra = (plan, timeout_s, model_name)
        return pipelined(model, mesh, args, kw, pipeline, opts, *extra)  # type: ignore[arg-type,return-value]
    groups = _mesh_groups(mesh, timeout_s)
    args = tuple(example_inputs)
    kwargs = dict(example_kwargs or {})
    captured = capture(model, args, kwargs)
    name = model_name or type(model).__name__
    chosen = _agreed_plan(captured, mesh, opts, plan, name, price_baselines)

    if state_dict is not None:
        # A model built on meta: the tensors its graph creates (arange, ...) must live where
        # its shards are materialized.
        _retarget_factories(captured.gm, _runtime_device())
    output_placements = _output_placements(captured, mesh, chosen, opts)
    lowered = lower(
        captured, chosen.choices(), mesh.shape, groups.key, output_placements=output_placements
    )
    if model.training:
        # The plan's recomputed segments (the eval graph, lowered on demand, has none).
        lowered = checkpoint_lowered(lowered, chosen.checkpoint_segments())
    drop_capture_meta(lowered)
    plan_mesh = Mesh.from_dict(chosen.data["mesh"])
    plan_options = PlanOptions.from_kwargs(chosen.data["options"])
    pmodel = _parallel_module(lowered, model, groups, chosen, plan_mesh, plan_options, state_dict)
    # Keep nothing that pins the original model's tensors: the plan without its live strategy
    # space (whose capture references every original parameter), and a meta-device skeleton of
    # the model to capture the other train/eval mode from.
    pmodel.plan = chosen if chosen.space is None else Plan(data=chosen.data)
    try:
        skeleton = _meta_skeleton(model)
    except Exception:  # an attribute deepcopy refuses (a lock, a handle): keep the model itself
        skeleton = model
    lower_mode = _mode_lowering(
        skeleton, args, kwargs, mesh, groups, plan_mesh, plan_options, lowered, output_placements
    )
    pmodel.attach_mode_lowering(lower_mode)
    return pmodel


def _read_plan(plan: Plan | str | os.PathLike[str] | None) -> Plan | None:
    """A plan file read on rank 0 and sent to every rank (each needs to know whether it is
    pipelined before anything else)."""
    if plan is None or isinstance(plan, Plan):
        return plan
    text = _from_rank0(lambda: Plan.load(plan).to_json(), what=f"reading plan {plan}")
    return Plan.from_json(text)


def capture_mode(skeleton: nn.Module, training: bool, args: tuple, kwargs: dict) -> Captured:
    """``skeleton``'s graph in train (``training``) or eval mode, inactive dropout erased and
    factories on this rank's device; every rank checks it captured the same graph."""
    was_training = skeleton.training
    skeleton.train(training)
    try:
        other = capture(skeleton, args, kwargs)
    finally:
        skeleton.train(was_training)
    _erase_inactive_dropout(other.gm)
    _retarget_factories(other.gm, _runtime_device())
    hashes = [other.graph_hash]
    dist.broadcast_object_list(hashes, src=0)
    _agree(lambda: _same_hash(other.graph_hash, hashes[0]))
    return other


def _mode_lowering(
    skeleton: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    mesh: Mesh,
    groups: AxisGroups,
    plan_mesh: Mesh,
    plan_options: PlanOptions,
    lowered: LoweredGraph,
    output_placements: list[Placements] | None,
) -> Callable[[bool], LoweredGraph]:
    """``lower_mode(training)``: the other train/eval mode's graph, captured from ``skeleton``
    and lowered with every parameter, buffer and input kept in its layout in ``lowered``."""

    def lower_mode(training: bool) -> LoweredGraph:
        other = capture_mode(skeleton, training, args, kwargs)
        choices = _from_rank0(
            lambda: choices_with_layouts(other, plan_mesh, plan_options, lowered),
            what=f"planning the {'train' if training else 'eval'}-mode graph",
        )
        return drop_capture_meta(
            lower(other, choices, mesh.shape, groups.key, output_placements=output_placements)
        )

    return lower_mode


def _agreed_plan(
    captured: Captured,
    mesh: Mesh,
    opts: PlanOptions,
    plan: Plan | None,
    name: str,
    price_baselines: bool,
) -> Plan:
    """The plan rank 0 made or was given (a plan file is read by :func:`_read_plan` first), on
    every rank, once every rank has checked it against its own capture and the mesh
    (PlanMismatchError on every rank otherwise)."""

    def make_plan() -> str:
        chosen = plan
        if chosen is None:
            chosen = plan_captured(
                captured, mesh, opts, model_name=name, price_baselines=price_baselines
            )
        made[0] = chosen
        return chosen.to_json()

    made: list[Plan | None] = [None]
    text = _from_rank0(make_plan, what="planning")
    chosen = made[0] if made[0] is not None else Plan.from_json(text)
    rank0_hash = [captured.graph_hash]
    dist.broadcast_object_list(rank0_hash, src=0)

    def check() -> None:
        _same_hash(captured.graph_hash, rank0_hash[0])
        check_plan(chosen, captured, mesh)

    _agree(check)
    return chosen


def _parallel_module(
    lowered: LoweredGraph,
    model: nn.Module,
    groups: AxisGroups,
    chosen: Plan,
    plan_mesh: Mesh,
    plan_options: PlanOptions,
    state_dict: Any,
    zero_alone: tuple[str, ...] = (),
) -> ParallelModule:
    """The ParallelModule running ``lowered`` with the plan's ZeRO layout and precision
    (``zero_alone``: FQNs in ZeRO chunks of their own, see :class:`ParallelModule`)."""
    zero = chosen.data["zero"]
    zero_config = ZeroConfig.from_json(zero, plan_mesh.axis_names)
    # Uniform stages as (stage, axes); per-axis stages as one stage per mesh axis.
    zero_stage: int | tuple[int, ...] = (
        zero_config.stage
        if zero_config.is_uniform
        else tuple(zero_config.stage_of(a) for a in range(plan_mesh.ndim))
    )
    zero_axes = list(zero_config.axes) or None if zero_config.is_uniform else None
    return ParallelModule(
        lowered,
        model,
        groups,
        zero_stage=zero_stage,
        zero_axes=zero_axes,
        chunk_bytes=zero.get("chunk_bytes"),
        mixed_precision=plan_options.mixed_precision,
        state_source=(
            state_dict
            if state_dict is None or isinstance(state_dict, StateSource)
            else StateSource(state_dict)
        ),
        device=_runtime_device(),
        zero_alone=zero_alone,
    )


def _meta_skeleton(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are meta tensors (same shapes, same
    tying): enough to capture the graph again, holding none of the model's memory."""
    memo: dict[int, Any] = {}
    for tensor in (*model.parameters(), *model.buffers()):
        if id(tensor) in memo:
            continue
        meta = torch.empty_like(tensor, device="meta")
        if isinstance(tensor, nn.Parameter):
            meta = nn.Parameter(meta, requires_grad=tensor.requires_grad)
        memo[id(tensor)] = meta
    return copy.deepcopy(model, memo)


def _runtime_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _retarget_factories(gm: fx.GraphModule, device: torch.device) -> None:
    """Point ``device=meta`` arguments (factory ops such as ``arange`` in a capture of the meta
    skeleton) at the device the graph runs on."""
    meta = torch.device("meta")
    changed = False
    for node in gm.graph.nodes:
        if node.kwargs.get("device") == meta:
            node.update_kwarg("device", device)
            changed = True
    if changed:
        gm.recompile()


def check_plan(plan: Plan, captured: Captured, mesh: Mesh) -> None:
    """Refuse a plan made for another graph or another mesh shape (PlanMismatchError)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if plan.graph_hash != captured.graph_hash:
        raise PlanMismatchError(
            f"rank {rank}: the plan was made for another model or other input shapes (plan graph "
            f"hash {plan.graph_hash[:12]}..., model {plan.data['model']['name']!r}; this model's "
            f"graph hash is {captured.graph_hash[:12]}...); re-plan for this model and these "
            f"example inputs, or pass plan=None to let rank 0 plan"
        )
    plan_shape = tuple(plan.data["mesh"]["shape"])
    if plan_shape != tuple(mesh.shape):
        raise PlanMismatchError(
            f"rank {rank}: the plan was made for mesh shape {plan_shape} but this mesh has shape "
            f"{tuple(mesh.shape)}; re-plan for this mesh"
        )


def choices_with_layouts(
    captured: Captured, mesh: Mesh, options: PlanOptions, reference: LoweredGraph
) -> dict[str, Strategy]:
    """Strategies for ``captured`` with every parameter, buffer and input pinned to its layout
    in ``reference`` (another lowering of the same model): the planner's ILP, restricted.

    Raises:
        PlanningError: the graph has a parameter, buffer or input the reference lacks, or no
            strategy keeps a pinned layout.
    """
    canonical = {
        other: fqn for fqn, others in reference.tied_params.items() for other in (fqn, *others)
    }
    input_index = {name: i for i, name in enumerate(captured.input_nodes)}
    space = build_space(captured, mesh, options)
    allowed: dict[str, list[int]] = {}
    for node in space.nodes:
        if node.kind == "op":
            continue
        wanted: Placements | None
        if node.kind == "param":
            wanted = reference.param_placements.get(canonical.get(node.fqn, node.fqn))
        elif node.kind == "buffer":
            wanted = reference.buffer_placements.get(node.fqn, replicated(mesh.ndim))
        else:
            index = input_index.get(node.name)
            wanted = None if index is None else reference.input_placements[index]
        match = [i for i, s in enumerate(node.strategies) if s.outputs[0] == wanted]
        if not match:
            raise PlanningError(
                f"cannot keep the layout of {node.fqn or node.name} in the other train/eval mode "
                f"(its graph differs in parameters or inputs); capture and plan the model in that "
                f"mode separately"
            )
        allowed[node.name] = match
    solved = Driver(space).solve_pinned(allowed, name="pinned")
    return {
        node.name: node.strategies[c] for node, c in zip(space.nodes, solved.choice, strict=True)
    }


# --------------------------------------------------------------------------------------------
# Helpers


def _mesh_groups(mesh: Mesh, timeout_s: float | None) -> AxisGroups:
    """The mesh's process groups (built now for an offline mesh), with ``timeout_s`` applied."""
    world_size = dist.get_world_size()
    if mesh.num_devices != world_size:
        raise ValueError(
            f"mesh shape {mesh.shape} has {mesh.num_devices} devices but the world size is "
            f"{world_size}; build the mesh with autopar.Mesh.from_world for this world"
        )
    groups = mesh.groups
    if groups is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        groups = axis_groups(mesh.shape, mesh.axis_names, device_type=device_type)
    if timeout_s is not None:
        set_groups_timeout(groups, timeout_s)
    return groups


def _from_rank0(make: Any, *, what: str) -> Any:
    """Run ``make()`` on rank 0 and broadcast its result; every rank
    raises rank 0's error (as the same class where it is one of autopar's or a ValueError)."""
    payload: list[Any] = [None]
    error: Exception | None = None
    if dist.get_rank() == 0:
        try:
            payload[0] = ("ok", make(), "")
        except Exception as exc:  # every rank must learn of it, or they wait for rank 0
            error = exc
            payload[0] = ("error", type(exc).__name__, str(exc))
    dist.broadcast_object_list(payload, src=0)
    status, value, detail = payload[0]
    if status == "error":
        if error is not None:
            raise error
        cls = _ERRORS.get(value, PlanningError)
        raise cls(f"rank 0 failed {what}: {detail}")
    return value


def _agree(check: Any) -> None:
    """Run ``check()`` on every rank; if it raises PlanMismatchError on any rank, raise on every
    rank (a rank left alone would wait in the first collective until the timeout)."""
    problem: str | None = None
    try:
        check()
    except PlanMismatchError as exc:
        problem = str(exc)
    problems: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    if problem is not None:
        raise PlanMismatchError(problem)
    failed = [(r, p) for r, p in enumerate(problems) if p is not None]
    if failed:
        rank, message = failed[0]
        raise PlanMismatchError(
            f"rank {dist.get_rank()}: ranks {[r for r, _ in failed]} refused the plan; rank "
            f"{rank} says: {message}"
        )


def _same_hash(graph_hash: str, rank0_hash: str) -> None:
    if graph_hash != rank0_hash:
        raise PlanMismatchError(
            f"rank {dist.get_rank()} captured a different graph than rank 0 (graph hash "
            f"{graph_hash[:12]}... vs {rank0_hash[:12]}...): every rank must build the same model "
            f"with the same example input shapes"
        )


_ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (PlanMismatchError, PlanningError, UnsupportedModelError, ValueError)
}


def _erase_inactive_dropout(gm: fx.GraphModule) -> None:
    """Remove ``aten.dropout(x, p, train=False)`` nodes (identities an eval-mode export keeps)."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten.dropout.default:
            train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train")
            if train is False:
                node.replace_all_uses_with(node.args[0])
                gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()


def _output_placements(
    captured: Captured, mesh: Mesh, plan: Plan, options: PlanOptions
) -> list[Placements] | None:
    """Per flattened output: the placements asked for (``output_placements=`` here, else the
    plan's option), Replicate where none is given; None when nothing was asked."""
    texts = options.output_placements
    if texts is None:
        texts = plan.data["options"].get("output_placements")
    if texts is None:
        return None
    output_node = next(n for n in captured.gm.graph.nodes if n.op == "output")
    num_outputs = sum(isinstance(leaf, fx.Node) for leaf in tree_flatten(output_node.args[0])[0])
    out: list[Placements] = []
    for i in range(num_outputs):
        if i < len(texts):
            placements = parse_placements(texts[i])
            if len(placements) != mesh.ndim:
                raise ValueError(
                    f"output_placements[{i}] = {texts[i]!r} has {len(placements)} entries but the "
                    f"mesh has {mesh.ndim} axes; give one placement per axis, e.g. "
                    f"{','.join(['S0'] * mesh.ndim)!r}"
                )
            out.append(placements)
        else:
            out.append(replicated(mesh.ndim))
    return out
