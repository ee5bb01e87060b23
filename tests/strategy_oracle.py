"""Test oracle for sharding rules: in-process numeric simulation and DTensor's propagation.

Two independent checks of a rule's strategies, both in one process:

* :func:`simulate` builds every rank's local inputs from full random inputs (Shard -> the rank's
  chunk, Replicate -> the full tensor, Partial -> a deterministic random split of the full tensor
  into parts that sum to it), runs the op per rank, assembles the outputs per the output
  placements and compares with the op on the full inputs. It then checks the backward under the
  gradient convention (a Partial output's gradient is Replicate; ``strategy.input_grads`` says how
  each input's local gradient assembles: Partial -> sum over the axis).
* :func:`dtensor_output_placements` asks DTensor (fake process group, one process) which output
  placements it produces for the strategy's input placements, refusing any redistribution.

:func:`check_rule` runs both over every strategy a registered rule expands to.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from autopar.placement import (
    Partial,
    Placement,
    Replicate,
    SectionShard,
    Shard,
    format_placements,
    section_axis,
)
from autopar.resharding.sections import from_rank_major, to_rank_major
from autopar.strategies.registry import (
    OpCall,
    Strategy,
    expand,
    get_rule,
    output_metas,
    tensor_meta,
)

Coord = tuple[int, ...]
# adjust_args(local_args, local_kwargs, local_output_shapes) -> (args, kwargs): lets shape-taking
# ops (view, reshape, expand, new_zeros, ...) receive per-rank sizes in the simulation.
AdjustArgs = Callable[[tuple, dict, tuple], tuple[tuple, dict]]

FAKE_WORLD_SIZE = 64


# --------------------------------------------------------------------------------------------
# OpCall from real arguments


def _clone_tensors(tree: Any) -> Any:
    return tree_map(lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, tree)


def call_from_args(op: Any, args: tuple, kwargs: dict) -> OpCall:
    """The OpCall a node ``op(*args, **kwargs)`` would give, from real tensors."""
    leaves, _ = tree_flatten((args, kwargs))
    inputs = tuple(tensor_meta(x) for x in leaves if isinstance(x, torch.Tensor))
    cargs, ckwargs = _clone_tensors((args, kwargs))
    out = op(*cargs, **ckwargs)
    return OpCall(
        op,
        tuple(tensor_meta(a) for a in args),
        {k: tensor_meta(v) for k, v in kwargs.items()},
        inputs,
        output_metas(out),
    )


def _out_tuple(out: Any) -> tuple[Any, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


# --------------------------------------------------------------------------------------------
# Local pieces of a global tensor


def _coords(mesh_shape: Sequence[int]) -> list[Coord]:
    return list(itertools.product(*(range(s) for s in mesh_shape)))


def _shard_slice(
    t: torch.Tensor, placements: Sequence[Placement], mesh_shape: Sequence[int], coord: Coord
) -> torch.Tensor:
    """The rank's chunk: each dim split over its Shard axes in mesh-axis order (axis 0 outermost).

    A SectionShard dim is put in rank-major order first (a copy, so only for reading)."""
    axis = section_axis(placements)
    if axis is not None:
        p = placements[axis]
        t = to_rank_major(t, p.dim % t.ndim, p.sections, mesh_shape[axis])
        placements = _contiguous(placements)
    out = t
    for dim in range(t.ndim):
        index, count = 0, 1
        for axis, p in enumerate(placements):
            if isinstance(p, Shard) and p.dim % t.ndim == dim:
                index = index * mesh_shape[axis] + coord[axis]
                count *= mesh_shape[axis]
        if count > 1:
            assert t.shape[dim] % count == 0, (t.shape, format_placements(placements), mesh_shape)
            size = t.shape[dim] // count
            out = out.narrow(dim, index * size, size)
    return out


def _contiguous(placements: Sequence[Placement]) -> tuple[Placement, ...]:
    """``placements`` with a SectionShard read as the Shard of its dim."""
    return tuple(Shard(p.dim) if isinstance(p, SectionShard) else p for p in placements)


def _partial_parts(
    t: torch.Tensor, placements: Sequence[Placement], mesh_shape: Sequence[int], seed: int
) -> dict[Coord, torch.Tensor]:
    """Random parts of ``t``, one per coordinate on the Partial axes, that sum to ``t``."""
    axes = [a for a, p in enumerate(placements) if isinstance(p, Partial)]
    keys = list(itertools.product(*(range(mesh_shape[a]) for a in axes)))
    if len(keys) == 1:
        return {keys[0]: t}
    gen = torch.Generator().manual_seed(seed)
    parts: dict[Coord, torch.Tensor] = {}
    if t.dtype.is_floating_point or t.dtype.is_complex:
        total = torch.zeros_like(t)
        for key in keys[:-1]:
            part = torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.dtype)
            parts[key] = part
            total = total + part
        parts[keys[-1]] = t - total
    else:
        assert t.dtype != torch.bool, "a bool tensor cannot be Partial"
        for key in keys:
            parts[key] = torch.zeros_like(t)
        parts[keys[0]] = t.clone()
    return parts


def _local_value(
    t: torch.Tensor,
    placements: Sequence[Placement],
    mesh_shape: Sequence[int],
    coord: Coord,
    parts: dict[Coord, torch.Tensor],
) -> torch.Tensor:
    axes = [a for a, p in enumerate(placements) if isinstance(p, Partial)]
    part = parts[tuple(coord[a] for a in axes)]
    return _shard_slice(part, placements, mesh_shape, coord).clone()


def _local_shape(
    shape: Sequence[int], placements: Sequence[Placement], mesh_shape: Sequence[int]
) -> tuple[int, ...]:
    out = list(shape)
    for axis, p in enumerate(placements):
        if isinstance(p, (Shard, SectionShard)):
            out[p.dim % len(shape)] //= mesh_shape[axis]
    return tuple(out)


def _assemble(
    locals_: dict[Coord, torch.Tensor],
    placements: Sequence[Placement],
    mesh_shape: Sequence[int],
    full_shape: Sequence[int],
    what: str,
    *,
    rtol: float,
    atol: float,
) -> torch.Tensor:
    """Global tensor from per-rank values: Shard -> concatenate, Partial -> sum, Replicate -> equal.

    A SectionShard is assembled as a Shard of the rank-major order, then put in section order."""
    axis = section_axis(placements)
    if axis is not None:
        p = placements[axis]
        rank_major = _assemble(
            locals_,
            _contiguous(placements),
            mesh_shape,
            full_shape,
            what,
            rtol=rtol,
            atol=atol,
        )
        return from_rank_major(rank_major, p.dim % len(full_shape), p.sections, mesh_shape[axis])
    any_local = next(iter(locals_.values()))
    result = torch.zeros(tuple(full_shape), dtype=any_local.dtype)
    rep_axes = [a for a, p in enumerate(placements) if isinstance(p, Replicate)]
    for coord, value in locals_.items():
        base = tuple(0 if a in rep_axes else c for a, c in enumerate(coord))
        if base != coord:
            torch.testing.assert_close(
                value,
                locals_[base],
                rtol=rtol,
                atol=atol,
                msg=lambda m, coord=coord, base=base: (
                    f"{what}: ranks {coord} and {base} differ on a Replicate axis\n{m}"
                ),
            )
            continue
        region = _shard_slice(result, placements, mesh_shape, coord)
        assert region.shape == value.shape, (
            f"{what}: local shape {tuple(value.shape)} != {tuple(region.shape)}"
        )
        if result.dtype == torch.bool:
            region |= value
        else:
            region += value
    return result


# --------------------------------------------------------------------------------------------
# Numeric simulation


def _is_float(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.dtype.is_floating_point or t.dtype.is_complex)


def _run(
    op: Any, spec: Any, leaves: list[Any], adjust: AdjustArgs | None, out_shapes: tuple
) -> tuple:
    # Clone before calling so in-place ops neither touch the leaves nor break autograd on them.
    fed = [x.clone() if isinstance(x, torch.Tensor) else x for x in leaves]
    args, kwargs = tree_unflatten(fed, spec)
    if adjust is not None:
        args, kwargs = adjust(args, kwargs, out_shapes)
    return _out_tuple(op(*args, **kwargs))


def _differentiable_positions(
    op: Any, spec: Any, leaves: list[Any], tensor_pos: list[int]
) -> set[int]:
    """Leaf positions of the float inputs that may require grad (some ops refuse it, e.g. nll's weight)."""
    positions = set()
    for i in tensor_pos:
        if not _is_float(leaves[i]):
            continue
        trial = [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in leaves]
        trial[i].requires_grad_(True)
        try:
            _run(op, spec, trial, None, ())
        except RuntimeError as e:
            if "not differentiable" not in str(e) and "does not require grad" not in str(e):
                raise
            continue
        positions.add(i)
    return positions


def simulate(
    op: Any,
    args: tuple,
    kwargs: dict,
    strategy: Strategy,
    mesh_shape: tuple[int, ...],
    *,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    adjust_args: AdjustArgs | None = None,
) -> None:
    """Assert that ``strategy`` computes ``op`` exactly, forward and backward, on ``mesh_shape``.

    ``adjust_args`` (optional) rewrites the per-rank args of shape-taking ops, given the local
    output shapes. Use float64 inputs so that Partial splits do not add rounding noise.
    """
    mesh_shape = tuple(mesh_shape)
    leaves, spec = tree_flatten((args, kwargs))
    tensor_pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    assert len(tensor_pos) == len(strategy.inputs), "strategy has a different number of inputs"
    name = f"{op} {strategy.describe()} on {mesh_shape}"

    # Full run with gradients (for the float inputs the op is differentiable in).
    differentiable = _differentiable_positions(op, spec, leaves, tensor_pos)
    full_leaves = [
        x.detach().clone().requires_grad_(i in differentiable) if isinstance(x, torch.Tensor) else x
        for i, x in enumerate(leaves)
    ]
    full_outs = _run(op, spec, full_leaves, None, ())
    full_out_shapes = tuple(
        tuple(o.shape) if isinstance(o, torch.Tensor) else None for o in full_outs
    )
    out_local_shapes = tuple(
        None if pl is None or shape is None else _local_shape(shape, pl, mesh_shape)
        for shape, pl in zip(full_out_shapes, strategy.outputs)
    )
    gen = torch.Generator().manual_seed(1234)
    upstream = tuple(
        torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)
        if _is_float(o) and o.requires_grad
        else None
        for o in full_outs
    )
    grad_inputs = [full_leaves[i] for i in tensor_pos if i in differentiable]
    pairs = [(o, g) for o, g in zip(full_outs, upstream) if g is not None]
    full_grads: list[torch.Tensor | None] = [None] * len(grad_inputs)
    if pairs and grad_inputs:
        full_grads = list(
            torch.autograd.grad(
                [o for o, _ in pairs], grad_inputs, [g for _, g in pairs], allow_unused=True
            )
        )

    # Per-rank runs.
    parts = {
        j: _partial_parts(leaves[i], strategy.inputs[j], mesh_shape, seed=100 + j)
        for j, i in enumerate(tensor_pos)
        if strategy.inputs[j] is not None
    }
    local_outs: list[dict[Coord, torch.Tensor]] = [{} for _ in full_outs]
    local_grads: list[dict[Coord, torch.Tensor]] = [{} for _ in grad_inputs]
    for coord in _coords(mesh_shape):
        local_leaves = list(leaves)
        for j, i in enumerate(tensor_pos):
            placements = strategy.inputs[j]
            value = (
                leaves[i]
                if placements is None
                else _local_value(leaves[i], placements, mesh_shape, coord, parts[j])
            )
            local_leaves[i] = value.detach().clone().requires_grad_(i in differentiable)
        outs = _run(op, spec, local_leaves, adjust_args, out_local_shapes)
        assert len(outs) == len(full_outs), f"{name}: local run gave {len(outs)} outputs"
        for k, o in enumerate(outs):
            if isinstance(o, torch.Tensor) and strategy.outputs[k] is not None:
                assert tuple(o.shape) == out_local_shapes[k], (
                    f"{name}: rank {coord} output {k} has shape {tuple(o.shape)}, "
                    f"the placement implies {out_local_shapes[k]}"
                )
                local_outs[k][coord] = o.detach()
        local_pairs = []
        for k, o in enumerate(outs):
            if upstream[k] is None or strategy.outputs[k] is None:
                continue
            g = _shard_slice(upstream[k], strategy.outputs[k], mesh_shape, coord)
            local_pairs.append((o, g))
        local_grad_inputs = [local_leaves[i] for i in tensor_pos if i in differentiable]
        if local_pairs and local_grad_inputs:
            grads = torch.autograd.grad(
                [o for o, _ in local_pairs],
                local_grad_inputs,
                [g for _, g in local_pairs],
                allow_unused=True,
            )
            for k, g in enumerate(grads):
                local_grads[k][coord] = torch.zeros_like(local_grad_inputs[k]) if g is None else g

    for k, full in enumerate(full_outs):
        if strategy.outputs[k] is None or not isinstance(full, torch.Tensor):
            continue
        got = _assemble(
            local_outs[k],
            strategy.outputs[k],
            mesh_shape,
            full.shape,
            f"{name} output {k}",
            rtol=rtol,
            atol=atol,
        )
        torch.testing.assert_close(
            got,
            full.detach(),
            rtol=rtol,
            atol=atol,
            equal_nan=True,
            msg=lambda m, k=k: f"{name}: output {k} differs from the unsharded op\n{m}",
        )

    float_slots = [j for j, i in enumerate(tensor_pos) if i in differentiable]
    for k, j in enumerate(float_slots):
        if not local_grads[k] or full_grads[k] is None:
            continue
        grad_pl = strategy.input_grads[j] if strategy.input_grads else None
        if grad_pl is None:
            continue
        got = _assemble(
            local_grads[k],
            grad_pl,
            mesh_shape,
            leaves[tensor_pos[j]].shape,
            f"{name} grad of input {j}",
            rtol=rtol,
            atol=atol,
        )
        torch.testing.assert_close(
            got,
            full_grads[k],
            rtol=rtol,
            atol=atol,
            equal_nan=True,
            msg=lambda m, j=j, grad_pl=grad_pl: (
                f"{name}: gradient of input {j} (as {format_placements(grad_pl)}) is wrong\n{m}"
            ),
        )


# --------------------------------------------------------------------------------------------
# DTensor's propagation (fake process group)


@functools.cache
def _device_mesh(mesh_shape: tuple[int, ...]) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    if not dist.is_initialized():
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=FAKE_WORLD_SIZE)
    world = dist.get_world_size()
    if math.prod(mesh_shape) > world:
        raise RuntimeError(
            f"mesh {mesh_shape} needs {math.prod(mesh_shape)} ranks; the process group has {world}"
        )
    return DeviceMesh("cpu", torch.arange(math.prod(mesh_shape)).reshape(mesh_shape))


def dtensor_output_placements(
    op: Any, args: tuple, kwargs: dict, strategy: Strategy, mesh_shape: tuple[int, ...]
) -> tuple | None:
    """DTensor's output placements for the strategy's input placements (rank 0's view).

    Returns None when DTensor has no strategy for the op or would redistribute any input
    (checked with ``ExplicitRedistributionContext(strict=True)``, which also covers the ops of a
    CompositeImplicitAutograd decomposition such as ``aten.linear``). Non-tensor outputs are None.
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import ExplicitRedistributionContext

    mesh = _device_mesh(tuple(mesh_shape))
    coord = (0,) * len(mesh_shape)
    leaves, spec = tree_flatten((args, kwargs))
    fed = list(leaves)
    j = 0
    for i, x in enumerate(leaves):
        if not isinstance(x, torch.Tensor):
            continue
        placements = strategy.inputs[j]
        if placements is not None:
            parts = _partial_parts(x, placements, mesh_shape, seed=7)
            local = _local_value(x, placements, mesh_shape, coord, parts)
            fed[i] = DTensor.from_local(
                local, mesh, placements, run_check=False, shape=x.shape, stride=x.stride()
            )
        j += 1
    dargs, dkwargs = tree_unflatten(fed, spec)
    try:
        with torch.no_grad(), ExplicitRedistributionContext(strict=True):
            out = op(*dargs, **dkwargs)
    except Exception:  # noqa: BLE001
        # No strategy (NotImplementedError), a refused redistribution (RuntimeError), or DTensor
        # failing inside a decomposition (e.g. a view of a doubly-split dim): DTensor cannot run
        # the op with these input placements.
        return None
    return tuple(o.placements if isinstance(o, DTensor) else None for o in _out_tuple(out))


# --------------------------------------------------------------------------------------------
# The whole check


def _explained(describe: str, dtensor_differs: dict[str, str]) -> bool:
    """Allow-list keys: an exact ``Strategy.describe()``, ``"*"`` (every strategy), or
    ``"re:<regex>"`` searched in ``describe()``."""
    for key in dtensor_differs:
        if key == "*" or key == describe:
            return True
        if key.startswith("re:") and re.search(key[3:], describe):
            return True
    return False


def _same_placements(ours: tuple, theirs: tuple | None) -> bool:
    if theirs is None or len(ours) != len(theirs):
        return False
    for a, b in zip(ours, theirs):
        if a is None or b is None:
            continue
        if tuple(a) != tuple(b):
            return False
    return True


def check_rule(
    op: Any,
    args: tuple,
    kwargs: dict,
    *,
    mesh_shapes: Sequence[tuple[int, ...]] = ((2,), (2, 2)),
    dtensor_differs: dict[str, str] | None = None,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    adjust_args: AdjustArgs | None = None,
    dtensor_mesh_shapes: Sequence[tuple[int, ...]] | None = None,
) -> list[Strategy]:
    """Expand the registered rule of ``op`` on each mesh, simulate every strategy numerically and
    compare its outputs with DTensor's; returns all strategies checked.

    ``dtensor_differs`` maps a ``Strategy.describe()`` (or ``"*"`` / ``"re:<regex>"``) to the
    reason our strategy differs from DTensor's choice; unexplained mismatches fail.
    ``dtensor_mesh_shapes`` (default: ``mesh_shapes``) limits the DTensor comparison to some
    meshes: DTensor's redistribution planner makes decomposed ops (4-D matmul, einsum) slow.
    """
    rule = get_rule(op)
    assert rule is not None, f"no rule registered for {op}"
    call = call_from_args(op, args, kwargs)
    differs = dtensor_differs or {}
    checked: list[Strategy] = []
    mismatches: list[str] = []
    for mesh_shape in mesh_shapes:
        strategies = expand(call, rule(call), mesh_shape)
        assert strategies, f"{op}: no strategy on mesh {mesh_shape}"
        assert any(
            all(
                p is None or all(isinstance(x, Replicate) for x in p)
                for p in (*s.inputs, *s.outputs)
            )
            for s in strategies
        ), f"{op}: the all-Replicate strategy is missing on mesh {mesh_shape}"
        for strategy in strategies:
            simulate(
                op,
                args,
                kwargs,
                strategy,
                tuple(mesh_shape),
                rtol=rtol,
                atol=atol,
                adjust_args=adjust_args,
            )
            checked.append(strategy)
            if dtensor_mesh_shapes is not None and tuple(mesh_shape) not in {
                tuple(m) for m in dtensor_mesh_shapes
            }:
                continue
            theirs = dtensor_output_placements(op, args, kwargs, strategy, tuple(mesh_shape))
            if not _same_placements(strategy.outputs, theirs) and not _explained(
                strategy.describe(), differs
            ):
                shown = None if theirs is None else " ".join(format_placements(p) for p in theirs)
                mismatches.append(
                    f"  mesh {tuple(mesh_shape)}: ours {strategy.describe()}, DTensor -> {shown}"
                )
    assert not mismatches, (
        f"{op}: strategies that differ from DTensor without a reason:\n" + "\n".join(mismatches)
    )
    return checked
