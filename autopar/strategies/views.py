"""Sharding rules for view, shape and data-movement ops.

Every rule here moves elements without combining them, so a Partial input gives a Partial output
(the op is linear) and a Shard survives exactly when each rank's local block of the input is, by
itself, the local block of the output. The dim correspondence of a view comes from
:func:`view_groups`: input and output dims are cut into groups of equal element count
(``[B, S, H*D] -> [B, S, H, D]`` gives ``{0}->{0}, {1}->{1}, {2}->{2, 3}``); only the outermost
non-size-1 dim of a group can carry a Shard, on both sides, because an even split of that dim
is an even split of the group's flattened elements into contiguous blocks. The expander's
divisibility check on input and output is then exactly the condition for the blocks to agree.

Ops whose dim argument is sharded (split, cat, stack along that dim, a real slice of it) are not
given that Shard: it would need communication or uneven shards. Bool tensors never get Partial
(a sum of booleans is not their value).

What the lowering must make local (the strategies assume it): the size arguments of view,
reshape, _unsafe_view, unflatten, expand (the local output shape); ``squeeze.default``, which on
a shard whose local size is 1 would drop that dim too (rewrite it to ``squeeze.dims`` of the
global size-1 dims); ``repeat_interleave``'s ``output_size``; and a slice that keeps a sharded
dim whole (its end clamps to the local size, so ``end >= global size`` is fine as it is).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from autopar.placement import PARTIAL, REPLICATE, Placement, Shard
from autopar.strategies.registry import AxisStrategy, OpCall, TensorMeta, register

aten = torch.ops.aten


def normalize_dim(dim: int, ndim: int) -> int:
    """A dim argument in ``[0, ndim)`` (negative dims count from the end; ndim 0 acts as 1)."""
    size = max(ndim, 1)
    if not -size <= dim < size:
        raise IndexError(f"dim {dim} out of range for a tensor with {ndim} dims")
    return dim % size


def partial_ok(*metas: TensorMeta | None) -> bool:
    """Whether a sum-Partial layout is meaningful for all these tensors (not for bool)."""
    return all(m is None or m.dtype != torch.bool for m in metas)


def tensor_inputs(call: OpCall) -> list[TensorMeta | None]:
    return [m if isinstance(m, TensorMeta) else None for m in call.inputs]


def _same_on_all(call: OpCall, inp: Placement, out: Placement) -> AxisStrategy:
    """``inp`` on every tensor input, ``out`` on every tensor output."""
    ins = tuple(inp if m is not None else None for m in tensor_inputs(call))
    outs = tuple(out for _ in call.outputs)
    return AxisStrategy(outputs=outs, inputs=ins)


def replicate_and_partial(call: OpCall) -> list[AxisStrategy]:
    """The all-Replicate strategy, plus all-Partial when every tensor allows it."""
    options = [_same_on_all(call, REPLICATE, REPLICATE)]
    metas = [m for m in (*tensor_inputs(call), *call.outputs) if m is not None]
    if partial_ok(*metas):
        options.append(_same_on_all(call, PARTIAL, PARTIAL))
    return options


# --------------------------------------------------------------------------------------------
# Views: dim grouping


def view_groups(
    in_shape: Sequence[int], out_shape: Sequence[int]
) -> list[tuple[list[int], list[int]]]:
    """Cut the dims of a view into groups of equal element count.

    Returns ``(input_dims, output_dims)`` pairs in order; size-1 dims belong to no group (they
    can never be sharded). A group with more than one dim on a side is a merge or a split.
    Raises ValueError when the element counts differ (not a view).
    """
    ins = [d for d, s in enumerate(in_shape) if s != 1]
    outs = [d for d, s in enumerate(out_shape) if s != 1]
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(ins) and j < len(outs):
        g_in, g_out = [ins[i]], [outs[j]]
        n_in, n_out = in_shape[ins[i]], out_shape[outs[j]]
        i += 1
        j += 1
        while n_in != n_out:
            if n_in < n_out and i < len(ins):
                g_in.append(ins[i])
                n_in *= in_shape[ins[i]]
                i += 1
            elif n_out < n_in and j < len(outs):
                g_out.append(outs[j])
                n_out *= out_shape[outs[j]]
                j += 1
            else:
                raise ValueError(f"cannot view shape {tuple(in_shape)} as {tuple(out_shape)}")
        groups.append((g_in, g_out))
    if i < len(ins) or j < len(outs):
        raise ValueError(f"cannot view shape {tuple(in_shape)} as {tuple(out_shape)}")
    return groups


def view_dim_map(in_shape: Sequence[int], out_shape: Sequence[int]) -> dict[int, int]:
    """Input dim -> output dim for every input dim whose Shard survives the view."""
    if 0 in in_shape or 0 in out_shape:
        return {}
    return {g_in[0]: g_out[0] for g_in, g_out in view_groups(in_shape, out_shape)}


def view_strategies(inp: TensorMeta, out: TensorMeta) -> list[AxisStrategy]:
    options = [AxisStrategy(outputs=(REPLICATE,), inputs=(REPLICATE,))]
    for d_in, d_out in view_dim_map(inp.shape, out.shape).items():
        options.append(AxisStrategy(outputs=(Shard(d_out),), inputs=(Shard(d_in),)))
    if partial_ok(inp):
        options.append(AxisStrategy(outputs=(PARTIAL,), inputs=(PARTIAL,)))
    return options


@register(
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.view_copy.default,
    aten._reshape_alias.default,
    aten.flatten.using_ints,
    aten.unflatten.int,
    aten.squeeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.unsqueeze.default,
    aten.view_as.default,
)
def view_rule(call: OpCall) -> list[AxisStrategy]:
    # Every op here is "the same elements in a new shape", so the rule needs only the input's
    # and the output's shapes (``-1`` and squeeze's dims are already resolved in the output).
    # view_as's second tensor lends its (local) shape, so it must be laid out like the output.
    inp, out = call.inputs[0], call.outputs[0]
    return with_shape_source(call, view_strategies(inp, out))


def with_shape_source(call: OpCall, options: list[AxisStrategy]) -> list[AxisStrategy]:
    """For ``view_as``/``expand_as``: the second input's local shape becomes the output's, so it
    takes the output's Shard (Replicate when the output is Replicate or Partial)."""
    if len(call.inputs) == 1:
        return options
    return [
        AxisStrategy(
            outputs=s.outputs,
            inputs=(s.inputs[0], s.outputs[0] if isinstance(s.outputs[0], Shard) else REPLICATE),
        )
        for s in options
    ]


# --------------------------------------------------------------------------------------------
# Dim permutations and identities


def permutation_strategies(inp: TensorMeta, out_dim_of: Sequence[int]) -> list[AxisStrategy]:
    """Shard(d) -> Shard(out_dim_of[d]) for every input dim d, plus R and P."""
    options = [AxisStrategy(outputs=(REPLICATE,), inputs=(REPLICATE,))]
    for d in range(inp.ndim):
        options.append(AxisStrategy(outputs=(Shard(out_dim_of[d]),), inputs=(Shard(d),)))
    if partial_ok(inp):
        options.append(AxisStrategy(outputs=(PARTIAL,), inputs=(PARTIAL,)))
    return options


@register(aten.transpose.int, aten.swapaxes.default, aten.swapdims.default)
def transpose_rule(call: OpCall) -> list[AxisStrategy]:
    inp = call.inputs[0]
    d0, d1 = (normalize_dim(d, inp.ndim) for d in call.args[1:3])
    perm = list(range(inp.ndim))
    perm[d0], perm[d1] = d1, d0
    return permutation_strategies(inp, perm)


@register(aten.t.default, aten.numpy_T.default)
def t_rule(call: OpCall) -> list[AxisStrategy]:
    inp = call.inputs[0]
    return permutation_strategies(inp, list(reversed(range(inp.ndim))))


@register(aten.permute.default)
def permute_rule(call: OpCall) -> list[AxisStrategy]:
    inp = call.inputs[0]
    dims = call.args[1] if len(call.args) > 1 else call.kwargs["dims"]
    perm = [normalize_dim(d, inp.ndim) for d in dims]
    out_dim_of = [0] * inp.ndim
    for out_dim, in_dim in enumerate(perm):
        out_dim_of[in_dim] = out_dim
    return permutation_strategies(inp, out_dim_of)


@register(aten.movedim.int)
def movedim_rule(call: OpCall) -> list[AxisStrategy]:
    inp = call.inputs[0]
    src, dst = (normalize_dim(d, inp.ndim) for d in call.args[1:3])
    order = [d for d in range(inp.ndim) if d != src]
    order.insert(dst, src)
    out_dim_of = [0] * inp.ndim
    for out_dim, in_dim in enumerate(order):
        out_dim_of[in_dim] = out_dim
    return permutation_strategies(inp, out_dim_of)


# clone, contiguous and lift_fresh_copy are registered with the same strategies in pointwise.py
# (as linear elementwise ops / casts); registering them here too would shadow one of the two.
@register(aten.alias.default, aten.detach.default, aten.lift_fresh.default)
def identity_rule(call: OpCall) -> list[AxisStrategy]:
    inp = call.inputs[0]
    return permutation_strategies(inp, list(range(inp.ndim)))


# --------------------------------------------------------------------------------------------
# Broadcasting: expand, broadcast_tensors


def broadcast_dim_map(in_shape: Sequence[int], out_shape: Sequence[int]) -> dict[int, int]:
    """Input dim -> output dim for the dims that broadcasting keeps whole (not size 1 -> n)."""
    lead = len(out_shape) - len(in_shape)
    return {d: d + lead for d, s in enumerate(in_shape) if s != 1 and s == out_shape[d + lead]}


@register(aten.expand.default, aten.expand_copy.default, aten.expand_as.default)
def expand_rule(call: OpCall) -> list[AxisStrategy]:
    # A dim that is broadcast from size 1 stays Replicate on the output (every rank holds all of
    # it); new leading dims likewise.
    inp, out = call.inputs[0], call.outputs[0]
    mapping = broadcast_dim_map(inp.shape, out.shape)
    options = [AxisStrategy(outputs=(REPLICATE,), inputs=(REPLICATE,))]
    options += [AxisStrategy(outputs=(Shard(o),), inputs=(Shard(i),)) for i, o in mapping.items()]
    if partial_ok(inp):
        options.append(AxisStrategy(outputs=(PARTIAL,), inputs=(PARTIAL,)))
    return with_shape_source(call, options)


@register(aten.broadcast_tensors.default)
def broadcast_tensors_rule(call: OpCall) -> list[AxisStrategy]:
    # Output i is input i broadcast to the common shape: shard one common dim on every output,
    # and on each input that holds that dim whole (inputs where it is broadcast stay R).
    metas = tensor_inputs(call)
    out_shape = call.outputs[0].shape
    options = replicate_and_partial(call)
    for d_out in range(len(out_shape)):
        ins: list[Placement | None] = []
        for m in metas:
            if m is None:
                ins.append(None)
                continue
            inverse = {o: i for i, o in broadcast_dim_map(m.shape, out_shape).items()}
            ins.append(Shard(inverse[d_out]) if d_out in inverse else REPLICATE)
        outs = tuple(Shard(d_out) for _ in call.outputs)
        options.append(AxisStrategy(outputs=outs, inputs=tuple(ins)))
    return options


# --------------------------------------------------------------------------------------------
# Splitting and joining along a dim


def keep_other_dims(call: OpCall, dim: int, out_dim_of: Sequence[int | None]) -> list[AxisStrategy]:
    """R, P, and Shard(d) for every d != dim, on the single input and every tensor output.

    ``out_dim_of[d]`` is where input dim d lands in each output (None: it does not survive).
    """
    inp = call.inputs[0]
    options = replicate_and_partial(call)
    for d in range(inp.ndim):
        if d == dim or out_dim_of[d] is None:
            continue
        shard = Shard(out_dim_of[d])
        options.append(_same_on_all(call, Shard(d), shard))
    return options


@register(
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.split_with_sizes_copy.default,
    aten.split_copy.Tensor,
    aten.chunk.default,
    aten.tensor_split.sections,
    aten.tensor_split.indices,
)
def split_rule(call: OpCall) -> list[AxisStrategy]:
    inp = call.inputs[0]
    dim_arg = call.args[2] if len(call.args) > 2 else call.kwargs.get("dim", 0)
    dim = normalize_dim(dim_arg, inp.ndim)
    return keep_other_dims(call, dim, list(range(inp.ndim)))


@register(aten.unbind.int)
def unbind_rule(call: OpCall) -> list[AxisStrategy]:
    inp = call.inputs[0]
    dim = normalize_dim(call.args[1] if len(call.args) > 1 else call.kwargs.get("dim", 0), inp.ndim)
    return keep_other_dims(call, dim, [d if d < dim else d - 1 for d in range(inp.ndim)])


@register(aten.select.int)
def select_rule(call: OpCall) -> list[AxisStrategy]:
    inp = call.inputs[0]
    dim = normalize_dim(call.args[1], inp.ndim)
    return keep_other_dims(call, dim, [d if d < dim else d - 1 for d in range(inp.ndim)])


def _slice_is_whole(size: int, start: int | None, end: int | None, step: int) -> bool:
    start = 0 if start is None else (start + size if start < 0 else start)
    end = size if end is None else min(end + size if end < 0 else end, size)
    return step == 1 and start <= 0 and end >= size


@register(aten.slice.Tensor, aten.slice_copy.Tensor)
def slice_rule(call: OpCall) -> list[AxisStrategy]:
    # slice(self, dim=0, start=None, end=None, step=1). A slice that keeps the whole dim is the
    # identity there, so that dim may stay sharded too (HF models slice masks to their length).
    inp = call.inputs[0]
    params = [*call.args[1:], None, None, None, None]
    dim = normalize_dim(call.kwargs.get("dim", params[0] if params[0] is not None else 0), inp.ndim)
    start = call.kwargs.get("start", params[1])
    end = call.kwargs.get("end", params[2])
    step = call.kwargs.get("step", params[3] if params[3] is not None else 1)
    if inp.ndim and _slice_is_whole(inp.shape[dim], start, end, step):
        return permutation_strategies(inp, list(range(inp.ndim)))
    return keep_other_dims(call, dim, list(range(inp.ndim)))


@register(aten.narrow.default, aten.narrow_copy.default)
def narrow_rule(call: OpCall) -> list[AxisStrategy]:
    inp = call.inputs[0]
    dim = normalize_dim(call.args[1], inp.ndim)
    return keep_other_dims(call, dim, list(range(inp.ndim)))


@register(aten.cat.default, aten.concat.default, aten.concatenate.default)
def cat_rule(call: OpCall) -> list[AxisStrategy]:
    # Every input carries the same Shard(d), d != dim, so the local cat is the local block of the
    # global cat. The legacy empty 1-D input (shape [0]) that cat skips stays Replicate.
    out = call.outputs[0]
    dim_arg = call.args[1] if len(call.args) > 1 else call.kwargs.get("dim", 0)
    dim = normalize_dim(dim_arg, out.ndim)
    metas = tensor_inputs(call)
    options = replicate_and_partial(call)
    for d in range(out.ndim):
        if d == dim:
            continue
        ins = tuple(
            None if m is None else (REPLICATE if m.shape == (0,) else Shard(d)) for m in metas
        )
        options.append(AxisStrategy(outputs=(Shard(d),), inputs=ins))
    return options


@register(aten.stack.default)
def stack_rule(call: OpCall) -> list[AxisStrategy]:
    out = call.outputs[0]
    dim_arg = call.args[1] if len(call.args) > 1 else call.kwargs.get("dim", 0)
    dim = normalize_dim(dim_arg, out.ndim)
    options = replicate_and_partial(call)
    for d in range(out.ndim - 1):
        options.append(_same_on_all(call, Shard(d), Shard(d if d < dim else d + 1)))
    return options


# --------------------------------------------------------------------------------------------
# Repetition and gathering along a dim


@register(aten.repeat_interleave.self_int)
def repeat_interleave_rule(call: OpCall) -> list[AxisStrategy]:
    # repeat_interleave(self, repeats, dim=None, output_size=None). Element i of the dim becomes
    # elements i*r .. i*r+r-1, so an even split of the dim maps to the same even split of the
    # output: the sharded dim itself may stay sharded (GQA: KV heads S1 -> query heads S1).
    inp, out = call.inputs[0], call.outputs[0]
    dim = call.args[2] if len(call.args) > 2 else call.kwargs.get("dim")
    options = [AxisStrategy(outputs=(REPLICATE,), inputs=(REPLICATE,))]
    if dim is None:
        # The input is flattened first: only its outermost non-size-1 dim keeps contiguous blocks.
        mapping = view_dim_map(inp.shape, (math.prod(inp.shape),))
        options += [AxisStrategy(outputs=(Shard(0),), inputs=(Shard(d),)) for d in mapping]
    else:
        options += [AxisStrategy(outputs=(Shard(d),), inputs=(Shard(d),)) for d in range(inp.ndim)]
    if partial_ok(inp, out):
        options.append(AxisStrategy(outputs=(PARTIAL,), inputs=(PARTIAL,)))
    return options


@register(aten.repeat.default)
def repeat_rule(call: OpCall) -> list[AxisStrategy]:
    # Tiling copies the whole dim, so only dims repeated once (and present in the input) keep a
    # Shard; new leading dims and tiled dims are Replicate.
    inp = call.inputs[0]
    repeats = list(call.args[1])
    lead = len(repeats) - inp.ndim
    options = [AxisStrategy(outputs=(REPLICATE,), inputs=(REPLICATE,))]
    for d in range(inp.ndim):
        if repeats[d + lead] == 1:
            options.append(AxisStrategy(outputs=(Shard(d + lead),), inputs=(Shard(d),)))
    if partial_ok(inp):
        options.append(AxisStrategy(outputs=(PARTIAL,), inputs=(PARTIAL,)))
    return options


@register(aten.index_select.default)
def index_select_rule(call: OpCall) -> list[AxisStrategy]:
    # index_select(self, dim, index): shard any other dim of self (index replicated), or shard
    # the 1-D index with self replicated (the output's dim is then split like the index).
    inp, index = call.inputs
    dim = normalize_dim(call.args[1], inp.ndim)
    options = [AxisStrategy(outputs=(REPLICATE,), inputs=(REPLICATE, REPLICATE))]
    for d in range(inp.ndim):
        if d != dim:
            options.append(AxisStrategy(outputs=(Shard(d),), inputs=(Shard(d), REPLICATE)))
    if index.ndim == 1:
        options.append(AxisStrategy(outputs=(Shard(dim),), inputs=(REPLICATE, Shard(0))))
    if partial_ok(inp):
        options.append(AxisStrategy(outputs=(PARTIAL,), inputs=(PARTIAL, REPLICATE)))
    return options


@register(aten.constant_pad_nd.default, aten.pad.default)
def pad_rule(call: OpCall) -> list[AxisStrategy]:
    # pad(self, pad, mode="constant", value=None): pad lists (left, right) pairs from the last
    # dim backwards. Unpadded dims keep a Shard. Partial only for constant-zero padding, the
    # one case where padding the parts sums to padding the whole.
    inp = call.inputs[0]
    pad = list(call.args[1])
    mode = call.args[2] if len(call.args) > 2 else call.kwargs.get("mode", "constant")
    value = call.args[3] if len(call.args) > 3 else call.kwargs.get("value")
    if call.op is aten.constant_pad_nd.default:
        mode, value = (
            "constant",
            (call.args[2] if len(call.args) > 2 else call.kwargs.get("value", 0)),
        )
    padded = {inp.ndim - 1 - k // 2 for k, amount in enumerate(pad) if amount != 0}
    if mode != "constant":
        # Reflect/replicate/circular padding reads across the padded dims' edges, which are the
        # last len(pad)//2 dims whatever the amounts.
        padded |= {inp.ndim - 1 - k for k in range(len(pad) // 2)}
    options = [AxisStrategy(outputs=(REPLICATE,), inputs=(REPLICATE,))]
    options += [
        AxisStrategy(outputs=(Shard(d),), inputs=(Shard(d),))
        for d in range(inp.ndim)
        if d not in padded
    ]
    if mode == "constant" and not value and partial_ok(inp):
        options.append(AxisStrategy(outputs=(PARTIAL,), inputs=(PARTIAL,)))
    return options


@register(aten.index.Tensor)
def index_rule(call: OpCall) -> list[AxisStrategy]:
    # self[..., i0, i1, ...] with the index tensors at consecutive positions p .. p+k-1 after
    # p full slices (None): output = self.shape[:p] + broadcast(index shapes) + self.shape[p+k:].
    # A sliced dim of self keeps its Shard (indices replicated); a broadcast-index dim is
    # sharded on every index tensor that has it (self replicated: a gather of each rank's rows).
    # Bool (mask) indices give data-dependent shapes, and non-adjacent indices move the
    # broadcast dims to the front: both run replicated.
    inp, out = call.inputs[0], call.outputs[0]
    entries = list(call.args[1])
    positions = [i for i, e in enumerate(entries) if e is not None]
    indices = [entries[i] for i in positions]
    options = [_same_on_all(call, REPLICATE, REPLICATE)]
    contiguous = (
        positions == list(range(positions[0], positions[0] + len(positions)))
        if positions
        else False
    )
    if not contiguous or any(m.dtype == torch.bool for m in indices):
        return options
    first, num_indexed = positions[0], len(positions)
    num_bcast = out.ndim - (inp.ndim - num_indexed)

    def strategy(out_dim: int, self_pl: Placement, index_pl: list[Placement]) -> AxisStrategy:
        return AxisStrategy(outputs=(Shard(out_dim),), inputs=(self_pl, *index_pl))

    for d in range(inp.ndim):
        if d < first:
            options.append(strategy(d, Shard(d), [REPLICATE] * num_indexed))
        elif d >= first + num_indexed:
            options.append(
                strategy(d - num_indexed + num_bcast, Shard(d), [REPLICATE] * num_indexed)
            )
    bcast_shape = out.shape[first : first + num_bcast]
    for j in range(num_bcast):
        index_pl: list[Placement] = []
        for m in indices:
            k = j - (num_bcast - m.ndim)
            index_pl.append(Shard(k) if k >= 0 and m.shape[k] == bcast_shape[j] != 1 else REPLICATE)
        options.append(strategy(first + j, REPLICATE, index_pl))
    if partial_ok(inp):
        options.append(
            AxisStrategy(outputs=(PARTIAL,), inputs=(PARTIAL, *([REPLICATE] * num_indexed)))
        )
    return options
