"""The backward side of the ZeRO runtime: each chunk's flat gradient is reduced (reduce-scatter
over G, all-reduce over the partial axes outside G) as soon as backward completes it, with a
bounded number of reductions in flight, and handed to the shard parameters' ``.grad`` at the end
of backward; ``no_sync`` accumulates locally (see :mod:`autopar.runtime.zero`).
"""

from __future__ import annotations

import contextlib
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
        # Where the last step's reduced gradient (what the shard .grad views) is all zeros
        # (zero_grad(set_to_none=False)), this backward reduces into it rather than next to it.
        reuse = self.zeroed_grad_buffer(chunk) if self._sync else None
        if reuse is not None and not chunk.grad_axes and reuse.numel() == chunk.numel:
            flat, reuse = reuse, None  # every element is written below
        else:
            flat = torch.empty(chunk.numel, dtype=torch.float32, device=chunk.shard.device)  # type: ignore[union-attr]
        # Every element written once: the gradients copied in, zeros only where there is none
        # (padding, a slot without a gradient), not a zero fill of the whole chunk first.
        end = 0
        for slot, grad in sorted(zip(chunk.slots, grads), key=lambda sg: sg[0].offset):
            if slot.offset > end:
                flat[end : slot.offset].zero_()
            piece = flat[slot.offset : slot.offset + slot.numel]
            if grad is None:
                piece.zero_()
            else:
                piece.copy_(grad.reshape(-1))
            end = max(end, slot.offset + slot.numel)
        if end < flat.numel():
            flat[end:].zero_()
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
            if axis in chunk.scatter_axes:
                if reuse is not None and axis == chunk.grad_axes[-1] and reuse.numel() == part:
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
                value = value[
                    self.mesh.coords[axis] * part : (self.mesh.coords[axis] + 1) * part
                ].clone()
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
        """The G-level buffer that every shard ``.grad`` of the chunk still views (as
        :meth:`_finish_backward` set them), if its O-shard (what the ``.grad`` views cover)
        holds only zeros; else None. The rest of it is stale: the caller overwrites it."""
        base = None
        for slot, param in zip(chunk.slots, chunk.params):
            if slot.empty:
                continue  # no .grad here (_finish_backward)
            grad = param.grad
            if grad is None or grad._base is None:
                return None
            if base is None:
                base = grad._base
            lo = base.storage_offset() + chunk.shard_in_grad + slot.shard_lo
            if grad._base is not base or grad.storage_offset() != lo:
                return None
        if base is None or base.dtype != torch.float32 or base.dim() != 1:
            return None
        lo = chunk.shard_in_grad
        if base.numel() < lo + chunk.shard_numel or base[lo : lo + chunk.shard_numel].any():
            return None
        return base

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
            lo = chunk.shard_in_grad
            grad_shard = chunk.reduced[lo : lo + chunk.shard_numel]
            chunk.reduced = None
            for slot, param in zip(chunk.slots, chunk.params):
                if slot.empty:
                    continue
                grad = grad_shard[slot.shard_lo : slot.shard_hi]
                if param.grad is None:
                    param.grad = grad
                elif param.grad._base is not grad._base:
                    param.grad.add_(grad)
                # else: reduced in place into the zeroed buffer .grad views (chunk_backward)
        self._end_backward()
