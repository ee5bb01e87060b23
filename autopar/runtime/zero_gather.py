"""The parameter side of the ZeRO runtime: a chunk's full local parameters for forward and
backward (see :mod:`autopar.runtime.zero`).

A chunk sharded over P is all-gathered before its first use in forward (prefetching the next
chunk) and freed when the graph's last view of it dies; tensors autograd saves for backward are
packed as (chunk, size, stride, offset) and unpacking them all-gathers the chunk again
(prefetching the previous one), released when the chunk's backward ran; the chunk the graph
uses last keeps its forward buffer into backward instead (:meth:`ChunkGatherer.keep_for_backward`).
A chunk with P empty uses its kept buffer and communicates nothing.
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
        self._packed: set[int] = set()
        """Chunks a saved tensor of this forward was packed from (see :meth:`end_forward`)."""

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

    def keep_for_backward(self, index: int) -> KeptBuffer | None:
        """Keep the buffer forward just gathered for chunk ``index`` (P non-empty) for its
        backward, instead of freeing it after its last use and gathering it again when
        backward unpacks it: for the chunk the graph uses last (its backward comes first),
        where autograd records the call. The caller's autograd node owns the returned holder
        (a graph dropped without backward frees the buffer with it); the chunk refers to it
        weakly. Saved views are still packed as geometry."""
        chunk = self.store.chunks[index]
        full = chunk.full_ref() if chunk.num_param_axes and chunk.full_ref is not None else None
        if full is None:
            return None
        holder = KeptBuffer(full)
        chunk.kept_for_backward = weakref.ref(holder)
        self._packed.discard(index)  # packs from before (a recompute in backward) are stale
        return holder

    @staticmethod
    def _take_kept(chunk: Chunk) -> torch.Tensor | None:
        """The buffer kept for backward (:meth:`keep_for_backward`), taken from its holder."""
        ref, chunk.kept_for_backward = chunk.kept_for_backward, None
        holder = ref() if ref is not None else None
        if holder is None:
            return None
        buffer, holder.buffer = holder.buffer, None
        return buffer

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
        every rank. Drop a chunk kept for backward (:meth:`keep_for_backward`) that no
        backward will unpack (no saved tensor views it): backward would not gather it."""
        for chunk in self.store.chunks:
            if chunk.prefetch is not None:
                chunk.prefetch[0].wait()
                chunk.prefetch = None
            if chunk.kept_for_backward is not None and chunk.index not in self._packed:
                self._take_kept(chunk)
        self._packed.clear()

    def release(self, chunk: Chunk) -> None:
        """Every use of the chunk in backward is done: drop its gathered buffer (P non-empty)."""
        if chunk.num_param_axes:
            chunk.full, chunk.kept_for_backward = None, None

    def end_backward(self) -> None:
        """Drop every gathered buffer and complete any prefetch left at the end of backward."""
        for chunk in self.store.chunks:
            self.release(chunk)
            if chunk.prefetch is not None:
                chunk.prefetch[0].wait()
                chunk.prefetch = None

    def pack(self, t: torch.Tensor) -> Any:
        """``saved_tensors_hooks`` pack: a view of a gathered chunk is kept as its geometry;
        any other tensor detached (autograd gives the unpacked tensor its history back; the
        tensor itself, for an output of the saving node, would hold that node and so its whole
        graph: a graph dropped without backward would never be freed)."""
        base = t._base
        if base is not None:
            for chunk in self.store.chunks:
                ref = chunk.full_ref
                if ref is not None and ref() is base:
                    self._packed.add(chunk.index)
                    return Packed(
                        chunk.index, tuple(t.size()), tuple(t.stride()), t.storage_offset()
                    )
        return t.detach()

    def unpack(self, packed: Any) -> torch.Tensor:
        """``saved_tensors_hooks`` unpack: gathers the chunk again for backward."""
        if not isinstance(packed, Packed):
            return packed
        chunks = self.store.chunks
        chunk = chunks[packed.chunk]
        if chunk.full is None:
            # Gathered again unless kept for backward (keep_for_backward: the node being
            # backpropagated owns it, so whether it is alive is the same on every rank), even
            # if forward's buffer is still alive: whether it is can depend on when Python's
            # cycle collector ran, which differs between ranks, and every rank must issue the
            # same collectives.
            kept = self._take_kept(chunk)
            chunk.full = kept if kept is not None else self._gathered(chunk)
            if packed.chunk > 0:
                self._start_prefetch(chunks[packed.chunk - 1])
        return chunk.full.as_strided(packed.size, packed.stride, packed.offset)


class KeptBuffer:
    """Holds a gathered buffer kept from forward for backward (owned by an autograd node)."""

    __slots__ = ("__weakref__", "buffer")

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer: torch.Tensor | None = buffer


def _views(full: torch.Tensor, chunk: Chunk) -> tuple[torch.Tensor, ...]:
    """The slots' parameters as views of ``full``: one split (slots are packed from offset 0,
    the padding last), then a view to each parameter's shape."""
    sizes = [s.numel for s in chunk.slots]
    pieces = full.split_with_sizes([*sizes, full.numel() - sum(sizes)])
    return tuple(piece.view(s.shape) for piece, s in zip(pieces, chunk.slots))
