"""The backward side of the ZeRO runtime: each chunk's flat gradient is reduced (reduce-scatter
over G, all-reduce over the partial axes outside G) as soon as backward completes it, with a
bounded number of reductions in flight, and handed to the shard parameters' ``.grad`` at the end
of backward; ``no_sync`` accumulates locally (see :mod:`autopar.runtime.zero`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch.autograd import Variable

from autopar.comm.collective_check import run_collective, wait_collective
from autopar.runtime.zero_layout import Chunk, ZeroMesh
from autopar.runtime.zero_store import ChunkStore

__all__ = ["MAX_IN_FLIGHT", "GradientReducer"]

MAX_IN_FLIGHT = 2
"""Asynchronous gradient reductions (one per chunk) in flight during backward; the oldest is
waited for when another is launched (its input, the chunk's full flat gradient, is then freed)."""


class GradientReducer:
    """Reduces each chunk's gradient as backward completes it and sets the shard parameters'
    ``.grad`` when backward ends.

    Args:
        store: the chunks.
        mesh: the process groups the reductions run on.
        end_backward: called once at the end of every synchronised backward, after the last
            reduction (the gatherer drops the buffers gathered for backward).
    """

    def __init__(self, store: ChunkStore, mesh: ZeroMesh, end_backward: Callable[[], None]) -> None:
        self.store = store
        self.mesh = mesh
        self._end_backward = end_backward
        self._sync = True
        self._callback_queued = False
        self._in_flight: list[Chunk] = []
        """Chunks whose asynchronous gradient reduction is launched and not yet waited for."""

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward calls inside accumulate local gradients without communicating."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def chunk_backward(self, chunk: Chunk, grads: Sequence[torch.Tensor | None]) -> None:
        """Backward completed the chunk's gradients (``grads``, one per slot): reduce them, or
        under :meth:`no_sync` accumulate them."""
        # The chunk's kept gradient buffer (what the shard .grad views) is written in place when
        # nothing it holds is still wanted: every .grad is None (zero_grad's default) or a
        # zeroed view of it. Otherwise (gradients to add to, no_sync) the reduction runs next
        # to it and is added at the end of backward.
        reuse = self.zeroed_grad_buffer(chunk) if self._sync else None
        if reuse is not None and not chunk.grad_axes:
            flat = reuse
        else:
            flat = torch.empty(chunk.numel, dtype=torch.float32, device=chunk.shard.device)  # type: ignore[union-attr]
        self._flatten(chunk, grads, flat)
        if chunk.pending is not None:
            flat += chunk.pending
            chunk.pending = None
        if not self._sync:
            chunk.pending = flat
            return
        if not self._callback_queued:
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self._finish_backward)
        # Reduce-scatter (or slice, where the gradient is already whole) over G; the last
        # collective launched here runs asynchronously, overlapped with the rest of backward.
        value = flat
        last_scatter = chunk.scatter_axes[-1] if chunk.scatter_axes else None
        what = f"zero chunk {chunk.index} grad"
        for axis in chunk.grad_axes:
            size = self.mesh.shape[axis]
            part = value.numel() // size
            last_g = axis == chunk.grad_axes[-1]
            if axis in chunk.scatter_axes:
                if reuse is not None and last_g:
                    out = reuse
                else:
                    out = torch.empty(part, dtype=value.dtype, device=value.device)
                last = axis == last_scatter and not chunk.allreduce_axes
                src, group = value, self.mesh.group_of(axis)
                work = run_collective(
                    "reduce_scatter", what, src, group, self.mesh.axis_names[axis],
                    lambda: dist.reduce_scatter_single(out, src, group=group, async_op=last),  # noqa: B023
                )  # fmt: skip
                if last:
                    chunk.work = work
                value = out
            else:
                coord = self.mesh.coords[axis]
                piece = value[coord * part : (coord + 1) * part]
                value = reuse.copy_(piece) if reuse is not None and last_g else piece.clone()
        if chunk.allreduce_axes:
            axis = chunk.allreduce_axes[0]
            src, group = value, self.mesh.group_of(axis)
            chunk.work = run_collective(
                "all_reduce", what, src, group, self.mesh.axis_names[axis],
                lambda: dist.all_reduce(src, group=group, async_op=True),
            )  # fmt: skip
        chunk.reduced = value
        if chunk.work is not None:
            self._bound_in_flight(chunk)

    def _flatten(
        self, chunk: Chunk, grads: Sequence[torch.Tensor | None], flat: torch.Tensor
    ) -> None:
        """Write the slots' gradients into ``flat`` (the chunk's layout), every element once:
        one ``_foreach_copy_`` into the slots' kept views when ``flat`` is the kept buffer,
        else one ``_chunk_cat`` (FSDP2's reduce-scatter input copy), zeros in the padding;
        per slot only where a gradient is missing."""
        used = sum(slot.numel for slot in chunk.slots)  # slots are packed from offset 0
        present = [g for g in grads if g is not None]
        if len(present) == len(grads) and flat is chunk.grad_buffer and chunk.flat_views:
            torch._foreach_copy_(chunk.flat_views, present)
        elif (
            len(present) == len(grads)
            and present
            and all(g.dim() and g.dtype == present[0].dtype for g in present)
        ):
            torch._chunk_cat(present, 0, 1, out=flat[:used].view(1, used))
        else:
            for slot, grad in zip(chunk.slots, grads):
                piece = flat[slot.offset : slot.offset + slot.numel]
                if grad is None:
                    piece.zero_()
                else:
                    piece.copy_(grad.reshape(-1))
        if used < flat.numel():
            flat[used:].zero_()

    def reduce_pending(self) -> None:
        """Reduce now, outside backward, what backward passes under :meth:`no_sync`
        accumulated (each chunk's pending flat gradient), as a synchronised backward would,
        and set the shard parameters' ``.grad``."""
        chunks = [chunk for chunk in self.store.chunks if chunk.pending is not None]
        if not chunks:
            return
        self._callback_queued = True  # finished below, not by a callback of a backward
        for chunk in chunks:
            self.chunk_backward(chunk, [None] * len(chunk.slots))
        self._finish_backward()

    def zeroed_grad_buffer(self, chunk: Chunk) -> torch.Tensor | None:
        """The G-level gradient buffer this backward may write in place, else None.

        G empty (stages 0-1 on the chunk's axes): the chunk's kept buffer (made at the first
        call, with the shard ``.grad`` views of it), if every non-empty slot's ``.grad`` is
        None or its view and, where some view is set, the O-shard holds only zeros. G
        non-empty: the buffer is not kept between steps (it is the sharded gradient, which
        ``zero_grad()`` frees, as FSDP2's does); the G-level buffer that every shard ``.grad``
        still views, if its O-shard holds only zeros (``zero_grad(set_to_none=False)``).
        The rest of the buffer is stale: the caller overwrites it."""
        lo = chunk.shard_in_grad
        if chunk.grad_axes:
            base = None
            for slot, param in zip(chunk.slots, chunk.params):
                if slot.empty:
                    continue  # no .grad here (_finish_backward)
                grad = param.grad
                if grad is None or grad._base is None:
                    return None
                if base is None:
                    base = grad._base
                offset = base.storage_offset() + lo + slot.shard_lo
                if grad._base is not base or grad.storage_offset() != offset:
                    return None
            if base is None or base.dtype != torch.float32 or base.dim() != 1:
                return None
            if base.numel() != chunk.numel // math.prod(
                self.mesh.shape[a] for a in chunk.grad_axes
            ):
                return None
            return None if base[lo : lo + chunk.shard_numel].any() else base
        if chunk.grad_buffer is None:
            self._make_grad_buffer(chunk)
        assert chunk.grad_buffer is not None and chunk.grad_views is not None
        viewed = False
        for param, view in zip(chunk.params, chunk.grad_views):
            grad = param.grad
            if view is None or grad is None:
                continue  # an empty slot has no .grad here (_finish_backward)
            if grad is not view:
                return None
            viewed = True
        if viewed and chunk.grad_buffer[lo : lo + chunk.shard_numel].any():
            return None
        return chunk.grad_buffer

    def _make_grad_buffer(self, chunk: Chunk) -> None:
        """G empty: the chunk's kept gradient buffer and, once, its views (the whole chunk,
        as DDP keeps its buckets; module docstring)."""
        buffer = torch.zeros(chunk.numel, dtype=torch.float32, device=chunk.shard.device)  # type: ignore[union-attr]
        chunk.grad_buffer = buffer
        chunk.grad_views = [
            None if view.numel() == 0 else view
            for view in _shard_pieces(buffer[chunk.shard_in_grad :], chunk)
        ]
        chunk.flat_views = [
            buffer[s.offset : s.offset + s.numel].view(s.shape) for s in chunk.slots
        ]

    def _bound_in_flight(self, chunk: Chunk) -> None:
        """Wait for the oldest reductions beyond :data:`MAX_IN_FLIGHT`: an asynchronous
        reduce-scatter holds its input, the chunk's full flat gradient, until it is waited for,
        so unbounded, every chunk's full gradient would be alive at the end of backward."""
        self._in_flight.append(chunk)
        while len(self._in_flight) > MAX_IN_FLIGHT:
            oldest = self._in_flight.pop(0)
            if oldest.work is not None:
                self._wait_reduction(oldest)

    def _wait_reduction(self, chunk: Chunk) -> None:
        """Wait for the chunk's asynchronous gradient reduction (a failure names it)."""
        op, axis = (
            ("all_reduce", chunk.allreduce_axes[0])
            if chunk.allreduce_axes
            else ("reduce_scatter", chunk.scatter_axes[-1])
        )
        assert chunk.work is not None and chunk.reduced is not None
        what = f"zero chunk {chunk.index} grad"
        group, label = self.mesh.group_of(axis), self.mesh.axis_names[axis]
        wait_collective(chunk.work, op, what, chunk.reduced, group, label)
        chunk.work = None

    def _finish_backward(self) -> None:
        self._callback_queued = False
        self._in_flight = []
        for chunk in self.store.chunks:
            if chunk.reduced is None:
                continue
            if chunk.work is not None:
                self._wait_reduction(chunk)
            for axis in chunk.allreduce_axes[1:]:
                src, group = chunk.reduced, self.mesh.group_of(axis)
                run_collective(
                    "all_reduce", f"zero chunk {chunk.index} grad", src, group,
                    self.mesh.axis_names[axis], lambda: dist.all_reduce(src, group=group),  # noqa: B023
                )  # fmt: skip
            # The optimizer's gradient is the O-shard of the reduced G-shard (a view: the G-shard
            # stays alive as the gradient storage, as the memory model counts it). A parameter
            # none of whose elements lie in this rank's O-shard gets no .grad: the optimizer's
            # loop skips it here (its owners update it), as ZeroRedundancyOptimizer's ranks
            # step only the parameters they own.
            reduced, chunk.reduced = chunk.reduced, None
            if reduced is chunk.grad_buffer:
                # Reduced in place: the .grad are the views built once (no slicing per step).
                for param, view in zip(chunk.params, chunk.grad_views):  # type: ignore[arg-type]
                    if view is not None and param.grad is None:
                        param.grad = view
                continue
            pieces = _shard_pieces(reduced[chunk.shard_in_grad :], chunk)
            for slot, param, grad in zip(chunk.slots, chunk.params, pieces):
                if slot.empty:
                    continue
                if param.grad is None:
                    param.grad = grad
                elif param.grad._base is not reduced:
                    param.grad.add_(grad)
                # else: reduced in place into the zeroed buffer .grad views (chunk_backward)
        self._end_backward()


def _shard_pieces(grad: torch.Tensor, chunk: Chunk) -> tuple[torch.Tensor, ...]:
    """Each slot's piece of this rank's O-shard of a gradient that starts at the O-shard
    (one split: the non-empty slots tile the shard from its start, empty ones have size 0)."""
    sizes = [slot.shard_hi - slot.shard_lo for slot in chunk.slots]
    return grad.split_with_sizes([*sizes, grad.numel() - sum(sizes)])[:-1]
