"""build_problem's edge tables (solver/tables.py float_table): the vectorised conversion gives exactly the tuples of reading
every entry one by one (the reference below), with recipe subsets, reordered strategies and
banned pairs."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from solver.tables import float_table


def one_by_one(table, rows, cols, banned):
    finite = np.isfinite(table)
    values = table.tolist()
    return tuple(
        tuple(None if (not finite[a, b] or (a, b) in banned) else values[a][b] for b in cols)
        for a in rows
    )


@st.composite
def tables(draw):
    shape = (draw(st.integers(1, 6)), draw(st.integers(1, 6)))
    entries = st.one_of(st.floats(-1e3, 1e3), st.just(np.inf), st.just(np.nan))
    table = np.array(
        draw(st.lists(entries, min_size=shape[0] * shape[1], max_size=shape[0] * shape[1]))
    ).reshape(shape)
    rows = tuple(draw(st.permutations(range(shape[0])))[: draw(st.integers(1, shape[0]))])
    cols = tuple(draw(st.permutations(range(shape[1])))[: draw(st.integers(1, shape[1]))])
    pairs = st.tuples(st.integers(0, shape[0] - 1), st.integers(0, shape[1] - 1))
    banned = frozenset(draw(st.lists(pairs, max_size=4)))
    return table, rows, cols, banned


@settings(max_examples=150, deadline=None)
@given(tables(), st.booleans())
def test_edge_tables_equal_reading_every_entry(case, full) -> None:
    table, rows, cols, banned = case
    if full:
        rows, cols = tuple(range(table.shape[0])), tuple(range(table.shape[1]))
    got = float_table(table, rows, cols, banned)
    want = one_by_one(table, rows, cols, banned)
    assert got == want
    flat_got = [x for row in got for x in row]
    assert all(type(x) is float or x is None for x in flat_got)  # Python floats, not numpy


def test_parameter_costs_memoised_across_configurations_equal_param_state() -> None:
    """node_cost_vector with one memo shared by every parameter and ZeRO configuration (as
    build_problem shares it) gives, per strategy, exactly param_state's bytes and seconds."""
    import torch

    from autopar.capture.export import capture
    from autopar.mesh import Mesh
    from autopar.options import PlanOptions
    from autopar.planner.problem import ZeroConfig, build_space, node_cost_vector, param_state
    from tests.models import tiny_mlp

    model, args = tiny_mlp()[:2]
    with torch.no_grad():
        captured = capture(model, args)
    mesh = Mesh.spec((2, 2, 2), ("a", "b", "c"))
    space = build_space(captured, mesh, PlanOptions(mixed_precision="bf16"))
    memo: dict = {}
    params = [n for n in space.nodes if n.kind == "param"]
    assert len(params) >= 4 and max(len(n.strategies) for n in params) > 8
    for zero in (ZeroConfig(), ZeroConfig(stages=(3, 1, 2)), ZeroConfig(stage=3, axes=(0, 2))):
        for node in params:
            cost, memory = node_cost_vector(space, node, zero, memo)
            plain_cost, plain_memory = node_cost_vector(space, node, zero)
            base = node.compute_s + node.grad_comm_s + node.param_grad_comm_s + node.output_comm_s
            for s in range(len(node.strategies)):
                mem, comm, _ = param_state(space, node, s, zero)
                assert cost[s] == plain_cost[s] == base[s] + comm
                assert (
                    memory[s]
                    == plain_memory[s]
                    == node.activation_bytes[s] + node.fixed_bytes[s] + mem
                )
