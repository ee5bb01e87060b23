"""A pipelined plan as the plan JSON: the ``pipeline`` entry and the document around it.

The stage planner's answer (``planner.pipeline.SearchResult``) becomes:

- ``pipeline``: :class:`autopar.planner.stages.PipelinePlan`'s JSON (stages with their block
  ranges, first module path, pipeline rank, global ranks and parameter FQNs; microbatches;
  schedule; predicted step, bubble, p2p and collectives), plus per stage what its intra-op plan
  chose (``layouts``, ``zero_stage`` on its ``dp`` axis, ``recomputed_blocks``) in its
  ``predicted`` entry, the stage submesh, the ranked table of candidates the search weighed,
  ``megatron-3d`` and the best plan without stages;
- the usual top-level figures (``predicted`` with ``pipeline_bubble_s`` and ``p2p_s`` in its
  breakdown, ``baselines`` with ``megatron-3d`` and ``no-stages``), on the ``pp x dp x tp``
  mesh. ``nodes`` and ``params`` are empty: each stage's layouts are in
  ``pipeline.stage_plans`` (one-stage plan documents of the stage graphs, added by
  ``autopar.api.plan_stages``), which the runtime lowers as saved; a plan without them has its
  stages planned again by the runtime on their stage graphs.
"""

from __future__ import annotations

from typing import Any

from autopar.capture.blocks import index_in_stack
from autopar.mesh import Mesh
from autopar.options import PlanOptions
from autopar.planner.pipeline import Candidate, SearchResult
from autopar.planner.stages import PipelinePlan, Stage, stage_rank
from autopar.version import version

MAX_ROWS = 30
"""Candidates kept in the plan file's ranked table."""


def candidate_row(c: Candidate) -> dict[str, Any]:
    """One row of the ranked table (what ``autopar plan --devices`` prints)."""
    return {
        "recipe": c.recipe,
        "mesh": [c.mesh.pp, c.mesh.dp, c.mesh.tp],
        "stages": c.num_stages,
        "virtual_stages": c.virtual_stages,
        "blocks": list(c.sizes),
        "microbatches": c.microbatches,
        "schedule": c.schedule,
        "step_s": c.step_s,
        "peak_memory_bytes": c.peak_memory_bytes,
        "bubble_fraction": c.time.bubble_fraction,
    }


def candidate_mesh(c: Candidate, device) -> Mesh:
    """The ``pp x dp x tp`` mesh of a candidate, with its links."""
    m = c.mesh
    return Mesh(
        shape=(m.pp, m.dp, m.tp),
        axis_names=("pp", "dp", "tp"),
        device=device,
        links=(m.pp_link, m.dp_link, m.tp_link),
    )


def pipeline_plan(c: Candidate, *, stack: str, param_fqns: tuple[str, ...]) -> PipelinePlan:
    """The :class:`PipelinePlan` of a candidate with stages (``pp > 1``)."""
    pp, dp, tp = c.mesh.pp, c.mesh.dp, c.mesh.tp
    in_block = {f: i for f in param_fqns if (i := index_in_stack(f, stack)) is not None}
    ends = [f for f in param_fqns if f not in in_block]
    stages, start = [], 0
    num_blocks = sum(c.sizes)
    for index, (size, cost) in enumerate(zip(c.sizes, c.stages, strict=True)):
        rank = stage_rank(c.schedule, index, pp)  # V schedules fold back: 0, 1, 1, 0
        owned = [f for f in param_fqns if start <= in_block.get(f, -1) < start + size]
        if index == 0:
            owned = [f for f in ends if _is_head(f, param_fqns, stack)] + owned
        if index == len(c.sizes) - 1:
            owned += [f for f in ends if not _is_head(f, param_fqns, stack)]
        stages.append(
            Stage(
                index=index,
                blocks=(start, start + size),
                first_fqn=f"{stack}.{start}",
                pp_rank=rank,
                ranks=tuple(range(rank * dp * tp, (rank + 1) * dp * tp)),
                param_fqns=tuple(owned),
                predicted={
                    "forward_s": cost.forward_s,
                    "backward_s": cost.backward_s,
                    "p2p_s": cost.p2p_s,
                    "grad_sync_s": cost.step_s,
                    "peak_memory_bytes": cost.peak_memory_bytes,
                    **{f"memory_{k}_bytes": v for k, v in cost.memory.items()},
                    "zero_stage": float(cost.detail["zero_stage"]),
                    "recomputed_blocks": float(cost.detail["recomputed_blocks"]),
                    "in_flight": float(cost.detail["in_flight"]),
                },
            )
        )
        start += size
    return PipelinePlan(
        axis=0,
        stack=stack,
        num_blocks=num_blocks,
        stages=tuple(stages),
        microbatches=c.microbatches,
        schedule=c.schedule,
        virtual_stages=c.virtual_stages,
        predicted=c.time.to_json(),
    )


def _is_head(fqn: str, param_fqns: tuple[str, ...], stack: str) -> bool:
    """A parameter outside the stack belongs to the head end when it comes before the stack's
    first parameter in module order (embeddings), else to the tail (final norm, output layer)."""
    first_block = next((k for k, f in enumerate(param_fqns) if f.startswith(stack + ".")), 0)
    return param_fqns.index(fqn) < first_block


def search_json(result: SearchResult) -> dict[str, Any]:
    """The ranked table of a search (``plan.data["stage_search"]``)."""
    return {
        "seconds": result.seconds,
        "probes": result.probes,
        "candidates": [candidate_row(c) for c in result.ranked[:MAX_ROWS]],
        "megatron_3d": candidate_row(result.megatron_3d) if result.megatron_3d else None,
        "no_stages": (
            candidate_row(result.best_without_stages) if result.best_without_stages else None
        ),
    }


def _figures(c: Candidate) -> dict[str, Any]:
    slowest = max(c.stages, key=lambda s: s.peak_memory_bytes)
    return {
        "step_s": c.step_s,
        "breakdown": {
            "compute_s": c.time.compute_s,
            "resharding_s": 0.0,
            "grad_sync_s": c.time.collectives_s,
            "activation_grad_comm_s": 0.0,
            "zero_comm_s": 0.0,
            "output_comm_s": 0.0,
            "pipeline_bubble_s": c.time.bubble_s,
            "p2p_s": c.time.p2p_s,
            "pipeline_ends_s": c.time.head_s + c.time.tail_s,
        },
        "peak_memory_bytes": c.peak_memory_bytes,
        "memory": dict(slowest.memory),
    }


def pipelined_document(
    result: SearchResult,
    chosen: Candidate,
    *,
    model_name: str,
    graph_hash: str,
    num_nodes: int,
    num_params: int,
    stack: str,
    param_fqns: tuple[str, ...],
    options: PlanOptions,
    budget: float,
    device,
    timings: dict[str, float],
    warnings: list[str],
) -> dict[str, Any]:
    """The plan JSON of a pipelined ``chosen`` (see the module docstring)."""
    from autopar.plan.document import PLAN_VERSION

    mesh = candidate_mesh(chosen, device)
    pipeline = pipeline_plan(chosen, stack=stack, param_fqns=param_fqns)
    baselines = {}
    for name, other in (
        ("megatron-3d", result.megatron_3d),
        ("no-stages", result.best_without_stages),
    ):
        if other is not None:
            baselines[name] = {
                **_figures(other),
                "fits": True,
                "mesh": [other.mesh.pp, other.mesh.dp, other.mesh.tp],
                "microbatches": other.microbatches,
                "schedule": other.schedule,
            }
    return {
        "version": PLAN_VERSION,
        "autopar_version": version(),
        "recipe": "auto",
        "model": {
            "name": model_name,
            "graph_hash": graph_hash,
            "num_nodes": num_nodes,
            "num_params": num_params,
        },
        "mesh": mesh.to_dict(),
        "options": {**options.to_dict(), "recipe": "auto"},
        "memory_budget_bytes": budget,
        "inputs": [],
        "nodes": [],
        "params": {},
        "zero": {
            "stage": max(int(s.predicted["zero_stage"]) for s in pipeline.stages),
            "axes": ["dp"] if any(s.predicted["zero_stage"] for s in pipeline.stages) else [],
        },
        "checkpoint": {"mode": options.checkpoint, "segments": []},
        "predicted": _figures(chosen),
        "baselines": baselines,
        "solver": {
            "backend": options.solver,
            "status": "optimal",
            "objective_s": chosen.step_s,
            "bound_s": chosen.step_s,
            "gap": 0.0,
            "num_variables": 0,
            "num_constraints": 0,
            "solve_s": result.seconds,
            "probes": result.probes,
        },
        "timings": timings,
        "warnings": warnings,
        "pipeline": {
            **pipeline.to_json(),
            "submesh": {"shape": [chosen.mesh.dp, chosen.mesh.tp], "axis_names": ["dp", "tp"]},
        },
    }
