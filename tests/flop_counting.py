"""torch's FlopCounterMode as a test oracle for ``autopar.capture.flops``, with SDPA counted on CPU.

On CPU, SDPA runs ``aten._scaled_dot_product_flash_attention_for_cpu``, which torch has no
formula for (it would count 0); ``CPU_SDPA_MAPPING`` maps it and its backward to torch's own SDPA
formulas, so a CPU run counts what a GPU run counts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten


def _cpu_flash_forward(query, key, value, *args: Any, out_shape=None, **kwargs: Any) -> int:
    return sdpa_flop_count(query, key, value)


def _cpu_flash_backward(grad_out, query, key, value, *args: Any, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


CPU_SDPA_MAPPING = {
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_forward,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward,
}


def flop_counter() -> FlopCounterMode:
    return FlopCounterMode(display=False, custom_mapping=CPU_SDPA_MAPPING)


def counted_forward_backward(fn: Callable[[], Any]) -> tuple[int, int]:
    """FlopCounterMode's totals for ``fn()`` and for the backward of the sum of its output."""
    with flop_counter() as forward:
        out = fn()
    out = out[0] if isinstance(out, tuple) else out
    with flop_counter() as backward:
        if out.requires_grad:
            out.sum().backward()
    return forward.get_total_flops(), backward.get_total_flops()
