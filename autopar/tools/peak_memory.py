"""Peak memory of a block of work: the largest growth of allocated bytes while active (CUDA
allocator statistics on a GPU, glibc's ``mallinfo2`` sampled after every ATen op on a CPU), as
the cost-model benchmark (:mod:`autopar.tools.bench_cost`) measures a training step.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

__all__ = ["PeakMemory"]


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                     "uordblks", "fordblks", "keepcost")
    ]  # fmt: skip


def _libc_in_use() -> Any:
    try:
        libc = ctypes.CDLL("libc.so.6")
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _Mallinfo2

    def in_use() -> int:
        info = fn()
        return int(info.uordblks + info.hblkhd)

    return in_use


class PeakMemory:
    """Largest growth of allocated bytes while active: CUDA allocator statistics on a GPU,
    glibc's ``mallinfo2`` sampled after every ATen op on a CPU (None where neither exists)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak_delta: int | None = None
        self._in_use = _libc_in_use() if device.type == "cpu" else None

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        elif self._in_use is not None:
            from torch.utils._python_dispatch import TorchDispatchMode

            start = self._in_use()
            state = {"peak": start}
            in_use = self._in_use

            class _Sampler(TorchDispatchMode):
                def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
                    out = func(*args, **(kwargs or {}))
                    state["peak"] = max(state["peak"], in_use())
                    return out

            self._start, self._state = start, state
            self._mode = _Sampler()
            self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_delta = int(torch.cuda.max_memory_allocated(self.device) - self._start)
        elif self._in_use is not None:
            self._mode.__exit__(*exc)
            self.peak_delta = int(self._state["peak"] - self._start)
