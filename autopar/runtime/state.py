"""Sharded state dicts for ``torch.distributed.checkpoint`` and lazy loading of full checkpoints.

Sharded form. :func:`sharded_state_dict` returns, per FQN, a ``DTensor`` whose local tensor is
this rank's real shard and whose placements say where it lies in the full tensor, so that
``torch.distributed.checkpoint`` (DCP) saves each element once and loads it onto any other mesh,
plan or ZeRO stage (or into plain tensors on one process). Nothing is gathered whole:

* a parameter or buffer that is not ZeRO-managed is its tensor-parallel block, with the plan's
  placements on a ``DeviceMesh`` built from autopar's own per-axis process groups;
* a ZeRO-managed parameter lives in flat chunk pieces (any elements of the block, cut at chunk
  boundaries). It is re-partitioned into an even split of the block's rows (dim 0) over its
  ZeRO axes, ``torch.chunk`` style (uneven splits allowed, as DTensor's ``Shard`` allows), by
  one uneven all-to-all in which a rank exchanges with its ZeRO group only (each element
  moves at most once; no rank holds more than its pieces and its rows). In DTensor terms that is
  ``Shard(0)`` on each ZeRO axis, nested INSIDE the tensor-parallel shards; DTensor nests
  shards of one dim in mesh-axis order, so the ``DeviceMesh`` of such a tensor lists the
  non-ZeRO axes first and the ZeRO axes last (the same ranks and groups, axes permuted).
  A 0-d parameter is the exception: it is Replicate on the ZeRO axes (one element).

Loading (:func:`load_sharded_state_dict`) runs the exchange backwards; the DTensors must have
this module's layout (what :func:`sharded_state_dict` returns, filled by ``dcp.load``). The
optimizer's state follows the same rules per state tensor (:func:`sharded_optim_state_dict`,
:func:`load_sharded_optim_state_dict`), in the FQN-keyed format of
``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``, so a plain module on one
process loads it with ``set_optimizer_state_dict``.

Lazy full loading: :class:`StateSource` and :func:`block_index` (:mod:`.state_source`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.nn.modules.module import _IncompatibleKeys

from autopar.placement import Placements, section_axis
from autopar.runtime.materialize import local_block
from autopar.runtime.state_sections import contiguous_sections, convert_sections
from autopar.runtime.state_source import StateSource, block_index, global_shape

__all__ = [
    "StateSource",
    "block_index",
    "global_shape",
    "load_sharded_optim_state_dict",
    "load_sharded_state_dict",
    "sharded_optim_state_dict",
    "sharded_state_dict",
]


def _nested_rows(num_rows: int, splits: Iterable[tuple[int, int]]) -> tuple[int, int]:
    """Rows [start, stop) of a member after nested ``torch.chunk`` splits ``(size, coord)``,
    outermost first (DTensor's uneven ``Shard`` semantics)."""
    start, length = 0, num_rows
    for size, coord in splits:
        full = -(-length // size)
        offset = min(full * coord, length)
        new_length = max(0, min(length, offset + full) - offset)
        start, length = start + offset, new_length
    return start, start + length


@dataclass(frozen=True, kw_only=True, slots=True)
class _ZeroGroup:
    """Where a ZeRO-managed parameter's elements are, over the ranks of its ZeRO group."""

    ranks: tuple[int, ...]
    """Global ranks of the group, by shard index (row-major over the ZeRO axes)."""
    have: tuple[tuple[int, int], ...]
    """Per member: flat range of the tensor-parallel block its chunk piece holds."""
    want: tuple[tuple[int, int], ...]
    """Per member: flat range its row shard covers."""
    me: int
    """This rank's index in ``ranks``."""
    rows_shape: tuple[int, ...]
    """Shape of this rank's row shard."""


class _Layouts:
    """The sharded-form layout of every local tensor of one ParallelModule."""

    def __init__(self, pmodel: Any) -> None:
        self.pmodel = pmodel
        self.groups = pmodel.groups
        self.mesh_shape = tuple(pmodel.lowered.mesh_shape)
        self.coords = tuple(pmodel.coords)
        self._meshes: dict[tuple[int, ...], DeviceMesh] = {}

    def device_mesh(self, order: tuple[int, ...]) -> DeviceMesh:
        """The mesh's DeviceMesh with its axes in ``order`` (same ranks and groups)."""
        mesh = self._meshes.get(order)
        if mesh is None:
            base = self.groups.device_mesh
            if order == tuple(range(len(self.mesh_shape))):
                mesh = base
            else:
                # Global ranks (a pipeline stage's submesh is not the whole world).
                grid = base.mesh.view(self.mesh_shape)
                names = tuple(self.groups.axis_names[a] for a in order)
                mesh = DeviceMesh.from_group(
                    [self.groups.groups[a] for a in order],
                    base.device_type,
                    mesh=grid.permute(order).contiguous(),
                    mesh_dim_names=names,
                )
            self._meshes[order] = mesh
        return mesh

    def placements_of(self, name: str) -> Placements:
        """The plan's (tensor-parallel) placements of a parameter or buffer."""
        pmodel = self.pmodel
        return pmodel._param_placements.get(name) or pmodel._buffer_placements[name]

    def zero_group(self, param: torch.Tensor) -> _ZeroGroup | None:
        """The ZeRO geometry of a managed shard parameter (None if not managed)."""
        engine = self.pmodel.zero
        if engine is None or not engine.manages(param):
            return None
        chunk, slot = engine.slot_of(param)
        axes = chunk.zero_axes
        sizes = [self.mesh_shape[a] for a in axes]
        num_rows = slot.shape[0] if len(slot.shape) else 1
        row_numel = math.prod(slot.shape[1:]) if len(slot.shape) else 1
        ranks, have, want = [], [], []
        me = -1
        for k in range(math.prod(sizes)):
            member = list(self.coords)
            rest = k
            for axis, size in zip(reversed(axes), reversed(sizes)):
                member[axis] = rest % size
                rest //= size
            # Global rank of the member (a pipeline stage's submesh is not the whole world).
            ranks.append(int(self.groups.device_mesh.mesh.view(self.mesh_shape)[tuple(member)]))
            if tuple(member) == self.coords:
                me = k
            lo = max(k * chunk.shard_numel - slot.offset, 0)
            hi = min((k + 1) * chunk.shard_numel - slot.offset, slot.numel)
            have.append((lo, max(lo, hi)))
            if len(slot.shape):
                r0, r1 = _nested_rows(num_rows, zip(sizes, (member[a] for a in axes)))
            else:
                r0, r1 = 0, 1
            want.append((r0 * row_numel, r1 * row_numel))
        assert me >= 0
        rows = (want[me][1] - want[me][0]) // row_numel
        rows_shape = (rows, *slot.shape[1:]) if len(slot.shape) else ()
        return _ZeroGroup(
            ranks=tuple(ranks), have=tuple(have), want=tuple(want), me=me, rows_shape=rows_shape
        )

    def placements(
        self, name: str, param: torch.Tensor, zero: _ZeroGroup | None
    ) -> tuple[tuple[int, ...], tuple[Any, ...], tuple[int, ...]]:
        """(mesh axis order, DTensor placements in that order, global shape) of one tensor."""
        pmodel = self.pmodel
        tp = self.placements_of(name)
        num_axes = len(self.mesh_shape)
        # DCP needs contiguous blocks: a SectionShard is the Shard of its dim (state_sections).
        tp = contiguous_sections(tp)
        if zero is None:
            return tuple(range(num_axes)), tuple(tp), global_shape(param.shape, tp, self.mesh_shape)
        engine = pmodel.zero
        chunk, slot = engine.slot_of(param)
        zero_axes = chunk.zero_axes
        order = tuple(a for a in range(num_axes) if a not in zero_axes) + tuple(zero_axes)
        row_split = Shard(0) if len(slot.shape) else Replicate()
        placements = tuple(tp[a] if a not in zero_axes else row_split for a in order)
        return order, placements, global_shape(slot.shape, tp, self.mesh_shape)


def _exchange(
    items: Sequence[tuple[_ZeroGroup, torch.Tensor]], *, backwards: bool = False
) -> list[torch.Tensor]:
    """Move ZeRO-managed elements between the chunk-piece layout and the row layout.

    ``items``: (geometry, flat local data). Forwards the data is each member's ``have`` range
    and the result its ``want`` range; backwards the other way round. What goes to one peer is
    the pieces of every item concatenated in item order (every rank computes every range, so
    both ends agree on sizes and order). A collective: every rank must call it with the same
    items (its own geometry of each)."""
    me = dist.get_rank()
    outs: list[torch.Tensor] = []
    sends: dict[int, list[torch.Tensor]] = {}
    recvs: dict[int, list[tuple[int, int, int]]] = {}
    for i, (group, data) in enumerate(items):
        have, want = (group.want, group.have) if backwards else (group.have, group.want)
        my_have, my_want = have[group.me], want[group.me]
        out = torch.empty(my_want[1] - my_want[0], dtype=data.dtype, device=data.device)
        outs.append(out)
        for k, peer in enumerate(group.ranks):
            lo, hi = max(my_have[0], want[k][0]), min(my_have[1], want[k][1])
            if hi > lo:
                piece = data[lo - my_have[0] : hi - my_have[0]]
                if peer == me:
                    out[lo - my_want[0] : hi - my_want[0]].copy_(piece)
                else:
                    sends.setdefault(peer, []).append(piece)
            lo, hi = max(have[k][0], my_want[0]), min(have[k][1], my_want[1])
            if hi > lo and peer != me:
                recvs.setdefault(peer, []).append((i, lo - my_want[0], hi - my_want[0]))
    dtypes = {data.dtype for _, data in items}
    if len(dtypes) > 1:
        raise AssertionError(f"one exchange per dtype, got {dtypes}")
    if not items:
        return outs
    # One all_to_all over the world (uneven splits, zero for ranks outside the ZeRO groups):
    # a collective keeps every rank's sequence of operations on the group the same, which
    # point-to-point messages of rank-dependent counts would not.
    world = dist.get_world_size()
    send_sizes = [sum(p.numel() for p in sends.get(r, [])) for r in range(world)]
    recv_sizes = [sum(hi - lo for _, lo, hi in recvs.get(r, [])) for r in range(world)]
    dtype, device = outs[0].dtype, outs[0].device
    pieces = [p for r in range(world) for p in sends.get(r, [])]
    send = torch.cat(pieces) if pieces else torch.empty(0, dtype=dtype, device=device)
    recv = torch.empty(sum(recv_sizes), dtype=dtype, device=device)
    dist.all_to_all_single(recv, send, recv_sizes, send_sizes)
    at = 0
    for r in range(world):
        for i, lo, hi in recvs.get(r, []):
            outs[i][lo:hi].copy_(recv[at : at + hi - lo])
            at += hi - lo
    return outs


# ---------------------------------------------------------------------------------------------
# Model state


def sharded_state_dict(pmodel: Any) -> dict[str, DTensor]:
    """Per persistent FQN, a DTensor of this rank's shard (module docstring); a collective
    (ZeRO-managed parameters are exchanged among their ZeRO group). Tied parameters appear
    under each of their names. ``dcp.save`` it; to load, fill a fresh one with ``dcp.load``
    and pass it to ``pmodel.load_state_dict``."""
    layouts = _Layouts(pmodel)
    named = [(n, t) for n, t in pmodel._named_state() if n in pmodel._persistent]
    return _to_dtensors(layouts, [(name, tensor, tensor) for name, tensor in named])


def _to_dtensors(
    layouts: _Layouts, entries: Sequence[tuple[str, torch.Tensor, torch.Tensor]]
) -> dict[str, Any]:
    """(name, shard parameter or buffer, local value shaped like it) -> name -> DTensor."""
    out: dict[str, Any] = {}
    done: dict[int, DTensor] = {}
    zero_items: dict[torch.dtype, list[tuple[str, _ZeroGroup, torch.Tensor, torch.Tensor]]] = {}
    section_items: list[tuple[str, _ZeroGroup, torch.Tensor, torch.Tensor]] = []
    for name, param, value in entries:
        if id(value) in done:
            out[name] = done[id(value)]
            continue
        zero = layouts.zero_group(param)
        if zero is not None and section_axis(layouts.placements_of(name)) is not None:
            section_items.append((name, zero, param, value))
        elif zero is None:
            local = convert_sections(layouts.placements_of(name), value.detach(), layouts.groups)
            out[name] = done[id(value)] = _dtensor(layouts, name, param, local, None)
        else:
            zero_items.setdefault(value.dtype, []).append((name, zero, param, value))
    for dtype in sorted(zero_items, key=str):
        items = zero_items[dtype]
        rows = _exchange([(z, v.detach().reshape(-1)) for _, z, _, v in items])
        for (name, zero, param, value), flat in zip(items, rows):
            dt = _dtensor(layouts, name, param, flat.view(zero.rows_shape), zero)
            out[name] = done[id(value)] = dt
    if section_items:
        # Whole local blocks (gathered over the ZeRO axes), then their contiguous form.
        pieces = {id(p): v.detach() for _, _, p, v in section_items}
        blocks = layouts.pmodel.zero.gather_pieces(pieces)
        for name, zero, param, value in section_items:
            tp = layouts.placements_of(name)
            local = convert_sections(tp, blocks[id(param)], layouts.groups).reshape(-1)
            rows = local[zero.want[zero.me][0] : zero.want[zero.me][1]].view(zero.rows_shape)
            out[name] = done[id(value)] = _dtensor(layouts, name, param, rows, zero)
    return {name: out[name] for name, _, _ in entries}


def _dtensor(
    layouts: _Layouts, name: str, param: torch.Tensor, local: torch.Tensor, zero: _ZeroGroup | None
) -> DTensor:
    order, placements, shape = layouts.placements(name, param, zero)
    mesh = layouts.device_mesh(order)
    stride = torch.empty(shape, device="meta").stride()
    expected, _ = compute_local_shape_and_global_offset(shape, mesh, placements)
    assert tuple(expected) == tuple(local.shape), (name, expected, local.shape)
    return DTensor.from_local(
        local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride
    )


def _local_of(layouts: _Layouts, name: str, param: torch.Tensor, value: Any) -> torch.Tensor:
    """The local tensor of a DTensor that must have this module's sharded layout."""
    if not isinstance(value, DTensor):
        raise TypeError(f"{name}: expected a DTensor of the sharded form, got {type(value)}")
    zero = layouts.zero_group(param)
    order, placements, shape = layouts.placements(name, param, zero)
    mesh = layouts.device_mesh(order)
    same_mesh = value.device_mesh.mesh.tolist() == mesh.mesh.tolist()
    if tuple(value.shape) != tuple(shape):
        raise ValueError(
            f"{name}: the checkpoint has shape {tuple(value.shape)} but the model has "
            f"{tuple(shape)}; load a checkpoint of this model"
        )
    if not same_mesh or tuple(value.placements) != placements:
        raise ValueError(
            f"{name}: this sharded state dict has another layout ({value.placements} on "
            f"{value.device_mesh}) than this module ({placements} on {mesh}); load it through "
            f"torch.distributed.checkpoint: sd = pmodel.state_dict(sharded=True); "
            f"dcp.load(sd, checkpoint_id=...); pmodel.load_state_dict(sd)"
        )
    return value.to_local()


def load_sharded_state_dict(
    pmodel: Any, state_dict: Mapping[str, Any], strict: bool = True
) -> _IncompatibleKeys:
    """Load :func:`sharded_state_dict`'s form (of this module's layout); a collective.

    Plain tensors in ``state_dict`` are taken as FULL tensors (``load_state_dict``'s other
    form)."""
    layouts = _Layouts(pmodel)
    own = dict(pmodel._named_state())
    missing = [n for n in own if n in pmodel._persistent and n not in state_dict]
    unexpected = [n for n in state_dict if n not in own]
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"ParallelModule.load_state_dict: missing keys {missing}, unexpected keys "
            f"{unexpected}; a sharded state dict must come from pmodel.state_dict(sharded=True)"
        )
    full = {n: v for n, v in state_dict.items() if n in own and not isinstance(v, DTensor)}
    if full:
        pmodel.load_state_dict(full, strict=False)
    entries = [(n, own[n], v) for n, v in state_dict.items() if n in own and n not in full]
    _store(layouts, entries, lambda param, local: _copy_into(param, local))
    return _IncompatibleKeys(missing, unexpected)


def _copy_into(target: torch.Tensor, local: torch.Tensor) -> None:
    with torch.no_grad():
        target.copy_(local.reshape(target.shape))


def _store(
    layouts: _Layouts,
    entries: Sequence[tuple[str, torch.Tensor, Any]],
    put: Callable[[torch.Tensor, torch.Tensor], None],
) -> None:
    """For (name, shard parameter or buffer, DTensor): ``put(param, local value shaped like
    the parameter)``, exchanging ZeRO-managed ones back to chunk pieces; a collective."""
    engine = layouts.pmodel.zero
    zero_items: dict[torch.dtype, list[tuple[_ZeroGroup, torch.Tensor, torch.Tensor]]] = {}
    seen: set[tuple[int, int]] = set()
    touched: set[int] = set()
    for name, param, value in entries:
        local = _local_of(layouts, name, param, value)
        if (id(param), id(value)) in seen:
            continue  # a tied parameter's other name
        seen.add((id(param), id(value)))
        zero = layouts.zero_group(param)
        tp = layouts.placements_of(name)
        if zero is None:
            put(param, convert_sections(tp, local, layouts.groups, to_contiguous=False))
        elif section_axis(tp) is not None:
            # Rows of the contiguous form: gathered whole (one tensor), then this rank's block.
            full = value.full_tensor()
            block = local_block(full, tp, layouts.mesh_shape, layouts.coords)
            put(param, engine.piece_of(param, block))
            touched.add(engine.slot_of(param)[0].index)
        else:
            zero_items.setdefault(local.dtype, []).append((zero, param, local))
    for dtype in sorted(zero_items, key=str):
        items = zero_items[dtype]
        pieces = _exchange([(z, v.reshape(-1)) for z, _, v in items], backwards=True)
        for (_, param, _), piece in zip(items, pieces):
            put(param, piece)
            touched.add(engine.slot_of(param)[0].index)
    if engine is not None:
        for index in sorted(touched):
            engine.sync_full(index)


# ---------------------------------------------------------------------------------------------
# Optimizer state


def _init_optim_state(pmodel: Any, optimizer: torch.optim.Optimizer) -> None:
    """Create missing optimizer state by a zero-learning-rate step with zero gradients (as
    ``torch.distributed.checkpoint.state_dict`` does; parameters do not change); under ZeRO,
    parameters this rank holds no piece of take their owners' state form (a collective)."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    params = [p for p in params if pmodel.zero is None or not pmodel.zero.holds_none_of(p)]
    if any(p not in optimizer.state for p in params):
        saved_lr = [g["lr"] for g in optimizer.param_groups]
        for g in optimizer.param_groups:
            g["lr"] = torch.tensor(0.0) if torch.is_tensor(g["lr"]) else 0.0
        missing = [p for p in params if p.grad is None]
        for p in missing:
            p.grad = torch.zeros_like(p)
        try:
            optimizer.step()
        finally:
            for g, lr in zip(optimizer.param_groups, saved_lr):
                g["lr"] = lr
            for p in missing:
                p.grad = None
    if pmodel.zero is not None:
        pmodel.zero.complete_optim_state(optimizer)


def sharded_optim_state_dict(pmodel: Any, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state in ``get_optimizer_state_dict``'s FQN-keyed form, with every
    per-element state tensor a DTensor laid out like its parameter's sharded form:
    ``{"state": {fqn: {key: DTensor | scalar}}, "param_groups": [{..., "params": [fqn]}]}``.
    A collective; a fresh optimizer gets its state created first (zero-learning-rate step),
    so the result is also the template ``dcp.load`` fills before
    :func:`load_sharded_optim_state_dict`."""
    _init_optim_state(pmodel, optimizer)
    layouts = _Layouts(pmodel)
    names = {id(p): n for n, p in pmodel.named_parameters()}
    params = [p for g in optimizer.param_groups for p in g["params"] if p in optimizer.state]
    state: dict[str, dict[str, Any]] = {names[id(p)]: {} for p in params}
    keys = sorted({k for p in params for k in optimizer.state[p]})
    for key in keys:
        entries = []
        for p in params:
            value = optimizer.state[p].get(key)
            if _is_elementwise(value, p):
                entries.append((names[id(p)], p, value))
            elif value is not None:
                state[names[id(p)]][key] = value.clone() if torch.is_tensor(value) else value
        for name, dt in _to_dtensors(layouts, entries).items():
            state[name][key] = dt
    return {"state": state, "param_groups": named_param_groups(optimizer, names)}


def named_param_groups(optimizer: torch.optim.Optimizer, names: Mapping[int, str]) -> list[dict]:
    """The optimizer's param groups with parameters replaced by their FQNs (``names`` maps a
    parameter's ``id`` to its name), as torch's optimizer state dicts store them by FQN."""
    return [
        {
            **{k: v for k, v in g.items() if k != "params"},
            "params": [names[id(p)] for p in g["params"]],
        }
        for g in optimizer.param_groups
    ]


def load_param_groups(optimizer: torch.optim.Optimizer, saved_groups: Sequence[Mapping]) -> None:
    """Hyperparameters of saved groups onto the optimizer's, by group index."""
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"the state dict has {len(saved_groups)} param groups but the optimizer has "
            f"{len(optimizer.param_groups)}; build the optimizer with the same groups"
        )
    for group, saved in zip(optimizer.param_groups, saved_groups):
        group.update({k: v for k, v in saved.items() if k != "params"})


def load_sharded_optim_state_dict(
    pmodel: Any, optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any]
) -> None:
    """Load :func:`sharded_optim_state_dict`'s form (this module's layout, e.g. filled by
    ``dcp.load``); a collective. Hyperparameters are taken by group index."""
    layouts = _Layouts(pmodel)
    by_name = dict(pmodel.named_parameters())
    load_param_groups(optimizer, state_dict["param_groups"])
    unknown = sorted(set(state_dict["state"]) - set(by_name))
    if unknown:
        raise ValueError(f"optimizer state for unknown parameters {unknown[:8]}")
    keys = sorted({k for entries in state_dict["state"].values() for k in entries})
    new_state: dict[torch.Tensor, dict[str, Any]] = {}
    for key in keys:
        entries = []
        for name, saved in state_dict["state"].items():
            value = saved.get(key)
            param = by_name[name]
            own = new_state.setdefault(param, {})
            if isinstance(value, DTensor):
                entries.append((name, param, value))
            elif value is not None:
                own[key] = value.clone() if torch.is_tensor(value) else value

        def put(param: torch.Tensor, local: torch.Tensor, key: str = key) -> None:
            new_state[param][key] = local.reshape(param.shape).clone().to(param.dtype)

        _store(layouts, entries, put)
    for param, own in new_state.items():
        optimizer.state[param] = own


def _is_elementwise(value: Any, param: torch.Tensor) -> bool:
    return torch.is_tensor(value) and value.dim() > 0 and value.shape == param.shape
