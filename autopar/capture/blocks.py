"""Stacks of repeated blocks, found by module path: one pattern for every layer that needs it.

A block is a module at ``STACK.INDEX`` where ``STACK`` ends in one of :data:`STACK_NAMES`
(``layers.3``, ``transformer.h.11``, ``encoder.layer.0``). Layer tying (planner), checkpoint
segments (planner), pipeline stage cuts (capture, plan, runtime) all read blocks through here.
"""

from __future__ import annotations

import re

import torch.fx as fx

STACK_NAMES = ("layers", "blocks", "h", "layer", "block")
"""Last name of a module that holds the repeated blocks (``nn.ModuleList`` or ``Sequential``)."""

STACK_PATTERN = re.compile(r"(?:^|\.)(" + "|".join(STACK_NAMES) + r")\.(\d+)(?=\.|$)")
"""Matches ``... STACK.INDEX`` inside a module path or FQN; group 1 ends the stack's path."""


def node_path(node: fx.Node) -> str:
    """The module path (or parameter FQN) capture recorded for a node; '' when none."""
    return node.meta.get("autopar_fqn") or node.meta.get("autopar_module_path") or ""


def block_of_path(path: str) -> tuple[str, int] | None:
    """(stack module path, block index) of a module path or FQN inside a stack, else None."""
    match = STACK_PATTERN.search(path)
    if match is None:
        return None
    return path[: match.end(1)], int(match.group(2))


def index_in_stack(path: str, stack: str) -> int | None:
    """Block index of ``path`` inside the stack at module path ``stack``, else None."""
    if not path.startswith(stack + "."):
        return None
    head = path[len(stack) + 1 :].split(".", 1)[0]
    return int(head) if head.isdigit() else None
