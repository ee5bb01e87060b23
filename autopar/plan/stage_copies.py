"""Identical pipeline stages planned once: a stage's plan document renamed onto a twin stage.

Two stage graphs are twins when they have the same graph hash (structure, shapes, dtypes; no
names) and, node by node in graph order, the same op, target and module path up to the block
index inside the stack (``layers.21.attention`` in one, ``layers.41.attention`` in the other,
each relative to its stage's first block), and neither uses a parameter shared with another
stage. The ILP of a twin is then the same problem under other names, so its plan is the solved
stage's document with every node name, parameter FQN and module path renamed one to one
(:func:`renamed_plan`); a renaming that does not cover the twin's names exactly is refused
(None), and the caller solves that stage instead.
"""

from __future__ import annotations

import copy
from typing import Any

from autopar.capture.blocks import index_in_stack, node_path
from autopar.capture.stages import StageGraph

__all__ = ["renamed_plan", "twin_key"]


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
    if len(src_nodes) != len(dst_nodes):
        return None
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
    out["model"]["graph_hash"] = target.captured.graph_hash
    out["mesh"] = copy.deepcopy(data["mesh"])
    out["options"] = copy.deepcopy(data["options"])
    names = {e["name"] for e in out["nodes"]}
    if not names <= {n.name for n in dst_nodes} or set(out["params"]) != set(
        target.captured.param_nodes.values()
    ):
        return None
    return out
