"""Timing on this rank: repeated calls, one forward plus backward, and agreeing across ranks.

Shared by calibration (:mod:`autopar.tools.calibration`, :mod:`autopar.tools.calibration_links`)
and ``autopar bench-cost``. On a GPU the calls of a trial are queued back to back and synchronised
once, as a training step runs them; across ranks, timings are averaged (kernels, every rank
measuring at once) or the slowest rank counts (collectives).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "fwd_bwd_callable",
    "max_over_ranks",
    "mean_over_ranks",
    "sync_device",
    "time_callable",
    "time_queued",
]


def sync_device(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_callable(
    fn: Callable[[], Any], *, device: torch.device, min_time_s: float, trials: int
) -> float:
    """Median over ``trials`` of the mean seconds per call, each trial repeating ``fn`` until
    ``min_time_s`` has passed (after one warm-up call). On a GPU the calls of a trial are
    queued back to back and synchronised once at the end, as a training step runs them: a
    synchronisation per call would time the host round trip, not the kernel."""
    fn()
    sync_device(device)
    if device.type == "cuda":
        start = time.perf_counter()
        fn()
        sync_device(device)
        once = max(time.perf_counter() - start, 1e-6)
        return time_queued(fn, device, max(2, int(min_time_s / once)), trials)
    results = []
    for _ in range(max(trials, 1)):
        count = 0
        start = time.perf_counter()
        while True:
            fn()
            count += 1
            sync_device(device)
            elapsed = time.perf_counter() - start
            if count >= 2 and elapsed >= min_time_s:
                break
        results.append(elapsed / count)
    return statistics.median(results)


def fwd_bwd_callable(
    target: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any] | None = None
) -> Callable[[], None]:
    """A closure that runs ``target(*args, **kwargs)`` and, when some floating input requires
    a gradient, its backward (a random output gradient, gradients of those inputs only)."""
    kwargs = kwargs or {}
    leaves = torch.utils._pytree.tree_leaves((list(args), kwargs))
    grad_inputs = [a for a in leaves if isinstance(a, torch.Tensor) and a.requires_grad]
    probe = target(*args, **kwargs)
    outputs = [probe] if isinstance(probe, torch.Tensor) else list(probe)
    float_outputs = [
        i
        for i, o in enumerate(outputs)
        if isinstance(o, torch.Tensor) and o.is_floating_point() and o.requires_grad
    ]
    grads = [torch.randn_like(outputs[i]) for i in float_outputs]

    def run() -> None:
        out = target(*args, **kwargs)
        if grad_inputs and float_outputs:
            outs = [out] if isinstance(out, torch.Tensor) else list(out)
            torch.autograd.grad(
                [outs[i] for i in float_outputs], grad_inputs, grads, allow_unused=True
            )

    return run


def time_queued(fn: Callable[[], Any], device: torch.device, count: int, trials: int) -> float:
    """Median over ``trials`` of the mean seconds per call of ``count`` calls queued back to
    back and synchronised once."""
    results = []
    for _ in range(max(trials, 1)):
        start = time.perf_counter()
        for _ in range(count):
            fn()
        sync_device(device)
        results.append((time.perf_counter() - start) / count)
    return statistics.median(results)


def mean_over_ranks(values: list[float], device: torch.device) -> list[float]:
    """The mean of ``values`` over all ranks (``values`` itself without a process group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


def max_over_ranks(values: list[float], device: torch.device) -> list[float]:
    """The maximum of ``values`` over all ranks (``values`` itself without a process group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()
