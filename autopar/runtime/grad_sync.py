"""Chunked, overlapped all-reduce of parameter gradients that are Partial over some mesh axes.

A parameter replicated over an axis on which its consumers' work is split (a batch-sharded axis,
typically) ends backward with a different summand of its gradient on every rank of that axis
(``LoweredGraph.param_grad_reduce_axes``). :class:`GradReducer` sums them:

* parameters are grouped into flat buckets of about ``bucket_bytes`` by (axes, dtype, device),
  filled in REVERSE order of first use in forward, which is roughly the order backward
  produces their gradients;
* a ``register_post_accumulate_grad_hook`` on each parameter counts the bucket's ready
  gradients; when a bucket is complete its gradients are moved into the bucket's flat buffer,
  each ``param.grad`` becoming a view of its slot (DDP's ``gradient_as_bucket_view``), and an
  asynchronous all-reduce over the first axis is launched on the buffer, overlapping the rest
  of backward. (The buffer is made when the bucket is complete, not at its first gradient: made
  early it would sit next to the activations backward still holds, raising the step's peak);
* the first hook of a backward queues a callback on the autograd engine
  (``Variable._execution_engine.queue_callback``) that runs when backward ends: it launches any
  bucket not yet complete (a parameter without a gradient contributes zeros), waits for every
  all-reduce and reduces over the remaining axes. The sums are then already in ``param.grad``.

The flat buffer is kept between steps, as DDP keeps its buckets (a new 7 MiB buffer per step
cost the like-for-like GPT's recompute and ddp pairs a fresh mapping and its page faults every
step; README, "Session 13: the data-parallel bucket kept"). It is reused only when nothing
outside the reducer still views it: with ``zero_grad()`` (set to None) the views go and the
next backward's gradients are copied into the same buffer; with ``zero_grad(set_to_none=False)``
the zeroed views stay as ``.grad`` and the next backward accumulates into them (nothing copied).
A ``.grad`` tensor (or any view of one) that a caller keeps across ``zero_grad()`` holds a
reference to the buffer's storage, so the reducer leaves that buffer to the caller and makes a
new one: a kept gradient is never overwritten by a later backward (unlike DDP's
``gradient_as_bucket_view=True``, where it is). Gradients move in with one split and one
``_foreach_copy_`` per bucket (README, "Session 12: ZeRO views and collectives"). (Before,
the gradients were concatenated into a new buffer and copied back after the all-reduce: one
more copy of every gradient per step, and the buffer and the gradients alive together.)

So the user writes ``loss.backward(); opt.step()`` and nothing else. Gradients are SUMMED, not
averaged: the loss is the replicated global value, so the per-rank summands add up to the true
gradient (DESIGN.md, gradient convention).

Gradient accumulation: run every micro-batch but the last under :meth:`GradReducer.no_sync`
(DDP's idiom). The partial summands then accumulate in ``.grad`` and the last backward reduces
their sum once; reducing after every backward would count the earlier micro-batches again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd import Variable
from torch.multiprocessing.reductions import StorageWeakRef

from autopar.comm.collective_check import run_collective, wait_collective

__all__ = ["DEFAULT_BUCKET_BYTES", "GradReducer"]

DEFAULT_BUCKET_BYTES = 25 * 2**20


@dataclass(slots=True, eq=False)  # identity: buckets hold tensors, and are found by index
class _Bucket:
    axes: tuple[int, ...]
    params: list[nn.Parameter] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    """Element offset of each parameter's slot in ``flat``."""
    numel: int = 0
    num_bytes: int = 0
    num_ready: int = 0
    flat: torch.Tensor | None = None
    """The buffer of the backward in progress (None between steps)."""
    kept: torch.Tensor | None = None
    """The previous step's buffer, reused when nothing outside the reducer views it."""
    kept_storage: StorageWeakRef | None = None
    """A weak reference to ``kept``'s storage (it counts the tensors that view it)."""
    kept_uses: int = 0
    """Uses of that storage that are neither a ``.grad`` slot nor outside the reducer."""
    work: Any = None


class GradReducer:
    """Sums partial parameter gradients over mesh axes after each backward (module docstring).

    Args:
        params: ``(parameter, axes)`` in order of first use in forward; each parameter once.
        group_of: mesh axis -> the process group of this rank along that axis.
        bucket_bytes: target size of one flat bucket.
        axis_names: the mesh axes' names (collective failures and check mode name the axis).
    """

    def __init__(
        self,
        params: Sequence[tuple[nn.Parameter, tuple[int, ...]]],
        group_of: Callable[[int], Any],
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        axis_names: Sequence[str] | None = None,
    ) -> None:
        self._group_of = group_of
        self._axis_names = tuple(axis_names or ())
        self._buckets: list[_Bucket] = []
        self._bucket_of: dict[int, tuple[_Bucket, int]] = {}
        """id(parameter) -> (its bucket, its index there)."""
        self._callback_queued = False
        self._enabled = True
        open_buckets: dict[tuple[Any, ...], _Bucket] = {}
        for param, axes in reversed(list(params)):
            if not axes or not param.requires_grad:
                continue
            key = (tuple(axes), param.dtype, param.device)
            bucket = open_buckets.get(key)
            if bucket is None or bucket.num_bytes >= bucket_bytes:
                bucket = _Bucket(axes=tuple(axes))
                open_buckets[key] = bucket
                self._buckets.append(bucket)
            self._bucket_of[id(param)] = (bucket, len(bucket.params))
            bucket.params.append(param)
            bucket.offsets.append(bucket.numel)
            bucket.numel += param.numel()
            bucket.num_bytes += param.numel() * param.element_size()
        self._handles = [
            param.register_post_accumulate_grad_hook(self._on_grad_ready)
            for bucket in self._buckets
            for param in bucket.params
        ]

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward calls inside only accumulate local gradients (no reduction)."""
        previous, self._enabled = self._enabled, False
        try:
            yield
        finally:
            self._enabled = previous

    def reduce_now(self) -> None:
        """Reduce every bucket's accumulated ``.grad`` now, outside backward (gradients that
        backward passes under :meth:`no_sync`, or ones that bypass the hooks, left there)."""
        self._finish()

    def remove(self) -> None:
        """Detach the hooks (gradients are then no longer reduced)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self._enabled:
            return
        if not self._callback_queued:
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self._finish)
        bucket, _ = self._bucket_of[id(param)]
        bucket.num_ready += 1
        if bucket.num_ready == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        """Move the bucket's gradients into its flat buffer, each ``.grad`` becoming a view of
        its slot, and launch the all-reduce over the first axis. One split of the buffer and
        one ``_foreach_copy_`` for the bucket (it was ``slice`` + ``reshape`` + ``copy_`` +
        ``view_as`` per parameter); nothing to copy where ``.grad`` already is its slot (as
        under ``zero_grad(set_to_none=False)``), zeros where a parameter has no gradient."""
        if bucket.flat is None:
            bucket.flat = self._reusable(bucket)
        if bucket.flat is None:
            bucket.flat = _unshared(bucket)
        bucket.kept = bucket.kept_storage = None
        if bucket.flat is None:
            param = bucket.params[0]
            bucket.flat = torch.empty(bucket.numel, dtype=param.dtype, device=param.device)
        flat = bucket.flat
        pieces: tuple[torch.Tensor, ...] | None = None
        moved, into = [], []
        for index, param in enumerate(bucket.params):
            grad = param.grad
            if grad is not None and _is_slot(grad, flat, bucket.offsets[index]):
                continue
            if pieces is None:
                pieces = flat.split_with_sizes([p.numel() for p in bucket.params])
            if grad is None:
                pieces[index].zero_()
            else:
                view = pieces[index].view_as(param)
                moved.append(grad)
                into.append(view)
                param.grad = view
        if moved:
            torch._foreach_copy_(into, moved)
        group = self._group_of(bucket.axes[0])
        bucket.work = run_collective(
            "all_reduce", f"grad bucket {self._buckets.index(bucket)}", flat, group,
            self._axis_label(bucket.axes[0]),
            lambda: dist.all_reduce(flat, group=group, async_op=True),
        )  # fmt: skip

    @staticmethod
    def _reusable(bucket: _Bucket) -> torch.Tensor | None:
        """The flat buffer the first gradient of the bucket still views in its slot (kept
        by ``zero_grad(set_to_none=False)``), if any."""
        for param, offset in zip(bucket.params, bucket.offsets):
            grad = param.grad
            if grad is None:
                continue
            base = grad._base
            if (
                base is not None
                and base.dim() == 1
                and base.numel() == bucket.numel
                and base.dtype == param.dtype
                and _is_slot(grad, base, offset)
            ):
                return base
            return None
        return None

    def _axis_label(self, axis: int) -> str:
        return self._axis_names[axis] if axis < len(self._axis_names) else f"a{axis}"

    def _finish(self) -> None:
        # Every rank launches the same buckets in the same order, so the collectives match.
        self._callback_queued = False
        for bucket in self._buckets:
            if bucket.work is None:
                self._launch(bucket)
        for index, bucket in enumerate(self._buckets):
            flat = bucket.flat
            assert flat is not None
            axis = bucket.axes[0]
            wait_collective(bucket.work, "all_reduce", f"grad bucket {index}", flat,
                            self._group_of(axis), self._axis_label(axis))  # fmt: skip
            for axis in bucket.axes[1:]:
                group = self._group_of(axis)
                run_collective(
                    "all_reduce", f"grad bucket {index}", flat, group, self._axis_label(axis),
                    lambda: dist.all_reduce(flat, group=group),  # noqa: B023 - runs now
                )  # fmt: skip
            bucket.flat = None
            bucket.work = None
            bucket.kept, bucket.kept_storage = flat, StorageWeakRef(flat.untyped_storage())
            bucket.kept_uses = _storage_uses(bucket) - _num_slots(bucket)
            bucket.num_ready = 0


def _unshared(bucket: _Bucket) -> torch.Tensor | None:
    """The bucket's kept buffer if nothing but the reducer and the parameters' ``.grad`` slots
    uses its storage (a ``.grad``, or a view of one, kept elsewhere counts), else None: a
    gradient a caller keeps is never overwritten."""
    if bucket.kept is None:
        return None
    unchanged = _storage_uses(bucket) == bucket.kept_uses + _num_slots(bucket)
    return bucket.kept if unchanged else None


def _storage_uses(bucket: _Bucket) -> int:
    """The use count of the kept buffer's storage: one per tensor viewing it, plus what holds
    the storage itself (calibrated when the buffer is kept: ``_Bucket.kept_uses``)."""
    assert bucket.kept_storage is not None
    return torch._C._storage_Use_Count(bucket.kept_storage.cdata)


def _num_slots(bucket: _Bucket) -> int:
    """How many parameters' ``.grad`` are their slot of the kept buffer."""
    kept = bucket.kept
    assert kept is not None
    return sum(
        1
        for param, offset in zip(bucket.params, bucket.offsets)
        if param.grad is not None and _is_slot(param.grad, kept, offset)
    )


def _is_slot(grad: torch.Tensor, flat: torch.Tensor, offset: int) -> bool:
    """Whether ``grad`` is the contiguous view of ``flat`` starting at element ``offset``."""
    return (
        grad._base is flat
        and grad.storage_offset() == flat.storage_offset() + offset
        and grad.is_contiguous()
    )
