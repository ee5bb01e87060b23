"""Per-axis ZeRO stages, the geometry of one chunk and the mesh the chunks are split over (see
:mod:`autopar.runtime.zero`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from autopar.comm.collective_check import run_collective, wait_collective

__all__ = ["Chunk", "Slot", "ZeroMesh", "resolve_stages"]


def resolve_stages(
    stage: int | Sequence[int], num_axes: int, axes: Sequence[int] | None = None
) -> tuple[int, ...]:
    """The per-axis stages of a ``stage`` argument: an int (that stage on ``axes``, every axis
    if None) or one stage per mesh axis.

    Raises:
        ValueError: a stage outside 0-3, a sequence of the wrong length, an axis out of range.
    """
    if isinstance(stage, int):
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
        chosen = range(num_axes) if axes is None else [int(a) for a in axes]
        bad = [a for a in chosen if not 0 <= a < num_axes]
        if bad:
            raise ValueError(f"zero axes {bad} are not axes of a {num_axes}-axis mesh")
        return tuple(stage if a in chosen else 0 for a in range(num_axes))
    stages = tuple(int(s) for s in stage)
    if len(stages) != num_axes:
        raise ValueError(
            f"per-axis ZeRO stages {list(stages)} need one stage per mesh axis ({num_axes})"
        )
    if any(s not in (0, 1, 2, 3) for s in stages):
        raise ValueError(f"ZeRO stages must each be 0, 1, 2 or 3, got {list(stages)}")
    if axes is not None:
        raise ValueError("give either per-axis stages or an int stage with zero_axes, not both")
    return stages


@dataclass(slots=True)
class Slot:
    fqn: str
    shape: torch.Size
    offset: int
    numel: int
    shard_lo: int
    """Range of this parameter's elements inside this rank's O-shard (shard-relative)."""
    shard_hi: int
    param_lo: int
    """Range of the parameter's flat elements that this rank's shard holds."""

    @property
    def empty(self) -> bool:
        """Whether this rank's O-shard holds none of the parameter: it has no ``.grad`` and no
        optimizer work here (its owners, the ranks whose shards hold it, update it)."""
        return self.shard_lo == self.shard_hi


@dataclass(slots=True)
class Chunk:
    index: int
    zero_axes: tuple[int, ...]
    """O's axes in split order: P, then G \\ P, then O \\ G (module docstring)."""
    num_param_axes: int
    """|P| as a count of leading ``zero_axes``."""
    num_grad_axes: int
    """|G| as a count of leading ``zero_axes``."""
    scatter_axes: tuple[int, ...]
    """G axes on which the gradient is Partial (reduce-scatter); on the others, slice."""
    allreduce_axes: tuple[int, ...]
    """Axes outside G on which the gradient is Partial (all-reduce of the G-shard)."""
    numel: int
    shard_numel: int
    shard_index: int
    """Row-major index of this rank's O-shard over ``zero_axes``."""
    kept_numel: int
    kept_index: int
    shard_in_kept: int
    """Offset of the O-shard in the kept (P-level) buffer."""
    shard_in_grad: int
    """Offset of the O-shard in the reduced (G-level) gradient."""
    slots: list[Slot] = field(default_factory=list)
    shard: torch.Tensor | None = None
    """The fp32 O-shard (master weights): a view of ``kept`` unless mixed precision."""
    kept: torch.Tensor | None = None
    """The P-level buffer in the compute dtype (None under mixed precision when O = P)."""
    full: torch.Tensor | None = None
    """P empty: the kept buffer (the compute buffer). P non-empty: the buffer gathered for
    backward while backward needs it."""
    full_ref: Any = None
    """P non-empty: weak reference to the buffer gathered for forward."""
    kept_for_backward: Any = None
    """P non-empty: weak reference to the holder of the buffer forward gathered and kept for
    backward (the chunk the graph uses last, whose backward comes first: not gathered again;
    the forward's autograd node owns the holder, so a graph dropped without backward frees
    it: ``runtime.zero_gather.ChunkGatherer.keep_for_backward``)."""
    views: tuple[torch.Tensor, ...] | None = None
    """P empty: the full local parameters as views of ``full``, built at the first forward
    with autograd and handed out again every step (no per-parameter slicing per step)."""
    grad_buffer: torch.Tensor | None = None
    """G empty: the chunk's fp32 gradient buffer, allocated at the first backward and kept
    (DDP's bucket): the all-reduce runs in it and the shard ``.grad`` view it. G non-empty:
    None (the reduce-scatter output is the sharded gradient, made each backward and freed
    with the ``.grad`` views, as FSDP2's)."""
    grad_views: list[torch.Tensor | None] | None = None
    """Per slot, the shard parameter's ``.grad``: a view of ``grad_buffer`` built once (None
    for an empty slot)."""
    flat_views: list[torch.Tensor] | None = None
    """G empty: per slot, a parameter-shaped view of ``grad_buffer`` that backward copies the
    slot's gradient into (one ``_foreach_copy_`` a chunk)."""
    prefetch: tuple[Any, torch.Tensor] | None = None
    pending: torch.Tensor | None = None
    work: Any = None
    reduced: torch.Tensor | None = None
    params: list[nn.Parameter] = field(default_factory=list)

    @property
    def param_axes(self) -> tuple[int, ...]:
        return self.zero_axes[: self.num_param_axes]

    @property
    def grad_axes(self) -> tuple[int, ...]:
        return self.zero_axes[: self.num_grad_axes]


class ZeroMesh:
    """This rank's place on the mesh the chunks are split over: axis sizes, coordinates, process
    groups and names (collective failures and check mode name the axis).

    Args:
        mesh_shape: size of each mesh axis.
        coords: this rank's mesh coordinate.
        group_of: mesh axis -> this rank's process group along it.
        axis_names: the mesh axes' names; None = ``a0``, ``a1``, ...
    """

    def __init__(
        self,
        mesh_shape: Sequence[int],
        coords: Sequence[int],
        group_of: Callable[[int], Any],
        axis_names: Sequence[str] | None = None,
    ) -> None:
        self.shape = tuple(mesh_shape)
        self.coords = tuple(coords)
        self.group_of = group_of
        self.axis_names = tuple(axis_names or (f"a{i}" for i in range(len(self.shape))))

    def index(self, axes: Sequence[int]) -> int:
        """This rank's row-major index over ``axes``."""
        index = 0
        for a in axes:
            index = index * self.shape[a] + self.coords[a]
        return index

    def gather_flat(
        self, shard: torch.Tensor, axes: Sequence[int], out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """All-gather a flat shard over ``axes`` (row-major shard index) into one buffer
        (``out`` when given: the last gather lands there, with no copy after it)."""
        value = shard
        # Innermost axis first: its pieces are adjacent in the chunk.
        for i, axis in enumerate(reversed(axes)):
            size = self.shape[axis]
            if out is not None and i == len(axes) - 1:
                dst = out
            else:
                dst = torch.empty(value.numel() * size, dtype=value.dtype, device=value.device)
            src, group = value.contiguous(), self.group_of(axis)
            run_collective(
                "all_gather", "zero flat shard", src, group, self.axis_names[axis],
                lambda: dist.all_gather_single(dst, src, group=group),  # noqa: B023 - runs now
            )  # fmt: skip
            value = dst
        return value

    def fill_flat(self, buffer: torch.Tensor, shard_numel: int, axes: Sequence[int]) -> None:
        """Complete ``buffer`` in place over ``axes``: it holds this rank's ``shard_numel``
        elements at its row-major shard index and receives every other rank's there (no
        temporary, no copy; the in-place form of :meth:`gather_flat`).

        On gloo, one broadcast per rank of each axis straight into its piece of ``buffer``:
        gloo's all-gather stages its output in a temporary the size of the result and copies
        it out (and the input in), which is what ZeroRedundancyOptimizer's per-parameter
        broadcasts avoid. Elsewhere (NCCL), one all-gather per axis whose input is this rank's
        piece of its output, NCCL's in-place form, as FSDP2 gathers.
        """
        block = shard_numel
        # Innermost axis first: after it, this rank's block of the next axis is complete.
        for i in reversed(range(len(axes))):
            axis, group = axes[i], self.group_of(axes[i])
            size, label = self.shape[axis], self.axis_names[axis]
            start = self.index(axes[:i]) * block * size
            region = buffer[start : start + block * size]
            if dist.get_backend(group) != "gloo":
                mine = region[self.coords[axis] * block : (self.coords[axis] + 1) * block]
                run_collective(
                    "all_gather", "zero flat shard", mine, group, label,
                    lambda: dist.all_gather_single(region, mine, group=group),  # noqa: B023
                )  # fmt: skip
            else:
                pieces = [region[j * block : (j + 1) * block] for j in range(size)]
                works = [
                    run_collective(
                        "broadcast",
                        f"zero flat shard {j}",
                        piece,
                        group,
                        label,
                        lambda: dist.broadcast(piece, group=group, group_src=j, async_op=True),  # noqa: B023
                    )  # fmt: skip
                    for j, piece in enumerate(pieces)
                ]
                for j, (work, piece) in enumerate(zip(works, pieces)):
                    wait_collective(work, "broadcast", f"zero flat shard {j}", piece, group, label)
            block *= size
