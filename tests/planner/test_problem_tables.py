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
