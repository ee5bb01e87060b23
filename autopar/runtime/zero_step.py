"""The optimizer side of the ZeRO runtime: which optimizers may step on the shards, and the
all-gather of the updated shards after each step (see :mod:`autopar.runtime.zero`).

After every optimizer step that touches a chunk (a global ``torch.optim`` step post-hook,
filtered by parameter identity) the updated O-shards are all-gathered over ``O \\ P`` into the
kept buffer (nothing to do when O = P).

Ownership. A parameter none of whose elements lie in this rank's O-shard (an empty slot) gets
no ``.grad`` here, so the optimizer's loop skips it on this rank and only its owners (the ranks
whose shards hold its elements) update it, as ZeroRedundancyOptimizer's ranks step only the
parameters they own: one chunk over 4 ranks, each rank's AdamW steps 7-9 of the like-for-like
GPT's 28 parameters instead of 28 (README, "Session 11: zero1 ownership"). The optimizer then
keeps no state for it here either; :meth:`OptimizerStepHook.complete_state` gives it its
owners' form (empty per-element tensors, their scalars such as Adam's ``step``) when a state
dict is taken, so state dicts keep one entry per parameter on every rank.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from autopar.runtime.zero_layout import ZeroMesh
from autopar.runtime.zero_store import ChunkStore

__all__ = ["ELEMENTWISE_OPTIMIZERS", "OptimizerStepHook"]

ELEMENTWISE_OPTIMIZERS: frozenset[str] = frozenset(
    {
        "SGD",
        "Adam",
        "AdamW",
        "Adamax",
        "Adagrad",
        "Adadelta",
        "ASGD",
        "NAdam",
        "RAdam",
        "RMSprop",
        "Rprop",
        "LAMB",
        "LARS",
    }
)
"""Optimizer class names whose update of an element depends only on that element (LAMB / LARS:
autopar.optim's, which reduce their norms over every shard)."""


class OptimizerStepHook:
    """Checks the optimizers that step this store's shard parameters and refreshes the kept
    buffers after each step (global ``torch.optim`` step hooks, removed by :meth:`remove` or
    when this object dies).

    Args:
        store: the chunks.
        mesh: the process groups the after-step all-gathers run on.
        stage: the ZeRO stage an error message names.
    """

    def __init__(self, store: ChunkStore, mesh: ZeroMesh, stage: int) -> None:
        self.store = store
        self.mesh = mesh
        self.stage = stage
        self._handles = _register_optimizer_hooks(self)

    def remove(self) -> None:
        """Remove the engine's optimizer step hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` holds some shard parameter of the store (raises if it is not
        elementwise)."""
        if not any(
            id(p) in self.store.chunk_of_param for g in optimizer.param_groups for p in g["params"]
        ):
            return False
        name = type(optimizer).__name__
        if name not in ELEMENTWISE_OPTIMIZERS and not getattr(
            type(optimizer), "autopar_elementwise", False
        ):
            raise ValueError(
                f"ZeRO stage {self.stage} gives the optimizer 1-D shards of each parameter, and "
                f"{name} needs whole parameters; use an elementwise optimizer (SGD, Adam, AdamW, ...) "
                f"or autopar.optim.LAMB / LARS, train with zero_stage=0, or set "
                f"{name}.autopar_elementwise = True if its update really is elementwise"
            )
        return True

    def complete_state(self, optimizer: torch.optim.Optimizer) -> None:
        """Give the optimizer state of this rank's empty slots (module docstring) the form of
        their owners' state: per-element tensors empty, the rest (Adam's ``step``, ...) the
        owners' values; no state where no owner has any. A collective over every ZeRO axis
        (one object all-gather per axis, merged hierarchically: after the last axis every rank
        has heard from every rank of each chunk's O-group)."""
        held = {id(p) for g in optimizer.param_groups for p in g["params"]}
        known: dict[str, dict[str, Any]] = {}
        empty: list[tuple[str, torch.Tensor]] = []
        for chunk in self.store.chunks:
            for slot, param in zip(chunk.slots, chunk.params):
                if id(param) not in held:
                    continue
                if slot.empty:
                    empty.append((slot.fqn, param))
                elif optimizer.state.get(param):
                    known[slot.fqn] = {
                        key: _portable(value, param)
                        for key, value in optimizer.state[param].items()
                    }
        for axis in sorted({a for c in self.store.chunks for a in c.zero_axes}):
            heard: list[Any] = [None] * self.mesh.shape[axis]
            dist.all_gather_object(heard, known, group=self.mesh.group_of(axis))
            for other in heard:
                for fqn, entry in other.items():
                    known.setdefault(fqn, entry)
        for fqn, param in empty:
            entry = known.get(fqn)
            if entry is None:
                optimizer.state.pop(param, None)
                continue
            optimizer.state[param] = {key: _restored(value, param) for key, value in entry.items()}

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        touched = sorted(
            {
                self.store.chunk_of_param[id(p)][0]
                for g in optimizer.param_groups
                for p in g["params"]
                if id(p) in self.store.chunk_of_param
            }
        )
        with torch.no_grad():
            for index in touched:
                self.sync_full(index)

    def sync_full(self, index: int) -> None:
        """All-gather the chunk's updated O-shards over ``O \\ P`` into its kept buffer (a
        collective over those axes; nothing when O = P). Under mixed precision the O-shard is
        first cast into its place in the kept buffer (the whole buffer for a chunk of no axes)."""
        chunk = self.store.chunks[index]
        if chunk.kept is None:  # O = P under mixed precision: the shard is cast when gathered
            return
        assert chunk.shard is not None
        kept, lo = chunk.kept, chunk.shard_in_kept
        mine = kept[lo : lo + chunk.shard_numel]
        if mine.data_ptr() != chunk.shard.data_ptr():  # mixed precision: cast into place
            mine.copy_(chunk.shard)
        rest = chunk.zero_axes[chunk.num_param_axes :]
        if rest:
            # In place: the O-shard already sits at its offset in the kept buffer.
            self.mesh.fill_flat(kept, chunk.shard_numel, rest)


@dataclass(frozen=True, slots=True)
class _PerElement:
    """An owner's per-element state tensor, by its dtype (its values are the owner's own)."""

    dtype: torch.dtype


@dataclass(frozen=True, slots=True)
class _OnDevice:
    """An owner's tensor that lived on its accelerator, sent as a CPU copy (the receiver puts
    it on its own device; pickled CUDA tensors would land on the sender's device index)."""

    value: torch.Tensor


def _portable(value: Any, param: torch.Tensor) -> Any:
    """An owner's state entry as the ranks holding no piece of ``param`` receive it."""
    if not torch.is_tensor(value):
        return value
    if value.dim() > 0 and value.shape == param.shape:
        return _PerElement(value.dtype)
    copy = value.detach().to("cpu", copy=True)
    return copy if value.device.type == "cpu" else _OnDevice(copy)


def _restored(value: Any, param: torch.Tensor) -> Any:
    """The state entry of a parameter this rank holds no piece of, from an owner's."""
    if isinstance(value, _PerElement):
        return torch.empty_like(param, dtype=value.dtype)
    if isinstance(value, _OnDevice):
        return value.value.to(param.device)
    return value.clone() if torch.is_tensor(value) else value


def _register_optimizer_hooks(hook: OptimizerStepHook) -> list[Any]:
    """Global torch.optim step hooks that act only on optimizers holding ``hook``'s shards
    (weakly referenced: a dropped module leaves inert hooks)."""
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    ref = weakref.ref(hook)

    def pre(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        live = ref()
        if live is not None:
            live.check_optimizer(optimizer)

    def post(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        live = ref()
        if live is not None and live.check_optimizer(optimizer):
            live.after_step(optimizer)

    handles = [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]
    weakref.finalize(hook, _remove_handles, list(handles))
    return handles


def _remove_handles(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()
