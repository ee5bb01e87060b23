"""A hand-built graph of a mean loss's two reductions, for the fused-reduction tests."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.fx as fx

from autopar.comm import collectives


def loss_and_count_chains(
    steps_sum: Sequence[int], steps_count: Sequence[int], key: str
) -> tuple[fx.Graph, list[fx.Node]]:
    """A graph (no output yet) where a float loss sum is all-reduced on ``steps_sum`` axes in
    order, then a token count (``sum`` of 64 bools) on ``steps_count``; and the two results."""
    graph = fx.Graph()
    loss = graph.placeholder("loss")
    loss.meta["val"] = torch.zeros(())
    flags = graph.placeholder("flags")
    flags.meta["val"] = torch.zeros((64,), dtype=torch.bool)
    count = graph.call_function(torch.ops.aten.sum.default, (flags,))
    count.meta["val"] = torch.zeros((), dtype=torch.int64)
    ends = []
    for value, steps in ((loss, steps_sum), (count, steps_count)):
        for axis in steps:
            value = graph.call_function(collectives.autopar_all_reduce, (value, key, axis))
            value.meta["val"] = torch.zeros((), dtype=value.args[0].meta["val"].dtype)
        ends.append(value)
    return graph, ends
