"""The parameter side of the ZeRO runtime: a chunk's full local parameters for forward and
backward (see :mod:`autopar.runtime.zero`).

A chunk sharded over P is all-gathered before its first use in forward (prefetching the next
chunk) and freed when the graph's last view of it dies; tensors autograd saves for backward are
packed as (chunk, size, stride, offset) and unpacking them all-gathers the chunk again
(prefetching the previous one), released when the chunk's backward ran. A chunk with P empty
uses its kept buffer and communicates nothing.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist

from autopar.comm.collective_check import run_collective, wait_collective
from autopar.runtime.zero_graph import Packed
from autopar.runtime.zero_layout import Chunk, ZeroMesh
from autopar.runtime.zero_store import ChunkStore

__all__ = ["ChunkGatherer"]


class ChunkGatherer:
    """Gathers, prefetches and releases the full buffers of a :class:`ChunkStore`'s chunks."""

    def __init__(self, store: ChunkStore, mesh: ZeroMesh) -> None:
        self.store = store
        self.mesh = mesh
        self.gathers = any(c.num_param_axes for c in store.chunks)
        """Whether some chunk is gathered for use (P non-empty): forward packs saved views."""
        self.gathered_bytes = 0
        """Bytes of gathered chunk buffers (P non-empty) still alive."""
        self.peak_gathered_bytes = 0
        """The most ``gathered_bytes`` has been (reset it to measure a step)."""

    def forward_views(self, index: int, persistent: bool = False) -> tuple[torch.Tensor, ...]:
        """The chunk's full local parameters as views of its compute buffer.

        Args:
            persistent: P empty: hand out the views built at the first such call (the kept
                buffer never moves), as DDP's parameters and FSDP2's sharded parameters are
                built once, instead of slicing every parameter every step. Only for a call
                that autograd records (the caller's ``_UseChunk`` resets their history each
                step; a view whose base the optimizer changed in place since must not be used
                with an old history, so evaluation without autograd takes fresh views).
        """
        chunks = self.store.chunks
        chunk = chunks[index]
        if not chunk.num_param_axes:
            full = chunk.full
            assert full is not None
            if persistent:
                if chunk.views is None:
                    chunk.views = _views(full, chunk)
                return chunk.views
        else:
            full = self._gathered(chunk)
            chunk.full_ref = weakref.ref(full)
            if index + 1 < len(chunks):
                self._start_prefetch(chunks[index + 1])
        return _views(full, chunk)

    def _start_prefetch(self, chunk: Chunk) -> None:
        if chunk.prefetch is not None or chunk.full is not None or chunk.num_param_axes != 1:
            return
        kept = self.store.compute_kept(chunk)
        out = torch.empty(chunk.numel, dtype=kept.dtype, device=kept.device)
        axis = chunk.zero_axes[0]
        group, label = self.mesh.group_of(axis), self.mesh.axis_names[axis]
        work = run_collective(
            "all_gather", f"zero chunk {chunk.index}", kept, group, label,
            lambda: dist.all_gather_single(out, kept, group=group, async_op=True),
        )  # fmt: skip
        chunk.prefetch = (work, self._track(out))

    def _track(self, buffer: torch.Tensor) -> torch.Tensor:
        nbytes = buffer.untyped_storage().nbytes()
        self.gathered_bytes += nbytes
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)
        weakref.finalize(buffer.untyped_storage(), self._untrack, nbytes)
        return buffer

    def _untrack(self, nbytes: int) -> None:
        self.gathered_bytes -= nbytes

    def _gathered(self, chunk: Chunk) -> torch.Tensor:
        """The chunk's full buffer (all-gathered over P now unless prefetched)."""
        if chunk.prefetch is not None:
            work, out = chunk.prefetch
            chunk.prefetch = None
            axis = chunk.zero_axes[0]
            group, label = self.mesh.group_of(axis), self.mesh.axis_names[axis]
            wait_collective(work, "all_gather", f"zero chunk {chunk.index}", out, group, label)
            return out
        kept = self.store.compute_kept(chunk)
        return self._track(self.mesh.gather_flat(kept, chunk.param_axes))

    def end_forward(self) -> None:
        """Complete a prefetch nobody consumed (the graph ended): it must still complete on
        every rank."""
        for chunk in self.store.chunks:
            if chunk.prefetch is not None:
                chunk.prefetch[0].wait()
                chunk.prefetch = None

    def release(self, chunk: Chunk) -> None:
        """Every use of the chunk in backward is done: drop its gathered buffer (P non-empty)."""
        if chunk.num_param_axes:
            chunk.full = None

    def end_backward(self) -> None:
        """Drop every gathered buffer and complete any prefetch left at the end of backward."""
        for chunk in self.store.chunks:
            self.release(chunk)
            if chunk.prefetch is not None:
                chunk.prefetch[0].wait()
                chunk.prefetch = None

    def pack(self, t: torch.Tensor) -> Any:
        """``saved_tensors_hooks`` pack: a view of a gathered chunk is kept as its geometry."""
        base = t._base
        if base is None:
            return t
        for chunk in self.store.chunks:
            ref = chunk.full_ref
            if ref is not None and ref() is base:
                return Packed(chunk.index, tuple(t.size()), tuple(t.stride()), t.storage_offset())
        return t

    def unpack(self, packed: Any) -> torch.Tensor:
        """``saved_tensors_hooks`` unpack: gathers the chunk again for backward."""
        if not isinstance(packed, Packed):
            return packed
        chunks = self.store.chunks
        chunk = chunks[packed.chunk]
        if chunk.full is None:
            # Always gathered again, even if forward's buffer is still alive: whether it is can
            # depend on when Python's cycle collector ran, which differs between ranks, and
            # every rank must issue the same collectives.
            chunk.full = self._gathered(chunk)
            if packed.chunk > 0:
                self._start_prefetch(chunks[packed.chunk - 1])
        return chunk.full.as_strided(packed.size, packed.stride, packed.offset)


def _views(full: torch.Tensor, chunk: Chunk) -> tuple[torch.Tensor, ...]:
    """The slots' parameters as views of ``full``: one split (slots are packed from offset 0,
    the padding last), then a view to each parameter's shape."""
    sizes = [s.numel for s in chunk.slots]
    pieces = full.split_with_sizes([*sizes, full.numel() - sum(sizes)])
    return tuple(piece.view(s.shape) for piece, s in zip(pieces, chunk.slots))
