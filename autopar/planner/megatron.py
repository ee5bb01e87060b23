"""The ``megatron`` recipe's parameter layouts (:mod:`autopar.planner.recipes`): on the
tensor-parallel axis matmul weights alternate column- and row-parallel along the data flow,
token embeddings and tied LM heads are vocab-parallel, and a fused projection that a split
cuts into sections (qkv) is column-parallel in Megatron's per-rank order."""

from __future__ import annotations

from collections import deque

import torch
import torch.fx as fx

from autopar.placement import REPLICATE, Placements, SectionShard, Shard, divides
from autopar.planner.problem import StrategySpace
from autopar.strategies import input_nodes
from autopar.strategies.sections import section_hints

__all__ = ["MATMUL_WEIGHTS", "megatron_layout"]

aten = torch.ops.aten

# op -> (index of the weight among the op's input nodes, weight dim holding output features,
#        index of the bias input or None)
MATMUL_WEIGHTS = {
    aten.linear.default: (1, 0, 2),
    aten.addmm.default: (2, 1, 0),
    aten.mm.default: (1, 1, None),
    aten.matmul.default: (1, 1, None),
}


def _fused_sections(node: fx.Node) -> SectionShard | None:
    """The weight layout of a ``linear`` whose output a split cuts into sections, or None."""
    if node.target is not aten.linear.default:
        return None
    ndim = node.meta["val"].dim()
    hints = [s for dim, s in section_hints(node) if dim == ndim - 1]
    return SectionShard(0, hints[0]) if hints else None


def megatron_layout(space: StrategySpace, tp: int, notes: list[str]) -> dict[str, Placements]:
    """Parameter placeholder name -> placements for Megatron tensor parallelism on axis ``tp``."""
    gm = space.captured.gm
    mesh = space.mesh
    params = space.captured.param_nodes
    ndim = mesh.ndim
    roles: dict[str, str] = {}  # matmul node name -> "col" | "row"
    layout: dict[str, Placements] = {}

    def on_tp(p) -> Placements:
        return tuple(p if axis == tp else REPLICATE for axis in range(ndim))

    def fits(node: fx.Node, placements: Placements) -> bool:
        return divides(tuple(node.meta["val"].shape), placements, mesh.shape)

    def weight_of(node: fx.Node) -> fx.Node | None:
        spec = MATMUL_WEIGHTS.get(node.target)
        if spec is None:
            return None
        ins = input_nodes(node)
        if spec[0] >= len(ins) or ins[spec[0]].name not in params:
            return None
        return ins[spec[0]]

    def upstream_role(node: fx.Node) -> str:
        # Nearest matmuls with parameter weights upstream along activations.
        seen: set[str] = set()
        queue = deque(inp for inp in input_nodes(node) if inp.name not in params)
        while queue:
            cur = queue.popleft()
            if cur.name in seen:
                continue
            seen.add(cur.name)
            if cur.name in roles:
                if roles[cur.name] == "col":
                    return "row"
                continue
            queue.extend(inp for inp in input_nodes(cur) if inp.name not in params)
        return "col"

    # Token embeddings (looked up by the user's inputs) are vocab-parallel; position embeddings
    # (looked up by arange) stay replicated, as in Megatron-LM.
    from_inputs = set(space.captured.input_nodes)
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if any(inp.name in from_inputs for inp in input_nodes(node)):
            from_inputs.add(node.name)
        if node.target is aten.embedding.default:
            weight, indices = input_nodes(node)[:2]
            if weight.name in params and weight.name not in layout and indices.name in from_inputs:
                wanted = on_tp(Shard(0))
                if fits(weight, wanted):
                    layout[weight.name] = wanted
            continue
        weight = weight_of(node)
        if weight is None:
            continue
        _, out_dim, bias_index = MATMUL_WEIGHTS[node.target]
        in_dim = 1 - out_dim
        role = upstream_role(node)
        if weight.name in layout:
            # A tied weight (e.g. the LM head sharing the vocab-parallel embedding) keeps the
            # layout of its first use; its role follows from that layout.
            first = layout[weight.name][tp]
            role = "col" if first == Shard(out_dim) else "row" if first == Shard(in_dim) else role
        else:
            wanted = on_tp(Shard(out_dim if role == "col" else in_dim))
            sections = _fused_sections(node) if role == "col" else None
            if sections is not None and fits(weight, on_tp(sections)):
                # A fused projection (qkv) split into sections: Megatron's per-rank order.
                wanted = on_tp(sections)
            if not fits(weight, wanted):
                notes.append(
                    f"megatron: {params[weight.name]} not divisible on the tp axis, kept replicated"
                )
                roles[node.name] = "none"
                continue
            layout[weight.name] = wanted
        roles[node.name] = role
        ins = input_nodes(node)
        # A column-parallel layer's bias is split with its output features, also when the
        # weight is tied (BERT's LM head: vocab-parallel weight plus a vocab-sized bias).
        if bias_index is not None and bias_index < len(ins) and ins[bias_index].name in params:
            bias = ins[bias_index]
            if role == "col" and bias.name not in layout and fits(bias, on_tp(Shard(0))):
                # Sectioned with its fused weight (qkv), else split with the output features
                # (a Conv1D weight is Shard(1): its bias still splits along its only dim).
                first = layout[weight.name][tp]
                bias_layout = on_tp(first if isinstance(first, SectionShard) else Shard(0))
                layout[bias.name] = bias_layout if fits(bias, bias_layout) else on_tp(Shard(0))
    # A tied parameter lifted as several placeholders is one parameter: one layout for all.
    by_fqn = {fqn: name for name, fqn in params.items()}
    for name, fqn in params.items():
        aliases = [by_fqn[o] for o in space.captured.tied_params.get(fqn, []) if o in by_fqn]
        owner = next((a for a in (name, *aliases) if a in layout), None)
        if owner is not None:
            layout[name] = layout[owner]
    return layout
