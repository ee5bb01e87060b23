"""The weight pass of the split-backward schedules (autopar/runtime/pipeline_backward.py), in
one process: after torch's own input pass (``stage_backward_input``), the weight gradients
equal a plain backward's, and the input pass is not run again (a node on the activation path
runs once in all), with the parameters plain or reached through one multi-output gather (as
ZeRO's chunks are), used once or twice; the replay pass (kept for stages that recompute) runs
it twice."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.pipelining._backward import stage_backward_input

from autopar.runtime.pipeline_backward import weight_pass


class _Gather(torch.autograd.Function):
    """A chunk's parameters as views of one flat buffer (as ZeRO's ``_UseChunk``): backward
    needs every gradient at once and writes the flat parameter's gradient itself."""

    calls: list[int] = []

    @staticmethod
    def forward(ctx, flat, *shapes):
        ctx.set_materialize_grads(False)
        ctx.flat = flat
        out, at = [], 0
        for shape in shapes:
            n = torch.Size(shape).numel()
            out.append(flat.detach()[at : at + n].view(shape))
            at += n
        ctx.sizes = [torch.Size(s).numel() for s in shapes]
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        _Gather.calls.append(sum(g is not None for g in grads))
        pieces = [
            (g if g is not None else torch.zeros(n)).reshape(-1)
            for g, n in zip(grads, ctx.sizes, strict=True)
        ]
        flat_grad = torch.cat(pieces)
        if ctx.flat.grad is None:
            ctx.flat.grad = flat_grad
        else:
            ctx.flat.grad += flat_grad
        return (None,) * (1 + len(grads))


SHAPES = ((8, 6), (6,), (5, 6))


def _params(gathered: bool):
    torch.manual_seed(0)
    w1, g, w2 = (torch.randn(s) for s in SHAPES)
    if not gathered:
        params = [t.requires_grad_() for t in (w1, g, w2)]
        return params, lambda: params
    flat = torch.cat([w1.reshape(-1), g, w2.reshape(-1)]).requires_grad_()
    return [flat], lambda: _Gather.apply(flat, *SHAPES)


def _forward(x, use, twice: bool):
    w1, g, w2 = use()
    h = F.gelu(F.linear(x, w1.t()))  # x (4, 8) @ w1 (8, 6): a transpose on the weight path
    h = h * g  # the norm's weight, fed straight into the product
    if twice:
        h = F.gelu(h) * g  # the same weight used again
    return F.linear(h, w2)


def _gelu_nodes(out) -> list:
    found, todo, seen = [], [out.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if node.name() == "GeluBackward0":
            found.append(node)
        todo.extend(child for child, _ in node.next_functions)
    return found


@pytest.mark.parametrize("twice", [False, True])
@pytest.mark.parametrize("gathered", [False, True])
@pytest.mark.parametrize("replay", [False, True])
def test_weight_grads_as_a_plain_backward_and_the_input_pass_not_replayed(
    gathered: bool, twice: bool, replay: bool
) -> None:
    torch.manual_seed(1)
    x0 = torch.randn(4, 8)
    want_params, use = _params(gathered)
    x = x0.clone().requires_grad_()
    _forward(x, use, twice).square().sum().backward()
    want = [p.grad.clone() for p in want_params]
    want_x = x.grad.clone()

    params, use = _params(gathered)
    x = x0.clone().requires_grad_()
    out = _forward(x, use, twice)
    runs: list[int] = []
    for node in _gelu_nodes(out):
        node.register_prehook(lambda grads: runs.append(1))
    loss = out.square().sum()
    _Gather.calls.clear()
    (dx,), groups = stage_backward_input([loss], None, [x], iter(params))
    assert dx is not None and torch.allclose(dx, want_x, rtol=1e-6, atol=1e-7)
    after_input = len(runs)
    assert after_input == (2 if twice else 1) and not _Gather.calls
    weight_pass(params, groups, replay=replay)
    for p, w in zip(params, want, strict=True):
        torch.testing.assert_close(p.grad, w, rtol=1e-6, atol=1e-7)
    if gathered:
        assert _Gather.calls == [3]  # the gather's backward once, with every gradient
    if replay:
        assert len(runs) > after_input  # the activation path ran again
    else:
        assert len(runs) == after_input  # each activation-path node ran once in all
