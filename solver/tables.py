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
    if banned:
        sub = sub.copy()  # never the caller's matrix
        row_at = {a: k for k, a in enumerate(rows)}
        col_at = {b: k for k, b in enumerate(cols)}
        for a, b in banned:
            if a in row_at and b in col_at:
                sub[row_at[a], col_at[b]] = np.inf
    return array_table(sub)


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


class ArrayTable(tuple):
    """An edge table made from a float matrix: nested tuples like any other (equal to, and
    hashed as, the plain tuple of the same rows) that also hold what reading them back gives,
    ``matrix`` (float64, +inf where forbidden, read-only). The passes that need the matrix
    (presolve.cost_matrix, the series memo of solver/eliminate.py) take it instead of
    converting the tuples again: the relaxation's priced solves made each table in one pass
    (tie contraction, elimination, pattern terms) only for the next to read it back."""

    matrix: np.ndarray


def array_table(matrix: np.ndarray) -> Table:
    """``matrix`` as the solver's nested tuples (None where not finite), holding the matrix
    those tuples read back as (:class:`ArrayTable`): the same floats, zero signs included."""
    finite = np.isfinite(matrix)
    if finite.all():  # tolist's floats directly: no object array (about half the time)
        table = ArrayTable(map(tuple, matrix.tolist()))
        held = np.array(matrix, dtype=np.float64)
    else:
        values = matrix.astype(object)
        values[~finite] = None
        table = ArrayTable(map(tuple, values.tolist()))
        held = np.where(finite, matrix, np.inf)
    held.flags.writeable = False
    table.matrix = held
    return table


def table_matrix(table: Table) -> np.ndarray:
    """An edge table as a float64 matrix, +inf where forbidden (None). An
    :class:`ArrayTable`'s own matrix, which is read-only: callers never write to it."""
    if isinstance(table, ArrayTable):
        return table.matrix
    matrix = np.array(table, dtype=np.float64)  # None becomes nan
    matrix[np.isnan(matrix)] = np.inf
    return matrix
