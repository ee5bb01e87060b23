"""Edge tables converted once over a sequence of solves (eliminate.SeriesMemo.matrix by table
object, its tuples by content): the same floats as converting each time, shared only where
the bits agree (a zero's sign included), and solves sharing a memo equal solves alone."""

from __future__ import annotations

import pickle

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from solver.budgeted import EdgeHashes
from solver.eliminate import SeriesMemo, eliminate
from solver.fixing import restrict_budgeted
from solver.parallel import problem_entries
from solver.presolve import cost_matrix, plan_objective_s, validate
from solver.problem import Edge, Node, Problem
from solver.tables import ArrayTable, array_table, table_matrix
from solver.tying import contract

_ENTRIES = st.sampled_from([0.0, -0.0, 1.5, 2.0, None])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(_ENTRIES, min_size=2, max_size=2), min_size=1, max_size=3), st.data())
def test_tables_converted_once_keep_their_bits(rows, data) -> None:
    memo = SeriesMemo()
    table = tuple(tuple(r) for r in rows)
    first = memo.matrix(table)
    assert first.tobytes() == table_matrix(table).tobytes()
    memo.next_generation()
    assert memo.matrix(table) is first  # the same object: converted once
    copy = tuple(tuple(r) for r in rows)  # equal, another object: converted again
    assert memo.matrix(copy).tobytes() == first.tobytes()
    # Tuples by content across solves: shared where the bits agree, not across a zero's sign.
    matrix = first.copy()
    flipped = matrix.copy().reshape(-1)
    k = data.draw(st.integers(0, flipped.size - 1))
    flipped[k] = -flipped[k] if flipped[k] == 0 else 7.0
    flipped = flipped.reshape(matrix.shape)
    tuples = SeriesMemo().tuples
    out = tuples(matrix)
    tuples.next_generation()
    assert tuples(matrix.copy()) is out
    got = tuples(flipped)
    want = tuple(tuple(None if not np.isfinite(v) else v for v in row) for row in flipped.tolist())
    assert got == want
    assert all(
        (a is None and b is None) or bool(np.signbit(a)) == bool(np.signbit(b))
        for ra, rb in zip(got, want, strict=True)
        for a, b in zip(ra, rb, strict=True)
    )


_MATRIX_ENTRIES = st.sampled_from([0.0, -0.0, 1.5, 2.0, np.inf, -np.inf, np.nan])


@settings(max_examples=80, deadline=None)
@given(st.lists(st.lists(_MATRIX_ENTRIES, min_size=3, max_size=3), min_size=1, max_size=4))
def test_a_table_made_from_a_matrix_reads_back_as_its_tuples_would(rows) -> None:
    """array_table: the very tuples of converting entry by entry (None where not finite), and
    the matrix it holds is what reading those tuples gives, bit for bit; every reader (presolve,
    the series memo) takes that matrix instead of converting again."""
    matrix = np.array(rows, dtype=np.float64)
    table = array_table(matrix)
    plain = tuple(tuple(float(v) if np.isfinite(v) else None for v in row) for row in rows)
    assert table == plain
    assert all(
        (a is None and b is None) or bool(np.signbit(a)) == bool(np.signbit(b))
        for ra, rb in zip(table, plain, strict=True)
        for a, b in zip(ra, rb, strict=True)
    )
    assert table.matrix.tobytes() == table_matrix(plain).tobytes()
    assert cost_matrix(table) is table.matrix
    assert SeriesMemo().matrix(table) is table.matrix
    assert not table.matrix.flags.writeable  # shared by every reader: never written to
    matrix[0, 0] = 9.0  # the caller's matrix is not the one held
    assert table.matrix.tobytes() == table_matrix(plain).tobytes()


def test_contracted_and_eliminated_tables_hold_their_matrix() -> None:
    """The tables tie contraction and elimination make are read back without conversion."""
    node = Node(name="n", cost_s=(1.0, 2.0), memory_bytes=(0.0, 0.0))
    edge_table = ((0.0, 1.0), (None, -0.0))
    problem = Problem(
        nodes=(node,) * 4,
        edges=(
            Edge(src=0, dst=1, cost_s=edge_table),
            Edge(src=2, dst=3, cost_s=edge_table),
            Edge(src=1, dst=2, cost_s=edge_table),
        ),
        tied=((0, 2), (1, 3)),
    )
    contracted = contract(problem).problem
    assert contracted.edges
    for e in contracted.edges:
        assert isinstance(e.cost_s, ArrayTable)
        assert cost_matrix(e.cost_s) is e.cost_s.matrix
        assert e.cost_s.matrix.tobytes() == table_matrix(tuple(e.cost_s)).tobytes()
    complete = Problem(
        nodes=(node,) * 4,
        edges=tuple(
            Edge(src=a, dst=b, cost_s=edge_table)
            for a, b in ((0, 1), (1, 2), (2, 3), (3, 0), (0, 2), (1, 3))  # K4: nothing of degree 2
        ),
    )
    kept = eliminate(complete).problem
    assert kept.edges
    assert all(isinstance(e.cost_s, ArrayTable) for e in kept.edges)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(_MATRIX_ENTRIES, min_size=3, max_size=3), min_size=1, max_size=4))
def test_a_table_read_entry_by_entry_gives_the_tuples_floats(rows) -> None:
    """Rows read one at a time (before the whole tuple is made) are the whole tuple's rows,
    float for float and zero signs included; slicing, iterating, equality and hashing are
    the plain tuple's; a pickled table comes back equal, holding its matrix."""
    matrix = np.array(rows, dtype=np.float64)
    plain = tuple(tuple(float(v) if np.isfinite(v) else None for v in row) for row in rows)
    table = array_table(matrix)
    by_row = [table[k] for k in range(len(table))]
    assert [[repr(v) for v in row] for row in by_row] == [[repr(v) for v in row] for row in plain]
    assert table[-1] == plain[-1] and table[1:] == plain[1:] and len(table) == len(plain)
    assert tuple(table) == plain and table == plain and plain == table and not table != plain
    assert hash(table) == hash(plain) and table == array_table(matrix)
    back = pickle.loads(pickle.dumps(table))
    assert back == plain and back.matrix.tobytes() == table.matrix.tobytes()


def test_readers_of_the_matrix_make_no_tuples() -> None:
    """validate, the budgeted solver's answer keys, problem sizes and restrict_budgeted read an
    ArrayTable's matrix: its tuples are never made (they were most of the time of making the
    relaxation's tables); looking one entry up makes that row only."""
    node = Node(name="n", cost_s=(1.0, 2.0, 3.0), memory_bytes=(0.0, 1.0, 2.0))
    tables = [array_table(np.arange(9.0).reshape(3, 3) + k) for k in range(2)]
    problem = Problem(
        nodes=(node,) * 3,
        edges=(Edge(src=0, dst=1, cost_s=tables[0]), Edge(src=1, dst=2, cost_s=tables[1])),
        memory_budget_bytes=10.0,
    )
    validate(problem)
    EdgeHashes()(problem.edges)
    assert problem_entries(problem) == 9 + 9 + 9
    restricted = restrict_budgeted(problem, ((0, 2), (1, 2), (0, 1, 2)))
    assert all(t._rows is None and not t._row_at for t in tables)
    assert restricted.edges[0].cost_s == ((1.0, 2.0), (7.0, 8.0))
    assert isinstance(restricted.edges[0].cost_s, ArrayTable)
    assert plan_objective_s(problem, (0, 1, 2)) == 1.0 + 2.0 + 3.0 + 1.0 + 6.0
    assert tables[0]._rows is None and set(tables[0]._row_at) == {0}
