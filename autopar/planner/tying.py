"""Shrinking the ILP before it is built: repeated-block detection (tying).

``repeated_blocks`` finds structurally identical layers and returns, for each position inside
a layer, the class of space nodes at that position in every tied layer; ``build_problem``
hands these classes to the solver (``solver.Problem.tied``), which solves one layer's
variables with costs and bytes multiplied (solver/tying.py) and expands the choice to every
layer.

Detection: a node belongs to layer ``i`` of a stack when its module path (a parameter's FQN)
contains ``<name>.<i>`` for a stack name such as ``layers``, ``blocks``, ``h`` or ``layer``.
Names only propose blocks; a layer is tied to the others only when its nodes, in graph order,
have the same signature: op, argument structure, shapes and dtypes, gradient flags (the space
signature, which fixes strategies and costs) and where each input comes from (a node of the
same layer by position, of the previous layer by position, or the same node outside the
stack). The first and the last layer of a stack are never tied: their neighbours differ
(embedding, final norm), so the optimum may lay them out differently; tying the layers in
between is then exact whenever the best plan repeats in the middle of the stack, which the
planner tests check against the untied optimum on small models.
"""

from __future__ import annotations

from collections import Counter

import torch.fx as fx

from autopar.capture.blocks import block_of_path, node_path
from autopar.planner.problem import StrategySpace
from autopar.strategies import input_nodes

MIN_TIED_LAYERS = 2
"""Fewer tied layers than this save nothing."""


def block_of(node: fx.Node) -> tuple[str, int] | None:
    """(stack module path, block index) of a node inside a stack of blocks, else None."""
    return block_of_path(node_path(node))


def stack_blocks(gm: fx.GraphModule) -> dict[str, set[int]]:
    """Block indices seen per stack module path (e.g. ``{"layers": {0, 1, 2}}``)."""
    found: dict[str, set[int]] = {}
    for node in gm.graph.nodes:
        key = block_of(node)
        if key is not None:
            found.setdefault(key[0], set()).add(key[1])
    return found


def repeated_blocks(
    space: StrategySpace, *, include_ends: bool = False
) -> tuple[tuple[int, ...], ...]:
    """Tie classes of space node indices (see the module docstring); () when none repeat.

    ``include_ends`` also ties the first and last layer when their own structure matches (their
    inputs from outside the layer then only count as coming from outside)."""
    gm = space.captured.gm
    blocks: dict[tuple[str, int], list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.name not in space.index:
            continue
        key = block_of(node)
        if key is not None:
            blocks.setdefault(key, []).append(node)
    stacks: dict[str, list[int]] = {}
    for prefix, i in blocks:
        stacks.setdefault(prefix, []).append(i)
    classes: list[tuple[int, ...]] = []
    for prefix, layer_ids in sorted(stacks.items()):
        layer_ids.sort()
        if layer_ids != list(range(layer_ids[0], layer_ids[0] + len(layer_ids))):
            continue  # gaps: not one stack
        middle = layer_ids if include_ends else layer_ids[1:-1]
        signatures = {
            i: _layer_signature(
                space, blocks[prefix, i], blocks.get((prefix, i - 1), []), include_ends
            )
            for i in middle
        }
        if not signatures:
            continue
        common, count = Counter(signatures.values()).most_common(1)[0]
        if count < MIN_TIED_LAYERS:
            continue
        tied = [i for i in middle if signatures[i] == common]
        for position in range(len(blocks[prefix, tied[0]])):
            classes.append(tuple(space.index[blocks[prefix, i][position].name] for i in tied))
    return tuple(classes)


def _layer_signature(
    space: StrategySpace, layer: list[fx.Node], previous: list[fx.Node], loose: bool
) -> tuple:
    here = {node.name: p for p, node in enumerate(layer)}
    before = {node.name: p for p, node in enumerate(previous)}
    entries = []
    for node in layer:
        sources = []
        for inp in input_nodes(node):
            if inp.name in here:
                sources.append(("here", here[inp.name]))
            elif loose:
                sources.append(("outside",))
            elif inp.name in before:
                sources.append(("previous", before[inp.name]))
            else:
                sources.append(("outside", inp.name))
        entries.append((space.signatures.get(node.name), tuple(sources)))
    return tuple(entries)
