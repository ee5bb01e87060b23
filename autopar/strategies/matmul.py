"""The matmul family, each op described by one einsum equation over its operands' dims.

For an equation such as ``"bmk,bkn->bmn"`` and one mesh axis, :func:`einsum_strategies` gives:

* all Replicate;
* for every letter in the output: Shard it on the output and on each operand that has it with
  its full size (an operand that lacks it or broadcasts it from size 1 stays Replicate);
* for every contracted letter (in operands only): Shard it on every operand that has it with its
  full size, output Partial (each rank sums its slice of the contraction);
* for each operand: that operand Partial, the others Replicate, output Partial (the op is linear
  in each operand separately, never in two at once).

An additive operand (the bias of ``linear``/``addmm``/``baddbmm``) follows the output: Shard where
it has the output's sharded dim at full size, Partial when the output is Partial (so the bias is
added once over the axis), Replicate otherwise.
"""

from __future__ import annotations

import string
from collections.abc import Sequence

import torch

from autopar.placement import PARTIAL, REPLICATE, Placement, Shard
from autopar.strategies.pointwise import broadcast_placement
from autopar.strategies.registry import AxisStrategy, OpCall, TensorMeta, register

aten = torch.ops.aten


def einsum_strategies(
    equation: str,
    operands: Sequence[TensorMeta],
    out: TensorMeta,
    *,
    addend: TensorMeta | None = None,
) -> list[tuple[tuple[Placement, ...], Placement, Placement | None]]:
    """Per-axis strategies of ``equation`` as (operand placements, output placement, addend placement).

    ``equation`` has no ellipsis and one letter per dim; a letter's size may be 1 in an operand
    that broadcasts it.
    """
    lhs, rhs = equation.replace(" ", "").split("->")
    terms = lhs.split(",")
    assert len(terms) == len(operands), (equation, len(operands))
    sizes: dict[str, int] = {}
    for term, meta in zip(terms, operands):
        assert len(term) == meta.ndim, (equation, meta.shape)
        for letter, size in zip(term, meta.shape):
            sizes[letter] = max(sizes.get(letter, 1), size)

    def addend_for(out_placement: Placement) -> Placement | None:
        if addend is None:
            return None
        if isinstance(out_placement, Shard):
            return broadcast_placement(out.shape, addend, out_placement.dim)
        return out_placement

    def sharded(letter: str) -> tuple[Placement, ...]:
        return tuple(
            Shard(term.index(letter))
            if letter in term and meta.shape[term.index(letter)] == sizes[letter]
            else REPLICATE
            for term, meta in zip(terms, operands)
        )

    results = [((REPLICATE,) * len(operands), REPLICATE, addend_for(REPLICATE))]
    for letter in dict.fromkeys(lhs.replace(",", "") + rhs):
        if letter in rhs:
            out_p: Placement = Shard(rhs.index(letter))
        else:
            out_p = PARTIAL
        results.append((sharded(letter), out_p, addend_for(out_p)))
    for i, meta in enumerate(operands):
        if meta.is_float:
            inputs = tuple(PARTIAL if j == i else REPLICATE for j in range(len(operands)))
            results.append((inputs, PARTIAL, addend_for(PARTIAL)))
    return results


def _batch_letters(n: int) -> str:
    return "".join(c for c in string.ascii_lowercase if c not in "kmn")[:n]


def _to_axis_strategies(
    call: OpCall, results, operand_slots: Sequence[int], addend_slot: int | None
) -> list[AxisStrategy]:
    strategies = []
    for operand_ps, out_p, addend_p in results:
        inputs: list[Placement | None] = [None] * len(call.inputs)
        for slot, p in zip(operand_slots, operand_ps):
            inputs[slot] = p
        if addend_slot is not None:
            inputs[addend_slot] = addend_p
        strategies.append(AxisStrategy(outputs=(out_p,), inputs=tuple(inputs)))
    return strategies


@register(aten.mm.default)
def mm_rule(call: OpCall) -> list[AxisStrategy]:
    return _to_axis_strategies(
        call, einsum_strategies("mk,kn->mn", call.inputs, call.outputs[0]), (0, 1), None
    )


@register(aten.bmm.default)
def bmm_rule(call: OpCall) -> list[AxisStrategy]:
    return _to_axis_strategies(
        call, einsum_strategies("bmk,bkn->bmn", call.inputs, call.outputs[0]), (0, 1), None
    )


@register(aten.mv.default)
def mv_rule(call: OpCall) -> list[AxisStrategy]:
    return _to_axis_strategies(
        call, einsum_strategies("mk,k->m", call.inputs, call.outputs[0]), (0, 1), None
    )


@register(aten.dot.default)
def dot_rule(call: OpCall) -> list[AxisStrategy]:
    return _to_axis_strategies(
        call, einsum_strategies("k,k->", call.inputs, call.outputs[0]), (0, 1), None
    )


@register(aten.addmm.default)
def addmm_rule(call: OpCall) -> list[AxisStrategy]:
    bias, m1, m2 = call.inputs
    results = einsum_strategies("mk,kn->mn", (m1, m2), call.outputs[0], addend=bias)
    return _to_axis_strategies(call, results, (1, 2), 0)


@register(aten.baddbmm.default)
def baddbmm_rule(call: OpCall) -> list[AxisStrategy]:
    bias, b1, b2 = call.inputs
    results = einsum_strategies("bmk,bkn->bmn", (b1, b2), call.outputs[0], addend=bias)
    return _to_axis_strategies(call, results, (1, 2), 0)


@register(aten.linear.default)
def linear_rule(call: OpCall) -> list[AxisStrategy]:
    # linear(x[..., k], w[n, k], b[n]) = x @ w.T + b
    x, w = call.inputs[0], call.inputs[1]
    batch = _batch_letters(x.ndim - 1)
    equation = f"{batch}k,nk->{batch}n"
    bias = call.inputs[2] if len(call.inputs) > 2 else None
    results = einsum_strategies(equation, (x, w), call.outputs[0], addend=bias)
    return _to_axis_strategies(call, results, (0, 1), 2 if bias is not None else None)


def matmul_equation(a: TensorMeta, b: TensorMeta) -> str:
    """torch.matmul's semantics as an equation: 1-D operands are promoted and the promoted dim
    dropped; batch dims broadcast from the right."""
    if a.ndim == 1 and b.ndim == 1:
        return "k,k->"
    if b.ndim == 1:
        batch = _batch_letters(a.ndim - 1)
        return f"{batch}k,k->{batch}"
    if a.ndim == 1:
        batch = _batch_letters(b.ndim - 2)
        return f"k,{batch}kn->{batch}n"
    num_batch = max(a.ndim, b.ndim) - 2
    batch = _batch_letters(num_batch)
    a_batch = batch[num_batch - (a.ndim - 2) :]
    b_batch = batch[num_batch - (b.ndim - 2) :]
    return f"{a_batch}mk,{b_batch}kn->{batch}mn"


@register(aten.matmul.default)
def matmul_rule(call: OpCall) -> list[AxisStrategy]:
    a, b = call.inputs
    results = einsum_strategies(matmul_equation(a, b), (a, b), call.outputs[0])
    return _to_axis_strategies(call, results, (0, 1), None)


def _expand_ellipsis(equation: str, operands: Sequence[TensorMeta]) -> str:
    lhs, _, rhs = equation.replace(" ", "").partition("->")
    terms = lhs.split(",")
    if not rhs and "->" not in equation:
        # Implicit output: letters that appear once, in alphabetical order (ellipsis first).
        counts = {c: lhs.count(c) for c in lhs if c.isalpha()}
        rhs = ("..." if "..." in lhs else "") + "".join(
            sorted(c for c, n in counts.items() if n == 1)
        )
    used = set(lhs + rhs)
    free = [c for c in string.ascii_letters if c not in used]
    num_ellipsis = max(
        (m.ndim - (len(t) - 3) for t, m in zip(terms, operands) if "..." in t), default=0
    )
    fill = "".join(free[:num_ellipsis])
    new_terms = []
    for t, m in zip(terms, operands):
        if "..." in t:
            n = m.ndim - (len(t) - 3)
            t = t.replace("...", fill[num_ellipsis - n :])
        new_terms.append(t)
    return ",".join(new_terms) + "->" + rhs.replace("...", fill)


@register(aten.einsum.default)
def einsum_rule(call: OpCall) -> list[AxisStrategy]:
    equation = call.args[0]
    operands = [m for m in call.inputs if isinstance(m, TensorMeta)]
    if not isinstance(equation, str) or any(
        term.count(c) > 1
        for term in equation.split("->")[0].split(",")
        for c in term
        if c.isalpha()
    ):
        return []  # diagonals (repeated letters in one operand) are left replicated
    results = einsum_strategies(_expand_ellipsis(equation, operands), operands, call.outputs[0])
    return _to_axis_strategies(call, results, tuple(range(len(operands))), None)
