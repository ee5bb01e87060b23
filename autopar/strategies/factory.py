"""Sharding rules for tensor factories, metadata-only uses of tensors, and tril/triu.

* Factories without tensor inputs (``arange``, ``zeros``, ``ones``, ``full``, ``empty``,
  ``scalar_tensor``, ...) produce Replicate: every rank builds the whole (small, constant)
  tensor, and a consumer that wants a Shard takes its block with a local slice, which costs no
  communication. A sharded factory would need rank-dependent arguments (``arange`` offsets).
* ``new_zeros``/``new_ones``/``new_full``/``new_empty`` read only the dtype and device of their
  tensor argument: it may have any layout; the output is Replicate.
* ``zeros_like`` and friends are elementwise rules in pointwise.py.
* ``_assert_tensor_metadata`` checks dtype/device only: any input layout, no output.
* ``tril``/``triu`` act on the last two dims: shard any earlier dim; Partial passes (they mask
  entries, which is linear).
* ``lift_fresh_copy`` is an identity, registered with the casts in pointwise.py.
"""

from __future__ import annotations

import torch

from autopar.placement import PARTIAL, REPLICATE, Placement, Shard
from autopar.strategies.registry import AxisStrategy, OpCall, TensorMeta, register

aten = torch.ops.aten


def any_layout(meta: TensorMeta) -> list[Placement]:
    """Every layout of a tensor on one axis (bool tensors are never Partial)."""
    options: list[Placement] = [REPLICATE, *(Shard(d) for d in range(meta.ndim))]
    if meta.dtype != torch.bool:
        options.append(PARTIAL)
    return options


@register(
    aten.arange.default,
    aten.arange.start,
    aten.arange.start_step,
    aten.zeros.default,
    aten.ones.default,
    aten.full.default,
    aten.empty.memory_format,
    aten.empty_strided.default,
    aten.scalar_tensor.default,
    aten.linspace.default,
    aten.eye.default,
    aten.eye.m,
)
def factory_rule(call: OpCall) -> list[AxisStrategy]:
    # No tensor inputs in these overloads; a stray tensor argument (none in the schemas above)
    # would be required Replicate.
    ins = tuple(REPLICATE if isinstance(m, TensorMeta) else None for m in call.inputs)
    return [AxisStrategy(outputs=(REPLICATE,) * len(call.outputs), inputs=ins)]


@register(
    aten.new_zeros.default, aten.new_ones.default, aten.new_full.default, aten.new_empty.default
)
def new_factory_rule(call: OpCall) -> list[AxisStrategy]:
    return [AxisStrategy(outputs=(REPLICATE,), inputs=(p,)) for p in any_layout(call.inputs[0])]


@register(aten._assert_tensor_metadata.default)
def assert_metadata_rule(call: OpCall) -> list[AxisStrategy]:
    # The output slot is None (the op returns nothing); its placement is ignored.
    return [AxisStrategy(outputs=(REPLICATE,), inputs=(p,)) for p in any_layout(call.inputs[0])]


@register(aten.tril.default, aten.triu.default)
def tril_rule(call: OpCall) -> list[AxisStrategy]:
    inp = call.inputs[0]
    options = [AxisStrategy(outputs=(REPLICATE,), inputs=(REPLICATE,))]
    options += [AxisStrategy(outputs=(Shard(d),), inputs=(Shard(d),)) for d in range(inp.ndim - 2)]
    if inp.dtype != torch.bool:
        options.append(AxisStrategy(outputs=(PARTIAL,), inputs=(PARTIAL,)))
    return options
