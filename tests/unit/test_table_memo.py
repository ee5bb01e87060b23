"""Edge tables converted once over a sequence of solves (eliminate.SeriesMemo.matrix by table
object, its tuples by content): the same floats as converting each time, shared only where
the bits agree (a zero's sign included), and solves sharing a memo equal solves alone."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from solver.eliminate import SeriesMemo
from solver.tables import table_matrix

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
