"""Activation checkpointing in the lowered graph: chosen segments recompute in backward.

:func:`checkpoint_graph` outlines every :class:`~autopar.planner.checkpointing.CheckpointSegment` of a
lowered graph into a sub-``GraphModule`` and calls it through a :class:`CheckpointedSegment`,
which runs it under ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``:

* **Membership.** A segment holds the graph nodes the plan names (captured node names survive
  lowering) plus the nodes the lowering inserted for them: a conversion (collective) whose every
  user is in the segment joins it, so it is re-issued when the segment recomputes in backward;
  its autograd backward is the original one (recomputation only rebuilds saved values).
  Conversions of a segment's outputs for consumers outside stay outside. The segment becomes
  one node of the outer graph, placed in topological order (the node set must be convex: no
  path leaves the segment and comes back).
* **Inputs.** Checkpoint saves the segment's inputs through the saved-tensor hooks active
  around the call, so under ZeRO stage 3 a gathered parameter view entering a segment is packed
  by the engine's hooks as its chunk geometry (the chunk is still freed after its last use in
  forward) and gathered again when the segment recomputes.
* **Dropout.** Checkpoint restores the RNG state of the forward before recomputing, so
  ``autopar_dropout`` draws the same seed, hence the same mask, in both runs.
* **Selective policy.** Marker calls around each ``keep`` node switch a flag that the
  ``policy_fn`` of ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` reads: every
  non-view ATen op run inside a keep node is saved (``MUST_SAVE``; for ``linear`` the matmul),
  the others recompute (views of a kept output are rebuilt from it for free).
* **No grad / eval.** Without autograd (``torch.no_grad()``, eval graphs) a segment runs plainly.

:func:`count_saved_activation_bytes` measures what a forward keeps for backward (distinct
storages packed by autograd's saved-tensor hooks plus what selective checkpointing caches),
which tests compare with the plan's predicted activation memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import operator
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from autopar.planner.checkpointing import CheckpointSegment

__all__ = [
    "CheckpointedSegment",
    "SavedBytes",
    "checkpoint_graph",
    "checkpoint_lowered",
    "count_saved_activation_bytes",
]


# --------------------------------------------------------------------------------------------
# Runtime


@dataclass(slots=True)
class _KeepFlag:
    """Whether the ops now running belong to a ``keep`` node (mutable, one per segment)."""

    inside: bool = False


class _KeepMarker(nn.Module):
    """Graph handle that switches a segment's keep flag (a call_module node)."""

    def __init__(self, flag: _KeepFlag) -> None:
        super().__init__()
        self.flag = flag

    def forward(self, inside: bool) -> None:
        self.flag.inside = inside


class CheckpointedSegment(nn.Module):
    """One outlined segment; forward runs it under non-reentrant ``checkpoint`` (module docstring).

    Attributes: ``gm`` (the segment's graph; returns a tuple of its outputs), ``module_path``,
    ``policy`` ("full" or "selective"), ``keep`` (names of the kept nodes).
    """

    def __init__(
        self,
        gm: fx.GraphModule,
        *,
        module_path: str,
        policy: str,
        keep: tuple[str, ...],
        flag: _KeepFlag,
    ) -> None:
        super().__init__()
        self.gm = gm
        self.module_path = module_path
        self.policy = policy
        self.keep = keep
        self._flag = flag
        self.observer: SavedBytes | None = None
        """Set by :func:`count_saved_activation_bytes` while it measures."""

    def _policy(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        # Views recompute for free, and saving one inside a kept node (linear views its input)
        # would keep that node's input alive too.
        if self._flag.inside and not getattr(op, "is_view", False):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    def forward(self, *args: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.gm(*args)
        if self.policy != "selective":
            return checkpoint(self.gm, *args, use_reentrant=False, preserve_rng_state=True)
        contexts = create_selective_checkpoint_contexts(self._policy)
        self._flag.inside = False
        out = checkpoint(
            self.gm,
            *args,
            use_reentrant=False,
            preserve_rng_state=True,
            context_fn=lambda: contexts,
        )
        if self.observer is not None:
            # The outputs of MUST_SAVE ops live in the caching mode's storage, not in saved
            # tensors: count them as kept for backward.
            for per_op in contexts[0].storage.values():
                for value in per_op.values():
                    for leaf in torch.utils._pytree.tree_leaves(value):
                        # Saved entries are torch's version-checking wrappers of the outputs.
                        tensor = getattr(leaf, "val", None)
                        if isinstance(tensor, torch.Tensor):
                            self.observer.add(tensor)
        return out


# --------------------------------------------------------------------------------------------
# Graph pass


def checkpoint_graph(gm: fx.GraphModule, segments: Sequence[CheckpointSegment]) -> fx.GraphModule:
    """A copy of ``gm`` in which each segment runs as a :class:`CheckpointedSegment`.

    Args:
        gm: a lowered graph (node names as in the captured graph).
        segments: the segments to recompute; their node sets must be disjoint.

    Returns:
        The new GraphModule (``gm`` is not modified); ``gm`` itself when ``segments`` is empty.

    Raises:
        ValueError: a segment names a node the graph lacks, segments overlap, or a segment is
            not convex (a path leaves it and comes back).
    """
    if not segments:
        return gm
    nodes = list(gm.graph.nodes)
    by_name = {n.name: n for n in nodes}
    member: dict[fx.Node, int] = {}
    for k, segment in enumerate(segments):
        missing = [name for name in segment.nodes if name not in by_name]
        if missing:
            raise ValueError(
                f"checkpoint segment {segment.module_path!r} names nodes the graph lacks "
                f"({', '.join(missing[:5])}); the plan was made for another graph: re-plan"
            )
        for name in segment.nodes:
            node = by_name[name]
            if node.op != "call_function":
                continue
            if node in member:
                raise ValueError(
                    f"checkpoint segments {segments[member[node]].module_path!r} and "
                    f"{segment.module_path!r} share node {name}; segments must be disjoint"
                )
            member[node] = k
    # Inserted conversions (no captured metadata) whose users are all in one segment join it.
    for node in reversed(nodes):
        if node in member or node.op != "call_function" or "val" in node.meta or not node.users:
            continue
        owners = {member.get(user, -1) for user in node.users}
        if len(owners) == 1 and -1 not in owners:
            member[node] = owners.pop()
    _check_convex(nodes, member, segments)

    new_graph = fx.Graph()
    new_gm = fx.GraphModule(gm, new_graph)
    env: dict[fx.Node, fx.Node] = {}
    segment_nodes: list[list[fx.Node]] = [[] for _ in segments]
    for node in nodes:
        if node in member:
            segment_nodes[member[node]].append(node)
    for unit in _units_in_order(nodes, member, len(segments)):
        if isinstance(unit, fx.Node):
            env[unit] = new_graph.node_copy(unit, lambda n: env[n])
            continue
        seg_nodes = segment_nodes[unit]
        if not seg_nodes:
            continue
        inside = set(seg_nodes)
        inputs = list(
            dict.fromkeys(i for n in seg_nodes for i in n.all_input_nodes if i not in inside)
        )
        outputs = [n for n in seg_nodes if any(u not in inside for u in n.users)]
        segment = segments[unit]
        if segment.policy not in ("full", "selective"):
            raise ValueError(
                f"checkpoint segment {segment.module_path!r} has policy {segment.policy!r}; "
                f"use 'full' or 'selective'"
            )
        flag = _KeepFlag()
        keep = tuple(segment.keep) if segment.policy == "selective" else ()
        target = f"autopar_checkpoint_{unit}"
        new_gm.add_submodule(
            target,
            CheckpointedSegment(
                _outline(seg_nodes, inputs, outputs, keep, flag),
                module_path=segment.module_path,
                policy=segment.policy,
                keep=keep,
                flag=flag,
            ),
        )
        call = new_graph.call_module(target, tuple(env[i] for i in inputs))
        call.meta["autopar_checkpoint"] = segment.module_path
        for j, out in enumerate(outputs):
            value = new_graph.call_function(operator.getitem, (call, j))
            value.meta.update(out.meta)
            env[out] = value
    new_graph.lint()
    new_gm.recompile()
    return new_gm


def _check_convex(
    nodes: Sequence[fx.Node], member: Mapping[fx.Node, int], segments: Sequence[CheckpointSegment]
) -> None:
    """Raise if some outside node depends on segment ``k`` and feeds segment ``k``."""
    depends: dict[fx.Node, set[int]] = {}
    for node in nodes:
        reach: set[int] = set()
        for inp in node.all_input_nodes:
            reach |= depends.get(inp, set())
            if inp in member:
                reach.add(member[inp])
        k = member.get(node)
        if k is not None:
            for inp in node.all_input_nodes:
                if inp not in member and k in depends.get(inp, set()):
                    raise ValueError(
                        f"checkpoint segment {segments[k].module_path!r} is not convex: {inp.name} "
                        f"depends on the segment and feeds it; add {inp.name} to the segment"
                    )
        depends[node] = reach


def _units_in_order(
    nodes: Sequence[fx.Node], member: Mapping[fx.Node, int], num_segments: int
) -> Iterator[fx.Node | int]:
    """Nodes outside segments and segment indices, topologically ordered (each segment one unit,
    placed as early as its inputs allow; ties keep the original order)."""
    position = {n: i for i, n in enumerate(nodes)}

    def unit_of(node: fx.Node) -> fx.Node | int:
        return member.get(node, node)

    first: dict[int, int] = {}
    for node in nodes:
        if node in member:
            first.setdefault(member[node], position[node])
    units: list[fx.Node | int] = [n for n in nodes if n not in member] + sorted(first)
    pending: dict[Any, int] = {}
    users: dict[Any, set[Any]] = {u: set() for u in units}
    for node in nodes:
        mine = unit_of(node)
        for inp in node.all_input_nodes:
            theirs = unit_of(inp)
            if theirs != mine and mine not in users[theirs]:
                users[theirs].add(mine)
                pending[mine] = pending.get(mine, 0) + 1

    def key(unit: fx.Node | int) -> tuple[int, int]:
        return (first[unit], 1) if isinstance(unit, int) else (position[unit], 0)

    ready = [(key(u), i, u) for i, u in enumerate(units) if not pending.get(u)]
    heapq.heapify(ready)
    emitted = 0
    while ready:
        _, i, unit = heapq.heappop(ready)
        emitted += 1
        yield unit
        for user in users[unit]:
            pending[user] -= 1
            if not pending[user]:
                heapq.heappush(ready, (key(user), units.index(user), user))
    assert emitted == len(units), "checkpoint segments form a cycle"


def _outline(
    seg_nodes: Sequence[fx.Node],
    inputs: Sequence[fx.Node],
    outputs: Sequence[fx.Node],
    keep: Iterable[str],
    flag: _KeepFlag,
) -> fx.GraphModule:
    """The segment as a GraphModule: one placeholder per input, a tuple of outputs; calls that
    set ``flag`` around each kept node."""
    graph = fx.Graph()
    root = nn.Module()
    keep_names = set(keep)
    if keep_names:
        root.add_module("autopar_keep", _KeepMarker(flag))
    env: dict[fx.Node, fx.Node] = {}
    for inp in inputs:
        holder = graph.placeholder(inp.name)
        holder.meta.update(inp.meta)
        env[inp] = holder
    for node in seg_nodes:
        if node.name in keep_names:
            graph.call_module("autopar_keep", (True,))
        env[node] = graph.node_copy(node, lambda n: env[n])
        if node.name in keep_names:
            graph.call_module("autopar_keep", (False,))
    graph.output(tuple(env[o] for o in outputs))
    graph.lint()
    return fx.GraphModule(root, graph)


def checkpoint_lowered(lowered: Any, segments: Sequence[CheckpointSegment]) -> Any:
    """``lowered`` (a LoweredGraph) with its graph passed through :func:`checkpoint_graph`."""
    if not segments:
        return lowered
    return dataclasses.replace(lowered, gm=checkpoint_graph(lowered.gm, segments))


# --------------------------------------------------------------------------------------------
# Measurement


class SavedBytes:
    """Distinct storages a forward keeps for backward (filled by
    :func:`count_saved_activation_bytes`)."""

    def __init__(self, exclude: Iterable[torch.Tensor]) -> None:
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self.storages: dict[int, int] = {}
        """Storage address -> bytes, for every counted storage."""

    def add(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        address = storage.data_ptr()
        if address and address not in self._excluded:
            self.storages[address] = storage.nbytes()

    @property
    def total_bytes(self) -> int:
        return sum(self.storages.values())


@contextlib.contextmanager
def count_saved_activation_bytes(
    graph_module: nn.Module, exclude: Iterable[torch.Tensor] = ()
) -> Iterator[SavedBytes]:
    """Count what the forwards run inside keep for backward, per distinct storage.

    Counted: every tensor autograd's saved-tensor hooks see (checkpoint saves its segments'
    inputs through them; what a segment saves inside is replaced by checkpoint's own hooks and
    not counted) plus the outputs selective checkpointing caches. Not counted: storages of
    ``exclude`` (pass the parameters, buffers and inputs: views share their storage). Hooks
    installed inside the graph (ZeRO stage 3's) take precedence over these: measure without.

    Args:
        graph_module: the module that runs the graph (e.g. ``pmodel.lowered.gm``), searched for
            :class:`CheckpointedSegment` submodules.
    """
    counter = SavedBytes(exclude)
    segments = [m for m in graph_module.modules() if isinstance(m, CheckpointedSegment)]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        counter.add(tensor)
        return tensor

    for segment in segments:
        segment.observer = counter
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield counter
    finally:
        for segment in segments:
            segment.observer = None
