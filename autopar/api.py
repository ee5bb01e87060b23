"""``autopar.plan()``: capture -> strategy space -> the planner's driver -> Plan.

The thin entry point; the policy (which configurations are solved, and how) is
:mod:`autopar.planner.driver`, the document :mod:`autopar.plan.build`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch.nn as nn

from autopar.capture.export import Captured, capture
from autopar.capture.stages import StageGraph, split_stages
from autopar.mesh import Mesh
from autopar.options import PlanOptions, parse_bytes
from autopar.plan.build import plan_document
from autopar.plan.document import Plan
from autopar.plan.pipelined import pipelined_document, search_json
from autopar.plan.stage_copies import renamed_plan, stored_entries, twin_key
from autopar.plan.stage_search import StageOptions, search_stages, slice_inputs
from autopar.planner.driver import Driver, Planned, memory_budget_bytes
from autopar.planner.outputs import ANY_PLACEMENT
from autopar.planner.space import build_space
from autopar.planner.stages import PipelinePlan


def plan(
    model: nn.Module,
    mesh: Mesh | None,
    example_inputs: Sequence[Any] = (),
    example_kwargs: dict[str, Any] | None = None,
    *,
    model_name: str | None = None,
    devices: int | None = None,
    per_node: int = 8,
    stages: int | None = None,
    microbatches: int | None = None,
    schedule: str | None = None,
    device: str = "h100",
    stage_plans: bool = True,
    **options: Any,
) -> Plan:
    """Plan ``model`` on ``mesh`` for the GLOBAL batch given by the example inputs.

    Runs in one process on fake/meta tensors (no GPU, no process group). Options are the
    fields of :class:`autopar.options.PlanOptions` (``recipe``, ``memory_budget``,
    ``optimizer``, ``mixed_precision``, ``zero_stage``, ``checkpoint``, ``output_placements``,
    ``time_limit_s``, ``gap``, ``solver``).

    Pipeline stages (README "Pipeline stages in the planner"): with ``devices`` (and
    ``per_node``, ``device``) and ``mesh=None`` every ``pp x dp x tp`` mesh is searched; with a
    mesh that has an axis named ``pp``, or with ``stages``, ``microbatches`` or ``schedule``
    given, stages are searched on its ``pp`` (else outermost) axis; ``stages=1`` turns them off.
    A pipelined plan carries each stage's intra-op plan (``pipeline.stage_plans``), which the
    runtime lowers as saved; ``stage_plans=False`` leaves them out (the runtime then plans each
    stage on its submesh).
    """
    opts = PlanOptions.from_kwargs(options)
    start = time.perf_counter()
    args = tuple(example_inputs)
    captured = capture(model, args, example_kwargs)
    capture_s = time.perf_counter() - start
    name = model_name or type(model).__name__
    stage = StageOptions(
        devices=devices,
        per_node=per_node,
        stages=stages,
        microbatches=microbatches,
        schedule=schedule,
    )
    if stage.wanted or (mesh is not None and "pp" in mesh.axis_names):

        def probe(batch: int) -> Captured:
            return capture(model, slice_inputs(args, batch), slice_inputs(example_kwargs, batch))

        return plan_stages(
            captured,
            probe,
            mesh=mesh,
            stage=stage,
            options=opts,
            model_name=name,
            capture_s=capture_s,
            device=device,
            stage_plans=stage_plans,
        )
    if mesh is None:
        raise ValueError("give a mesh, or devices= (and per_node=) to search one")
    return plan_captured(captured, mesh, opts, model_name=name, capture_s=capture_s)


def plan_stages(
    captured: Captured,
    probe: Callable[[int], Captured],
    *,
    mesh: Mesh | None,
    stage: StageOptions,
    options: PlanOptions,
    model_name: str,
    capture_s: float = 0.0,
    device: str = "h100",
    progress: Callable[[str], None] | None = None,
    capture_microbatch: Callable[[int], Captured] | None = None,
    stage_plans: bool = True,
) -> Plan:
    """Search pipeline stages (``autopar.plan.stage_search``) and return the best plan: a
    pipelined plan (JSON ``pipeline`` entry), or, when no stages win, the ordinary plan on the
    winning ``dp x tp`` mesh; when that plan accumulates ``m > 1`` microbatches it is the plan
    of the whole model captured at ``batch / m`` by ``capture_microbatch`` (default ``probe``),
    run ``m`` times per optimizer step (``plan.data["stage_search"]["accumulate"]``). Either
    way ``plan.data["stage_search"]`` holds the ranked table. With ``stage_plans`` a pipelined
    plan's ``pipeline.stage_plans`` holds every stage's intra-op plan (:func:`plan_stage_graphs`
    on the model captured at the microbatch's shapes by ``capture_microbatch``)."""
    start = time.perf_counter()
    result, model, ref_mesh = search_stages(
        captured,
        probe,
        model_name=model_name,
        mesh=mesh,
        stage=stage,
        options=options,
        device=device,
        progress=progress,
    )
    best = result.best
    search = search_json(result)
    if best.mesh.pp == 1:
        flat = Mesh(
            shape=(best.mesh.dp, best.mesh.tp),
            axis_names=("dp", "tp"),
            device=ref_mesh.device,
            links=(best.mesh.dp_link, best.mesh.tp_link),
        )
        whole = captured
        if best.microbatches > 1:
            whole = (capture_microbatch or probe)(model.batch // best.microbatches)
        # The search priced the alternatives (megatron-3d, other meshes): no recipes alongside.
        plan = plan_captured(
            whole,
            flat,
            dataclasses.replace(options, accumulation=best.microbatches),
            model_name=model_name,
            capture_s=capture_s,
            progress=progress,
            price_baselines=False,
        )
        search["accumulate"] = best.microbatches
        plan.data["stage_search"] = search
        return plan
    data = pipelined_document(
        result,
        best,
        model_name=model_name,
        graph_hash=captured.graph_hash,
        num_nodes=len(captured.gm.graph.nodes),
        num_params=captured.num_params,
        stack=model.stack,
        param_fqns=model.param_fqns,
        options=options,
        budget=memory_budget_bytes(ref_mesh, options),
        device=ref_mesh.device,
        timings={"capture_s": capture_s, "stages_s": time.perf_counter() - start},
        warnings=list(result.notes),
    )
    data["stage_search"] = search
    if stage_plans:
        pipeline = PipelinePlan.from_json(data["pipeline"])
        whole = (capture_microbatch or probe)(model.batch // best.microbatches)
        sub_mesh = stage_mesh(Mesh.from_dict(data["mesh"]), pipeline.axis)
        planned = _plan_stage_graphs(
            split_stages(whole, pipeline),
            sub_mesh,
            stage_plan_options(options, pipeline, data["memory_budget_bytes"]),
            model_name,
            pipeline.stack,
        )
        data["pipeline"]["stage_plans"] = stored_entries(
            [p.data for p, _ in planned], [source for _, source in planned]
        )
        data["warnings"] = [
            *data.get("warnings", []),
            *stage_plan_warnings(pipeline, [p for p, _ in planned], data["memory_budget_bytes"]),
        ]
        data["timings"]["stages_s"] = time.perf_counter() - start
    return Plan(data=data)


def with_stage_axis(mesh: Mesh) -> Mesh:
    """``mesh``, a 1-D one with a size-1 data axis added (a stage's planning mesh drops the
    pipeline axis and the ILP needs one axis left), without process groups then."""
    if mesh.ndim != 1:
        return mesh
    name = "dp" if mesh.axis_names[0] != "dp" else "data"
    return dataclasses.replace(
        mesh,
        shape=(*mesh.shape, 1),
        axis_names=(*mesh.axis_names, name),
        links=(*mesh.links, mesh.links[0]),
        groups=None,
    )


def stage_mesh(mesh: Mesh, axis: int) -> Mesh:
    """The planning mesh of one pipeline stage: ``mesh`` without its pipeline ``axis``
    (:func:`with_stage_axis` first), without process groups."""
    mesh = with_stage_axis(mesh)
    keep = [a for a in range(mesh.ndim) if a != axis]
    return dataclasses.replace(
        mesh,
        shape=tuple(mesh.shape[a] for a in keep),
        axis_names=tuple(mesh.axis_names[a] for a in keep),
        links=tuple(mesh.links[a] for a in keep),
        groups=None,
    )


def stage_plan_options(
    options: PlanOptions, pipeline: PipelinePlan, budget_bytes: float
) -> list[PlanOptions]:
    """Per stage, the options its intra-op plan is solved with, so that the plan the runtime
    lowers is the stage the search priced:

    - the ZeRO stage the search chose on the stage's ``dp`` axis (``predicted["zero_stage"]``);
    - ``in_flight``: the microbatches the schedule keeps in flight on the stage (the ILP counts
      that many copies of the activations it keeps, and chooses layouts and recomputation for
      them);
    - ``accumulation``: the microbatches per step (the gradient sync, once per step, weighs
      ``1/m`` against each microbatch's work, as the search prices it);
    - the budget less what the rank's other stages hold (``memory_other_stages_bytes``,
      schedules with 2 stages per rank).

    Without them the ILP saw one microbatch under the whole budget with the whole sync: it chose
    no ZeRO where the search needed it, layouts keeping more activations per microbatch than
    priced, and tensor-parallel layouts whose collectives, paid ``m`` times, cost more than the
    sync they saved. A stage without a priced entry (a pipeline given by hand) keeps
    ``options``."""
    out = []
    for stage in pipeline.stages:
        priced = stage.predicted
        if "in_flight" not in priced or "zero_stage" not in priced:
            out.append(options)
            continue
        others = float(priced.get("memory_other_stages_bytes", 0.0))
        out.append(
            dataclasses.replace(
                options,
                zero_stage=(("dp", int(priced["zero_stage"])),),
                in_flight=max(int(priced["in_flight"]), 1),
                accumulation=pipeline.microbatches,
                memory_budget=int(budget_bytes - others),
            )
        )
    return out


def stage_plan_warnings(
    pipeline: PipelinePlan, plans: Sequence[Plan], budget_bytes: float
) -> list[str]:
    """One line per stage whose intra-op plan is not the stage the search priced: it holds
    more than the budget beside its rank's other stages (its peak counts the microbatches in
    flight, :func:`stage_plan_options`), or it recomputes where the search priced none (or
    the reverse: the split schedules' weight pass replays where a stage recomputes, priced
    by ``planner.split_schedules.replays``)."""
    out = []
    for stage, plan in zip(pipeline.stages, plans, strict=True):
        priced = stage.predicted
        if "in_flight" not in priced:
            continue
        held = float(plan.data["predicted"]["peak_memory_bytes"])
        held += float(priced.get("memory_other_stages_bytes", 0.0))
        if held > budget_bytes * (1 + 1e-9):
            out.append(
                f"stage {stage.index}: its intra-op plan with {priced['in_flight']:.0f} "
                f"microbatches in flight, beside its rank's other stages, holds about "
                f"{held / 2**30:.2f} GiB of the {budget_bytes / 2**30:.2f} GiB budget"
            )
        segments = len(plan.checkpoint_segments())
        if bool(segments) != bool(priced.get("recomputed_blocks")):
            out.append(
                f"stage {stage.index}: its intra-op plan recomputes {segments} segment(s) where "
                f"the stage search priced {priced.get('recomputed_blocks', 0):.0f} recomputed "
                f"block(s): its time differs from the priced one"
            )
    return out


def plan_stage_graphs(
    stages: Sequence[StageGraph],
    mesh: Mesh,
    options: PlanOptions | Sequence[PlanOptions],
    *,
    model_name: str,
    stack: str | None = None,
) -> list[Plan]:
    """Each stage graph's intra-op plan on the stage ``mesh`` (the offline planner and the
    runtime, for a plan without stored stage plans, both plan stages here), with ``options``
    or one options per stage (:func:`stage_plan_options`). With the pipeline's ``stack``, twin
    stages (same graph up to the block index and the same options,
    :mod:`autopar.plan.stage_copies`) are solved once and the others get that plan renamed;
    else one ILP per stage."""
    return [p for p, _ in _plan_stage_graphs(stages, mesh, options, model_name, stack)]


def _plan_stage_graphs(
    stages: Sequence[StageGraph],
    mesh: Mesh,
    options: PlanOptions | Sequence[PlanOptions],
    model_name: str,
    stack: str | None,
) -> list[tuple[Plan, int | None]]:
    """:func:`plan_stage_graphs`, each plan with the stage it was renamed from (None: solved)."""
    per_stage = [options] * len(stages) if isinstance(options, PlanOptions) else list(options)
    graph_keys = [None if stack is None else twin_key(s, stack) for s in stages]
    per_stage = _twins_alike(graph_keys, per_stage)
    planned: list[tuple[Plan, int | None]] = []
    solved: dict[tuple, tuple[StageGraph, Plan]] = {}
    for s, opts, graph_key in zip(stages, per_stage, graph_keys, strict=True):
        name = f"{model_name}/stage{s.index}"
        if s.index < len(stages) - 1 and opts.output_placements is None:
            # The boundary goes to the next stage in the layout it reads (the runtime lowers
            # it so), not gathered: no output conversion to price.
            opts = dataclasses.replace(opts, output_placements=(ANY_PLACEMENT,) * len(s.outputs))
        key = None if graph_key is None else (graph_key, opts)
        if key in solved:
            source, plan = solved[key]
            data = renamed_plan(plan.data, source, s, model_name=name)
            if data is not None:
                planned.append((Plan(data=data), source.index))
                continue
        plan = plan_captured(s.captured, mesh, opts, model_name=name, price_baselines=False)
        if key is not None:
            solved.setdefault(key, (s, plan))
        planned.append((plan, None))
    return planned


def _twins_alike(graph_keys: list, options: list[PlanOptions]) -> list[PlanOptions]:
    """Twin stages whose options differ only in their in-flight count and budget (their
    positions in the schedule) are solved once, with the most in flight and the least
    budget of the twins: that plan fits every one of them."""
    groups: dict[tuple, list[int]] = {}
    for i, (key, opts) in enumerate(zip(graph_keys, options, strict=True)):
        if key is not None:
            loose = dataclasses.replace(opts, in_flight=1, memory_budget=None)
            groups.setdefault((key, loose), []).append(i)
    out = list(options)
    for members in groups.values():
        budgets = [options[i].memory_budget for i in members]
        merged = dataclasses.replace(
            options[members[0]],
            in_flight=max(options[i].in_flight for i in members),
            memory_budget=None if None in budgets else min(parse_bytes(b) for b in budgets),
        )
        for i in members:
            out[i] = merged
    return out


def plan_captured(
    captured: Captured,
    mesh: Mesh,
    options: PlanOptions,
    *,
    model_name: str,
    capture_s: float = 0.0,
    price_baselines: bool = True,
    progress: Callable[[str], None] | None = None,
) -> Plan:
    """Plan an already captured graph (the CLI and autoparallelize share this). With
    ``price_baselines=False`` the recipes are not priced alongside (``plan.baselines`` then
    holds only the chosen recipe, if any), which saves one ILP per recipe. ``progress`` (e.g.
    the CLI's stderr display) receives one line per finished stage and per solve; library
    calls print nothing unless they pass one."""
    report = progress or (lambda line: None)
    start = time.perf_counter()
    space = build_space(captured, mesh, options)
    driver = Driver(space, progress=progress)
    strategies_s = time.perf_counter() - start
    tied = driver.tied
    report(
        f"strategies: {len(space.nodes)} nodes, {len(space.edges)} edges, "
        f"{sum(len(c) for c in tied[0]) if tied else 0} nodes in repeated layers, "
        f"{strategies_s:.2f} s"
    )
    planned = driver.plan(price_baselines=price_baselines)
    return document_plan(
        driver,
        planned,
        model_name=model_name,
        timings={"capture_s": capture_s, "strategies_s": strategies_s, "solve_s": planned.solve_s},
    )


def document_plan(
    driver: Driver, planned: Planned, *, model_name: str, timings: dict[str, float]
) -> Plan:
    """The Plan of one :meth:`Driver.plan` answer."""
    space = driver.space
    data = plan_document(
        space,
        planned.chosen,
        planned.baselines,
        budget=driver.budget,
        recipe=planned.recipe,
        model_name=model_name,
        log=planned.log,
        warnings=sorted(set(space.warnings)) + sorted(set(planned.notes)),
        timings=timings,
    )
    if planned.decision is not None:  # written only where a margin was weighed
        data["auto_choice"] = planned.decision
    return Plan(data=data, space=space, choice=planned.chosen.choice)


__all__ = [
    "document_plan",
    "plan",
    "plan_captured",
    "plan_stage_graphs",
    "plan_stages",
    "stage_mesh",
    "stage_plan_options",
    "stage_plan_warnings",
    "with_stage_axis",
]
