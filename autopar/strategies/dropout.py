"""Sharding rules for dropout.

Dropout keeps or zeroes each element independently, so any Shard(d) or Replicate layout of the
input is kept by the output. Numerically a sharded dropout is a different draw from the unsharded
one (each rank draws the mask of its own block), which is statistically the same op; a Replicate
input needs every rank to draw the SAME mask (the runtime seeds the ranks of a replicated group
alike). Tests therefore compare in eval mode or with ``p = 0``.

Partial passes only when the op is the identity (``train`` False or ``p == 0``): with a real mask,
the parts of a Partial tensor would need one shared mask, and the sum of differently masked parts
is not a masked sum.
"""

from __future__ import annotations

import torch

from autopar.placement import PARTIAL, REPLICATE, Shard
from autopar.strategies.registry import AxisStrategy, OpCall, register

aten = torch.ops.aten


@register(
    aten.dropout.default,
    aten.native_dropout.default,
    aten.feature_dropout.default,
    aten.alpha_dropout.default,
    aten.feature_alpha_dropout.default,
)
def dropout_rule(call: OpCall) -> list[AxisStrategy]:
    # dropout(input, p, train) -> out; native_dropout(input, p, train) -> (out, mask). The
    # feature variants zero whole channels (dims >= 2 share a draw): still elementwise in layout.
    inp = call.inputs[0]
    p = call.args[1] if len(call.args) > 1 else call.kwargs.get("p", 0.5)
    train = call.args[2] if len(call.args) > 2 else call.kwargs.get("train", True)
    num_outputs = len(call.outputs)
    options = [AxisStrategy(outputs=(REPLICATE,) * num_outputs, inputs=(REPLICATE,))]
    options += [
        AxisStrategy(outputs=(Shard(d),) * num_outputs, inputs=(Shard(d),)) for d in range(inp.ndim)
    ]
    identity = train is False or p == 0
    if identity and inp.dtype != torch.bool and num_outputs == 1:
        options.append(AxisStrategy(outputs=(PARTIAL,), inputs=(PARTIAL,)))
    return options
