"""The optimizer side of the ZeRO runtime: which optimizers may step on the shards, and the
all-gather of the updated shards after each step. Mixed into
:class:`autopar.runtime.zero.ZeroEngine` (see that module's docstring).

After every optimizer step that touches a chunk (a global ``torch.optim`` step post-hook,
filtered by parameter identity) the updated O-shards are all-gathered over ``O \\ P`` into the
kept buffer (nothing to do when O = P).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from autopar.runtime.zero_layout import Chunk

__all__ = ["ELEMENTWISE_OPTIMIZERS", "ZeroStepMixin", "register_optimizer_hooks"]

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


class ZeroStepMixin:
    """The engine's optimizer-step methods (state: :class:`~autopar.runtime.zero.ZeroEngine`)."""

    chunks: list[Chunk]
    stage: int
    compute_dtype: torch.dtype | None
    _chunk_of_param: dict[int, tuple[int, int]]
    _handles: list[Any]

    if TYPE_CHECKING:

        def _gather_flat(self, shard: torch.Tensor, zero_axes: Sequence[int]) -> torch.Tensor: ...

        def _compute_shard(self, chunk: Chunk) -> torch.Tensor: ...

    def remove(self) -> None:
        """Remove the engine's optimizer step hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _check_optimizer(self, optimizer: torch.optim.Optimizer) -> bool:
        if not any(
            id(p) in self._chunk_of_param for g in optimizer.param_groups for p in g["params"]
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

    def _after_step(self, optimizer: torch.optim.Optimizer) -> None:
        touched = sorted(
            {
                self._chunk_of_param[id(p)][0]
                for g in optimizer.param_groups
                for p in g["params"]
                if id(p) in self._chunk_of_param
            }
        )
        with torch.no_grad():
            for index in touched:
                self.sync_full(index)

    def sync_full(self, index: int) -> None:
        """All-gather the chunk's updated O-shards over ``O \\ P`` into its kept buffer (a
        collective over those axes; nothing when O = P)."""
        chunk = self.chunks[index]
        rest = chunk.zero_axes[chunk.num_param_axes :]
        if not rest:
            return
        assert chunk.kept is not None and chunk.shard is not None
        # From a copy: the shard is a view into the buffer being written.
        chunk.kept.copy_(self._gather_flat(self._compute_shard(chunk).clone(), rest))


def register_optimizer_hooks(engine: ZeroStepMixin) -> list[Any]:
    """Global torch.optim step hooks that act only on optimizers holding this engine's shards
    (weakly referenced: a dropped module leaves inert hooks)."""
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    ref = weakref.ref(engine)

    def pre(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        live = ref()
        if live is not None:
            live._check_optimizer(optimizer)

    def post(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        live = ref()
        if live is not None and live._check_optimizer(optimizer):
            live._after_step(optimizer)

    handles = [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]
    weakref.finalize(engine, _remove_handles, list(handles))
    return handles


def _remove_handles(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()
