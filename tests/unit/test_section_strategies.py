"""Section-sharded strategies of a fused projection and its split, against the unsharded op.

Every strategy :func:`autopar.strategies.sections.section_strategies` lists for a ``linear``
whose output a split cuts into sections (equal, as GPT's qkv, and unequal, as grouped-query
attention's), and for the split itself (``split``, ``split_with_sizes``, ``chunk``), is run per
rank in one process by the strategy oracle (forward and every input gradient vs the op on full
tensors, fp64) on a 2-rank and a 2x2 mesh.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

from autopar.placement import SectionShard, Shard, format_placements, section_axis
from autopar.strategies.sections import section_hints, section_strategies
from tests.strategy_oracle import simulate

aten = torch.ops.aten
MESHES = [(2,), (2, 2)]


def graph_of(sections: list[int], split: tuple, bias: bool = True) -> tuple[fx.Node, fx.Node, list]:
    """x[4, 6, 8] -> linear(x, w[sum(sections), 8], b) -> split(...) as an fx graph with values."""
    gen = torch.Generator().manual_seed(0)
    n = sum(sections)
    x = torch.randn(4, 6, 8, generator=gen, dtype=torch.float64)
    w = torch.randn(n, 8, generator=gen, dtype=torch.float64)
    b = torch.randn(n, generator=gen, dtype=torch.float64)
    graph = fx.Graph()
    inputs = [graph.placeholder(name) for name in ("x", "w", "b")[: 3 if bias else 2]]
    values = [x, w, b][: len(inputs)]
    for node, value in zip(inputs, values):
        node.meta["val"] = value
    linear = graph.call_function(aten.linear.default, tuple(inputs))
    linear.meta["val"] = aten.linear.default(*values)
    op, arg, dim = split
    split_node = graph.call_function(op, (linear, arg, dim))
    split_node.meta["val"] = op(linear.meta["val"], arg, dim)
    graph.output(split_node)
    return linear, split_node, values


def local_split_args(args: tuple, kwargs: dict, out_shapes: tuple) -> tuple[tuple, dict]:
    """Per rank, a split's sizes are its local pieces' (what the lowering must write)."""
    t, arg, dim = args
    if isinstance(arg, int) and len(out_shapes) == arg and len(set(out_shapes)) == 1:
        return args, kwargs  # chunk(n) of equal pieces: the same n locally
    sizes = [shape[dim] for shape in out_shapes]
    if isinstance(arg, int) and len(set(sizes)) == 1:
        return (t, sizes[0], dim), kwargs
    return (t, sizes, dim), kwargs


CASES = {
    "gpt_qkv_split": ([8, 8, 8], (aten.split.Tensor, 8, 2)),
    "gqa_split_with_sizes": ([8, 4, 4], (aten.split_with_sizes.default, [8, 4, 4], -1)),
    "chunk": ([8, 8, 8], (aten.chunk.default, 3, -1)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_projection_and_split_strategies_match_the_unsharded_ops(case: str) -> None:
    sections, split = CASES[case]
    linear, split_node, (x, w, b) = graph_of(sections, split)
    assert section_hints(linear) == ((2, tuple(sections)),)
    for mesh in MESHES:
        linear_strategies = section_strategies(linear, mesh)
        split_strategies = section_strategies(split_node, mesh)
        assert linear_strategies and split_strategies, mesh
        for strategy in linear_strategies:
            axis = section_axis(strategy.outputs[0])
            assert axis is not None
            # The column-parallel shape: x Replicate, w and b section-sharded along dim 0.
            assert strategy.inputs[1][axis] == SectionShard(0, tuple(sections))
            simulate(aten.linear.default, (x, w, b), {}, strategy, mesh, rtol=1e-12, atol=1e-12)
        for strategy in split_strategies:
            axis = section_axis(strategy.inputs[0])
            assert axis is not None
            assert all(out[axis] == Shard(2) for out in strategy.outputs), strategy.describe()
            y = aten.linear.default(x, w, b)
            op, arg, dim = split
            simulate(
                op,
                (y, arg, dim),
                {},
                strategy,
                mesh,
                rtol=1e-12,
                atol=1e-12,
                adjust_args=local_split_args,
            )
        # 2x2: the other axis may split the batch (data parallel) with the sections on tp.
        if mesh == (2, 2):
            layouts = {format_placements(s.outputs[0]) for s in linear_strategies}
            assert f"S0,S2[{':'.join(map(str, sections))}]" in layouts


def test_no_sections_where_no_split_cuts_the_projection_or_the_axis_does_not_divide() -> None:
    linear, split_node, _ = graph_of([8, 8, 8], (aten.split.Tensor, 8, 1))  # splits dim 1
    assert section_hints(linear) == ()
    assert section_strategies(linear, (2,)) == []
    assert all(
        section_axis(p) is None for s in section_strategies(split_node, (2,)) for p in s.inputs
    )
    # Sections of 3 cannot be split 2 ways: no strategy (autopar never pads).
    linear, split_node, _ = graph_of([3, 3, 2], (aten.split_with_sizes.default, [3, 3, 2], 2))
    assert section_hints(linear) == ((2, (3, 3, 2)),)
    assert section_strategies(linear, (2,)) == []
    assert section_strategies(split_node, (2,)) == []
    # A linear without bias.
    linear, _, _ = graph_of([4, 4], (aten.split.Tensor, 4, 2), bias=False)
    assert [len(s.inputs) for s in section_strategies(linear, (2,))] == [2]
