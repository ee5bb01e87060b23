"""The series min-plus product, with work skipped only where the result cannot change.

    best[s, r] = min_t  a[s, t] + vw[t, r],      a[s, t] = uv[s, t] + cv[t]

:func:`series_min` forms it one t at a time (two 2-D passes per t, ``np.minimum(best, sum)``,
which keeps the LAST of equal values: the sign of a zero depends on which t came last). On
llama3-70b at batch 256 pruning forms about 14,000 of these per priced solve with up to
316 x 316 x 316 entries; the tables there repeat rows (a 316-strategy node shows 124-193
distinct ones) and most t cannot reach the minimum. Three shortcuts, each giving the very
same floats (bitwise, the sign of zeros and nan included):

- equal rows of ``a`` (byte for byte) give equal rows of ``best``, and equal columns of
  ``vw`` equal columns: the product is formed over the distinct ones and expanded;
- a t is skipped when, for EVERY row s, ``a[s, t] + min_r vw[t, r] > ub[s]`` (strictly),
  with ``ub[s] = min_t' a[s, t'] + max_r vw[t', r]``. Rounding is monotone, so every sum of
  that t exceeds ub[s], which is at least the sum of the t' reaching it at every r: that t
  is never the minimum, nor tied with it, so the t kept and their order give the same
  result. A nan anywhere makes ub nan and the comparison false: nothing is skipped;
- the t kept are still added and compared in ascending order, as in the plain loop; from
  :data:`ROW_WORK` entries on, one row s at a time (:func:`_by_rows`: one (t, r) sum and its
  minimum down t, in ascending t, the last of equal values kept as by the loop over t).

Below :data:`SMALL_WORK` entries the shortcuts' own passes cost more than they save (most
products of the smaller rows, measured on their recorded products): the plain loop runs.

From :data:`THREAD_WORK` entries on, the rows formed one at a time are split between threads
(:func:`solver_threads`; numpy adds and reduces with the GIL released): each row is formed
exactly as alone, so the floats do not depend on the number of threads.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

SMALL_WORK = 40_000
"""Products of fewer than this many (s, t, r) entries take the plain loop."""

ROW_WORK = 1_000_000
"""Products of at least this many (s, t, r) entries (after the shortcuts) are formed a row at
a time: 0.85x the loop over t's time on the llama3-70b b256 fp32 row's recorded products of
1e7 entries and more, 0.87x at 1e6-1e7 (the same floats on all 5,202 recorded); the loop
over t is as fast below."""


THREAD_WORK = 2_000_000
"""Products formed a row at a time with at least this many (s, t, r) entries split their
rows between :func:`solver_threads` threads: on the llama3-70b b256 fp32 row (two cores)
the row passes took 5.3 s instead of 6.4 s; a 100 x 100 x 100 product is slower on two
threads than on one (1.3 against 1.1 ms), a 150-cubed one faster (2.4 against 3.0 ms)."""

THREADS_ENV = "AUTOPAR_SOLVER_THREADS"
"""Threads the min-plus row passes may use (default: the usable cores, at most
:data:`MAX_THREADS`); solver/parallel.py's worker processes get 1 where it is unset."""

MAX_THREADS = 8

_pool: tuple[ThreadPoolExecutor, int] | None = None
"""The row passes' threads and how many (made on first use, larger when asked for more)."""


def _forget_pool() -> None:
    """A forked child has none of the parent's threads: it makes its own pool."""
    global _pool
    _pool = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def solver_threads() -> int:
    """Threads a large row pass is split between (:data:`THREADS_ENV`, else the usable cores
    up to :data:`MAX_THREADS`).

    Raises:
        ValueError: the variable is set to something other than a positive integer.
    """
    text = os.environ.get(THREADS_ENV)
    if text is None:
        from solver.parallel import usable_cores  # solver.parallel imports this module

        return max(1, min(usable_cores(), MAX_THREADS))
    if not text.strip().isdigit() or int(text) < 1:
        raise ValueError(f"{THREADS_ENV} must be a positive integer, got {text!r}")
    return int(text)


_FINGERPRINT = np.uint64(0x9E3779B97F4A7C15)
"""An odd 64-bit constant (2^64 / golden ratio) spreading the fingerprint's weights."""


def series_min_plain(uv: np.ndarray, cv: np.ndarray, vw: np.ndarray) -> np.ndarray:
    """best[s, r] = min_t (uv[s, t] + cv[t]) + vw[t, r], one t at a time: 2-D work arrays
    only, several times faster than forming the 3-D sum and its argmin (the argmin of the
    chosen (s, r) is formed on demand by eliminate.back_substitute, from the same sums)."""
    vw = np.ascontiguousarray(vw)  # its rows are read one by one
    best = np.full((uv.shape[0], vw.shape[1]), np.inf)
    scratch = np.empty_like(best)
    for t in range(uv.shape[1]):
        np.add((uv[:, t] + cv[t])[:, None], vw[t, None, :], out=scratch)
        np.minimum(best, scratch, out=best)
    return best


def _distinct_rows(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """(index of one row per distinct byte pattern, row -> its distinct row), or None when
    every row is distinct.

    Rows are grouped by a fingerprint of their 64-bit words (a weighted sum, wrapping: equal
    bytes, equal fingerprints), and the grouping is then checked word for word; only where
    two different rows share a fingerprint are the rows' bytes sorted instead (np.unique
    over the rows as byte strings, several times slower on these tables). The distinct rows
    may come in another order than the byte sort's: the caller forms each row alone."""
    matrix = np.ascontiguousarray(matrix)
    if matrix.dtype.itemsize == 8 and matrix.shape[1] > 0:
        words = matrix.view(np.uint64)
        weights = np.arange(1, words.shape[1] + 1, dtype=np.uint64) * _FINGERPRINT | np.uint64(1)
        _, first, inverse = np.unique(
            (words * weights).sum(axis=1), return_index=True, return_inverse=True
        )
        if np.array_equal(words[first[inverse]], words):
            return None if len(first) == len(words) else (first, inverse.reshape(-1))
    rows = matrix.view(np.dtype((np.void, matrix.dtype.itemsize * matrix.shape[1]))).reshape(-1)
    _, first, inverse = np.unique(rows, return_index=True, return_inverse=True)
    if len(first) == len(rows):
        return None
    return first, inverse.reshape(-1)


def series_min(uv: np.ndarray, cv: np.ndarray, vw: np.ndarray) -> np.ndarray:
    """:func:`series_min_plain`'s result, bitwise, with the shortcuts of the module docstring."""
    num_rows, num_inner = uv.shape
    num_cols = vw.shape[1]
    if num_rows * num_inner * num_cols < SMALL_WORK or min(num_rows, num_inner, num_cols) == 0:
        return series_min_plain(uv, cv, vw)
    a = uv + cv[None, :]  # a[s, t] = uv[s, t] + cv[t], as the plain loop adds them
    rows = _distinct_rows(a)
    cols = _distinct_rows(vw.T)
    if rows is not None:
        a = a[rows[0]]
    b = np.ascontiguousarray(vw) if cols is None else vw[:, cols[0]]
    with np.errstate(invalid="ignore"):  # inf - inf or nan: kept, never skipped
        ub = np.min(a + np.max(b, axis=1)[None, :], axis=1)
        lower = a + np.min(b, axis=1)[None, :]
        skip = np.all(lower > ub[:, None], axis=0)
    keep = np.flatnonzero(~skip)
    if a.shape[0] * len(keep) * b.shape[1] >= ROW_WORK:
        best = _by_rows(a[:, keep], b[keep])
    else:
        best = np.full((a.shape[0], b.shape[1]), np.inf)
        scratch = np.empty_like(best)
        for t in keep.tolist():
            np.add(a[:, t, None], b[t, None, :], out=scratch)
            np.minimum(best, scratch, out=best)
    if rows is not None:
        best = best[rows[1]]
    if cols is not None:
        best = best[:, cols[1]]
    return best


def _by_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """best[s] = min over t of a[s, t] + b[t], one row s at a time: the (t, r) sums in one
    pass, then their minimum down t (numpy reduces the outer axis one t after another,
    ``minimum(out, sums[t])``: the last of equal values kept, as by the loop over t). From
    :data:`THREAD_WORK` entries on, contiguous blocks of rows go to threads."""
    global _pool
    num_rows = a.shape[0]
    best = np.empty((num_rows, b.shape[1]))
    threads = min(solver_threads(), num_rows) if a.size * b.shape[1] >= THREAD_WORK else 1
    if threads < 2:
        _rows(a, b, best, 0, num_rows)
        return best
    if _pool is None or _pool[1] < threads:
        _pool = (ThreadPoolExecutor(threads, thread_name_prefix="autopar-minplus"), threads)
    cuts = [num_rows * k // threads for k in range(threads + 1)]
    state = np.geterr()  # numpy's error handling is per thread: the caller's applies
    done = [_pool[0].submit(_rows, a, b, best, lo, hi, state) for lo, hi in zip(cuts, cuts[1:])]
    for future in done:
        future.result()  # re-raises a thread's error here
    return best


def _rows(
    a: np.ndarray, b: np.ndarray, best: np.ndarray, lo: int, hi: int, state: dict | None = None
) -> None:
    """Rows ``lo`` to ``hi`` of :func:`_by_rows`, formed into ``best`` (under numpy error
    handling ``state`` where given: a thread's own is the default, not its caller's)."""
    sums = np.empty_like(b)
    with np.errstate(**(state or {})):
        for s in range(lo, hi):
            np.add(a[s, :, None], b, out=sums)
            np.minimum.reduce(sums, axis=0, out=best[s])
