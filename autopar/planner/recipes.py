"""Standard recipes as restrictions of the same ILP, priced by the same cost model.

A recipe fixes the layout of parameters, buffers and user inputs and forbids resharding
parameters on their way to an op (they are used where they live); the ILP then chooses the
cheapest layout of everything else, which for these recipes is the layout the recipe implies
(batch-parallel activations for ``ddp``; column- then row-parallel matmuls for ``megatron``).

- ``ddp``: inputs Shard(0) (the batch) on every axis, parameters and buffers Replicate, and
  every activation computed from the inputs stays split on the data-parallel axes (no rank
  recomputes another rank's samples: a tiny model would otherwise be cheaper with every rank
  running the whole batch, which is not DDP).
- ``fsdp``: ``ddp`` plus ZeRO-3 on every axis.
- ``megatron``: on the tensor-parallel axis (named ``tp``, else the innermost), matmul weights
  are column-parallel (output features sharded) or row-parallel (input features sharded),
  alternating along the data flow (a matmul fed by a column-parallel one is row-parallel), and
  the token embedding is vocab-parallel; other parameters Replicate; inputs Shard(0) on the other
  axes and Replicate on ``tp``.
- ``fsdp+tp``: ``megatron`` plus ZeRO-3 on the other axes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autopar.placement import REPLICATE, Placements, Shard, divides
from autopar.planner.problem import StrategySpace, ZeroConfig
from autopar.strategies import input_nodes

aten = torch.ops.aten

BASELINE_RECIPES = ("ddp", "fsdp", "megatron", "fsdp+tp")

# op -> (index of the weight among the op's input nodes, weight dim holding output features,
#        index of the bias input or None)
_MATMUL_WEIGHTS = {
    aten.linear.default: (1, 0, 2),
    aten.addmm.default: (2, 1, 0),
    aten.mm.default: (1, 1, None),
    aten.matmul.default: (1, 1, None),
}


@dataclass(frozen=True, kw_only=True, slots=True)
class RecipeSpec:
    name: str
    allowed: dict[str, list[int]]
    forbid: dict[int, set[tuple[int, int]]]
    zero: ZeroConfig
    notes: list[str] = field(default_factory=list)


def tp_axis(axis_names: tuple[str, ...]) -> int:
    return axis_names.index("tp") if "tp" in axis_names else len(axis_names) - 1


def recipe_spec(space: StrategySpace, recipe: str) -> RecipeSpec:
    if recipe not in BASELINE_RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; choose one of {', '.join(BASELINE_RECIPES)}")
    mesh = space.mesh
    ndim = mesh.ndim
    tensor_parallel = recipe in ("megatron", "fsdp+tp")
    tp = tp_axis(mesh.axis_names) if tensor_parallel else None
    notes: list[str] = []
    data_axes = tuple(a for a in range(ndim) if a != tp and mesh.shape[a] > 1)
    param_layout = megatron_layout(space, tp, notes) if tp is not None else {}
    allowed: dict[str, list[int]] = {}
    batch_split = _batch_parallel_ops(space, data_axes)
    for node in space.nodes:
        if node.kind == "op":
            if node.name in batch_split:
                allowed[node.name] = batch_split[node.name]
            continue
        wanted = _wanted_layout(node, ndim, tp, param_layout)
        match = [i for i, s in enumerate(node.strategies) if s.outputs[0] == wanted]
        if not match:
            # Not divisible on some axis: fall back to Replicate there, and say so.
            wanted = tuple(REPLICATE for _ in range(ndim))
            match = [i for i, s in enumerate(node.strategies) if s.outputs[0] == wanted]
            notes.append(f"{recipe}: {node.fqn or node.name} kept replicated (shape not divisible)")
        allowed[node.name] = match
    forbid: dict[int, set[tuple[int, int]]] = {}
    # Repeated layers share strategy lists (autopar.planner.problem): ban pairs once per layer position.
    banned_by: dict[tuple, set[tuple[int, int]]] = {}
    for e, edge in enumerate(space.edges):
        src = space.nodes[edge.src]
        if src.kind != "param" or edge.input_index < 0:
            continue
        dst = space.nodes[edge.dst]
        key = (id(src.strategies), id(dst.strategies), edge.input_index, tuple(allowed[src.name]))
        banned = banned_by.get(key)
        if banned is None:
            banned = banned_by[key] = {
                (a, b)
                for a in allowed[src.name]
                for b in range(len(dst.strategies))
                if not _used_in_place(
                    src.strategies[a].outputs[0], dst.strategies[b].inputs[edge.input_index]
                )
            }
        forbid[e] = banned
    if recipe == "fsdp":
        zero = ZeroConfig(stage=3, axes=tuple(range(ndim)))
    elif recipe == "fsdp+tp":
        zero = ZeroConfig(stage=3, axes=tuple(a for a in range(ndim) if a != tp))
    else:
        zero = ZeroConfig()
    return RecipeSpec(name=recipe, allowed=allowed, forbid=forbid, zero=zero, notes=notes)


def _batch_parallel_ops(space: StrategySpace, data_axes: tuple[int, ...]) -> dict[str, list[int]]:
    """Op node -> strategies that keep it split on every data-parallel axis, for the non-scalar
    ops computed from the user inputs (Shard or Partial there, never Replicate). A node without
    such a strategy (e.g. a dimension too small to split) keeps all of its strategies."""
    if not data_axes:
        return {}
    gm = space.captured.gm
    from_inputs = {
        n.name
        for n in gm.graph.nodes
        if n.op == "placeholder" and n.name in space.index and space.node(n.name).kind == "input"
    }
    restricted: dict[str, list[int]] = {}
    kept_by: dict[int, list[int]] = {}  # repeated layers share strategy lists
    for fx_node in gm.graph.nodes:
        if fx_node.op != "call_function":
            continue
        if not any(inp.name in from_inputs for inp in input_nodes(fx_node)):
            continue
        from_inputs.add(fx_node.name)
        index = space.index.get(fx_node.name)
        val = fx_node.meta.get("val")
        if index is None or not isinstance(val, torch.Tensor) or val.dim() == 0:
            continue
        node = space.nodes[index]
        keep = kept_by.get(id(node.strategies))
        if keep is None:
            keep = kept_by[id(node.strategies)] = [
                i
                for i, s in enumerate(node.strategies)
                if s.outputs and s.outputs[0] is not None
                and all(not s.outputs[0][a].is_replicate() for a in data_axes)
            ]
        if keep:
            restricted[fx_node.name] = keep
    return restricted


def _used_in_place(have: Placements, need: Placements | None) -> bool:
    """A recipe uses parameters where they live; Replicate -> Partial is allowed because it is
    local (a row-parallel layer's bias is added once, as Megatron adds it after the all-reduce)."""
    if need is None:
        return True
    return all(h == n or (h.is_replicate() and n.is_partial()) for h, n in zip(have, need))


def _wanted_layout(node, ndim: int, tp: int | None, param_layout: dict[str, Placements]) -> Placements:
    if node.kind == "param":
        if node.name in param_layout:
            return param_layout[node.name]
        return tuple(REPLICATE for _ in range(ndim))
    if node.kind == "buffer":
        return tuple(REPLICATE for _ in range(ndim))
    # user input: the batch (dim 0) split over every data-parallel axis
    return tuple(REPLICATE if axis == tp else Shard(0) for axis in range(ndim))


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
        spec = _MATMUL_WEIGHTS.get(node.target)
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

    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is aten.embedding.default:
            weight = input_nodes(node)[0]
            if weight.name in params and weight.name not in layout:
                wanted = on_tp(Shard(0))
                if fits(weight, wanted):
                    layout[weight.name] = wanted
            continue
        weight = weight_of(node)
        if weight is None:
            continue
        _, out_dim, bias_index = _MATMUL_WEIGHTS[node.target]
        in_dim = 1 - out_dim
        role = upstream_role(node)
        if weight.name in layout:
            # A tied weight (e.g. the LM head sharing the vocab-parallel embedding) keeps the
            # layout of its first use; its role follows from that layout.
            first = layout[weight.name][tp]
            role = "col" if first == Shard(out_dim) else "row" if first == Shard(in_dim) else role
        else:
            wanted = on_tp(Shard(out_dim if role == "col" else in_dim))
            if not fits(weight, wanted):
                notes.append(f"megatron: {params[weight.name]} not divisible on the tp axis, kept replicated")
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
                layout[bias.name] = on_tp(Shard(0))
    # A tied parameter lifted as several placeholders is one parameter: one layout for all.
    by_fqn = {fqn: name for name, fqn in params.items()}
    for name, fqn in params.items():
        aliases = [by_fqn[o] for o in space.captured.tied_params.get(fqn, []) if o in by_fqn]
        owner = next((a for a in (name, *aliases) if a in layout), None)
        if owner is not None:
            layout[name] = layout[owner]
    return layout
