"""The optimizer side of the ZeRO runtime: which optimizers may step on the shards, and the
all-gather of the updated shards after each step (see :mod:`autopar.runtime.zero`).

After every optimizer step that touches a chunk (a global ``torch.optim`` step post-hook,
filtered by parameter identity) the updated O-shards are all-gathered over ``O \\ P`` into the
kept buffer (nothing to do when O = P).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

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
        collective over those axes; nothing when O = P)."""
        chunk = self.store.chunks[index]
        rest = chunk.zero_axes[chunk.num_param_axes :]
        if not rest:
            return
        assert chunk.kept is not None and chunk.shard is not None
        kept, lo = chunk.kept, chunk.shard_in_kept
        mine = kept[lo : lo + chunk.shard_numel]
        if mine.data_ptr() != chunk.shard.data_ptr():  # mixed precision: cast into place
            mine.copy_(chunk.shard)
        # In place: the O-shard already sits at its offset in the kept buffer.
        self.mesh.fill_flat(kept, chunk.shard_numel, rest)


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
