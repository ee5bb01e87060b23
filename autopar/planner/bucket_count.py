"""A plan's parameter-gradient reductions counted as the runtime issues them, after the solve.

The ILP prices each parameter input's gradient reduction on its consumer
(``space._op_space``: ``grad_sync_s`` per Partial axis), with the last bucket's latency shared
over one pool per mesh axis (``pricing.bucket_rounding``). The runtime
(``lowering.rewrite``, ``runtime.grad_sync``) does something the per-node costs cannot see:

* a parameter's gradient joins the buckets only on the axes where EVERY use leaves it Partial
  and no use converts it; on the other Partial axes each use's gradient is all-reduced in the
  graph, one whole collective per use;
* buckets are grouped by the parameter's set of axes (and dtype): each group issues
  ``ceil(bytes / GRAD_BUCKET_BYTES)`` all-reduces on each of its axes, so a parameter whose set
  differs from the others' (gpt's token embedding on a 2x2 mesh with the tokens replicated on
  one axis: Partial on the other only) pays an all-reduce's latency of its own.

:func:`bucket_correction_s` is the difference, for one solved plan, between that count and
what the solve priced (the plan's ``grad_sync`` sum): one term shared by the parameters that
choose the same set, so not a node or pair cost of the ILP. The driver
(``auto_margin.auto_or_recipe``) adds it to the auto plan and to each recipe before comparing
them, so a layout the solve ranked first only by the latency it did not count gives way to the
recipe (the decision says so). Parameters that ZeRO shards are left out (their gradients go
through ZeRO's chunks, priced by ``zero_pricing``), and so is any plan with a ZeRO stage: the
correction is 0 there.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from autopar.planner.evaluation_sums import zero_free_sums
from autopar.planner.pricing import GRAD_BUCKET_BYTES, CommPricer

__all__ = ["bucket_correction_s", "issued_grad_sync_s"]


def _uses(space: Any, choice: tuple[int, ...]) -> dict[int, list[tuple[Any, Any]]]:
    """Owner parameter node -> (input placements, input gradient placements) of each use at
    ``choice``."""
    uses: dict[int, list[tuple[Any, Any]]] = defaultdict(list)
    for edge in space.edges:
        src, dst, j = space.nodes[edge.src], space.nodes[edge.dst], edge.input_index
        if src.kind != "param" or dst.kind != "op" or j < 0:
            continue
        owner = space.index[src.alias_of] if src.alias_of is not None else edge.src
        strategy = dst.strategies[choice[edge.dst]]
        if j >= len(strategy.inputs) or j >= len(strategy.input_grads):
            continue
        uses[owner].append((strategy.inputs[j], strategy.input_grads[j]))
    return uses


def issued_grad_sync_s(space: Any, choice: tuple[int, ...]) -> float:
    """Seconds of the parameter-gradient reductions the runtime issues for ``choice`` without
    ZeRO (module docstring): the buckets per set of axes, each use's in-graph all-reduces."""
    from autopar.planner.space import local_bytes
    from autopar.strategies.registry import tensor_meta

    mesh = space.mesh
    shape = mesh.shape
    pricer = CommPricer(mesh, None)
    metas = {n.name: n.meta.get("val") for n in space.captured.gm.graph.nodes}
    buckets: dict[tuple, float] = defaultdict(float)
    in_graph = 0.0
    for owner, uses in _uses(space, choice).items():
        node = space.nodes[owner]
        meta = tensor_meta(metas[node.name])
        layout = node.strategies[choice[owner]].outputs[0]
        partial = [
            {a for a in range(len(shape)) if shape[a] > 1 and g is not None and g[a].is_partial()}
            for _, g in uses
        ]
        converts = any(placements != layout for placements, _ in uses)
        every = set.intersection(*partial) if partial and not converts else set()
        if every:
            key = (tuple(sorted(every)), meta.dtype)
            buckets[key] += local_bytes(meta, layout, shape)
        for (placements, _), axes in zip(uses, partial, strict=True):
            for a in sorted(axes - every):
                in_graph += pricer.all_reduce_s(local_bytes(meta, placements, shape), a)
    total = in_graph
    for (axes, _), nbytes in buckets.items():
        calls = math.ceil(nbytes / GRAD_BUCKET_BYTES)
        for a in axes:
            latency = pricer.all_reduce_latency_s(a)
            total += pricer.grad_sync_s(nbytes, a) - latency * nbytes / GRAD_BUCKET_BYTES
            total += calls * latency
    return total / space.options.accumulation  # once per step (PlanOptions.accumulation)


def bucket_correction_s(space: Any, solved: Any) -> float:
    """What ``solved``'s predicted step lacks (or has too much) for its parameter-gradient
    reductions as issued: :func:`issued_grad_sync_s` less the solve's ``grad_sync`` sum; 0
    under any ZeRO stage (module docstring)."""
    zero = solved.zero
    if any(zero.stage_of(a) >= 1 for a in range(len(space.mesh.shape)) if space.mesh.shape[a] > 1):
        return 0.0
    choice = tuple(solved.choice)
    return issued_grad_sync_s(space, choice) - float(zero_free_sums(space, choice)["grad_sync"])
