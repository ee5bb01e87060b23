"""Dynamic loss scaling for fp16 mixed precision on a mesh (every rank agrees to skip)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ShardedGradScaler"]


class ShardedGradScaler:
    """Dynamic loss scaling for fp16 mixed precision on a mesh, with ``torch.amp.GradScaler``'s
    API: ``scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()``.

    ``unscale_(optimizer)`` divides the optimizer's gradients (this rank's shards) by the scale
    in place and looks for inf/NaN; the verdict is all-reduced (max) over every mesh axis, so
    every rank and every shard agree to skip or take the step. ``step`` unscales if
    ``unscale_`` was not called (call it yourself before ``pmodel.clip_grad_norm_``) and runs
    ``optimizer.step()`` only when no rank overflowed. ``update`` multiplies the scale by
    ``backoff_factor`` after a skipped step and by ``growth_factor`` after ``growth_interval``
    clean steps in a row. Disabled (``enabled=False``, fp32 / bf16), it passes through.

    Args:
        groups: the process groups whose ranks must agree (one per mesh axis of size > 1).
    """

    def __init__(
        self,
        groups: Sequence[Any],
        *,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        if not 0.0 < backoff_factor < 1.0 or growth_factor <= 1.0 or growth_interval < 1:
            raise ValueError(
                f"need 0 < backoff_factor < 1 < growth_factor and growth_interval >= 1, got "
                f"{backoff_factor}, {growth_factor}, {growth_interval}"
            )
        self._groups = tuple(groups)
        self._scale = float(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.enabled = bool(enabled)
        self._growth_tracker = 0
        self._found_inf: dict[int, bool] = {}
        """id(optimizer) -> overflow verdict, for optimizers unscaled since the last update."""
        self.skipped_steps = 0
        """Optimizer steps skipped for overflow so far."""

    def get_scale(self) -> float:
        return self._scale if self.enabled else 1.0

    def is_enabled(self) -> bool:
        return self.enabled

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the current scale (unchanged when disabled)."""
        return loss * self._scale if self.enabled else loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> bool:
        """Divide ``optimizer``'s gradients by the scale; returns whether ANY rank found an
        inf/NaN (a collective over the mesh: every rank must call it)."""
        if not self.enabled:
            return False
        if id(optimizer) in self._found_inf:
            raise RuntimeError(
                "unscale_() was already called on this optimizer since the last update(); call "
                "it once per step, before step()"
            )
        inverse = 1.0 / self._scale
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        device = grads[0].device if grads else torch.device("cpu")
        if dist.is_initialized() and dist.get_backend() == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        found = torch.zeros(1, dtype=torch.float32, device=device)
        with torch.no_grad():
            for grad in grads:
                grad.mul_(inverse)
                if grad.numel() and not bool(torch.isfinite(grad).all()):
                    found.fill_(1.0)
            for group in self._groups:
                dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
        self._found_inf[id(optimizer)] = bool(found.item() > 0)
        return self._found_inf[id(optimizer)]

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """``optimizer.step()`` unless some rank's gradients overflowed (then None)."""
        if not self.enabled:
            return optimizer.step(*args, **kwargs)
        if id(optimizer) not in self._found_inf:
            self.unscale_(optimizer)
        if self._found_inf[id(optimizer)]:
            self.skipped_steps += 1
            return None
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale: float | None = None) -> None:
        """Adjust the scale after the step(s) of this iteration (same on every rank)."""
        if not self.enabled:
            return
        if new_scale is not None:
            self._scale = float(new_scale)
            self._growth_tracker = 0
        elif any(self._found_inf.values()):
            self._scale *= self.backoff_factor
            self._growth_tracker = 0
        elif self._found_inf:
            self._growth_tracker += 1
            if self._growth_tracker >= self.growth_interval:
                self._scale *= self.growth_factor
                self._growth_tracker = 0
        self._found_inf = {}

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self._scale,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "_growth_tracker": self._growth_tracker,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._scale = float(state["scale"])
        self.growth_factor = float(state["growth_factor"])
        self.backoff_factor = float(state["backoff_factor"])
        self.growth_interval = int(state["growth_interval"])
        self._growth_tracker = int(state["_growth_tracker"])
