"""The device mesh as the planner sees it: axis sizes and names, one link per axis, a device.

``Mesh.spec`` builds one offline (no processes, no GPU) for planning; ``Mesh.parse`` reads the
CLI's ``--mesh`` text. ``Mesh.from_world`` builds a live one inside torch.distributed (one process
group per axis, kept in ``Mesh.groups``); it imports torch lazily, so planning stays torch-free.

Defaults (DESIGN.md "Mesh axes"): axis names ``("dp", "tp")`` for a 2-D mesh and
``("a0", "a1", ...)`` otherwise; links NVLink on the innermost (last) axis and InfiniBand on the
others (NVLink 3 instead of NVLink 4 on A100s), and the "loopback" link on every axis of a CPU mesh.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from cost_models.hardware import DeviceSpec, LinkSpec, get_device, get_link
from cost_models.profile import Profile, load_profile

LinkArg = str | LinkSpec
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def default_axis_names(ndim: int) -> tuple[str, ...]:
    """``("dp", "tp")`` for 2 axes, ``("a0", "a1", ...)`` for any other count."""
    if ndim == 2:
        return ("dp", "tp")
    return tuple(f"a{i}" for i in range(ndim))


def default_links(ndim: int, device: DeviceSpec) -> tuple[LinkSpec, ...]:
    """Innermost axis on the intra-node link, the others on InfiniBand; loopback on a CPU."""
    if device.name == "cpu":
        return (get_link("loopback"),) * ndim
    intra = get_link("nvlink3" if device.name.startswith("a100") else "nvlink")
    return (get_link("infiniband"),) * (ndim - 1) + (intra,) if ndim else ()


@dataclass(frozen=True, kw_only=True, slots=True)
class Mesh:
    """An N-D grid of devices: ``shape[i]`` devices along axis ``axis_names[i]`` over ``links[i]``."""

    shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    device: DeviceSpec
    links: tuple[LinkSpec, ...]
    """One per axis: the interconnect a collective along that axis runs over."""
    groups: Any = field(default=None, compare=False, repr=False)
    """``autopar.comm.process_groups.AxisGroups`` of a live mesh (``from_world``), else None.
    Not part of the mesh's identity: equality, hash and ``to_dict`` ignore it."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self.shape))
        object.__setattr__(self, "axis_names", tuple(self.axis_names))
        object.__setattr__(self, "links", tuple(self.links))
        if not self.shape:
            raise ValueError("a mesh needs at least one axis, e.g. Mesh.spec((8,))")
        for i, size in enumerate(self.shape):
            if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
                raise ValueError(
                    f"mesh axis {i} has size {size!r}; every axis size must be a positive integer"
                )
        if len(self.axis_names) != len(self.shape):
            raise ValueError(
                f"mesh shape {self.shape} has {len(self.shape)} axes but {len(self.axis_names)} "
                f"names {self.axis_names}; give one name per axis"
            )
        for name in self.axis_names:
            if not isinstance(name, str) or not _NAME_RE.match(name):
                raise ValueError(
                    f"mesh axis name {name!r} is not an identifier (letters, digits, '_'; "
                    "not starting with a digit)"
                )
        duplicates = sorted({n for n in self.axis_names if self.axis_names.count(n) > 1})
        if duplicates:
            raise ValueError(f"duplicate mesh axis names {duplicates} in {self.axis_names}")
        if len(self.links) != len(self.shape):
            raise ValueError(
                f"mesh shape {self.shape} has {len(self.shape)} axes but {len(self.links)} links"
            )

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def spec(
        cls,
        shape: int | Sequence[int],
        axis_names: Sequence[str] | None = None,
        *,
        device: str | DeviceSpec = "h100",
        links: Sequence[LinkArg] | Mapping[str, LinkArg] | None = None,
        profile: str | os.PathLike[str] | Mapping[str, Any] | Profile | None = None,
    ) -> Mesh:
        """An offline mesh for planning.

        Args:
            shape: axis sizes, e.g. ``(8, 8)``; an int for a 1-D mesh.
            axis_names: one per axis; default ``("dp", "tp")`` for 2-D, ``("a0", ...)`` otherwise.
            device: a preset name ("h100", "a100", "cpu", ...) or a DeviceSpec.
            links: per-axis overrides: a sequence with one entry per axis, or a mapping from axis
                name (or index) to link; entries are preset names or LinkSpecs. Axes not named
                keep their defaults.
            profile: a profile (path, dict or Profile, see ``cost_models.profile``); its device
                and its links (keyed by axis name or index) override everything else.

        Raises:
            ValueError: a non-positive axis size, wrong name count, duplicate names, an unknown
                device or link, or a link key that is not an axis.
        """
        shape_t = (shape,) if isinstance(shape, int) else tuple(shape)
        names = default_axis_names(len(shape_t)) if axis_names is None else tuple(axis_names)
        # Validate shape and names before resolving links, so errors name the real problem.
        probe_links = (get_link("loopback"),) * len(shape_t)
        cls(shape=shape_t, axis_names=names, device=get_device("cpu"), links=probe_links)

        prof = load_profile(profile) if profile is not None else None
        dev = get_device(device)
        if prof is not None and prof.device is not None:
            dev = prof.device
        resolved = list(default_links(len(shape_t), dev))
        if links is not None:
            if isinstance(links, Mapping):
                for key, link in links.items():
                    resolved[_axis_of_key(key, names, "links=")] = get_link(link)
            else:
                if isinstance(links, str | LinkSpec) or len(links) != len(shape_t):
                    raise ValueError(
                        f"links= needs one entry per axis ({len(shape_t)} for shape {shape_t}) or "
                        f"a mapping from axis name to link, got {links!r}"
                    )
                resolved = [get_link(link) for link in links]
        if prof is not None:
            for key, link_spec in prof.links.items():
                resolved[_axis_of_key(key, names, "profile links")] = link_spec
        return cls(shape=shape_t, axis_names=names, device=dev, links=tuple(resolved))

    @classmethod
    def from_world(
        cls,
        shape: int | Sequence[int],
        axis_names: Sequence[str] | None = None,
        *,
        device: str | DeviceSpec | None = None,
        links: Sequence[LinkArg] | Mapping[str, LinkArg] | None = None,
        profile: str | os.PathLike[str] | Mapping[str, Any] | Profile | None = None,
        timeout_s: float | None = None,
    ) -> Mesh:
        """A live mesh over the ranks of torch.distributed, with one process group per axis.

        Call it on every rank (it is collective). If no process group is initialized yet and
        torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...) is set, it
        initializes one: NCCL when CUDA is available (on device ``LOCAL_RANK``), gloo otherwise.
        Ranks are laid out row-major: rank r has the coordinate ``numpy.unravel_index(r, shape)``.

        Args:
            shape, axis_names, links, profile: as in :meth:`spec`.
            device: the device whose figures the planner uses; default "cpu" under gloo, the
                matching preset of the local GPU under NCCL ("h100" if it is not recognised).
                Planning figures do not change how the plan executes.
            timeout_s: how long a collective on the mesh's groups waits for a peer before it
                raises (a rank that died or stalled); default the world group's timeout (the
                ``timeout=`` of ``init_process_group``; torch's default is 30 minutes for gloo,
                10 for NCCL). See :func:`set_groups_timeout` for TORCH_DISTRIBUTED_DEBUG=DETAIL.

        Raises:
            ValueError: the shape's product differs from the world size (the message names both).
            RuntimeError: no process group and no torchrun environment to create one.
        """
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        from autopar.comm.process_groups import axis_groups

        shape_t = (shape,) if isinstance(shape, int) else tuple(shape)
        if not dist.is_initialized():
            if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
                raise RuntimeError(
                    "Mesh.from_world needs torch.distributed: launch with torchrun (which sets "
                    "RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) or call "
                    "torch.distributed.init_process_group first; use Mesh.spec for offline planning"
                )
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            init_kwargs: dict[str, Any] = {}
            if timeout_s is not None:
                init_kwargs["timeout"] = timedelta(seconds=timeout_s)
            dist.init_process_group(backend, **init_kwargs)
        world_size = dist.get_world_size()
        if math.prod(shape_t) != world_size:
            raise ValueError(
                f"mesh shape {shape_t} has {math.prod(shape_t)} devices but the world size is "
                f"{world_size}; give a shape whose product is {world_size} (e.g. ({world_size},)) "
                f"or launch {math.prod(shape_t)} processes"
            )
        backend = dist.get_backend()
        if device is None:
            device = "cpu" if backend != "nccl" else _local_gpu_preset()
        mesh = cls.spec(shape_t, axis_names, device=device, links=links, profile=profile)
        groups = axis_groups(
            mesh.shape, mesh.axis_names, device_type="cuda" if backend == "nccl" else "cpu"
        )
        if timeout_s is not None:
            set_groups_timeout(groups, timeout_s)
        return replace(mesh, groups=groups)

    def set_timeout(self, timeout_s: float) -> None:
        """Make collectives on this live mesh's groups raise after ``timeout_s`` seconds
        without their peers (see :func:`set_groups_timeout`)."""
        if self.groups is None:
            raise ValueError(
                "an offline mesh (Mesh.spec) has no process groups; use Mesh.from_world"
            )
        set_groups_timeout(self.groups, timeout_s)

    @classmethod
    def parse(
        cls,
        text: str,
        *,
        device: str | DeviceSpec = "h100",
        links: Sequence[LinkArg] | Mapping[str, LinkArg] | None = None,
        profile: str | os.PathLike[str] | Mapping[str, Any] | Profile | None = None,
    ) -> Mesh:
        """A mesh from the CLI's ``--mesh``: "8", "8x8", "2x2x2" or "dp=8,tp=8"."""
        body = text.strip().replace(" ", "")
        try:
            if "=" in body:
                pairs = [item.split("=") for item in body.split(",")]
                if any(len(p) != 2 for p in pairs):
                    raise ValueError
                names: tuple[str, ...] | None = tuple(p[0] for p in pairs)
                shape = tuple(int(p[1]) for p in pairs)
            else:
                names = None
                shape = tuple(int(part) for part in body.lower().split("x"))
        except ValueError:
            raise ValueError(
                f"cannot read mesh {text!r}: write axis sizes joined by 'x' ('8', '8x8', "
                "'2x2x2') or name=size pairs joined by ',' ('dp=8,tp=8')"
            ) from None
        return cls.spec(shape, names, device=device, links=links, profile=profile)

    # -- queries -----------------------------------------------------------------------------

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def num_devices(self) -> int:
        return math.prod(self.shape)

    def axis_index(self, axis: str | int) -> int:
        """Index of an axis given by name or index (negative indices count from the end)."""
        if isinstance(axis, str):
            if axis in self.axis_names:
                return self.axis_names.index(axis)
            raise ValueError(f"mesh has no axis named {axis!r}; its axes are {self.axis_names}")
        if isinstance(axis, int) and not isinstance(axis, bool) and -self.ndim <= axis < self.ndim:
            return axis % self.ndim
        raise ValueError(
            f"mesh axis {axis!r} is out of range for a {self.ndim}-D mesh {self.axis_names}"
        )

    def axis_size(self, axis: str | int) -> int:
        return self.shape[self.axis_index(axis)]

    def link(self, axis: str | int) -> LinkSpec:
        return self.links[self.axis_index(axis)]

    def describe(self) -> str:
        """E.g. ``"dp=8 (infiniband) x tp=8 (nvlink) on h100"``."""
        axes = " x ".join(
            f"{n}={s} ({link.name})" for n, s, link in zip(self.axis_names, self.shape, self.links)
        )
        return f"{axes} on {self.device.name}"

    # -- JSON --------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly, with the full device and link specs (``from_dict`` inverts it)."""
        return {
            "shape": list(self.shape),
            "axis_names": list(self.axis_names),
            "device": self.device.to_dict(),
            "links": [link.to_dict() for link in self.links],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Mesh:
        missing = sorted({"shape", "axis_names", "device", "links"} - set(d))
        if missing:
            raise ValueError(f"mesh dict misses {missing}")
        return cls(
            shape=tuple(int(s) for s in d["shape"]),
            axis_names=tuple(d["axis_names"]),
            device=DeviceSpec.from_dict(d["device"]),
            links=tuple(LinkSpec.from_dict(x) for x in d["links"]),
        )


def set_groups_timeout(groups: Any, timeout_s: float) -> None:
    """Set the timeout of every per-axis process group of ``groups`` (an ``AxisGroups``).

    A collective whose peer never joins then raises after ``timeout_s`` (gloo: "Timed out
    waiting ... for recv"; autopar's collectives add the rank, op and axis). Under
    ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` torch checks every collective with a barrier on a helper
    group whose timeout is fixed when the group is created (the world's ``timeout=``); there the
    world's timeout bounds the wait.
    """
    from datetime import timedelta

    timeout = timedelta(seconds=timeout_s)
    for group in groups.groups:
        for device in group._device_types:
            backend = group._get_backend(device)
            while backend is not None:  # unwrap the DETAIL debug wrapper
                backend.set_timeout(timeout)
                backend = getattr(backend, "wrapped_pg", None)


def _local_gpu_preset() -> str:
    """The device preset matching this process's GPU (its name contains the preset's)."""
    import torch

    from cost_models.hardware import DEVICES

    name = torch.cuda.get_device_name().lower().replace(" ", "-")
    known = sorted(DEVICES, key=len, reverse=True)
    return next((preset for preset in known if preset in name), "h100")


def _axis_of_key(key: str | int, names: tuple[str, ...], what: str) -> int:
    """Axis index for a ``links`` key: an axis name, an int index, or an index as a string."""
    if isinstance(key, str) and key in names:
        return names.index(key)
    index: int | None = None
    if isinstance(key, int) and not isinstance(key, bool):
        index = key
    elif isinstance(key, str) and key.isdigit():
        index = int(key)
    if index is not None and 0 <= index < len(names):
        return index
    raise ValueError(
        f"{what} key {key!r} is not an axis of the mesh; axes: {names} (or 0..{len(names) - 1})"
    )
