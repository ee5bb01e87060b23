"""Repeated-block tying: nodes of structurally identical layers share one set of variables.

A tie class {i_1, ..., i_L} (the same node of L identical layers) is contracted into one node
whose cost and resident bytes per strategy are the members' sums and whose transient bytes are
the members' largest; every edge is re-pointed at the contracted nodes, and edges that land on
the same contracted pair are summed into one matrix (the same matrix object, e.g. the same edge
of each layer as the autopar bridge shares them, is converted once and multiplied by its
count). An edge between two members of one class becomes a self-loop, which presolve reduces to
its diagonal, as the members choose alike. The contracted problem's objective and peak of a
choice equal the original problem's for the expanded choice (every member takes its class's
strategy), so solving it solves the tied problem exactly.

Under a memory budget the members of a class may also choose differently: solver/counts.py
solves the classes as counts per strategy and solver/realise.py turns the counts into a plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from solver.presolve import cost_matrix
from solver.problem import Edge, Node, Problem
from solver.tables import array_table


@dataclass(frozen=True, kw_only=True, slots=True)
class Contracted:
    problem: Problem
    """The contracted problem (no tie classes left)."""
    node_map: tuple[int, ...]
    """Original node index -> contracted node index."""


def contract(problem: Problem) -> Contracted:
    """Contract ``problem.tied`` (see the module docstring).

    Raises:
        ValueError: a class names a node out of range, twice, or members whose numbers of
            strategies differ.
    """
    nodes = problem.nodes
    owner: dict[int, int] = {}
    for c, members in enumerate(problem.tied):
        for i in members:
            if not 0 <= i < len(nodes):
                raise ValueError(f"tie class {c} names node {i}, out of range")
            if i in owner:
                raise ValueError(f"node {i} is in tie classes {owner[i]} and {c}; merge them")
            if nodes[i].num_choices != nodes[members[0]].num_choices:
                raise ValueError(
                    f"tie class {c}: nodes {members[0]} and {i} have different numbers of "
                    f"strategies; tie only identical nodes"
                )
            owner[i] = c
    node_map: list[int] = []
    new_nodes: list[Node] = []
    class_index: dict[int, int] = {}
    for i, node in enumerate(nodes):
        tie = owner.get(i)
        if tie is None:
            node_map.append(len(new_nodes))
            new_nodes.append(node)
        elif tie in class_index:
            node_map.append(class_index[tie])
        else:
            class_index[tie] = len(new_nodes)
            node_map.append(len(new_nodes))
            new_nodes.append(_merge_nodes([nodes[j] for j in problem.tied[tie]]))
    counts: dict[tuple[int, int, int], list] = {}
    for edge in problem.edges:
        key = (node_map[edge.src], node_map[edge.dst], id(edge.cost_s))
        entry = counts.get(key)
        if entry is None:
            counts[key] = [edge.cost_s, 1]
        else:
            entry[1] += 1
    # Sum every edge landing on one contracted pair (either orientation) in one array.
    pairs: dict[tuple[int, int], np.ndarray] = {}
    for (src, dst, _), (matrix, count) in counts.items():
        array = cost_matrix(matrix) * count
        if src > dst:
            src, dst, array = dst, src, array.T
        pairs[src, dst] = pairs[src, dst] + array if (src, dst) in pairs else array
    new_edges = [
        Edge(src=src, dst=dst, cost_s=array_table(array)) for (src, dst), array in pairs.items()
    ]
    contracted = Problem(
        nodes=tuple(new_nodes),
        edges=tuple(new_edges),
        memory_budget_bytes=problem.memory_budget_bytes,
        memory_offset_bytes=problem.memory_offset_bytes,
    )
    return Contracted(problem=contracted, node_map=tuple(node_map))


def _merge_nodes(members: list[Node]) -> Node:
    """Costs and resident bytes summed member by member, in member order (the same floats as
    Python's sum), transient bytes the largest."""
    first = members[0]
    num = first.num_choices
    cost = np.zeros(num)
    memory = np.zeros(num)
    for m in members:
        cost += np.asarray(m.cost_s, dtype=np.float64)
        memory += np.asarray(m.memory_bytes, dtype=np.float64)
    transient: tuple[float, ...] = ()
    if any(m.transient_bytes for m in members):
        largest = np.zeros(num)
        for m in members:
            if m.transient_bytes:
                np.maximum(largest, m.transient_bytes, out=largest)
        transient = tuple(largest.tolist())
    return Node(
        name=f"{first.name}(x{len(members)})",
        cost_s=tuple(cost.tolist()),
        memory_bytes=tuple(memory.tolist()),
        transient_bytes=transient,
    )


def expand(contracted: Contracted, choices: tuple[int, ...]) -> tuple[int, ...]:
    """The contracted problem's choices, one per original node."""
    return tuple(choices[c] for c in contracted.node_map)
