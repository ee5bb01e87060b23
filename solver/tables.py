"""Edge tables as the solver's nested tuples, converted with numpy (one conversion per distinct
table instead of one Python expression per entry).

An edge table (``Edge.cost_s``) is a tuple of rows, one per producer strategy, each a tuple of
floats with None for a forbidden pair. Repeated layers share one table object; several passes
(presolve, tie contraction, elimination) key their work on that identity, so what these helpers
return keeps it where the caller asks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

Table = tuple[tuple[Any, ...], ...]
"""An edge table: rows of Python floats, None where forbidden."""


def float_table(
    matrix: np.ndarray,
    rows: Sequence[int],
    cols: Sequence[int],
    banned: frozenset[tuple[int, int]] | set[tuple[int, int]] = frozenset(),
) -> Table:
    """The solver's nested tuples of ``matrix[rows][:, cols]``: None where not finite or where
    (row, col) of the full matrix is in ``banned``, else the entry as a Python float (the same
    values as reading them one by one with ``float``)."""
    sub = np.asarray(matrix, dtype=np.float64)
    if tuple(rows) != tuple(range(sub.shape[0])) or tuple(cols) != tuple(range(sub.shape[1])):
        sub = sub[np.ix_(rows, cols)]
    values = sub.astype(object)
    values[~np.isfinite(sub)] = None
    if banned:
        row_at = {a: k for k, a in enumerate(rows)}
        col_at = {b: k for k, b in enumerate(cols)}
        for a, b in banned:
            if a in row_at and b in col_at:
                values[row_at[a], col_at[b]] = None
    return tuple(map(tuple, values.tolist()))


def entry_array(table: Table) -> np.ndarray:
    """``table`` as a 2-D object array holding the very same entry objects (floats, None, or
    whatever a hand-built table holds: nothing is converted)."""
    num_cols = len(table[0]) if table else 0
    out = np.empty((len(table), num_cols), dtype=object)
    for k, row in enumerate(table):
        if len(row) != num_cols:
            raise ValueError(f"edge table row {k} has {len(row)} entries, row 0 has {num_cols}")
        out[k] = row
    return out


def sub_table(entries: np.ndarray, rows: Sequence[int], cols: Sequence[int]) -> Table:
    """``entries[rows][:, cols]`` (an :func:`entry_array`) as nested tuples of the same entry
    objects: equal, entry by entry, to ``tuple(tuple(t[r][c] for c in cols) for r in rows)``."""
    if tuple(rows) != tuple(range(entries.shape[0])) or tuple(cols) != tuple(
        range(entries.shape[1])
    ):
        entries = entries[np.ix_(rows, cols)]
    return tuple(map(tuple, entries.tolist()))
