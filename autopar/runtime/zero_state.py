"""The state side of the ZeRO runtime: full local blocks from the chunks and back. Mixed into
:class:`autopar.runtime.zero.ZeroEngine` (see that module's docstring).

``ParallelModule.state_dict`` reads :meth:`ZeroStateMixin.local_params` (fp32, gathered);
:meth:`~ZeroStateMixin.gather_pieces` / :meth:`~ZeroStateMixin.piece_of` turn shard-shaped
tensors (gradients, elementwise optimizer state) into full local blocks and back, which is what
``autopar.optim.full_optim_state_dict`` / ``load_full_optim_state_dict`` use.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from autopar.comm.collective_check import run_collective
from autopar.runtime.zero_layout import Chunk, Slot

__all__ = ["ZeroStateMixin"]


class ZeroStateMixin:
    """The engine's state methods (state: :class:`~autopar.runtime.zero.ZeroEngine`)."""

    chunks: list[Chunk]
    stage: int
    compute_dtype: torch.dtype | None
    _chunk_of_param: dict[int, tuple[int, int]]
    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    _group_of: Callable[[int], Any]

    def _gather_flat(self, shard: torch.Tensor, zero_axes: Sequence[int]) -> torch.Tensor:
        """All-gather a flat shard over ``zero_axes`` (row-major shard index) into one buffer."""
        value = shard
        # Innermost axis first: its pieces are adjacent in the chunk.
        for axis in reversed(zero_axes):
            size = self.mesh_shape[axis]
            out = torch.empty(value.numel() * size, dtype=value.dtype, device=value.device)
            src, group = value.contiguous(), self._group_of(axis)
            run_collective(
                "all_gather", "zero flat shard", src, group, self.axis_names[axis],
                lambda: dist.all_gather_single(out, src, group=group),  # noqa: B023 - runs now
            )  # fmt: skip
            value = out
        return value

    if TYPE_CHECKING:

        def _compute_shard(self, chunk: Chunk) -> torch.Tensor: ...

    def local_params(self) -> dict[int, torch.Tensor]:
        """id(shard parameter) -> this rank's full local block (a collective when some chunk
        is sharded over P, or under mixed precision)."""
        out: dict[int, torch.Tensor] = {}
        for chunk in self.chunks:
            if self.compute_dtype is None:
                assert chunk.kept is not None
                full = self._gather_flat(chunk.kept.detach(), chunk.param_axes)
            else:
                full = self._gather_flat(chunk.shard.detach(), chunk.zero_axes)  # type: ignore[union-attr]
            for slot, param in zip(chunk.slots, chunk.params):
                # A copy: a view would keep the whole gathered chunk alive (and alias the buffer).
                out[id(param)] = (
                    full[slot.offset : slot.offset + slot.numel].view(slot.shape).clone()
                )
        return out

    def local_grads(self) -> dict[int, torch.Tensor]:
        """id(shard parameter) -> the gradient of this rank's full local block (a collective;
        zeros where no gradient was produced)."""
        return self.gather_pieces(
            {id(p): p.grad for c in self.chunks for p in c.params if p.grad is not None}
        )

    def gather_pieces(self, pieces: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """id(shard parameter) -> full local block, from tensors shaped like the shard
        parameters (gradients, elementwise optimizer state); a collective over every chunk.
        Parameters without a piece read as zeros; every rank must pass the same ids."""
        out: dict[int, torch.Tensor] = {}
        for chunk in self.chunks:
            if not any(id(p) in pieces for p in chunk.params):
                continue
            flat = torch.zeros(chunk.shard_numel, dtype=torch.float32, device=chunk.shard.device)  # type: ignore[union-attr]
            for slot, param in zip(chunk.slots, chunk.params):
                piece = pieces.get(id(param))
                if piece is not None:
                    flat[slot.shard_lo : slot.shard_hi].copy_(piece)
            full = self._gather_flat(flat, chunk.zero_axes)
            for slot, param in zip(chunk.slots, chunk.params):
                if id(param) in pieces:
                    out[id(param)] = (
                        full[slot.offset : slot.offset + slot.numel].view(slot.shape).clone()
                    )
        return out

    def piece_of(self, param: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
        """The part of a full local block that this rank's shard parameter ``param`` holds."""
        index, k = self._chunk_of_param[id(param)]
        slot = self.chunks[index].slots[k]
        n = slot.shard_hi - slot.shard_lo
        return block.detach().reshape(-1)[slot.param_lo : slot.param_lo + n]

    @property
    def padding_fraction(self) -> float:
        """Share of the chunk buffers that holds no parameter (padding to the shard count)."""
        total = sum(c.numel for c in self.chunks)
        used = sum(s.numel for c in self.chunks for s in c.slots)
        return (total - used) / total if total else 0.0

    def manages(self, param: torch.Tensor) -> bool:
        return id(param) in self._chunk_of_param

    def slot_of(self, param: torch.Tensor) -> tuple[Chunk, Slot]:
        """The chunk of a managed shard parameter and its slot there (layout for
        :mod:`autopar.runtime.state`)."""
        index, k = self._chunk_of_param[id(param)]
        return self.chunks[index], self.chunks[index].slots[k]

    def load_local(self, param: torch.Tensor, block: torch.Tensor) -> None:
        """Set a managed parameter from this rank's full local block."""
        index, k = self._chunk_of_param[id(param)]
        chunk = self.chunks[index]
        slot = chunk.slots[k]
        flat = block.detach().reshape(-1)
        with torch.no_grad():
            param.copy_(self.piece_of(param, block))
            if chunk.kept is not None:
                # The part of the parameter inside this rank's kept range.
                kept_lo = chunk.kept_index * chunk.kept_numel
                a = max(slot.offset, kept_lo)
                b = min(slot.offset + slot.numel, kept_lo + chunk.kept_numel)
                if a < b:
                    chunk.kept[a - kept_lo : b - kept_lo].copy_(
                        flat[a - slot.offset : b - slot.offset]
                    )

    def zero_axes_of(self, param: torch.Tensor) -> tuple[int, ...]:
        """The mesh axes a managed parameter's optimizer shards are split over (O, in split
        order; empty if not managed)."""
        entry = self._chunk_of_param.get(id(param))
        return self.chunks[entry[0]].zero_axes if entry is not None else ()
