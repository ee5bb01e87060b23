"""Elementwise ops: one Shard(d) on the output and on every input that really has dim d.

Broadcasting follows numpy alignment (trailing dims line up): an input that lacks output dim d
(fewer dims) or has size 1 there while the output does not stays Replicate on that axis.

Partial passes only through ops that are linear in their Partial operands, and only where that
is exact for every part: ``neg``; ``add``/``sub`` when every tensor operand is Partial and no
Python-number operand is added; ``mul`` of one Partial operand by Replicate ones or by a number;
``div`` of a Partial numerator by a Replicate denominator or a number; ``where`` with both value
operands Partial and the condition Replicate; ``masked_fill`` with fill value 0; float-to-float
casts (``to``, ``_to_copy``, ``type_as``, ``clone``, ``contiguous``). Every other op here is
nonlinear (or yields bools/ints) and gets no Partial strategy.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

from autopar.placement import PARTIAL, REPLICATE, Placement, Shard
from autopar.strategies.registry import AxisStrategy, OpCall, TensorMeta, register

aten = torch.ops.aten


def broadcast_placement(out_shape: Sequence[int], in_meta: TensorMeta, out_dim: int) -> Placement:
    """The placement an input needs when output dim ``out_dim`` is sharded (numpy alignment)."""
    in_dim = out_dim - (len(out_shape) - in_meta.ndim)
    if in_dim < 0 or (in_meta.shape[in_dim] == 1 and out_shape[out_dim] != 1):
        return REPLICATE
    return Shard(in_dim)


def elementwise_strategies(
    call: OpCall, *, partial_inputs: Sequence[bool] | None = None
) -> list[AxisStrategy]:
    """R everywhere; Shard(d) for each output dim d; and, if ``partial_inputs`` is given, the
    linear strategy that takes those tensor inputs Partial (the others Replicate) to a Partial
    output. Non-tensor input nodes get None.
    """
    out = call.outputs[0]
    assert out is not None, f"{call.op} has no tensor output"

    def per_input(place) -> tuple[Placement | None, ...]:
        return tuple(place(m) if isinstance(m, TensorMeta) else None for m in call.inputs)

    num_outputs = len(call.outputs)
    strategies = [
        AxisStrategy(outputs=(REPLICATE,) * num_outputs, inputs=per_input(lambda m: REPLICATE))
    ]
    for d in range(out.ndim):
        strategies.append(
            AxisStrategy(
                outputs=(Shard(d),) * num_outputs,
                inputs=per_input(lambda m, d=d: broadcast_placement(out.shape, m, d)),
            )
        )
    if partial_inputs is not None and any(partial_inputs):
        pairs = list(zip(call.inputs, partial_inputs, strict=True))
        # Partial of ints or bools is not meaningful (e.g. add of bools is logical or).
        if all(isinstance(m, TensorMeta) and m.is_float for m, p in pairs if p):
            inputs = tuple(
                None if not isinstance(m, TensorMeta) else (PARTIAL if p else REPLICATE)
                for m, p in pairs
            )
            strategies.append(AxisStrategy(outputs=(PARTIAL,) * num_outputs, inputs=inputs))
    return strategies


def _tensor_slots(call: OpCall) -> list[bool]:
    return [isinstance(m, TensorMeta) for m in call.inputs]


def _is_nonzero_number(value: object) -> bool:
    return isinstance(value, (int, float, bool)) and value != 0


# --------------------------------------------------------------------------------------------
# Nonlinear ops and ops with bool/int results: Shard and Replicate only

_NONLINEAR = """
    abs acos asin atan ceil cos cosh erf exp exp2 expm1 floor log log10 log1p log2 reciprocal
    round rsqrt sigmoid sign sin sinh sqrt square tan tanh trunc relu gelu silu mish hardtanh
    leaky_relu elu softplus logical_not bitwise_not isnan isinf isfinite zeros_like ones_like
    empty_like full_like fill nan_to_num eq ne lt gt le ge logical_and logical_or logical_xor
    bitwise_and bitwise_or bitwise_xor __and__ __or__ __xor__ maximum minimum fmax fmin atan2
    pow clamp clamp_min clamp_max remainder fmod floor_divide lerp addcmul addcdiv gelu_backward
    silu_backward threshold_backward sigmoid_backward tanh_backward
""".split()


_OUT_OVERLOAD = re.compile(r"(^|_)out($|_)|^output$|grad_input")


def _overloads(names: Sequence[str], *, inplace: bool = True) -> list[torch._ops.OpOverload]:
    """Every overload of each ``aten.<name>`` (and ``<name>_`` in place), except ``out=`` ones."""
    ops: list[torch._ops.OpOverload] = []
    for name in names:
        for variant in (name, name + "_") if inplace else (name,):
            if not hasattr(aten, variant):
                continue
            packet = getattr(aten, variant)
            for overload in packet.overloads():
                if _OUT_OVERLOAD.search(overload):
                    continue
                ops.append(getattr(packet, overload))
    return ops


@register(*_overloads(_NONLINEAR))
def nonlinear_rule(call: OpCall) -> list[AxisStrategy]:
    return elementwise_strategies(call)


# --------------------------------------------------------------------------------------------
# Linear ops


@register(*_overloads(["neg", "positive", "clone", "contiguous"]))
def unary_linear_rule(call: OpCall) -> list[AxisStrategy]:
    return elementwise_strategies(call, partial_inputs=[True])


def _float_cast(call: OpCall) -> bool:
    src, out = call.inputs[0], call.outputs[0]
    return bool(
        src.is_float and out is not None and (out.dtype.is_floating_point or out.dtype.is_complex)
    )


@register(
    *_overloads(["to", "_to_copy", "type_as"], inplace=False),
    aten.lift_fresh_copy.default,
)
def cast_rule(call: OpCall) -> list[AxisStrategy]:
    # to(x, other) / type_as(x, other) read only other's dtype: other follows x's layout when it
    # has x's shape (so no strategy forces a reshard of it), else it is taken Replicate.
    out = call.outputs[0]
    assert out is not None
    cast_is_linear = _float_cast(call)

    def extra(p: Placement) -> tuple[Placement | None, ...]:
        return tuple(
            None if not isinstance(m, TensorMeta) else (p if m.shape == out.shape else REPLICATE)
            for m in call.inputs[1:]
        )

    options: list[Placement] = [REPLICATE, *(Shard(d) for d in range(out.ndim))]
    if cast_is_linear:
        options.append(PARTIAL)
    return [
        AxisStrategy(outputs=(p,), inputs=(p, *extra(REPLICATE if p is PARTIAL else p)))
        for p in options
    ]


@register(*_overloads(["add", "sub", "rsub"]))
def add_rule(call: OpCall) -> list[AxisStrategy]:
    tensors = _tensor_slots(call)
    numbers = [
        a
        for a in (*call.args[:2], call.kwargs.get("other"))
        if not isinstance(a, TensorMeta) and a is not None
    ]
    # add(P, P) is P; adding a Python number (or mixing P with R) would count it N times.
    exact = all(tensors) and not any(_is_nonzero_number(n) for n in numbers)
    return elementwise_strategies(call, partial_inputs=tensors if exact else None)


@register(*_overloads(["mul"]))
def mul_rule(call: OpCall) -> list[AxisStrategy]:
    strategies = elementwise_strategies(call)
    # One Partial factor times Replicate factors (or a number) is Partial; both Partial is not.
    for j, meta in enumerate(call.inputs):
        if isinstance(meta, TensorMeta) and meta.is_float:
            partial = [i == j for i in range(len(call.inputs))]
            strategies.append(elementwise_strategies(call, partial_inputs=partial)[-1])
    return strategies


@register(*_overloads(["div"]))
def div_rule(call: OpCall) -> list[AxisStrategy]:
    rounding = call.kwargs.get("rounding_mode")
    first = call.inputs[0] if call.inputs else None
    if rounding is not None or not (isinstance(first, TensorMeta) and first.is_float):
        return elementwise_strategies(call)
    numerator_is_input0 = isinstance(call.args[0], TensorMeta)
    if not numerator_is_input0:
        return elementwise_strategies(call)
    partial = [True] + [False] * (len(call.inputs) - 1)
    return elementwise_strategies(call, partial_inputs=partial)


@register(aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar)
def where_rule(call: OpCall) -> list[AxisStrategy]:
    # where(c, x, y) is linear in (x, y) jointly when both are tensors.
    args = list(call.args) + [None] * (3 - len(call.args))
    if len(call.inputs) == 3 and all(isinstance(a, TensorMeta) for a in args[:3]):
        return elementwise_strategies(call, partial_inputs=[False, True, True])
    return elementwise_strategies(call)


@register(*_overloads(["masked_fill"]))
def masked_fill_rule(call: OpCall) -> list[AxisStrategy]:
    value = call.args[2] if len(call.args) > 2 else call.kwargs.get("value")
    if isinstance(value, (int, float)) and value == 0 and call.inputs[0].is_float:
        return elementwise_strategies(call, partial_inputs=[True, False])
    return elementwise_strategies(call)
