"""Process groups per mesh axis, and a registry so fx graphs can name them.

Inside an initialized default process group, :func:`axis_groups` builds a torch ``DeviceMesh``
(rank-major: a rank's mesh coordinate is its row-major index, as DeviceMesh lays it out) and
records, for this rank, its coordinate and its group along each mesh axis.

A ``ProcessGroup`` cannot be an argument of an fx node (codegen cannot print it), so a rewritten
graph passes a string key instead and the collectives resolve it with :func:`lookup_axis_groups`.
The registry is the one piece of process-wide state here: process groups are themselves
process-wide, and the key is what ties a graph to them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = [
    "AxisGroups",
    "axis_groups",
    "cached_subgroup",
    "default_key",
    "lookup_axis_group",
    "lookup_axis_groups",
    "register_axis_groups",
    "unregister_axis_groups",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class AxisGroups:
    """This rank's view of a device mesh: its coordinate and its process group per mesh axis."""

    key: str
    """Registry key naming this mesh in fx graphs (see :func:`lookup_axis_groups`)."""
    mesh_shape: tuple[int, ...]
    """Size of each mesh axis."""
    axis_names: tuple[str, ...]
    """Name of each mesh axis (e.g. ``("dp", "tp")``)."""
    groups: tuple[dist.ProcessGroup, ...]
    """This rank's process group along each axis (ranks sharing every other coordinate)."""
    coordinate: tuple[int, ...]
    """This rank's coordinate on the mesh."""
    device_mesh: DeviceMesh
    """The torch DeviceMesh the groups come from (for DTensor interop)."""

    @property
    def rank(self) -> int:
        """This rank's global rank (the row-major index of its coordinate)."""
        return _ravel(self.coordinate, self.mesh_shape)

    def ranks_of_axis(self, axis: int) -> tuple[int, ...]:
        """Global ranks of this rank's group along ``axis``, in coordinate order on that axis."""
        return tuple(
            _ravel(self.coordinate[:axis] + (k,) + self.coordinate[axis + 1 :], self.mesh_shape)
            for k in range(self.mesh_shape[axis])
        )

    def axis_label(self, axis: int) -> str:
        return self.axis_names[axis] if axis < len(self.axis_names) else str(axis)


def _ravel(coordinate: Sequence[int], mesh_shape: Sequence[int]) -> int:
    index = 0
    for c, m in zip(coordinate, mesh_shape, strict=True):
        index = index * m + c
    return index


def default_key(mesh_shape: Sequence[int], axis_names: Sequence[str]) -> str:
    """The registry key :func:`axis_groups` uses unless given one, e.g. ``"dp=2,tp=4"``."""
    return ",".join(f"{name}={size}" for name, size in zip(axis_names, mesh_shape, strict=True))


def axis_groups(
    mesh_shape: Sequence[int],
    axis_names: Sequence[str],
    *,
    key: str | None = None,
    device_type: str | None = None,
    shared: bool = False,
) -> AxisGroups:
    """Build the per-axis process groups of a mesh and register them under ``key``.

    Args:
        mesh_shape: size of each mesh axis; the product must equal the world size.
        axis_names: one distinct name per axis.
        key: registry key (default: :func:`default_key`).
        device_type: DeviceMesh device type (default: "cuda" for NCCL, else "cpu").
        shared: reuse the groups an earlier shared call made for the same mesh in this
            process (:func:`_device_mesh`; the pipeline's own stage meshes): a timeout set on
            them (``autoparallelize(timeout_s=...)``) then holds for every module sharing them.

    Raises:
        RuntimeError: the default process group is not initialized.
        ValueError: the mesh's size differs from the world size, or the names do not fit.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "axis_groups needs an initialized process group: call "
            "torch.distributed.init_process_group first (torchrun sets its environment)"
        )
    shape = tuple(int(m) for m in mesh_shape)
    names = tuple(axis_names)
    if len(names) != len(shape) or len(set(names)) != len(names):
        raise ValueError(f"mesh {shape} needs {len(shape)} distinct axis names, got {names}")
    world_size = dist.get_world_size()
    if math.prod(shape) != world_size:
        raise ValueError(
            f"mesh {shape} has {math.prod(shape)} devices but the world size is {world_size}"
        )
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh = (
        _device_mesh(device_type, shape, names)
        if shared
        else init_device_mesh(device_type, shape, mesh_dim_names=names)
    )
    coordinate = mesh.get_coordinate()
    assert coordinate is not None, "every rank of the world is on the mesh"
    result = AxisGroups(
        key=key if key is not None else default_key(shape, names),
        mesh_shape=shape,
        axis_names=names,
        groups=tuple(mesh.get_group(axis) for axis in range(len(shape))),
        coordinate=tuple(int(c) for c in coordinate),
        device_mesh=mesh,
    )
    assert result.rank == dist.get_rank(), "DeviceMesh is rank-major"
    register_axis_groups(result.key, result)
    return result


_MESHES: dict[tuple, tuple[DeviceMesh, object]] = {}
"""DeviceMeshes built in this process, by (device type, shape, names, default group's id),
with the default group they were built in (held, so its id is not reused while it is here)."""


def _device_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """A DeviceMesh of ``shape`` and ``names``, built once per process and default group: every
    ``autoparallelize`` on the same mesh shares its process groups. Each gloo group keeps its
    own loop and worker threads, and a process holding a dozen of them (the pipeline check
    builds every configuration before timing them) waited twice as long at the tail of its
    pipeline's gaps on 2 shared cores (README, "Session 28")."""
    world = dist.group.WORLD
    key = (device_type, shape, names, id(world))
    found = _MESHES.get(key)
    if found is None:
        found = _MESHES[key] = (init_device_mesh(device_type, shape, mesh_dim_names=names), world)
    return found[0]


def cached_subgroup(enumeration: Sequence[Sequence[int]]) -> dist.ProcessGroup | None:
    """This rank's group of ``dist.new_subgroups_by_enumeration(enumeration)`` (None where it
    is in none), created once per process and default group (as :func:`_device_mesh`). A
    collective on every rank of the world the first time."""
    world = dist.group.WORLD
    key = ("subgroups", tuple(tuple(int(r) for r in row) for row in enumeration), id(world))
    found = _MESHES.get(key)
    if found is None:
        group, _ = dist.new_subgroups_by_enumeration([list(row) for row in key[1]])
        found = _MESHES[key] = (group, world)
    return found[0]


_REGISTRY: dict[str, AxisGroups] = {}


def register_axis_groups(key: str, groups: AxisGroups) -> None:
    """Make ``groups`` resolvable by ``key`` from fx graphs (replaces an earlier registration)."""
    _REGISTRY[key] = groups


def unregister_axis_groups(key: str) -> None:
    _REGISTRY.pop(key, None)


def lookup_axis_groups(key: str) -> AxisGroups:
    """The mesh registered under ``key``; KeyError naming the registered keys if none is."""
    try:
        return _REGISTRY[key]
    except KeyError:
        raise KeyError(
            f"no mesh registered under {key!r} (registered: {sorted(_REGISTRY)}); build it with "
            f"autopar.runtime.axis_groups(...) on every rank before running the graph"
        ) from None


def lookup_axis_group(key: str, axis: int) -> dist.ProcessGroup:
    """This rank's process group along ``axis`` of the mesh registered under ``key``."""
    return lookup_axis_groups(key).groups[axis]
