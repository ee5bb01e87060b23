"""Identical pipeline stages planned once: a stage's plan document renamed onto a twin stage.

Two stage graphs are twins when they have the same graph hash (structure, shapes, dtypes; no
names) and, node by node in graph order, the same op, target and module path up to the block
index inside the stack (``layers.21.attention`` in one, ``layers.41.attention`` in the other,
each relative to its stage's first block), and neither uses a parameter shared with another
stage. The ILP of a twin is then the same problem under other names, so its plan is the solved
stage's document with every node name, parameter FQN and module path renamed one to one
(:func:`renamed_plan`); a renaming that does not cover the twin's names exactly, or a plan or
stage of another graph hash, is refused (None), and the caller solves that stage instead.

A stored pipelined plan keeps the solved stage's document once and, for each twin,
``{"renamed_from": k}`` (:func:`stored_entries`); the runtime renames stage ``k``'s plan onto
its own stage graph (:func:`stage_plans_from_stored`) and refuses, in one line, a stage graph
that is not a renamed copy.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from autopar.capture.blocks import index_in_stack, node_path
from autopar.capture.stages import StageGraph
from autopar.errors import PlanMismatchError
from autopar.mesh import Mesh
from autopar.plan.document import Plan

__all__ = [
    "renamed_plan",
    "stage_plans_from_stored",
    "stored_entries",
    "stored_stage_plans",
    "twin_key",
]


def _relative_path(path: str, stack: str, first_block: int) -> str:
    index = index_in_stack(path, stack)
    if index is None:
        return path
    prefix = f"{stack}.{index}"
    at = path.find(prefix)
    return f"{path[:at]}{stack}.+{index - first_block}{path[at + len(prefix) :]}"


def twin_key(stage: StageGraph, stack: str) -> tuple | None:
    """What twin stages share (module docstring); None for a stage that is planned on its own."""
    if stage.shared_params or stage.captured.tied_params:
        return None
    first = stage.blocks[0]
    nodes = tuple(
        (
            node.op,
            str(node.target) if node.op == "call_function" else "",
            _relative_path(node_path(node), stack, first),
        )
        for node in stage.captured.gm.graph.nodes
    )
    return (stage.captured.graph_hash, stage.blocks[1] - stage.blocks[0], nodes)


def renamed_plan(
    data: dict[str, Any], source: StageGraph, target: StageGraph, *, model_name: str
) -> dict[str, Any] | None:
    """``source``'s plan document ``data`` renamed onto its twin ``target``, or None when the
    names do not map one to one (the caller then solves ``target``)."""
    src_nodes = list(source.captured.gm.graph.nodes)
    dst_nodes = list(target.captured.gm.graph.nodes)
    hashes = {data["model"]["graph_hash"], source.captured.graph_hash, target.captured.graph_hash}
    if len(src_nodes) != len(dst_nodes) or len(hashes) != 1:
        return None  # a plan for another graph, or stages that differ in structure or shapes
    mapping: dict[str, str] = {}
    for a, b in zip(src_nodes, dst_nodes, strict=True):
        for x, y in ((a.name, b.name), (node_path(a), node_path(b))):
            if mapping.setdefault(x, y) != y:
                return None
    src_state = {**source.captured.param_nodes, **source.captured.buffer_nodes}
    dst_state = {**target.captured.param_nodes, **target.captured.buffer_nodes}
    for name, fqn in src_state.items():
        other = dst_state.get(mapping[name])
        if other is None:
            return None
        for x, y in ((fqn, other), (fqn.rpartition(".")[0], other.rpartition(".")[0])):
            if mapping.setdefault(x, y) != y:
                return None
    if len(set(mapping.values())) != len(mapping):
        return None

    def rename(value: Any) -> Any:
        if isinstance(value, str):
            return mapping.get(value, value)
        if isinstance(value, list):
            return [rename(v) for v in value]
        if isinstance(value, dict):
            return {rename(k): rename(v) for k, v in value.items()}
        return value

    out = rename({k: v for k, v in data.items() if k not in ("model", "mesh", "options")})
    out["model"] = {**copy.deepcopy(data["model"]), "name": model_name}
    out["mesh"] = copy.deepcopy(data["mesh"])
    out["options"] = copy.deepcopy(data["options"])
    names = {e["name"] for e in out["nodes"]}
    if not names <= {n.name for n in dst_nodes} or set(out["params"]) != set(
        target.captured.param_nodes.values()
    ):
        return None
    return out


def stored_entries(datas: list[dict[str, Any]], copied_from: list[int | None]) -> list[dict]:
    """``pipeline.stage_plans`` as written: a stage whose plan was renamed from stage ``k``'s is
    stored as ``{"renamed_from": k}`` (the runtime renames again onto its own stage graph)."""
    return [
        data if source is None else {"renamed_from": source}
        for data, source in zip(datas, copied_from, strict=True)
    ]


def stage_plans_from_stored(
    entries: list[dict[str, Any]], stages: Sequence[StageGraph]
) -> list[Plan]:
    """Every stage's plan from ``pipeline.stage_plans`` (``{"renamed_from": k}`` entries
    renamed from stage ``k``'s stored plan onto this stage graph).

    Raises:
        PlanMismatchError: a stage graph is not a renamed copy of the stage it was stored as.
    """
    plans: list[Plan] = []
    for stage, entry in zip(stages, entries, strict=True):
        source = entry.get("renamed_from")
        if source is None:
            plans.append(Plan.from_dict(entry))
            continue
        data = None
        if (
            isinstance(source, int)
            and 0 <= source < stage.index
            and "renamed_from" not in entries[source]
        ):
            model = entries[source]["model"]["name"].rpartition("/stage")[0]
            name = f"{model}/stage{stage.index}"
            data = renamed_plan(entries[source], stages[source], stage, model_name=name)
        if data is None:
            raise PlanMismatchError(
                f"the plan stores pipeline stage {stage.index}'s layouts as a copy of stage "
                f"{source}'s, but this model's stage {stage.index} is not a renamed copy of it "
                f"(another model or other input shapes); re-plan for this model and these inputs"
            )
        plans.append(Plan(data=data))
    return plans


def stored_stage_plans(plan: Plan | None, mesh: Mesh, num_stages: int) -> list[dict] | None:
    """The stage plan entries ``plan`` stores (None without them: the runtime plans the
    stages); :func:`stage_plans_from_stored` makes them plans.

    Raises:
        PlanMismatchError: they are for another mesh shape or another stage count (a stage
            graph that is not the one they were planned for is refused by ``check_plan``).
    """
    stored = None if plan is None else plan.data["pipeline"].get("stage_plans")
    if not stored:
        return None
    plan_mesh = plan.data["mesh"]
    if tuple(plan_mesh["shape"]) != tuple(mesh.shape):
        raise PlanMismatchError(
            f"the plan's stage layouts were planned on mesh {tuple(plan_mesh['shape'])} "
            f"{tuple(plan_mesh['axis_names'])} but this mesh has shape {tuple(mesh.shape)}; build "
            f"it as autopar.Mesh.from_world({tuple(plan_mesh['shape'])}, "
            f"{tuple(plan_mesh['axis_names'])})"
        )
    if len(stored) != num_stages:
        raise PlanMismatchError(
            f"the plan stores {len(stored)} stage plans for {num_stages} pipeline stages; "
            f"plan again"
        )
    return stored
