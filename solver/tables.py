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


class ArrayTable(Sequence):
    """An edge table made from a float matrix, held as that matrix (float64, +inf where
    forbidden, read-only) and read as the solver's nested tuples: indexing, iterating,
    comparing and hashing behave as on the plain tuple of the same rows (equal to it, and
    hashed as it), which is made on first use only. The passes that need the matrix
    (presolve.cost_matrix, the series memo of solver/eliminate.py) take it instead: most
    tables of the relaxation's priced solves (tie contraction, elimination, pattern terms)
    are only ever read as matrices, and their tuples (a Python float per entry) were most
    of the time spent making them."""

    __slots__ = ("matrix", "_rows", "_row_at", "_content_hash")

    def __init__(self, matrix: np.ndarray) -> None:
        self.matrix = matrix
        self._rows: tuple[tuple[float | None, ...], ...] | None = None
        self._row_at: dict[int, tuple[float | None, ...]] = {}
        """Rows read one at a time (an entry looked up) before the whole tuple was made."""
        self._content_hash: int | None = None

    def content_hash(self) -> int:
        """A hash of the entries' values, from the matrix (not the tuples): equal for equal
        tables of this kind (zeros of either sign hash alike, as they compare equal), not
        the hash of the plain tuple. For memo keys over these tables only."""
        if self._content_hash is None:
            normal = self.matrix + 0.0  # -0.0 + 0.0 is +0.0
            self._content_hash = hash((normal.shape, normal.tobytes()))
        return self._content_hash

    def rows(self) -> tuple[tuple[float | None, ...], ...]:
        """The plain nested tuples (None where not finite): the same floats as reading the
        matrix entry by entry, zero signs included."""
        if self._rows is None:
            finite = np.isfinite(self.matrix)
            if finite.all():  # tolist's floats directly: no object array (about half the time)
                self._rows = tuple(map(tuple, self.matrix.tolist()))
            else:
                values = self.matrix.astype(object)
                values[~finite] = None
                self._rows = tuple(map(tuple, values.tolist()))
        return self._rows

    def __len__(self) -> int:
        return self.matrix.shape[0]

    def __getitem__(self, index):  # noqa: ANN001, ANN204 (as tuple's: an int or a slice)
        if self._rows is not None or not isinstance(index, int):
            return self.rows()[index]
        row = self._row_at.get(index)
        if row is None:  # the same floats as rows()' row (tolist per row or per matrix)
            values = self.matrix[index]
            finite = np.isfinite(values)
            if finite.all():
                row = tuple(values.tolist())
            else:
                objects = values.astype(object)
                objects[~finite] = None
                row = tuple(objects.tolist())
            self._row_at[index] = row
        return row

    def __iter__(self):  # noqa: ANN204
        return iter(self.rows())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ArrayTable):
            other = other.rows()
        return self.rows() == other

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash(self.rows())

    def __repr__(self) -> str:
        return repr(self.rows())

    def __reduce__(self) -> tuple:
        return array_table, (self.matrix,)


def array_table(matrix: np.ndarray) -> ArrayTable:
    """``matrix`` as the solver's nested tuples (None where not finite), held as the matrix
    those tuples read back as (:class:`ArrayTable`): the same floats, zero signs included."""
    finite = np.isfinite(matrix)
    if finite.all():
        held = np.array(matrix, dtype=np.float64)
    else:
        held = np.where(finite, matrix, np.inf)
    held.flags.writeable = False
    return ArrayTable(held)


def table_matrix(table: Table) -> np.ndarray:
    """An edge table as a float64 matrix, +inf where forbidden (None). An
    :class:`ArrayTable`'s own matrix, which is read-only: callers never write to it."""
    if isinstance(table, ArrayTable):
        return table.matrix
    matrix = np.array(table, dtype=np.float64)  # None becomes nan
    matrix[np.isnan(matrix)] = np.inf
    return matrix
