"""Where a tensor-parallel block lies in its full tensor, and lazy reading of full tensors.

:class:`StateSource` reads blocks of full tensors by name from a dict (one tensor at a time: the
caller keeps only the block) or from a safetensors file through
``safe_open(...).get_slice(name)``, which reads only the requested rows and columns from disk.
:class:`~autopar.runtime.module.ParallelModule` uses it to materialize a model built on the meta
device: each rank reads only its tensor-parallel blocks, and under ZeRO stage 3 only the rows
that cover its chunk pieces.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from autopar.placement import Placements, SectionShard, Shard, format_placements, section_axis

__all__ = ["StateSource", "block_index", "global_shape"]


# ---------------------------------------------------------------------------------------------
# Geometry


def global_shape(
    local_shape: Sequence[int], placements: Placements, mesh_shape: Sequence[int]
) -> tuple[int, ...]:
    """The full shape of a tensor-parallel block (plan placements split dims evenly)."""
    shape = list(local_shape)
    for axis, p in enumerate(placements):
        if isinstance(p, (Shard, SectionShard)):
            shape[p.dim] *= mesh_shape[axis]
    return tuple(shape)


def block_index(
    full_shape: Sequence[int],
    placements: Placements,
    mesh_shape: Sequence[int],
    coords: Sequence[int],
) -> tuple[slice, ...]:
    """Per dim, the slice of the full tensor that is this rank's tensor-parallel block (the
    region :func:`autopar.runtime.module.local_block` cuts: axis 0 outermost)."""
    if section_axis(placements) is not None:
        raise ValueError(
            f"a section-sharded tensor (placements {format_placements(placements)}) is not one "
            f"block of the full tensor; read it from a full state dict instead of a StateSource"
        )
    start = [0] * len(full_shape)
    size = list(full_shape)
    for axis, p in enumerate(placements):
        if isinstance(p, Shard):
            if size[p.dim] % mesh_shape[axis]:
                raise ValueError(
                    f"dim {p.dim} of shape {tuple(full_shape)} does not split {mesh_shape[axis]} "
                    f"ways (placements {format_placements(placements)})"
                )
            size[p.dim] //= mesh_shape[axis]
            start[p.dim] += coords[axis] * size[p.dim]
    return tuple(slice(a, a + n) for a, n in zip(start, size))


# ---------------------------------------------------------------------------------------------
# Lazy full state: a dict or a safetensors file


class StateSource:
    """Reads blocks of FULL tensors by name, one tensor at a time.

    Args:
        sources: a state dict (name -> full tensor), the path of a ``.safetensors`` file, or a
            sequence of those (the first one holding a name wins; e.g. a file plus a dict of
            the non-persistent buffers it lacks).

    ``read(name, index)`` returns a copy of ``full[index]``: from a safetensors file only those
    elements are read (``safe_open(...).get_slice(name)``). ``read_bytes`` counts the bytes
    read so far and ``max_read_bytes`` the largest single read (what a rank holds at most
    besides its shards while materializing).
    """

    def __init__(
        self,
        sources: Mapping[str, torch.Tensor]
        | str
        | os.PathLike[str]
        | Sequence[Mapping[str, torch.Tensor] | str | os.PathLike[str]],
    ) -> None:
        if isinstance(sources, (Mapping, str, os.PathLike)):
            sources = [sources]
        self._dicts: list[Mapping[str, torch.Tensor]] = []
        self._where: dict[str, tuple[str, Any]] = {}
        self._files: list[Any] = []
        self.read_bytes = 0
        self.max_read_bytes = 0
        for source in sources:
            if isinstance(source, Mapping):
                for name in source:
                    self._where.setdefault(name, ("dict", source))
            elif isinstance(source, (str, os.PathLike)):
                try:
                    from safetensors import safe_open
                except ImportError as exc:  # pragma: no cover - a dependency
                    raise ImportError(
                        "reading a safetensors file needs the safetensors package: "
                        "pip install safetensors"
                    ) from exc
                handle = safe_open(os.fspath(source), framework="pt", device="cpu")
                self._files.append(handle)
                for name in handle.keys():
                    self._where.setdefault(name, ("file", handle))
            else:
                raise TypeError(
                    f"state_dict= takes a dict of full tensors, a .safetensors path or a list of "
                    f"those, got {type(source).__name__}"
                )

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        kind, source = self._where[name]
        if kind == "dict":
            return tuple(source[name].shape)
        return tuple(source.get_slice(name).get_shape())

    def read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        """A copy of ``full[index]`` (``index``: one slice per dim; () for a 0-d tensor)."""
        kind, source = self._where[name]
        if kind == "dict":
            value = source[name].detach()[index].clone() if index else source[name].detach().clone()
        elif index:
            value = source.get_slice(name)[index]
        else:
            value = source.get_tensor(name)
        nbytes = value.numel() * value.element_size()
        self.read_bytes += nbytes
        self.max_read_bytes = max(self.max_read_bytes, nbytes)
        return value

    def read_flat(self, name: str, block: tuple[slice, ...], lo: int, hi: int) -> torch.Tensor:
        """Flat elements [lo, hi) of the block ``full[block]`` (read as the rows covering them)."""
        if not block:
            return self.read(name, ()).reshape(-1)[lo:hi]
        row_numel = math.prod(s.stop - s.start for s in block[1:])
        r0 = lo // max(row_numel, 1)
        r1 = -(-hi // max(row_numel, 1)) if row_numel else r0
        start = block[0].start
        rows = self.read(name, (slice(start + r0, start + r1), *block[1:])).reshape(-1)
        return rows[lo - r0 * row_numel : hi - r0 * row_numel]

    def close(self) -> None:
        self._files.clear()
