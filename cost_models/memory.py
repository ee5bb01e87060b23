"""Bytes of training state per device: parameters, gradients, optimizer state, master weights.

Per parameter element, before ZeRO (``p`` = param dtype bytes, ``k`` = optimizer buffers)::

    mixed_precision   params   grads   master   optimizer
    None              p        p       0        k * p     (torch keeps state in the param dtype)
    "bf16" / "fp16"   2        4       4        k * 4     (fp32 grads, master copy and state)

ZeRO over ``zero_shards`` devices divides: stage >= 1 the optimizer state and the master copy,
stage >= 2 also the gradients, stage 3 also the parameters. With a stage per mesh axis each kind
of state has its own shard count (``param_shards``, ``grad_shards``, ``state_shards``). Under ZeRO-3 the gathered working copy
of a parameter is a transient of the op that uses it and is not counted here.
"""

from __future__ import annotations

from dataclasses import dataclass

OPTIMIZER_BUFFERS = {
    "sgd": 0,
    "sgd-momentum": 1,
    "adam": 2,
    "adamw": 2,
    "lamb": 2,
    "lars": 1,
    "adagrad": 1,
}
OPTIMIZERS: tuple[str, ...] = tuple(OPTIMIZER_BUFFERS)
MIXED_PRECISIONS: tuple[str, ...] = ("bf16", "fp16")
_FP32_BYTES = 4
_HALF_BYTES = 2


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryBreakdown:
    """Bytes per device of each kind of training state."""

    params: float
    grads: float
    optimizer: float
    master: float
    """The fp32 master copy of the parameters under mixed precision (0 otherwise)."""

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.master

    def to_dict(self) -> dict[str, float]:
        return {
            "params": self.params,
            "grads": self.grads,
            "optimizer": self.optimizer,
            "master": self.master,
            "total": self.total,
        }


def optimizer_state_buffers(optimizer: str) -> int:
    """Per-element state buffers the optimizer keeps (Adam: exp_avg and exp_avg_sq -> 2).

    Raises:
        ValueError: unknown optimizer (the message lists the known ones).
    """
    key = optimizer.strip().lower()
    if key not in OPTIMIZER_BUFFERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {', '.join(OPTIMIZERS)}")
    return OPTIMIZER_BUFFERS[key]


def training_state_bytes(
    *,
    num_elements: float,
    param_dtype_bytes: int = 4,
    optimizer: str = "adamw",
    mixed_precision: str | None = None,
    zero_stage: int = 0,
    zero_shards: int = 1,
    param_shards: int | None = None,
    grad_shards: int | None = None,
    state_shards: int | None = None,
) -> MemoryBreakdown:
    """Bytes per device of the training state of ``num_elements`` parameter elements.

    Args:
        num_elements: parameter elements this device would hold without ZeRO (after any
            tensor-parallel sharding).
        param_dtype_bytes: bytes of the parameter dtype (used without mixed precision).
        optimizer: one of ``OPTIMIZERS``.
        mixed_precision: None, "bf16" or "fp16" (see the module docstring).
        zero_stage: 0-3.
        zero_shards: devices the ZeRO state is split over (product of the ZeRO axes' sizes).
        param_shards, grad_shards, state_shards: per-axis ZeRO stages
            (``autopar.runtime.zero``): the devices the parameters (P axes), the gradients (G)
            and the optimizer state with the master copy (O) are split over; each given one
            overrides what ``zero_stage`` / ``zero_shards`` imply for that kind of state.
    """
    if num_elements < 0:
        raise ValueError(f"num_elements must be >= 0, got {num_elements}")
    if param_dtype_bytes <= 0:
        raise ValueError(f"param_dtype_bytes must be > 0, got {param_dtype_bytes}")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage}")
    if zero_shards < 1:
        raise ValueError(f"zero_shards must be >= 1, got {zero_shards}")
    if param_shards is None:
        param_shards = zero_shards if zero_stage >= 3 else 1
    if grad_shards is None:
        grad_shards = zero_shards if zero_stage >= 2 else 1
    if state_shards is None:
        state_shards = zero_shards if zero_stage >= 1 else 1
    if min(param_shards, grad_shards, state_shards) < 1:
        raise ValueError(
            f"shard counts must be >= 1, got params {param_shards}, grads {grad_shards}, "
            f"state {state_shards}"
        )
    num_buffers = optimizer_state_buffers(optimizer)
    if mixed_precision is None:
        param_b, grad_b, master_b, state_b = (
            param_dtype_bytes,
            param_dtype_bytes,
            0,
            param_dtype_bytes,
        )
    elif mixed_precision in MIXED_PRECISIONS:
        param_b, grad_b, master_b, state_b = _HALF_BYTES, _FP32_BYTES, _FP32_BYTES, _FP32_BYTES
    else:
        raise ValueError(
            f"unknown mixed_precision {mixed_precision!r}; use None or one of {MIXED_PRECISIONS}"
        )
    params = float(num_elements * param_b)
    grads = float(num_elements * grad_b)
    master = float(num_elements * master_b)
    optimizer_bytes = float(num_elements * state_b * num_buffers)
    optimizer_bytes /= state_shards
    master /= state_shards
    grads /= grad_shards
    params /= param_shards
    return MemoryBreakdown(params=params, grads=grads, optimizer=optimizer_bytes, master=master)
