"""Autograd-aware collectives on one mesh axis, executing ``autopar.resharding`` steps.

Each step kind is an ``autograd.Function`` whose backward follows the gradient convention of
DESIGN.md (a tensor's gradient has its placement, a Partial tensor's gradient is Replicate), not
the true adjoint: every rank differentiates the same replicated scalar.

======================  ===========================  ===============================
function                forward                      backward
======================  ===========================  ===============================
AllGather   S(d) -> R   all_gather along d           local chunk of this coordinate
AllReduce   P -> R      all_reduce (sum)             identity
ReduceScatter P -> S(d) reduce_scatter along d       all_gather along d
AllToAll  S(i) -> S(j)  all_to_all i -> j            all_to_all j -> i
Slice       R -> S(d)   local chunk of this coord.   all_gather along d
ZeroOut     R -> P      zeros off coordinate 0       identity
GradAllReduce R -> R    identity                     all_reduce (sum): a Replicate input
                                                     whose gradient comes out Partial
AllReduceMany P.. -> R..  one all_reduce of a flat     identity per input
                        buffer holding every input
======================  ===========================  ===============================

Chunks and gathers follow the coordinate order on the axis, matching the simulator in
``autopar.resharding``. All calls work on gloo (CPU) and NCCL. Steps on an axis of size 1 are
identities. A failing collective re-raises naming the rank, the op, the axis, its group and the
tensor shape; the process group's timeout bounds how long a missing peer is waited for.

fx graphs call the module-level functions (``autopar_all_gather(t, group_key, axis, dim)``, ...): a
``ProcessGroup`` cannot be a node argument, so they take the key of a mesh registered by
``autopar.comm.process_groups.axis_groups``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from autopar.comm.collective_check import (
    CollectiveMismatchError,
    check_same,
    checks_enabled,
    describe,
)
from autopar.comm.process_groups import AxisGroups, lookup_axis_groups
from autopar.resharding.sections import from_rank_major, select_sections
from autopar.resharding.steps import Step

__all__ = [
    "AllGather",
    "AllReduce",
    "AllReduceMany",
    "AllToAll",
    "GradAllReduce",
    "ReduceScatter",
    "Slice",
    "ZeroOut",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "apply_step",
    "autopar_all_gather",
    "autopar_all_reduce",
    "autopar_all_reduce_many",
    "autopar_all_to_all",
    "autopar_gather_sections",
    "autopar_grad_all_reduce",
    "autopar_reduce_scatter",
    "autopar_select_sections",
    "autopar_slice",
    "autopar_zero_out",
    "gather_stacked",
    "grad_all_reduce",
    "local_slice",
    "reduce_scatter",
    "run_steps",
    "zero_out",
]


# ---------------------------------------------------------------------------------------------
# Plain (non-autograd) collectives on one axis.


def _guarded(
    op: str, groups: AxisGroups, axis: int, t: Tensor, call: Callable[[], Tensor]
) -> Tensor:
    try:
        if checks_enabled():
            label = groups.axis_label(axis)
            check_same(describe(op, "tensor", t), groups.groups[axis], label, t.device)
        return call()
    except CollectiveMismatchError:
        raise
    except Exception as exc:  # re-raised with the context a user needs to find the culprit
        raise RuntimeError(
            f"rank {dist.get_rank()}: {op} over axis '{groups.axis_label(axis)}' "
            f"(group ranks {list(groups.ranks_of_axis(axis))}) of shape {tuple(t.shape)} "
            f"failed: {exc}"
        ) from exc


def _gather(t: Tensor, groups: AxisGroups, axis: int, dim: int) -> Tensor:
    size = groups.mesh_shape[axis]
    if size == 1:
        return t

    def call() -> Tensor:
        # One collective into one buffer (stacked by coordinate): no per-rank part tensors and,
        # along dim 0, no concatenation copy at all.
        # (gloo wants the output as the parts concatenated along dim 0.)
        src = t.contiguous()
        out = torch.empty((size * src.shape[0], *src.shape[1:]), dtype=src.dtype, device=src.device)
        dist.all_gather_single(out, src, group=groups.groups[axis])
        if dim == 0:
            return out
        shape = list(src.shape)
        shape[dim] *= size
        return out.view(size, *src.shape).movedim(0, dim).reshape(shape)

    return _guarded("all_gather", groups, axis, t, call)


def _reduce(t: Tensor, groups: AxisGroups, axis: int) -> Tensor:
    if groups.mesh_shape[axis] == 1:
        return t

    def call() -> Tensor:
        out = t.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=groups.groups[axis])
        return out

    return _guarded("all_reduce", groups, axis, t, call)


def _reduce_many(
    tensors: Sequence[Tensor], groups: AxisGroups, axis: int, dtype: torch.dtype
) -> tuple[Tensor, ...]:
    """Sum each tensor over ``axis`` with ONE all-reduce of a flat ``dtype`` buffer holding them
    in order. A tensor of another dtype (an integer count) is converted into the buffer and its
    sum back: exact only while the sum is an integer the buffer's dtype represents, which the
    caller (``autopar.lowering.fused_reductions``) proves from the count's bound."""
    if groups.mesh_shape[axis] == 1:
        return tuple(tensors)

    # Scalars (a loss and its count) stack and unbind: fewer ops than flatten, cat and split.
    scalars = all(t.dim() == 0 for t in tensors)
    same = [t if t.dtype == dtype else t.to(dtype) for t in tensors]
    flat = torch.stack(same) if scalars else torch.cat([t.reshape(-1) for t in same])

    def call() -> Tensor:
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=groups.groups[axis])
        return flat

    summed = _guarded("all_reduce", groups, axis, flat, call)
    parts = summed.unbind() if scalars else summed.split([t.numel() for t in tensors])
    shaped = [
        part if scalars else part.view(t.shape) for part, t in zip(parts, tensors, strict=True)
    ]
    return tuple(
        p if p.dtype == t.dtype else p.to(t.dtype) for p, t in zip(shaped, tensors, strict=True)
    )


def gather_stacked(t: Tensor, groups: AxisGroups, axis: int) -> Tensor:
    """Plain (non-autograd) all-gather over ``axis`` stacked on a new leading dim, coordinate
    order (``[axis size, *t.shape]``), for ops whose collectives are part of their own forward
    (the vocab-parallel cross entropy)."""
    return _gather(t, groups, axis, 0).view(groups.mesh_shape[axis], *t.shape)


def _reduce_scatter(t: Tensor, groups: AxisGroups, axis: int, dim: int) -> Tensor:
    size = groups.mesh_shape[axis]
    if size == 1:
        return t

    def call() -> Tensor:
        # One contiguous input with the scattered dim leading (a copy only when ``dim`` is not
        # already leading and contiguous), one collective, no per-rank input chunks.
        shape = list(t.shape)
        shape[dim] //= size
        src = t.unflatten(dim, (size, shape[dim])).movedim(dim, 0).contiguous()
        src = src.view(size * shape[0], *shape[1:])
        out = torch.empty(shape, dtype=t.dtype, device=t.device)
        dist.reduce_scatter_single(out, src, op=dist.ReduceOp.SUM, group=groups.groups[axis])
        return out

    return _guarded("reduce_scatter", groups, axis, t, call)


def _all_to_all(t: Tensor, groups: AxisGroups, axis: int, dim: int, dst_dim: int) -> Tensor:
    size = groups.mesh_shape[axis]
    if size == 1:
        return t

    def call() -> Tensor:
        # Row k of ``send`` goes to coordinate k; row s of ``recv`` came from coordinate s.
        send = torch.stack(t.chunk(size, dim=dst_dim)).contiguous()
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=groups.groups[axis])
        return torch.cat(recv.unbind(0), dim=dim)

    return _guarded("all_to_all", groups, axis, t, call)


def _chunk(t: Tensor, groups: AxisGroups, axis: int, dim: int) -> Tensor:
    size = groups.mesh_shape[axis]
    if size == 1:
        return t
    return t.chunk(size, dim=dim)[groups.coordinate[axis]].clone(
        memory_format=torch.contiguous_format
    )


def _zero_off_first(t: Tensor, groups: AxisGroups, axis: int) -> Tensor:
    # A new tensor on every coordinate, never ``t`` itself on coordinate 0: what a rank's
    # autograd graph aliases must not depend on its coordinate. ZeRO-3 packs a saved tensor that
    # views a gathered chunk and all-gathers the chunk again to unpack it in backward; had
    # coordinate 0 returned a chunk view here (saved by the next matmul) and the others zeros,
    # only rank 0 would have issued that all-gather (the bench-cost fsdp deadlock).
    if groups.coordinate[axis] == 0:
        return t.clone(memory_format=torch.contiguous_format)
    return torch.zeros_like(t, memory_format=torch.contiguous_format)


# ---------------------------------------------------------------------------------------------
# Autograd functions (backward per the gradient convention).


class AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: Tensor, groups: AxisGroups, axis: int, dim: int) -> Tensor:
        ctx.args = (groups, axis, dim)
        return _gather(t, groups, axis, dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        return _chunk(grad, *ctx.args), None, None, None


class AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: Tensor, groups: AxisGroups, axis: int) -> Tensor:
        return _reduce(t, groups, axis)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        return grad, None, None


class AllReduceMany(torch.autograd.Function):
    """Several P -> R on one axis as one all-reduce; backward: identity for each (integer
    inputs, e.g. token counts, have no gradient)."""

    @staticmethod
    def forward(
        ctx: Any, groups: AxisGroups, axis: int, dtype: torch.dtype, *tensors: Tensor
    ) -> tuple[Tensor, ...]:
        outs = _reduce_many(tensors, groups, axis, dtype)
        ctx.mark_non_differentiable(*(o for o in outs if not o.is_floating_point()))
        return outs

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        return (None, None, None, *grads)


class ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: Tensor, groups: AxisGroups, axis: int, dim: int) -> Tensor:
        ctx.args = (groups, axis, dim)
        return _reduce_scatter(t, groups, axis, dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        return _gather(grad, *ctx.args), None, None, None


class AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, t: Tensor, groups: AxisGroups, axis: int, dim: int, dst_dim: int
    ) -> Tensor:
        ctx.args = (groups, axis, dim, dst_dim)
        return _all_to_all(t, groups, axis, dim, dst_dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        groups, axis, dim, dst_dim = ctx.args
        return _all_to_all(grad, groups, axis, dst_dim, dim), None, None, None, None


class Slice(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: Tensor, groups: AxisGroups, axis: int, dim: int) -> Tensor:
        ctx.args = (groups, axis, dim)
        return _chunk(t, groups, axis, dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        return _gather(grad, *ctx.args), None, None, None


class GatherSections(torch.autograd.Function):
    """SectionShard(dim, sections) -> R on ``axis``: all-gather, then section order; backward:
    this rank's pieces of every section."""

    @staticmethod
    def forward(
        ctx: Any, t: Tensor, groups: AxisGroups, axis: int, dim: int, sections: tuple[int, ...]
    ) -> Tensor:
        ctx.args = (groups, axis, dim, sections)
        gathered = _gather(t, groups, axis, dim)
        return from_rank_major(gathered, dim, sections, groups.mesh_shape[axis])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        groups, axis, dim, sections = ctx.args
        size, index = groups.mesh_shape[axis], groups.coordinate[axis]
        return select_sections(grad, dim, sections, size, index), None, None, None, None


class SelectSections(torch.autograd.Function):
    """R -> SectionShard(dim, sections) on ``axis`` (no communication); backward: all-gather,
    then section order."""

    @staticmethod
    def forward(
        ctx: Any, t: Tensor, groups: AxisGroups, axis: int, dim: int, sections: tuple[int, ...]
    ) -> Tensor:
        ctx.args = (groups, axis, dim, sections)
        size, index = groups.mesh_shape[axis], groups.coordinate[axis]
        return select_sections(t, dim, sections, size, index)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        groups, axis, dim, sections = ctx.args
        gathered = _gather(grad.contiguous(), groups, axis, dim)
        return (
            from_rank_major(gathered, dim, sections, groups.mesh_shape[axis]),
            None,
            None,
            None,
            None,
        )


class ZeroOut(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: Tensor, groups: AxisGroups, axis: int) -> Tensor:
        return _zero_off_first(t, groups, axis)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        return grad, None, None


class GradAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: Tensor, groups: AxisGroups, axis: int) -> Tensor:
        ctx.args = (groups, axis)
        return t

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        return _reduce(grad, *ctx.args), None, None


# ---------------------------------------------------------------------------------------------
# Entry points: a list of steps, or one step per call from an fx graph.


def _apply(
    t: Tensor,
    groups: AxisGroups,
    kind: str,
    axis: int,
    dim: int | None,
    dst_dim: int | None,
    sections: tuple[int, ...] | None = None,
) -> Tensor:
    if kind == "all_gather":
        assert dim is not None
        return AllGather.apply(t, groups, axis, dim)
    if kind == "all_reduce":
        return AllReduce.apply(t, groups, axis)
    if kind == "reduce_scatter":
        assert dim is not None
        return ReduceScatter.apply(t, groups, axis, dim)
    if kind == "all_to_all":
        assert dim is not None and dst_dim is not None
        return AllToAll.apply(t, groups, axis, dim, dst_dim)
    if kind == "slice":
        assert dim is not None
        return Slice.apply(t, groups, axis, dim)
    if kind == "zero_out":
        return ZeroOut.apply(t, groups, axis)
    if kind in ("gather_sections", "select_sections"):
        assert dim is not None and sections is not None
        fn = GatherSections if kind == "gather_sections" else SelectSections
        return fn.apply(t, groups, axis, dim, tuple(sections))
    raise ValueError(f"unknown step kind {kind!r}")


def run_steps(tensor: Tensor, steps: Sequence[Step], groups: AxisGroups) -> Tensor:
    """Execute the forward ``steps`` of :func:`autopar.resharding.steps.reshard_steps` on this rank's
    local tensor; autograd then runs the matching backward steps."""
    for step in steps:
        tensor = _apply(tensor, groups, step.kind, step.axis, step.dim, step.dst_dim, step.sections)
    return tensor


def apply_step(
    t: Tensor,
    group_key: str,
    kind: str,
    axis: int,
    dim: int | None = None,
    dst_dim: int | None = None,
) -> Tensor:
    """One step by name, for fx graphs (``group_key``: a mesh registered by ``axis_groups``)."""
    return _apply(t, lookup_axis_groups(group_key), kind, axis, dim, dst_dim)


def autopar_all_gather(t: Tensor, group_key: str, axis: int, dim: int) -> Tensor:
    """S(dim) -> R on ``axis``; backward: local slice."""
    return AllGather.apply(t, lookup_axis_groups(group_key), axis, dim)


def autopar_gather_sections(
    t: Tensor, group_key: str, axis: int, dim: int, sections: tuple[int, ...]
) -> Tensor:
    """SectionShard(dim, sections) -> R on ``axis``; backward: local selection."""
    return GatherSections.apply(t, lookup_axis_groups(group_key), axis, dim, tuple(sections))


def autopar_select_sections(
    t: Tensor, group_key: str, axis: int, dim: int, sections: tuple[int, ...]
) -> Tensor:
    """R -> SectionShard(dim, sections) on ``axis`` (no communication); backward: all-gather."""
    return SelectSections.apply(t, lookup_axis_groups(group_key), axis, dim, tuple(sections))


def autopar_all_reduce(t: Tensor, group_key: str, axis: int) -> Tensor:
    """P -> R on ``axis``; backward: identity."""
    return AllReduce.apply(t, lookup_axis_groups(group_key), axis)


def autopar_all_reduce_many(
    tensors: Sequence[Tensor], group_key: str, axis: int, dtype: torch.dtype
) -> tuple[Tensor, ...]:
    """Several P -> R on ``axis`` with one all-reduce of a ``dtype`` buffer (the lowering's
    fused reductions); backward: identity."""
    return AllReduceMany.apply(lookup_axis_groups(group_key), axis, dtype, *tensors)


def autopar_reduce_scatter(t: Tensor, group_key: str, axis: int, dim: int) -> Tensor:
    """P -> S(dim) on ``axis``; backward: all_gather."""
    return ReduceScatter.apply(t, lookup_axis_groups(group_key), axis, dim)


def autopar_all_to_all(t: Tensor, group_key: str, axis: int, dim: int, dst_dim: int) -> Tensor:
    """S(dim) -> S(dst_dim) on ``axis``; backward: all_to_all S(dst_dim) -> S(dim)."""
    return AllToAll.apply(t, lookup_axis_groups(group_key), axis, dim, dst_dim)


def autopar_slice(t: Tensor, group_key: str, axis: int, dim: int) -> Tensor:
    """R -> S(dim) on ``axis`` (no communication); backward: all_gather."""
    return Slice.apply(t, lookup_axis_groups(group_key), axis, dim)


def autopar_zero_out(t: Tensor, group_key: str, axis: int) -> Tensor:
    """R -> P on ``axis``: the value on coordinate 0, zeros elsewhere; backward: identity."""
    return ZeroOut.apply(t, lookup_axis_groups(group_key), axis)


def autopar_grad_all_reduce(t: Tensor, group_key: str, axes: int | Sequence[int]) -> Tensor:
    """Identity forward; backward all-reduces the gradient over ``axes`` (a Replicate input whose
    gradient an op produces as Partial, e.g. the input of a column-parallel matmul)."""
    groups = lookup_axis_groups(group_key)
    for axis in (axes,) if isinstance(axes, int) else axes:
        t = GradAllReduce.apply(t, groups, axis)
    return t


# The names fx graphs print are prefixed (``autopar_all_gather(x, 'dp=2,tp=2', 1, 0)``) so a
# rewritten graph's code says whose collective it calls; the short names are the same functions.
all_gather = autopar_all_gather
all_reduce = autopar_all_reduce
reduce_scatter = autopar_reduce_scatter
all_to_all = autopar_all_to_all
local_slice = autopar_slice
zero_out = autopar_zero_out
grad_all_reduce = autopar_grad_all_reduce
