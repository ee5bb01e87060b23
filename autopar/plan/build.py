"""The plan document: the driver's answer (``planner.driver.Planned``) as the Plan's JSON.

:func:`plan_document` writes every field of ``schema.json``: the chosen layout per node and
parameter, the ZeRO configuration with every configuration considered and why the chosen one
won, the checkpoint segments, the predicted figures and the recipes priced alongside, the
solver's report, timings and warnings.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch

from autopar.options import format_bytes, format_seconds
from autopar.plan.alternatives import alternatives_document, training_flops
from autopar.plan.document import PLAN_VERSION, strategy_entry
from autopar.planner.checkpointing import with_segments
from autopar.planner.configurations import Solved
from autopar.planner.problem import Evaluation, StrategySpace, ZeroConfig, evaluate, param_state
from autopar.planner.zero_choice import zero_configurations
from autopar.strategies import input_nodes
from autopar.version import version


def _figures(ev: Evaluation) -> dict[str, Any]:
    return {
        "step_s": ev.step_s,
        "breakdown": {
            "compute_s": ev.compute_s,
            "resharding_s": ev.resharding_s,
            "grad_sync_s": ev.grad_sync_s,
            "activation_grad_comm_s": ev.activation_grad_comm_s,
            "zero_comm_s": ev.zero_comm_s,
            "output_comm_s": ev.output_comm_s,
            "recompute_s": ev.recompute_s,
        },
        "peak_memory_bytes": ev.peak_memory_bytes,
        "memory": ev.memory,
    }


def plan_document(
    space: StrategySpace,
    chosen: Solved,
    baselines: dict[str, Solved],
    *,
    budget: float,
    recipe: str | None = None,
    model_name: str,
    log: list[dict],
    warnings: list[str],
    timings: dict[str, float],
) -> dict[str, Any]:
    """The Plan's JSON document (autopar/plan/schema.json) for ``chosen``, with ``baselines``
    priced alongside and the solver ``log``."""
    captured = space.captured
    mesh = space.mesh
    gm = captured.gm
    recipe = recipe or space.options.recipe
    zero = chosen.zero
    nodes, params, inputs, zero_numels = _node_entries(space, chosen)
    sol = chosen.solution
    considered, reason = zero_considered(space, chosen, log, budget, recipe)
    chunk_bytes = padding_waste = None
    if zero.stage > 0 and zero_numels:
        chunk_bytes, padding_waste = _chunk_size(space, chosen, zero_numels, budget)
    return {
        "version": PLAN_VERSION,
        "autopar_version": version(),
        "recipe": recipe,
        "model": {
            "name": model_name,
            "graph_hash": captured.graph_hash,
            "num_nodes": len(gm.graph.nodes),
            "num_params": captured.num_params,
            "train_flops": training_flops(space),
        },
        "mesh": mesh.to_dict(),
        "options": {**space.options.to_dict(), "recipe": recipe},
        "memory_budget_bytes": budget,
        "inputs": inputs,
        "nodes": nodes,
        "params": params,
        "zero": {
            **zero.to_json(mesh.axis_names),
            "chunk_bytes": chunk_bytes,
            "padding_waste": padding_waste,
            "per_stage": _per_stage(space, chosen),
            "considered": considered,
            "reason": reason,
        },
        "checkpoint": {
            "mode": space.options.checkpoint,
            "segments": [c.to_dict() for c in chosen.segments],
        },
        "predicted": _figures(chosen.evaluation),
        "baselines": {
            name: {
                **_figures(b.evaluation),
                "fits": bool(b.evaluation.peak_memory_bytes <= budget),
                "recomputed_segments": len(b.segments),
                "zero": b.zero.to_json(mesh.axis_names),
            }
            for name, b in baselines.items()
        },
        "solver": {
            "backend": sol.backend,
            "status": sol.status,
            "objective_s": sol.objective_s,
            "bound_s": sol.bound_s,
            "gap": sol.gap,
            "num_variables": sol.num_variables,
            "num_constraints": sol.num_constraints,
            "build_s": sol.build_s,
            "solve_s": sol.solve_s,
            "candidates": log,
        },
        "timings": timings,
        "warnings": warnings,
        "alternatives": alternatives_document(space, chosen, budget=budget, recipe=recipe),
    }


def _chunk_size(
    space: StrategySpace, chosen: Solved, zero_numels: list[int], budget: float
) -> tuple[int, float]:
    """The ZeRO chunk size (bytes) and its padding waste: the fewest exposed seconds of the
    chunks' collectives under the mesh's links and the plan's compute
    (:class:`~autopar.planner.chunks.ChunkPricing`), with the chunk transients
    (:data:`~autopar.planner.chunks.CHUNK_TRANSIENTS`) within the budget's headroom."""
    from autopar.planner.chunks import ChunkPricing, planned_chunk_bytes

    mesh, zero, ev = space.mesh, chosen.zero, chosen.evaluation
    forward = sum(
        float(node.forward_s[s])
        for node, s in zip(space.nodes, chosen.choice)
        if node.forward_s is not None
    )
    compute = ev.compute_s + ev.recompute_s
    pricing = ChunkPricing.on_mesh(
        shape=mesh.shape,
        links=mesh.links,
        device=mesh.device,
        stages=zero.stages,
        forward_s=min(forward, compute),
        backward_s=max(compute - forward, 0.0),
    )
    return planned_chunk_bytes(
        zero_numels,
        pricing,
        max_stage=max(zero.stages),
        headroom_bytes=budget - ev.peak_memory_bytes,
    )


def _node_entries(
    space: StrategySpace, chosen: Solved
) -> tuple[list[dict[str, Any]], dict[str, Any], list[dict[str, Any]], list[int]]:
    """The document's ``nodes``, ``params`` and ``inputs`` entries for ``chosen``, and the local
    element counts of the ZeRO-managed parameters in graph order (what chunks are sized by)."""
    captured = space.captured
    mesh = space.mesh
    zero = chosen.zero
    by_name = {n.name: n for n in captured.gm.graph.nodes}
    nodes = []
    params: dict[str, Any] = {}
    inputs = []
    zero_numels: list[int] = []  # local elements of ZeRO-managed parameters, in graph order
    for i, node in enumerate(space.nodes):
        s = chosen.choice[i]
        strategy = node.strategies[s]
        fx_node = by_name[node.name]
        entry = {
            "name": node.name,
            "op": str(fx_node.target),
            "kind": node.kind,
            "module_path": fx_node.meta.get("autopar_module_path", ""),
            **strategy_entry(strategy),
            "seconds": chosen.evaluation.node_s[i],
            "compute_s": float(node.compute_s[s]),
            "memory_bytes": float(node.activation_bytes[s] + node.fixed_bytes[s]),
            "num_strategies": len(node.strategies),
            "args": [inp.name for inp in input_nodes(fx_node)],
            "shapes": _output_shapes(fx_node),
            "dtype": _output_dtype(fx_node),
        }
        if node.fqn:
            entry["fqn"] = node.fqn
        if fx_node.target is operator.getitem:
            entry["getitem_index"] = int(fx_node.args[1])
        if node.kind == "param":
            mem, _, _ = param_state(space, node, s, zero)
            entry["memory_bytes"] = mem
            placements = strategy.outputs[0]
            replicate = [
                a for a in range(mesh.ndim) if placements[a].is_replicate() and mesh.shape[a] > 1
            ]
            own = zero.split(replicate)[2]
            zero_axes = [mesh.axis_names[a] for a in own]
            params[node.fqn] = {
                "placement": entry["outputs"][0],
                "shape": list(fx_node.meta["val"].shape),
                "module_path": _param_module(node.fqn),
                "zero": {
                    "stage": max((zero.stage_of(a) for a in own), default=0),
                    "axes": zero_axes,
                    "stages": {mesh.axis_names[a]: zero.stage_of(a) for a in own},
                },
                "tied_to": captured.tied_params.get(node.fqn, []),
            }
            if zero_axes and node.alias_of is None and node.local_numel is not None:
                zero_numels.append(int(node.local_numel[s]))
        if node.kind == "input":
            inputs.append({"name": node.name, "placements": entry["outputs"][0]})
        nodes.append(entry)
    return nodes, params, inputs, zero_numels


def zero_considered(
    space: StrategySpace, chosen: Solved, log: list[dict], budget: float, recipe: str
) -> tuple[list[dict[str, Any]], str]:
    """Every ZeRO configuration of the mesh with its figures and verdict, and why the chosen one
    won (the plan JSON's ``zero.considered`` / ``zero.reason``, shown by ``plan.summary()``).

    A configuration the planner solved shows its own optimum; one it did not solve (pruned by
    dominance, or not needed because an earlier one fitted) shows the chosen layouts priced
    under it, marked ``"layouts": "chosen"``."""
    mesh = space.mesh
    names = mesh.axis_names
    solved_by_key = {_log_key(entry): entry for entry in log}
    all_axes = tuple(a for a in range(mesh.ndim) if mesh.shape[a] > 1)
    chosen_key = chosen.zero
    stage0_fits = any(
        e.get("budget_free") and e.get("peak_memory_bytes", math.inf) <= budget for e in log
    )

    def label(zero: ZeroConfig) -> str:
        return zero.label(names)

    considered: list[dict[str, Any]] = []
    for zero, dominated_by in zero_configurations(mesh.shape):
        key = zero
        entry = solved_by_key.get(key)
        row: dict[str, Any] = zero.to_json(names)
        solved = entry is not None and entry.get("status") not in ("infeasible", "skipped")
        if solved:
            row.update(
                layouts="own",
                step_s=entry["step_s"],
                peak_memory_bytes=entry["peak_memory_bytes"],
                memory=entry.get("memory"),
            )
        else:
            ev = with_segments(evaluate(space, chosen.choice, zero), chosen.segments)
            row.update(
                layouts="chosen",
                step_s=ev.step_s,
                peak_memory_bytes=ev.peak_memory_bytes,
                memory=ev.memory,
            )
        if key == chosen_key:
            verdict = "chosen"
        elif recipe != "auto" or space.options.zero_stage is not None:
            verdict = "not solved: the configuration is fixed"
        elif entry is not None and entry.get("status") == "infeasible":
            verdict = (
                f"no layout fits the budget (needs {format_bytes(entry['min_budget_bytes'])})"
                if "min_budget_bytes" in entry
                else "no layout fits the budget"
            )
        elif entry is not None and entry.get("status") == "skipped":
            verdict = (
                f"skipped: its bound {format_seconds(entry['bound_s'])} is no faster than the "
                f"chosen step"
            )
        elif dominated_by is not None:
            verdict = f"pruned: {label(dominated_by)} is as fast with no more memory"
        elif stage0_fits:
            verdict = "not solved: stage 0 fits, and ZeRO never makes a step faster"
        elif zero.stage == 0 and all_axes:
            verdict = (
                f"its fastest layouts are over the budget; under the budget "
                f"{label(ZeroConfig(stage=2, axes=all_axes))} is as fast with no more memory"
            )
        elif entry is not None and entry["peak_memory_bytes"] > budget:
            verdict = "over the budget"
        elif entry is not None:
            verdict = f"slower ({format_seconds(entry['step_s'])} vs {format_seconds(chosen.evaluation.step_s)})"
        else:
            verdict = "not solved"
        row["verdict"] = verdict
        considered.append(row)

    if recipe != "auto":
        reason = f"recipe {recipe!r} fixes {label(chosen.zero)}"
    elif space.options.zero_stage is not None:
        spec = space.options.zero_stage
        reason = (
            f"zero_stage={spec} was asked for"
            if isinstance(spec, int)
            else f"zero_stage was asked for: {label(chosen.zero)}"
        )
    elif chosen.zero.stage == 0:
        reason = (
            f"stage 0 fits the budget ({format_bytes(chosen.evaluation.peak_memory_bytes)} of "
            f"{format_bytes(budget)}) and ZeRO never makes a step faster under the cost model"
        )
    else:
        free = next((e for e in log if e.get("budget_free")), None)
        need = f" (stage 0 needs {format_bytes(free['peak_memory_bytes'])})" if free else ""
        reason = (
            f"stage 0 does not fit the budget of {format_bytes(budget)}{need}; {label(chosen.zero)} "
            f"has the fastest step ({format_seconds(chosen.evaluation.step_s)}, peak "
            f"{format_bytes(chosen.evaluation.peak_memory_bytes)}) of the configurations that fit"
        )
    return considered, reason


def _log_key(entry: dict) -> ZeroConfig:
    """The configuration of a solver log entry (``zero_stages``; older entries: stage on axes)."""
    if "zero_stages" in entry:
        return ZeroConfig(stages=entry["zero_stages"])
    return ZeroConfig(stage=entry["zero_stage"], axes=tuple(entry["zero_axes"]))


def _per_stage(space: StrategySpace, chosen: Solved) -> dict[str, Any]:
    """The chosen layouts priced under every ZeRO stage on the same axes (all data-parallel
    axes when the plan uses none): what each stage would cost in time and keep per device; a
    plan with different stages per axis adds its own row (keyed "axis=stage,...")."""
    axes = chosen.zero.axes or tuple(a for a in range(space.mesh.ndim) if space.mesh.shape[a] > 1)
    out = {}
    for stage in range(4):
        ev = with_segments(
            evaluate(space, chosen.choice, ZeroConfig(stage=stage, axes=axes if stage else ())),
            chosen.segments,
        )
        out[str(stage)] = {
            "step_s": ev.step_s,
            "peak_memory_bytes": ev.peak_memory_bytes,
            "memory": ev.memory,
        }
    if not chosen.zero.is_uniform:
        # The chosen per-axis stages too, keyed like "dp=2,tp=3".
        names = space.mesh.axis_names
        key = ",".join(f"{names[a]}={chosen.zero.stage_of(a)}" for a in range(space.mesh.ndim))
        ev = chosen.evaluation
        out[key] = {
            "step_s": ev.step_s,
            "peak_memory_bytes": ev.peak_memory_bytes,
            "memory": ev.memory,
        }
    return out


def _output_shapes(node) -> list[list[int] | None]:
    val = node.meta.get("val")
    values = val if isinstance(val, (tuple, list)) else [val]
    return [list(v.shape) if isinstance(v, torch.Tensor) else None for v in values]


def _output_dtype(node) -> str:
    val = node.meta.get("val")
    values = val if isinstance(val, (tuple, list)) else [val]
    first = next((v for v in values if isinstance(v, torch.Tensor)), None)
    return str(first.dtype).removeprefix("torch.") if first is not None else "none"


def _param_module(fqn: str) -> str:
    return fqn.rsplit(".", 1)[0] if "." in fqn else ""
