"""The state side of the ZeRO runtime: full local blocks from the chunks and back (see
:mod:`autopar.runtime.zero`).

``ParallelModule.state_dict`` reads :meth:`ChunkState.local_params` (fp32, gathered);
:meth:`~ChunkState.gather_pieces` and :meth:`ChunkStore.piece_of
<autopar.runtime.zero_store.ChunkStore.piece_of>` turn shard-shaped tensors (gradients,
elementwise optimizer state) into full local blocks and back, which is what
``autopar.optim.full_optim_state_dict`` / ``load_full_optim_state_dict`` use.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from autopar.comm.collective_check import run_collective
from autopar.runtime.zero_layout import ZeroMesh
from autopar.runtime.zero_store import ChunkStore

__all__ = ["ChunkState"]


class ChunkState:
    """Reads and writes whole local parameter blocks of a :class:`ChunkStore` (collectives over
    the chunks' shard axes)."""

    def __init__(self, store: ChunkStore, mesh: ZeroMesh) -> None:
        self.store = store
        self.mesh = mesh

    def local_params(self) -> dict[int, torch.Tensor]:
        """id(shard parameter) -> this rank's full local block (a collective when some chunk
        is sharded over P, or under mixed precision)."""
        out: dict[int, torch.Tensor] = {}
        for chunk in self.store.chunks:
            if self.store.compute_dtype is None:
                assert chunk.kept is not None
                full = self.mesh.gather_flat(chunk.kept.detach(), chunk.param_axes)
            else:
                full = self.mesh.gather_flat(chunk.shard.detach(), chunk.zero_axes)  # type: ignore[union-attr]
            for slot, param in zip(chunk.slots, chunk.params):
                # A copy: a view would keep the whole gathered chunk alive (and alias the buffer).
                out[id(param)] = (
                    full[slot.offset : slot.offset + slot.numel].view(slot.shape).clone()
                )
        return out

    def local_grads(self) -> dict[int, torch.Tensor]:
        """id(shard parameter) -> the gradient of this rank's full local block, for every
        parameter with a ``.grad`` on some rank (a collective; zeros where no gradient was
        produced). A rank whose shard holds none of a parameter has no ``.grad`` for it
        (:mod:`autopar.runtime.zero_backward`): which parameters have one is agreed first."""
        params = [p for c in self.store.chunks for p in c.params]
        if not params:
            return {}
        device = self.store.chunks[0].shard.device  # type: ignore[union-attr]
        flags = torch.tensor(
            [float(p.grad is not None) for p in params], dtype=torch.float32, device=device
        )
        for axis in self.zero_axes():
            group = self.mesh.group_of(axis)
            run_collective(
                "all_reduce", "zero grad flags", flags, group, self.mesh.axis_names[axis],
                lambda: dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group),  # noqa: B023
            )  # fmt: skip
        return self.gather_pieces(
            {
                id(p): torch.zeros_like(p) if p.grad is None else p.grad
                for p, flag in zip(params, flags.tolist())
                if flag > 0
            }
        )

    def zero_axes(self) -> list[int]:
        """Every mesh axis some chunk is split over (the same list on every rank)."""
        return sorted({a for c in self.store.chunks for a in c.zero_axes})

    def gather_pieces(self, pieces: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """id(shard parameter) -> full local block, from tensors shaped like the shard
        parameters (gradients, elementwise optimizer state); a collective over every chunk.
        Parameters without a piece read as zeros; every rank must pass the same ids."""
        out: dict[int, torch.Tensor] = {}
        for chunk in self.store.chunks:
            if not any(id(p) in pieces for p in chunk.params):
                continue
            flat = torch.zeros(chunk.shard_numel, dtype=torch.float32, device=chunk.shard.device)  # type: ignore[union-attr]
            for slot, param in zip(chunk.slots, chunk.params):
                piece = pieces.get(id(param))
                if piece is not None:
                    flat[slot.shard_lo : slot.shard_hi].copy_(piece)
            full = self.mesh.gather_flat(flat, chunk.zero_axes)
            for slot, param in zip(chunk.slots, chunk.params):
                if id(param) in pieces:
                    out[id(param)] = (
                        full[slot.offset : slot.offset + slot.numel].view(slot.shape).clone()
                    )
        return out

    def load_local(self, param: torch.Tensor, block: torch.Tensor) -> None:
        """Set a managed parameter from this rank's full local block."""
        chunk, slot = self.store.slot_of(param)
        flat = block.detach().reshape(-1)
        with torch.no_grad():
            param.copy_(self.store.piece_of(param, block))
            if chunk.kept is not None:
                # The part of the parameter inside this rank's kept range.
                kept_lo = chunk.kept_index * chunk.kept_numel
                a = max(slot.offset, kept_lo)
                b = min(slot.offset + slot.numel, kept_lo + chunk.kept_numel)
                if a < b:
                    chunk.kept[a - kept_lo : b - kept_lo].copy_(
                        flat[a - slot.offset : b - slot.offset]
                    )
