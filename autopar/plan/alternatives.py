"""The alternatives the solver weighed, stored in the plan file for ``explain``.

For every parameter and for the most expensive op nodes, each strategy of the node is priced
with every other node's layout fixed at the plan's choice: its own cost under the plan's ZeRO
configuration plus the resharding on its edges (step-time delta vs the chosen strategy), its
resident bytes (memory delta), and in words why it was not chosen. The JSON is the plan's
``alternatives`` key (see ``schema.json``); ``training_flops`` is the model FLOPs per step the
summary's MFU divides by.
"""

from __future__ import annotations

import math
from typing import Any

from autopar.capture.flops import node_costs
from autopar.options import format_bytes, format_seconds
from autopar.placement import format_placements
from autopar.planner.configurations import Solved
from autopar.planner.problem import StrategySpace, ZeroConfig, node_cost_vector

TOP_NODES = 20
"""Op nodes (the most expensive under the chosen layouts) whose alternatives are stored."""
MAX_OPTIONS = 8
"""Strategies stored per node: the chosen one and the fastest others."""
_TIE_S = 1e-12


def recipe_allowed(space: StrategySpace, recipe: str) -> dict[str, list[int]] | None:
    """Strategy indices a fixed recipe leaves each node (None for ``auto``: everything)."""
    from autopar.planner.driver import replicated_allowed
    from autopar.planner.recipes import BASELINE_RECIPES, recipe_spec

    if recipe == "replicated":
        return replicated_allowed(space)
    if recipe in BASELINE_RECIPES:
        return recipe_spec(space, recipe).allowed
    return None


_Adjacency = tuple[list[list[Any]], list[list[Any]], dict[str, list[int]]]


def _adjacency(space: StrategySpace) -> _Adjacency:
    """Each node's incoming and outgoing edges, and each node name's aliases (the indices of
    the nodes whose ``alias_of`` names it), worked out once for all the nodes priced."""
    incoming: list[list[Any]] = [[] for _ in space.nodes]
    outgoing: list[list[Any]] = [[] for _ in space.nodes]
    for edge in space.edges:
        incoming[edge.dst].append(edge)
        outgoing[edge.src].append(edge)
    aliases: dict[str, list[int]] = {}
    for j, node in enumerate(space.nodes):
        if node.alias_of is not None:
            aliases.setdefault(node.alias_of, []).append(j)
    return incoming, outgoing, aliases


def node_alternatives(
    space: StrategySpace,
    choice: tuple[int, ...] | list[int],
    zero: ZeroConfig,
    i: int,
    *,
    headroom_bytes: float,
    allowed: dict[str, list[int]] | None = None,
    recipe: str = "auto",
    adjacency: _Adjacency | None = None,
    max_options: int = MAX_OPTIONS,
) -> dict[str, Any]:
    """One node's stored alternatives: ``{"node", "kind", "fqn"?, "chosen", "num_strategies",
    "options": [{"layout", "step_delta_s", "memory_delta_bytes", "reason"}]}`` with the chosen
    strategy first and the others by step-time delta (None: impossible). A tied parameter's
    aliases (``alias_of``) change layout with it; every other node keeps the plan's choice."""
    incoming, outgoing, aliases = adjacency or _adjacency(space)
    node = space.nodes[i]
    own_s, memory = node_cost_vector(space, node, zero)
    chosen = choice[i]
    permitted = set(allowed[node.name]) if allowed and node.name in allowed else None
    # A tied parameter lifted twice is one tensor: its aliases take the same layout with it.
    group = [i] + [
        j
        for j in aliases.get(node.name, ())
        if len(space.nodes[j].strategies) == len(node.strategies)
    ]
    costs = {j: node_cost_vector(space, space.nodes[j], zero)[0] for j in group[1:]}

    def total(s: int) -> float:
        seconds = float(own_s[s]) + sum(float(c[s]) for c in costs.values())
        for j in group:
            for edge in incoming[j]:
                seconds += float(edge.cost_s[s if edge.src in group else choice[edge.src], s])
            for edge in outgoing[j]:
                if edge.dst not in group:  # edges inside the group are counted once, above
                    seconds += float(edge.cost_s[s, choice[edge.dst]])
        return seconds

    base_s, base_mem = total(chosen), float(memory[chosen])
    rows = []
    for s, strategy in enumerate(node.strategies):
        delta_s = total(s) - base_s
        delta_mem = float(memory[s]) - base_mem
        layout = (
            strategy.describe() if node.kind == "op" else format_placements(strategy.outputs[0])
        )
        if s == chosen:
            reason = "chosen"
        elif permitted is not None and s not in permitted:
            reason = f"forbidden by recipe {recipe}"
        elif not math.isfinite(delta_s):
            reason = "impossible with its neighbours' layouts"
        elif delta_mem > headroom_bytes:
            reason = f"over budget by {format_bytes(delta_mem - headroom_bytes)}"
        elif delta_s > _TIE_S:
            reason = f"slower by {format_seconds(delta_s)}"
        elif delta_s < -_TIE_S:
            reason = (
                f"faster here by {format_seconds(-delta_s)} with the rest fixed, but not as a "
                "whole (repeated layers choose alike; memory and neighbours' layouts)"
            )
        else:
            reason = "as fast (a tie)"
        rows.append(
            {
                "layout": layout,
                "step_delta_s": delta_s if math.isfinite(delta_s) else None,
                "memory_delta_bytes": delta_mem,
                "reason": reason,
                "_order": (
                    s != chosen,
                    not math.isfinite(delta_s),
                    delta_s if math.isfinite(delta_s) else 0.0,
                ),
            }
        )
    rows.sort(key=lambda r: r["_order"])
    for row in rows:
        del row["_order"]
    entry: dict[str, Any] = {
        "node": node.name,
        "kind": node.kind,
        "chosen": rows[0]["layout"],
        "num_strategies": len(node.strategies),
        "options": rows[:max_options],
    }
    if node.fqn:
        entry["fqn"] = node.fqn
    return entry


def alternatives_document(
    space: StrategySpace, chosen: Solved, *, budget: float, recipe: str, top_nodes: int = TOP_NODES
) -> dict[str, Any]:
    """The plan JSON's ``alternatives``: every parameter and the ``top_nodes`` most expensive op
    nodes (by their seconds under the chosen layouts), keyed by node name."""
    allowed = recipe_allowed(space, recipe)
    adjacency = _adjacency(space)
    headroom = budget - chosen.evaluation.peak_memory_bytes
    node_s = chosen.evaluation.node_s
    params = [i for i, n in enumerate(space.nodes) if n.kind == "param" and n.alias_of is None]
    ops = sorted((i for i, n in enumerate(space.nodes) if n.kind == "op"), key=lambda i: -node_s[i])
    entries = {}
    for i in params + ops[:top_nodes]:
        entries[space.nodes[i].name] = node_alternatives(
            space,
            chosen.choice,
            chosen.zero,
            i,
            headroom_bytes=headroom,
            allowed=allowed,
            recipe=recipe,
            adjacency=adjacency,
        )
    return {"top_nodes": top_nodes, "entries": entries}


def training_flops(space: StrategySpace) -> float:
    """Model FLOPs of one training step on the global batch: every op's forward and (where a
    gradient flows) backward, without recomputation (what MFU counts)."""
    by_name = {n.name: n for n in space.captured.gm.graph.nodes}
    total = 0.0
    for node in space.nodes:
        if node.kind == "op":
            work = node_costs(by_name[node.name])
            total += work.fwd_flops + work.bwd_flops
    return total
