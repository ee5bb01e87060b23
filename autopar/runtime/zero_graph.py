"""The graph side of the ZeRO runtime: where a lowered graph takes its chunk parameters.

:func:`rewrite_graph` copies a lowered graph and inserts, before the first use of each chunk, one
call of :class:`_UseChunk` (an autograd function: forward returns the chunk's full local
parameters as views of its compute buffer, backward hands the chunk's gradients to the engine).
:class:`ZeroGraph` runs it under autocast (mixed precision) and, when some chunk is gathered
(stage 3 on one of its axes), under the engine's ``saved_tensors_hooks``. See
:mod:`autopar.runtime.zero` for the engine.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
import torch.nn as nn

if TYPE_CHECKING:
    from autopar.runtime.zero import ZeroEngine

__all__ = ["Packed", "ZeroGraph", "rewrite_graph"]


@dataclass(frozen=True, slots=True)
class Packed:
    """A saved tensor that is a view of a gathered chunk, kept as its geometry."""

    chunk: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


class _UseChunk(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        engine: ZeroEngine,
        index: int,
        persistent: bool,
        last: bool,
        *shards: torch.Tensor,
    ) -> Any:
        ctx.engine = engine
        ctx.index = index
        ctx.num_shards = len(shards)
        ctx.set_materialize_grads(False)
        views = engine.gatherer.forward_views(index, persistent)
        if last and persistent:
            # This node owns the kept buffer: it lives while the graph may still backward.
            ctx.kept = engine.gatherer.keep_for_backward(index)
        return views

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        ctx.engine.chunk_backward(ctx.index, grads)
        return (None, None, None, None) + (None,) * ctx.num_shards


class _UseChunkModule(nn.Module):
    """The graph's handle on the engine (a call_module node: fx cannot print the engine)."""

    def __init__(self, engine: ZeroEngine) -> None:
        super().__init__()
        self.engine = engine

    def forward(self, index: int, last: bool, *shards: torch.Tensor) -> Any:
        # Persistent views only where autograd records this call (it then gives them this
        # step's history; see ChunkGatherer.forward_views); likewise a gathered chunk is kept
        # for backward only where a backward will come.
        persistent = torch.is_grad_enabled() and any(s.requires_grad for s in shards)
        return _UseChunk.apply(self.engine, index, persistent, last, *shards)


class ZeroGraph(nn.Module):
    """A rewritten graph bound to its engine."""

    def __init__(self, gm: fx.GraphModule, engine: ZeroEngine) -> None:
        super().__init__()
        self.gm = gm
        self.engine = engine

    def forward(self, *args: Any) -> Any:
        engine = self.engine
        with contextlib.ExitStack() as stack:
            if engine.compute_dtype is not None:
                device_type = engine.chunks[0].shard.device.type if engine.chunks else "cpu"  # type: ignore[union-attr]
                stack.enter_context(torch.autocast(device_type, dtype=engine.compute_dtype))
            if not engine.gathers:
                return self.gm(*args)
            gatherer = engine.gatherer
            stack.enter_context(
                torch.autograd.graph.saved_tensors_hooks(gatherer.pack, gatherer.unpack)
            )
            try:
                return self.gm(*args)
            finally:
                gatherer.end_forward()


def _getitem(values: Any, index: int) -> Any:
    return values[index]


def rewrite_graph(
    engine: ZeroEngine, gm: fx.GraphModule, param_placeholders: dict[str, str]
) -> ZeroGraph:
    """A copy of ``gm`` whose chunk parameters come from ``engine`` (module docstring).

    Args:
        gm: the lowered graph; its parameter placeholders will receive the shard parameters.
        param_placeholders: placeholder node name -> canonical parameter FQN.
    """
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])
    new_gm = fx.GraphModule(gm, graph)
    new_gm.add_submodule("autopar_zero_use_chunk", _UseChunkModule(engine))
    holders_of: dict[str, list[fx.Node]] = {}
    for node in graph.nodes:
        fqn = param_placeholders.get(node.name) if node.op == "placeholder" else None
        if fqn is not None:
            holders_of.setdefault(fqn, []).append(node)
    order = {n: i for i, n in enumerate(graph.nodes)}
    calls: list[tuple[fx.Node, int]] = []
    for chunk in engine.chunks:
        # Tied parameters have one placeholder per name; the first stands for the chunk input.
        holders = [holders_of.get(slot.fqn, []) for slot in chunk.slots]
        if any(not h for h in holders):
            raise AssertionError(f"chunk {chunk.index}: a parameter has no placeholder")
        users = [u for hs in holders for h in hs for u in h.users]
        if not users:
            continue
        first = min(users, key=order.__getitem__)
        with graph.inserting_before(first):
            call = graph.call_module(
                "autopar_zero_use_chunk", (chunk.index, False, *(hs[0] for hs in holders))
            )
            views = [graph.call_function(_getitem, (call, k)) for k in range(len(holders))]
        calls.append((call, max(order[u] for u in users)))
        for hs, view in zip(holders, views):
            for holder in hs:
                for user in list(holder.users):
                    if user is not call:
                        user.replace_input_with(holder, view)
    if calls:
        # The chunk used last in forward has its backward first: it stays gathered from
        # forward into backward instead of being freed and gathered again at once (FSDP2
        # keeps its root's parameters so). A static choice, the same on every rank.
        call = max(calls, key=lambda item: item[1])[0]
        call.args = (call.args[0], True, *call.args[2:])
    graph.lint()
    new_gm.recompile()
    return ZeroGraph(new_gm, engine)
