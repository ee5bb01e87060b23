"""Fused reductions: back-to-back all-reduces on one axis become one all-reduce of a flat buffer.

A data-parallel mean loss with ``ignore_index`` is lowered (``autopar.capture.exact_means``) as
``sum of losses / count of kept tokens``, both Partial over the batch axes, so the graph issues
two scalar all-reduces on each such axis, one latency each, where one carries both. More
generally, ``fuse_all_reduces(graph)`` groups ``autopar_all_reduce`` calls that

* run on the same mesh (group key) and axis,
* follow each other in graph order with no node between them that uses one of their results
  (so none of them depends on another, and one call issued where the last one was issued sees
  every input already computed),
* carry floating-point tensors of one dtype, small enough (``MAX_FUSED_NUMEL`` elements in
  all) that the buffer's copy costs less than the latency saved,

and replaces each group of two or more by one ``autopar_all_reduce_many`` call (one all-reduce
of the concatenated buffer, identity backward per member) whose results are taken apart by
``getitem``.

A value Partial on two axes (the loss's sum and count on a 2x2 data-parallel mesh) is converted
by a chain, an all-reduce on the first axis whose result is all-reduced on the second; two such
chains are issued one after the other (``a0(sum), a1(.), a0(count), a1(.)``), where no two
neighbours may share a buffer. So first, within each contiguous block of all-reduces on one
mesh, the calls are reordered by chain step, then axis (``a0(sum), a0(count), a1(.), a1(.)``):
every call still follows the one whose result it takes, nothing outside the block moves, and
the order is a function of the graph, the same on every rank. Each step then fuses as above:
two calls instead of four. A member's dtype and count bound are those of its chain's origin
(the value before the first all-reduce; all-reduces keep dtype and shape, and a count's sum
over more ranks is still bounded by the global element count). An integer member joins a float group only when it is a count -- ``sum`` of a bool
tensor -- whose global bound (the bool tensor's element count) the buffer's dtype represents
exactly (2**24 for float32), so its sum and the conversion back are exact.

Numerics: every member's sum is over the same ranks' values. Integer counts are exact. On
gloo, floats are bit-identical to separate all-reduces with 2 ranks (one addition, commutative)
and, measured, for the 2-element loss-and-count buffer with 4 ranks; a longer buffer on 4 ranks
may have its elements added in another rank order (the ring's chunks move with the length), so
those sums agree to rounding only (``tests/distributed/test_lowering_reductions.py``), within
the distributed numerics tests' rtol 1e-5 / atol 1e-6.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autopar.comm import collectives
from autopar.comm.fusion import MAX_FUSED_NUMEL, buffer_members

__all__ = ["MAX_FUSED_NUMEL", "fuse_all_reduces"]


def _member(node: fx.Node, group_key: str, axis: int) -> bool:
    return (
        node.op == "call_function"
        and node.target is collectives.autopar_all_reduce
        and tuple(node.args[1:]) == (group_key, axis)
    )


def _is_all_reduce(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is collectives.autopar_all_reduce


def _origin(node: object) -> object:
    """The value a chain of all-reduces (fused or not) started from: ``node`` itself when it is
    no all-reduce's result."""
    while isinstance(node, fx.Node) and node.op == "call_function":
        if node.target is collectives.autopar_all_reduce:
            node = node.args[0]
        elif (
            node.target is operator.getitem
            and isinstance(node.args[0], fx.Node)
            and node.args[0].target is collectives.autopar_all_reduce_many
        ):
            node = node.args[0].args[0][node.args[1]]
        else:
            break
    return node


def _order_block(block: list[fx.Node]) -> None:
    """Reorder a contiguous block of all-reduces on one mesh by (chain step, axis, position)."""
    step: dict[fx.Node, int] = {}
    for node in block:
        source = node.args[0]
        step[node] = step[source] + 1 if source in step else 0
    position = {node: k for k, node in enumerate(block)}
    order = sorted(block, key=lambda n: (step[n], n.args[2], position[n]))
    if order == block:
        return
    anchor = block[0].prev
    for node in order:
        anchor.append(node)
        anchor = node


def order_chains(graph: fx.Graph) -> None:
    """Reorder chained all-reduces by chain step (module docstring), in place."""
    block: list[fx.Node] = []
    for node in list(graph.nodes):
        if _is_all_reduce(node) and (not block or node.args[1] == block[0].args[1]):
            block.append(node)
            continue
        if len(block) > 1:
            _order_block(block)
        block = [node] if _is_all_reduce(node) else []
    if len(block) > 1:
        _order_block(block)


def _runs(graph: fx.Graph) -> list[list[fx.Node]]:
    """Maximal runs of all-reduces on one (group key, axis) with nothing between them that uses
    a result of the run (other nodes between them stay where they are)."""
    runs: list[list[fx.Node]] = []
    current: list[fx.Node] = []
    for node in graph.nodes:
        if current and _member(node, *current[0].args[1:]):
            if node.args[0] in current:
                runs.append(current)
                current = [node]
            else:
                current.append(node)
            continue
        if current and any(arg in current for arg in node.all_input_nodes):
            runs.append(current)
            current = []
        if _is_all_reduce(node):
            if current:
                runs.append(current)
            current = [node]
    if current:
        runs.append(current)
    return [run for run in runs if len(run) > 1]


def _fusable(run: list[fx.Node]) -> tuple[torch.dtype, list[fx.Node]] | None:
    """The buffer's dtype and the members of ``run`` that may share it
    (:func:`autopar.comm.fusion.buffer_members`)."""
    found = buffer_members([_origin(node.args[0]) for node in run])
    if found is None:
        return None
    dtype, positions = found
    return dtype, [run[k] for k in positions]


def fuse_all_reduces(graph: fx.Graph) -> int:
    """Fuse back-to-back all-reduces of ``graph`` in place (module docstring); returns the number
    of all-reduces removed. The caller lints and recompiles."""
    order_chains(graph)
    removed = 0
    for run in _runs(graph):
        fusable = _fusable(run)
        if fusable is None:
            continue
        dtype, members = fusable
        _, group_key, axis = members[0].args
        with graph.inserting_after(members[-1]):
            fused = graph.call_function(
                collectives.autopar_all_reduce_many,
                ([m.args[0] for m in members], group_key, axis, dtype),
            )
        previous = fused
        for index, member in enumerate(members):
            with graph.inserting_after(previous):
                part = graph.call_function(operator.getitem, (fused, index))
            part.meta.update(member.meta)
            member.replace_all_uses_with(part)
            graph.erase_node(member)
            previous = part
        removed += len(members) - 1
    return removed
