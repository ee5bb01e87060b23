"""The parts of a plan's predicted figures that no ZeRO configuration changes
(:func:`autopar.planner.problem.evaluate` adds the parameters' ZeRO state and communication).
"""

from __future__ import annotations

from typing import Any

from autopar.planner.shared_grads import SHARED_GRAD_EDGE
from autopar.planner.sibling_grads import shared_grad_saving
from autopar.planner.space import StrategySpace


def zero_free_sums(space: StrategySpace, choice: tuple[int, ...]) -> dict[str, Any]:
    """The parts of :func:`autopar.planner.problem.evaluate` that no ZeRO configuration changes, memoised per choice
    (the plan prices one choice under every configuration it considered)."""
    cache = space.evaluation_cache
    key = choice
    if key in cache:
        return cache[key]
    compute = grad_sync = act_comm = out_comm = transient = 0.0
    memory = dict.fromkeys(
        ("params", "grads", "optimizer", "master", "activations", "inputs_buffers"), 0.0
    )
    node_s = [0.0] * len(space.nodes)
    params = []
    for i, node in enumerate(space.nodes):
        s = choice[i]
        compute += node.compute_s[s]
        grad_sync += node.param_grad_comm_s[s]
        act_comm += node.grad_comm_s[s]
        out_comm += node.output_comm_s[s]
        node_s[i] = float(
            node.compute_s[s]
            + node.param_grad_comm_s[s]
            + node.grad_comm_s[s]
            + node.output_comm_s[s]
        )
        memory["activations"] += node.activation_bytes[s]
        memory["inputs_buffers"] += node.fixed_bytes[s]
        transient = max(transient, float(node.transient_bytes[s]))
        if node.kind == "param":
            params.append(i)
    # An activation's Partial gradient taken alike by several ops is all-reduced once.
    for k, saved_s in shared_grad_saving(space.sibling_grads, choice).items():
        act_comm -= saved_s
        node_s[k] -= saved_s
    resharding = 0.0
    for edge in space.edges:
        c = float(edge.cost_s[choice[edge.src], choice[edge.dst]])
        if edge.input_index == SHARED_GRAD_EDGE:  # a parameter's reduction charged back
            grad_sync += c
        else:
            resharding += c
        node_s[edge.dst] += c
    if len(cache) >= 8:
        cache.clear()
    cache[key] = out = {
        "compute": compute,
        "grad_sync": grad_sync,
        "act_comm": act_comm,
        "out_comm": out_comm,
        "transient": transient,
        "memory": memory,
        "node_s": node_s,
        "params": params,
        "resharding": resharding,
    }
    return out
