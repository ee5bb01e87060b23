"""The weight half of a split backward (zero-bubble schedules), in one autograd call per stage.

torch's zero-bubble schedules split a stage's microbatch backward in two. The input pass
(torch's ``stage_backward_input``) differentiates the stage's outputs with respect to its
inputs only, and records, at each *intermediate* (an autograd node on the input path into which
a parameter-only path feeds: a matmul of an activation and a weight, say), the gradient flowing
into it. The weight pass starts from those intermediates with the recorded gradients and
differentiates with respect to the parameters.

torch's own weight pass runs one ``torch.autograd.grad`` per parameter group. Under ZeRO that
breaks: the parameters of one chunk reach the graph through ONE autograd function (the chunk's
gather, :mod:`autopar.runtime.zero_graph`) whose backward needs every gradient of the chunk at
once and returns no gradient to its shard parameters (it reduces the chunk itself). Here the
weight pass is a single ``torch.autograd.grad`` over every group's intermediates, with unused
parameters allowed; a chunk's backward then runs once with all its gradients, as in a plain
backward. Every intermediate's incoming gradient is pinned to the one recorded in the input
pass (that is already the whole gradient: every path from the outputs to an intermediate runs
through the input path), so gradients that reach one intermediate through another are not
counted twice.

Gradient reduction: neither pass runs the parameters' gradient-accumulation hooks (autograd.grad
returns the gradients instead), so :class:`autopar.runtime.pipeline.PipelineModule` runs every
pass under ``no_sync`` and reduces the accumulated gradients after the schedule.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.autograd.graph import GradientEdge

__all__ = ["weight_pass"]


def _accumulator(param: torch.Tensor) -> Any:
    """The autograd node that accumulates ``param``'s gradient (made on first request)."""
    return param.view_as(param).grad_fn.next_functions[0][0]


def weight_pass(params: Iterable[torch.Tensor], groups: list[dict[str, Any]]) -> None:
    """Accumulate into ``param.grad`` the weight gradients of one microbatch, from the
    ``groups`` torch's input pass recorded (``params``: accumulator nodes; ``intermediates``;
    ``grads``: what flowed into each intermediate)."""
    by_node = {_accumulator(p): p for p in params if p.requires_grad}
    roots: list[GradientEdge] = []
    root_grads: list[torch.Tensor] = []
    targets: list[Any] = []
    pinned: list[tuple[Any, tuple[Any, ...]]] = []
    for group in groups:
        recorded = group.pop("grads", None)
        nodes = list(group.pop("intermediates", ()))
        if recorded is None:
            continue  # the input pass never reached these intermediates: no gradient
        for node, grads in zip(nodes, recorded, strict=True):
            pinned.append((node, tuple(grads)))
            for i, grad in enumerate(grads):
                if grad is not None:
                    roots.append(GradientEdge(node, i))
                    root_grads.append(grad)
        targets.extend(n for n in group["params"] if n in by_node and n not in targets)
    if not roots or not targets:
        return
    handles = [node.register_prehook(lambda _, saved=grads: saved) for node, grads in pinned]
    try:
        weight_grads = torch.autograd.grad(
            roots,
            [GradientEdge(node, 0) for node in targets],
            grad_outputs=root_grads,
            allow_unused=True,
        )
    finally:
        for handle in handles:
            handle.remove()
    for node, grad in zip(targets, weight_grads, strict=True):
        if grad is None:
            continue  # e.g. a ZeRO shard: its chunk's backward accumulated it
        param = by_node[node]
        if param.grad is None:
            param.grad = grad
        else:
            param.grad += grad
