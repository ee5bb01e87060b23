"""The weight half of a split backward (zero-bubble schedules), without replaying the input half.

torch's zero-bubble schedules split a stage's microbatch backward in two. The input pass
(torch's ``stage_backward_input``) differentiates the stage's outputs with respect to its
inputs only, and records, at each *intermediate* (an autograd node on the input path into which
a parameter-only path feeds: a matmul of an activation and a weight, say), the gradient flowing
into it. The weight pass starts from those intermediates with the recorded gradients and
differentiates with respect to the parameters.

One ``torch.autograd.grad`` from every intermediate to every parameter (:func:`_replay_pass`,
what this module did until session 21) replays the input pass: autograd runs every node that
has a path to a requested gradient, and the input path from a later layer's intermediate leads
to an earlier layer's parameters, so every activation gradient is computed a second time
(measured: zero-bubble and ZBV 1.23-1.35x interleaved 1F1B's step on gloo, README "Session
19"). torch's own weight pass, one call per parameter group, avoids most of that without ZeRO;
under ZeRO the parameters of one chunk reach the graph through ONE autograd function (the
chunk's gather, :mod:`autopar.runtime.zero_graph`) whose backward needs every gradient of the
chunk at once and returns no gradient to its shard parameters (it reduces the chunk itself),
and every layer of the chunk leads to it.

So the weight pass cuts the graph at the intermediates' parameter-side edges
(:func:`_cut_pass`):

1. *The products.* Per intermediate, in creation order (the same on every rank: a ZeRO-3
   chunk gathered again by an unpack is a collective), the gradients of its next edges that
   lie on parameter-only paths (:func:`param_side`, the closure torch's ``get_param_groups``
   climbs). Where the node at such an edge is fed by this intermediate alone (a weight's
   transpose, an accumulator of a parameter used once), one ``torch.autograd.grad`` from the
   intermediate to those edges runs that intermediate alone, and only its parameter-side
   outputs (a matmul's dW, not its dX again). Where it is shared (a ZeRO chunk's gather fed
   straight by a norm's weight product: autograd would run every path into it), the
   intermediate is called directly, which also computes its input-side output and drops it:
   one node's work, not a path's.
2. *The parameter paths.* One ``torch.autograd.grad`` from all those edges, their gradients
   summed per edge, to the parameters' accumulators: the views, transposes, casts and ZeRO
   gathers between a product and its parameter, each run once with all its gradients (a
   chunk's backward whole, as in a plain backward).

The recorded gradient at an intermediate is already its whole gradient (every path from the
outputs to it runs through the input path), and each product runs once, so nothing is counted
twice. The replay pass stays for two cases: a stage that recomputes (``torch.utils.checkpoint``
recomputes a segment once per autograd call, so a call per intermediate would recompute it per
intermediate, where the one replay call recomputes it once), and an intermediate that cannot be
called directly (a custom autograd function, or a gradient missing) at a shared edge.

Gradient reduction: neither pass runs the parameters' gradient-accumulation hooks (autograd.grad
returns the gradients instead), so :class:`autopar.runtime.pipeline.PipelineModule` runs every
pass under ``no_sync`` and reduces the accumulated gradients after the schedule.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.autograd.graph import GradientEdge

__all__ = ["param_side", "weight_pass"]

_Pinned = list[tuple[Any, tuple[Any, ...]]]


def _accumulator(param: torch.Tensor) -> Any:
    """The autograd node that accumulates ``param``'s gradient (made on first request)."""
    return param.view_as(param).grad_fn.next_functions[0][0]


def weight_pass(
    params: Iterable[torch.Tensor], groups: list[dict[str, Any]], *, replay: bool = False
) -> None:
    """Accumulate into ``param.grad`` the weight gradients of one microbatch, from the
    ``groups`` torch's input pass recorded (``params``: accumulator nodes; ``intermediates``;
    ``grads``: what flowed into each intermediate). ``replay``: the stage recomputes, use the
    one-call pass (module docstring)."""
    by_node = {_accumulator(p): p for p in params if p.requires_grad}
    targets: list[Any] = []
    pinned: _Pinned = []
    seen: set[Any] = set()
    for group in groups:
        recorded = group.pop("grads", None)
        nodes = list(group.pop("intermediates", ()))
        if recorded is None:
            continue  # the input pass never reached these intermediates: no gradient
        for node, grads in zip(nodes, recorded, strict=True):
            if node not in seen:  # torch's grouping may list a node in two groups
                seen.add(node)
                pinned.append((node, tuple(grads)))
        targets.extend(n for n in group["params"] if n in by_node and n not in targets)
    if not pinned or not targets:
        return
    cut = None if replay else _cut_plan(pinned, targets)
    if cut is None:
        weight_grads = _replay_pass(pinned, targets)
    else:
        weight_grads = _cut_pass(cut, targets)
    for node, grad in zip(targets, weight_grads, strict=True):
        if grad is None:
            continue  # e.g. a ZeRO shard: its chunk's backward accumulated it
        param = by_node[node]
        if param.grad is None:
            param.grad = grad
        else:
            param.grad += grad


def param_side(intermediates: Iterable[Any], targets: Iterable[Any]) -> dict[Any, set[Any]]:
    """The nodes on parameter-only paths, each with the nodes that feed it: climbing from the
    ``targets`` (accumulators) through the nodes that feed on them, up to (not into) the
    ``intermediates``; the feeders counted in the graph below the intermediates."""
    stop = set(intermediates)
    parents: dict[Any, set[Any]] = {}
    seen = set(stop)
    todo = list(stop)
    while todo:  # the graph below the intermediates, edges reversed
        node = todo.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            parents.setdefault(child, set()).add(node)
            if child not in seen:
                seen.add(child)
                todo.append(child)
    side = {t: parents.get(t, set()) for t in targets}
    todo = list(side)
    while todo:
        node = todo.pop()
        for parent in parents.get(node, ()):
            if parent not in stop and parent not in side:
                side[parent] = parents.get(parent, set())
                todo.append(parent)
    return side


_Cut = list[tuple[Any, tuple[Any, ...], list[tuple[int, tuple[Any, int]]], bool]]


def _cut_plan(pinned: _Pinned, targets: list[Any]) -> _Cut | None:
    """Per intermediate in creation order: its recorded gradients, its parameter-side next
    edges with their indices, and whether it is called directly (a shared edge); None when
    one must be called directly but cannot be (module docstring)."""
    side = param_side([node for node, _ in pinned], targets)
    plan: _Cut = []
    for node, grads in sorted(pinned, key=lambda p: p[0]._sequence_nr(), reverse=True):
        edges = [(i, edge) for i, edge in enumerate(node.next_functions) if edge[0] in side]
        if not edges or all(g is None for g in grads):
            continue
        shared = any(side[child] != {node} for _, (child, _) in edges)
        if shared and (not callable(node) or any(g is None for g in grads)):
            return None
        plan.append((node, grads, edges, shared))
    return plan


def _cut_pass(plan: _Cut, targets: list[Any]) -> tuple[torch.Tensor | None, ...]:
    """Steps 1 and 2 of the module docstring: the weight gradient per target (None: none)."""
    summed: dict[tuple[Any, int], torch.Tensor] = {}
    for node, grads, edges, shared in plan:
        if shared:
            with torch.no_grad():
                out = node(*grads)
            got = [_as_input(out[i], edge) for i, edge in edges]
        else:
            roots = [(GradientEdge(node, i), g) for i, g in enumerate(grads) if g is not None]
            got = torch.autograd.grad(
                [edge for edge, _ in roots],
                [GradientEdge(*edge) for _, edge in edges],
                grad_outputs=[g for _, g in roots],
                allow_unused=True,
            )
        for (_, key), grad in zip(edges, got, strict=True):
            if grad is not None:
                summed[key] = grad if key not in summed else summed[key] + grad
    if not summed:
        return (None,) * len(targets)
    return torch.autograd.grad(
        [GradientEdge(child, nr) for child, nr in summed],
        [GradientEdge(node, 0) for node in targets],
        grad_outputs=list(summed.values()),
        allow_unused=True,
    )


def _as_input(grad: torch.Tensor | None, edge: tuple[Any, int]) -> torch.Tensor | None:
    """A gradient a node called directly returned, as the engine would pass it on along
    ``edge``: summed over broadcast dimensions and cast to the dtype the next node takes."""
    if grad is None:
        return None
    meta = edge[0]._input_metadata[edge[1]]
    if tuple(grad.shape) != tuple(meta.shape):
        grad = grad.sum_to_size(meta.shape)
    return grad if grad.dtype == meta.dtype else grad.to(meta.dtype)


def _replay_pass(pinned: _Pinned, targets: list[Any]) -> tuple[torch.Tensor | None, ...]:
    """One ``torch.autograd.grad`` over every intermediate with unused parameters allowed; each
    intermediate's incoming gradient pinned to the recorded one (gradients reaching it through
    another intermediate are not counted twice)."""
    roots: list[GradientEdge] = []
    root_grads: list[torch.Tensor] = []
    for node, grads in pinned:
        for i, grad in enumerate(grads):
            if grad is not None:
                roots.append(GradientEdge(node, i))
                root_grads.append(grad)
    if not roots:
        return (None,) * len(targets)
    handles = [node.register_prehook(lambda _, saved=grads: saved) for node, grads in pinned]
    try:
        return torch.autograd.grad(
            roots,
            [GradientEdge(node, 0) for node in targets],
            grad_outputs=root_grads,
            allow_unused=True,
        )
    finally:
        for handle in handles:
            handle.remove()
