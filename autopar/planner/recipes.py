"""Standard recipes as restrictions of the same ILP, priced by the same cost model.

A recipe pins what defines it and leaves the ILP only the choices the recipe leaves open:

- Parameters and buffers get a fixed layout and are used where they live: an op may not ask
  for a parameter or buffer in another layout on any axis, except that on the tensor-parallel
  axis a replicated one may be used as Partial (a row-parallel layer's bias is added once, as
  Megatron adds it after the all-reduce) and a replicated buffer may be sliced locally.
- Data-parallel axes carry the batch. User inputs are Shard(0) there; every activation
  computed from them keeps its batch dim split there (Shard(d), where d is the dim the batch
  moved to through views, transposes and attention), until an op sums over the batch (a
  loss), whose output is Partial; anything computed after that, or from no input at all
  (positions, masks), is Replicate there: every rank computes it whole.
- When the batch is not divisible by a data axis (with the axes before it), the recipe
  replicates the computation on that axis; a parameter whose recipe layout does not divide
  its shape stays Replicate; an op with no strategy that keeps the batch split is left to the
  solver. Each fallback is recorded in the plan's notes.

The recipes:

- ``ddp``: every axis is data-parallel; parameters and buffers Replicate and used as Replicate,
  so each parameter's gradient is a real all-reduce over every axis.
- ``fsdp``: ``ddp`` layouts plus ZeRO-3 on every axis.
- ``megatron``: on the tensor-parallel axis (named ``tp``, else the innermost), matmul weights
  are column-parallel (output features sharded, with the bias) or row-parallel (input features
  sharded), alternating along the data flow (attention q/k/v and MLP up/gate column, attention
  output and MLP down row), and the token embedding and the LM head are vocab-parallel; other
  parameters Replicate; the other axes are data-parallel as in ``ddp``.
- ``fsdp+tp``: ``megatron`` plus ZeRO-3 on the other axes.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autopar.placement import REPLICATE, Placement, Placements, Shard
from autopar.planner.megatron import MATMUL_WEIGHTS, megatron_layout
from autopar.planner.problem import StrategySpace, ZeroConfig
from autopar.strategies import Strategy, input_nodes

aten = torch.ops.aten

BASELINE_RECIPES = ("ddp", "fsdp", "megatron", "fsdp+tp")


@dataclass(frozen=True, kw_only=True, slots=True)
class RecipeSpec:
    name: str
    allowed: dict[str, list[int]]
    forbid: dict[int, set[tuple[int, int]]]
    zero: ZeroConfig
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True, slots=True)
class _Axes:
    """The recipe's roles of the mesh axes."""

    data: tuple[int, ...]
    """Axes that split the batch."""
    replicated: tuple[int, ...]
    """Data-parallel axes the batch does not divide: the computation is replicated there."""
    tp: int | None
    """The tensor-parallel axis (megatron, fsdp+tp)."""


def tp_axis(axis_names: tuple[str, ...]) -> int:
    return axis_names.index("tp") if "tp" in axis_names else len(axis_names) - 1


def recipe_spec(space: StrategySpace, recipe: str) -> RecipeSpec:
    """The restriction of ``space`` that is ``recipe`` (see the module docstring)."""
    return recipe_specs(space, (recipe,))[recipe]


_LABEL = "\x00recipe\x00"  # the recipe's name in the notes of layouts several recipes share


def recipe_specs(space: StrategySpace, names: Sequence[str]) -> dict[str, RecipeSpec]:
    """:func:`recipe_spec` of each of ``names``, the layouts worked out once per tp axis."""
    shared: dict[int | None, tuple[dict[str, list[int]], dict, list[str]]] = {}
    out: dict[str, RecipeSpec] = {}
    for recipe in names:
        if recipe not in BASELINE_RECIPES:
            raise ValueError(
                f"unknown recipe {recipe!r}; choose one of {', '.join(BASELINE_RECIPES)}"
            )
        tp = tp_axis(space.mesh.axis_names) if recipe in ("megatron", "fsdp+tp") else None
        if tp not in shared:
            shared[tp] = _layouts(space, tp)
        allowed, forbid, notes = shared[tp]
        axes = [a for a in range(space.mesh.ndim) if a != tp] if "fsdp" in recipe else ()
        named = [note.replace(_LABEL, recipe) for note in notes]
        zero = ZeroConfig(stage=3, axes=axes)  # no axes: stage 0
        spec = RecipeSpec(name=recipe, allowed=allowed, forbid=forbid, zero=zero, notes=named)
        out[recipe] = spec
    return out


def _layouts(space: StrategySpace, tp: int | None) -> tuple[dict, dict, list[str]]:
    """(allowed, forbid, notes naming the recipe ``_LABEL``) of tensor-parallel axis ``tp``."""
    ndim = space.mesh.ndim
    notes: list[str] = []
    axes = _batch_axes(space, tp, _LABEL, notes)
    param_layout = megatron_layout(space, tp, notes) if tp is not None else {}
    allowed: dict[str, list[int]] = {}
    for node in space.nodes:
        if node.kind == "op":
            continue
        wanted = _wanted_layout(node, ndim, axes, param_layout)
        match = [i for i, s in enumerate(node.strategies) if s.outputs[0] == wanted]
        if not match:
            # Not divisible on some axis: fall back to Replicate there, and say so.
            wanted = tuple(REPLICATE for _ in range(ndim))
            match = [i for i, s in enumerate(node.strategies) if s.outputs[0] == wanted]
            notes.append(f"{_LABEL}: {node.fqn or node.name} kept replicated (shape not divisible)")
        allowed[node.name] = match
    allowed.update(_batch_parallel_ops(space, axes, allowed, _LABEL, notes))
    forbid = _forbid_conversions(space, allowed, tp, param_layout)
    return allowed, forbid, notes


def _batch_axes(space: StrategySpace, tp: int | None, recipe: str, notes: list[str]) -> _Axes:
    """The data-parallel axes (every axis but ``tp``, of size > 1), split into those the batch
    divides (in mesh-axis order, as a dim split over several axes is) and the rest."""
    mesh = space.mesh
    values = {
        n.name: n.meta.get("val") for n in space.captured.gm.graph.nodes if n.op == "placeholder"
    }
    batch_sizes = [
        values[name].shape[0]
        for name in space.captured.input_nodes
        if name in space.index
        and isinstance(values.get(name), torch.Tensor)
        and values[name].dim() >= 1
    ]
    data: list[int] = []
    replicated: list[int] = []
    for axis in range(mesh.ndim):
        if axis == tp or mesh.shape[axis] == 1:
            continue
        ways = math.prod(mesh.shape[a] for a in data) * mesh.shape[axis]
        if batch_sizes and all(size % ways == 0 for size in batch_sizes):
            data.append(axis)
            continue
        replicated.append(axis)
        notes.append(
            f"{recipe}: the batch ({', '.join(map(str, sorted(set(batch_sizes)))) or 'none'}) does not split "
            f"{ways} ways, so axis {mesh.axis_names[axis]} ({mesh.shape[axis]}) replicates the computation"
        )
    return _Axes(data=tuple(data), replicated=tuple(replicated), tp=tp)


def _batch_parallel_ops(
    space: StrategySpace,
    axes: _Axes,
    pinned: dict[str, list[int]],
    recipe: str,
    notes: list[str],
) -> dict[str, list[int]]:
    """Op node -> its strategies that carry the batch on the data axes (module docstring).

    Walks the graph in order, tracking for each output of each node its placement on the data
    axes: Shard(batch dim), Partial (the batch summed away), or untracked (Replicate there).
    An op fed by a batch-sharded tensor must take each such input at its tracked placement,
    each parameter or buffer Replicate, and its strategies are narrowed to those whose outputs
    are the same on every data axis, keeping the most outputs sharded; the output placements
    of the kept strategies are what its consumers must take. Other ops (after the loss, or
    computed from no input) are Replicate on the data axes."""
    data_axes = (*axes.data, *axes.replicated)
    gm = space.captured.gm
    state = set(space.captured.param_nodes) | set(space.captured.buffer_nodes)
    tracked: dict[str, tuple[Placement | None, ...]] = {}
    for name in space.captured.input_nodes:
        if name in space.index:
            node = space.node(name)
            out = node.strategies[pinned[name][0]].outputs[0]
            if axes.data and out[axes.data[0]].is_shard():
                tracked[name] = (out[axes.data[0]],)
    free: set[str] = set()  # fed by an op left to the solver: no constraint either
    restricted: dict[str, list[int]] = {}
    cache: dict[tuple, tuple[list[int], tuple[Placement | None, ...]] | None] = {}
    for fx_node in gm.graph.nodes:
        if fx_node.op != "call_function":
            continue
        ins = input_nodes(fx_node)
        index = space.index.get(fx_node.name)
        want: list[Placement | None] = []
        sharded_input = False
        for inp in ins:
            placement = None
            if inp.name in tracked:
                k = fx_node.args[1] if fx_node.target is operator.getitem else 0
                outs = tracked[inp.name]
                placement = (
                    outs[k]
                    if k < len(outs) and outs[k] is not None and outs[k].is_shard()
                    else None
                )
                sharded_input = sharded_input or placement is not None
            elif inp.name in state:
                placement = REPLICATE
            want.append(placement)
        if index is None:
            continue
        node = space.nodes[index]
        if not ins:
            # A factory (arange, zeros): computed whole on every rank, on every axis.
            keep = [
                i
                for i, s in enumerate(node.strategies)
                if _replicated_on(s, tuple(range(space.mesh.ndim)))
            ]
            if keep:
                restricted[fx_node.name] = keep
            continue
        if not sharded_input:
            if any(inp.name in free for inp in ins):
                free.add(fx_node.name)
                continue
            keep = [i for i, s in enumerate(node.strategies) if _replicated_on(s, data_axes)]
            if keep and len(keep) < len(node.strategies):
                restricted[fx_node.name] = keep
            continue
        key = (id(node.strategies), tuple(want))
        if key not in cache:
            cache[key] = _keep_batch(node.strategies, want, axes)
        found = cache[key]
        if found is None:
            free.add(fx_node.name)
            notes.append(
                f"{recipe}: no strategy of {fx_node.name} ({fx_node.target}) keeps the batch split on the "
                "data axes; the solver chooses its layout"
            )
            continue
        restricted[fx_node.name], tracked[fx_node.name] = found
    return restricted


def _replicated_on(strategy: Strategy, axes: tuple[int, ...]) -> bool:
    return all(out is None or all(out[a].is_replicate() for a in axes) for out in strategy.outputs)


def _keep_batch(
    strategies: list[Strategy], want: list[Placement | None], axes: _Axes
) -> tuple[list[int], tuple[Placement | None, ...]] | None:
    """The strategies that take each input at ``want`` on the data axes (Replicate on the
    replicated ones) and give outputs alike on every data axis, the most of them sharded;
    with those outputs' data-axis placements (None where Replicate). None when there is none."""
    best: tuple[int, tuple[Placement | None, ...]] | None = None
    keep: list[int] = []
    for i, s in enumerate(strategies):
        if not _takes(s, want, axes):
            continue
        signature: list[Placement | None] = []
        for out in s.outputs:
            if out is None:
                signature.append(None)
                continue
            first = out[axes.data[0]] if axes.data else REPLICATE
            if any(out[a] != first for a in axes.data) or any(
                not out[a].is_replicate() for a in axes.replicated
            ):
                break
            signature.append(None if first.is_replicate() else first)
        else:
            score = sum(
                2 if p is not None and p.is_shard() else 1 if p is not None else 0
                for p in signature
            )
            if score == 0:
                continue
            if best is None or score > best[0]:
                best, keep = (score, tuple(signature)), [i]
            elif score == best[0] and tuple(signature) == best[1]:
                keep.append(i)
    return None if best is None else (keep, best[1])


def _takes(strategy: Strategy, want: list[Placement | None], axes: _Axes) -> bool:
    for need, placements in zip(want, strategy.inputs):
        if need is None or placements is None:
            continue
        if any(placements[a] != need for a in axes.data):
            return False
        if any(not placements[a].is_replicate() for a in axes.replicated):
            return False
    return True


def _forbid_conversions(
    space: StrategySpace,
    allowed: dict[str, list[int]],
    tp: int | None,
    param_layout: dict[str, Placements],
) -> dict[int, set[tuple[int, int]]]:
    """Edge index -> the (source, destination) strategy pairs the recipe forbids: converting a
    parameter or buffer on its way to an op (``_used_in_place``), and on the tensor-parallel
    axis any activation conversion but Megatron's (``_megatron_conversion``)."""
    fx_nodes = {n.name: n for n in space.captured.gm.graph.nodes}
    forbid: dict[int, set[tuple[int, int]]] = {}
    # Repeated layers share strategy lists (autopar.planner.problem): ban pairs once per layer position.
    banned_by: dict[tuple, set[tuple[int, int]]] = {}
    for e, edge in enumerate(space.edges):
        src = space.nodes[edge.src]
        dst = space.nodes[edge.dst]
        j = edge.input_index
        if j < 0 or (tp is None and src.kind not in ("param", "buffer")):
            continue
        dst_fx = fx_nodes[dst.name]
        out_index = dst_fx.args[1] if dst_fx.target is operator.getitem else 0
        row = src.kind not in ("param", "buffer") and _row_parallel(dst_fx, tp, param_layout)
        rows = allowed.get(src.name, range(len(src.strategies)))
        cols = allowed.get(dst.name, range(len(dst.strategies)))
        key = (
            id(src.strategies),
            id(dst.strategies),
            j,
            out_index,
            tuple(rows),
            tuple(cols),
            src.kind,
            row,
        )
        banned = banned_by.get(key)
        if banned is None:
            haves = {a: src.strategies[a].outputs[out_index] for a in rows}
            needs = {b: dst.strategies[b].inputs[j] for b in cols}
            verdict: dict[tuple, bool] = {}
            for have, need in {(h, n) for h in haves.values() for n in needs.values()}:
                if have is None or need is None:
                    verdict[have, need] = True
                elif src.kind in ("param", "buffer"):
                    verdict[have, need] = _used_in_place(
                        have, need, tp, buffer=src.kind == "buffer"
                    )
                else:
                    verdict[have, need] = _megatron_conversion(have[tp], need[tp], row)
            banned = banned_by[key] = {
                (a, b) for a, h in haves.items() for b, n in needs.items() if not verdict[h, n]
            }
        if banned:
            forbid[e] = banned
    return forbid


def _row_parallel(node: fx.Node, tp: int | None, param_layout: dict[str, Placements]) -> bool:
    spec = MATMUL_WEIGHTS.get(node.target)
    if spec is None or tp is None:
        return False
    ins = input_nodes(node)
    return (
        spec[0] < len(ins)
        and ins[spec[0]].name in param_layout
        and param_layout[ins[spec[0]].name][tp].is_shard(1 - spec[1])
    )


def _megatron_conversion(have: Placement, need: Placement, row_parallel: bool) -> bool:
    """On the tensor-parallel axis an activation is used as produced, gathered (S -> R) or
    all-reduced (P -> R), or sliced (R -> S) into a row-parallel matmul: no reduce-scatter and
    no all-to-all, so no sequence or batch parallelism there (Megatron without SP)."""
    if have == need or (need.is_replicate() and not have.is_replicate()):
        return True
    return row_parallel and have.is_replicate() and need.is_shard()


def _used_in_place(
    have: Placements, need: Placements | None, tp: int | None, *, buffer: bool
) -> bool:
    """A recipe uses parameters and buffers where they live. On the tensor-parallel axis only,
    Replicate -> Partial is allowed because it is local (a row-parallel layer's bias is added
    once, as Megatron adds it after the all-reduce), and a replicated buffer may be sliced."""
    if need is None:
        return True
    for axis, (h, n) in enumerate(zip(have, need)):
        if h == n:
            continue
        if axis != tp or not h.is_replicate() or not (n.is_partial() or buffer):
            return False
    return True


def _wanted_layout(node, ndim: int, axes: _Axes, param_layout: dict[str, Placements]) -> Placements:
    if node.kind == "param":
        if node.name in param_layout:
            return param_layout[node.name]
        return tuple(REPLICATE for _ in range(ndim))
    if node.kind == "buffer":
        return tuple(REPLICATE for _ in range(ndim))
    # user input: the batch (dim 0) split over the data-parallel axes that divide it
    return tuple(Shard(0) if axis in axes.data else REPLICATE for axis in range(ndim))
