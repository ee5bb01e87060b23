"""The series min-plus product's shortcuts (solver/minplus.py: distinct rows and columns,
inner strategies that cannot reach the minimum skipped) give the plain loop's floats, bitwise
(nan only where the plain loop has nan)."""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import solver.minplus as minplus

# Few values, so that rows, columns and sums repeat and tie; zeros of both signs, +inf
# (forbidden pairs); -inf and nan only where ``wild`` (not produced by the solver, but the
# shortcuts must not hide them either).
_TAME = [0.0, -0.0, 1.0, 2.0, 0.5, 3.25, np.inf]
_WILD = [*_TAME, -1.0, -np.inf, np.nan]


@st.composite
def products(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(uv, cv, vw) of 1-12 strategies per side, single-strategy nodes included, drawn from a
    few values with rows and columns copied."""
    values = draw(st.sampled_from([_TAME, _WILD]))
    num_rows, num_inner, num_cols = (draw(st.integers(1, 12)) for _ in range(3))

    def matrix(rows: int, cols: int) -> np.ndarray:
        flat = draw(st.lists(st.sampled_from(values), min_size=rows * cols, max_size=rows * cols))
        out = np.array(flat, dtype=np.float64).reshape(rows, cols)
        for _ in range(draw(st.integers(0, 3))):  # repeated rows and columns
            if draw(st.booleans()):
                out[draw(st.integers(0, rows - 1))] = out[draw(st.integers(0, rows - 1))]
            else:
                out[:, draw(st.integers(0, cols - 1))] = out[:, draw(st.integers(0, cols - 1))]
        return out

    uv = matrix(num_rows, num_inner)
    cv = matrix(1, num_inner)[0]
    vw = matrix(num_inner, num_cols)
    if draw(st.booleans()):  # a dominated inner strategy: worse everywhere than another
        t, u = draw(st.integers(0, num_inner - 1)), draw(st.integers(0, num_inner - 1))
        cv[u] = cv[t] + 1.0
        uv[:, u], vw[u] = uv[:, t] + 1.0, vw[t] + 2.0
    return uv, cv, vw


@settings(max_examples=120, deadline=None)
@given(products(), st.sampled_from([0, 10**18]))
def test_series_min_shortcuts_equal_the_plain_loop_bitwise(
    product: tuple[np.ndarray, np.ndarray, np.ndarray], row_work: int
) -> None:
    """Both ways of forming what the shortcuts leave: one t at a time and one row at a time
    (ROW_WORK 0: every product a row at a time)."""
    saved = minplus.SMALL_WORK, minplus.ROW_WORK
    minplus.SMALL_WORK = 0  # the shortcuts on every size, down to 1 x 1 x 1
    minplus.ROW_WORK = row_work
    try:
        with np.errstate(invalid="ignore"):
            got = minplus.series_min(*product)
            want = minplus.series_min_plain(*product)
    finally:
        minplus.SMALL_WORK, minplus.ROW_WORK = saved
    assert got.shape == want.shape
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    # The same bits wherever a number came out, zero signs included (a nan's sign bit
    # depends on which inf - inf made it: the solver's tables hold neither nan nor -inf).
    assert got[~nan].tobytes() == want[~nan].tobytes()


def test_skipped_inner_strategies_are_the_ones_that_cannot_reach_the_minimum() -> None:
    """A product whose inner strategies 1-3 are far worse than 0: the result is 0's sums, and
    dropping the strictness of the skip test (ties skipped too) changes a zero's sign."""
    uv = np.array([[0.0, 5.0, 6.0, 7.0], [1.0, 5.0, 6.0, 7.0]])
    cv = np.array([0.0, 0.0, 0.0, 0.0])
    vw = np.array([[0.0, 2.0], [9.0, 9.0], [9.0, 9.0], [9.0, 9.0]])
    saved = minplus.SMALL_WORK
    minplus.SMALL_WORK = 0
    try:
        assert minplus.series_min(uv, cv, vw).tolist() == [[0.0, 2.0], [1.0, 3.0]]
        # A tie at -0.0 vs 0.0: the plain loop keeps the last t, so t=1 must not be skipped.
        uv2 = np.array([[0.0, -0.0]])
        vw2 = np.array([[0.0], [-0.0]])
        got = minplus.series_min(uv2, np.array([0.0, -0.0]), vw2)
        assert np.signbit(got[0, 0]) == np.signbit(
            minplus.series_min_plain(uv2, np.array([0.0, -0.0]), vw2)[0, 0]
        )
    finally:
        minplus.SMALL_WORK = saved


def test_a_row_at_a_time_keeps_the_last_of_equal_zeros() -> None:
    """Formed a row at a time, a tie between +0.0 (t=0) and -0.0 (t=1) gives the loop's -0.0:
    the minimum down t runs in ascending t and keeps the later of equal values."""
    uv = np.array([[0.0, -0.0], [0.0, -0.0]])
    cv = np.array([0.0, -0.0])
    vw = np.array([[0.0, 0.0], [-0.0, -0.0]])
    saved = minplus.SMALL_WORK, minplus.ROW_WORK
    minplus.SMALL_WORK, minplus.ROW_WORK = 0, 0
    try:
        got = minplus.series_min(uv, cv, vw)
    finally:
        minplus.SMALL_WORK, minplus.ROW_WORK = saved
    want = minplus.series_min_plain(uv, cv, vw)
    assert np.signbit(want).all()  # the loop over t: the last t's -0.0
    assert got.tobytes() == want.tobytes()


def _classes(grouping: tuple[np.ndarray, np.ndarray] | None, num_rows: int) -> set[tuple]:
    """The partition of the rows that a _distinct_rows result describes."""
    inverse = np.arange(num_rows) if grouping is None else grouping[1]
    return {tuple(np.flatnonzero(inverse == g)) for g in np.unique(inverse)}


def _byte_classes(matrix: np.ndarray) -> set[tuple]:
    """The rows grouped by their bytes, one by one."""
    found: dict[bytes, list[int]] = {}
    for k, row in enumerate(matrix):
        found.setdefault(row.tobytes(), []).append(k)
    return {tuple(members) for members in found.values()}


@settings(max_examples=80, deadline=None)
@given(products(), st.booleans())
def test_distinct_rows_group_rows_by_their_bytes(
    product: tuple[np.ndarray, np.ndarray, np.ndarray], collide: bool
) -> None:
    """The fingerprint's groups are the rows' byte patterns (zeros of either sign apart), and
    each row's distinct row is one with its bytes; with every fingerprint weight 1 (sums of
    the words: rows that are permutations of each other collide) the check catches the
    collision and the byte sort decides."""
    uv, _, vw = product
    saved = minplus._FINGERPRINT
    if collide:
        minplus._FINGERPRINT = np.uint64(0)  # every weight 1
    try:
        for matrix in (uv, vw.T, np.array([[1.0, 2.0], [2.0, 1.0], [1.0, 2.0]])):
            grouping = minplus._distinct_rows(matrix)
            assert _classes(grouping, len(matrix)) == _byte_classes(matrix)
            if grouping is not None:
                first, inverse = grouping
                assert all(
                    matrix[first[g]].tobytes() == row.tobytes() for g, row in zip(inverse, matrix)
                )
    finally:
        minplus._FINGERPRINT = saved


@settings(max_examples=60, deadline=None)
@given(products(), st.integers(2, 5))
def test_rows_split_between_threads_give_the_same_bits(
    product: tuple[np.ndarray, np.ndarray, np.ndarray], threads: int
) -> None:
    """Every product formed a row at a time with its rows split between ``threads`` threads
    (THREAD_WORK 0) is bitwise the product formed on one thread, nan included."""
    saved = minplus.SMALL_WORK, minplus.ROW_WORK, minplus.THREAD_WORK
    minplus.SMALL_WORK, minplus.ROW_WORK, minplus.THREAD_WORK = 0, 0, 0
    try:
        with np.errstate(invalid="ignore"):
            with _threads(1):
                want = minplus.series_min(*product)
            with _threads(threads):
                got = minplus.series_min(*product)
    finally:
        minplus.SMALL_WORK, minplus.ROW_WORK, minplus.THREAD_WORK = saved
    assert got.tobytes() == want.tobytes()


def test_a_large_product_on_threads_is_the_one_thread_product() -> None:
    """A 64 x 300 x 300 product of repeating values (ties, zeros of both signs, +inf) at the
    default THREAD_WORK: split between 3 threads, the same bits as on one."""
    rng = np.random.default_rng(7)
    values = np.array([0.0, -0.0, 1.0, 2.5, np.inf])
    uv, vw = values[rng.integers(0, 5, (64, 300))], values[rng.integers(0, 5, (300, 300))]
    cv = values[rng.integers(0, 4, 300)]
    assert uv.size * vw.shape[1] >= minplus.THREAD_WORK
    with _threads(1):
        want = minplus.series_min(uv, cv, vw)
    with _threads(3):
        got = minplus.series_min(uv, cv, vw)
    assert got.tobytes() == want.tobytes()
    assert got.tobytes() == minplus.series_min_plain(uv, cv, vw).tobytes()


def test_the_thread_count_comes_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv(minplus.THREADS_ENV, "3")
    assert minplus.solver_threads() == 3
    for bad in ("0", "-2", "two", ""):
        monkeypatch.setenv(minplus.THREADS_ENV, bad)
        with pytest.raises(ValueError, match=minplus.THREADS_ENV):
            minplus.solver_threads()
    monkeypatch.delenv(minplus.THREADS_ENV)
    assert 1 <= minplus.solver_threads() <= minplus.MAX_THREADS


@contextlib.contextmanager
def _threads(count: int):
    """AUTOPAR_SOLVER_THREADS set to ``count`` inside."""
    saved = os.environ.get(minplus.THREADS_ENV)
    os.environ[minplus.THREADS_ENV] = str(count)
    try:
        yield
    finally:
        if saved is None:
            del os.environ[minplus.THREADS_ENV]
        else:
            os.environ[minplus.THREADS_ENV] = saved


def test_a_forked_child_forms_rows_on_its_own_threads() -> None:
    """A process forked after the row threads started (a data loader's workers, say) has
    none of them: its large products make their own pool instead of waiting on the parent's
    forever."""
    import multiprocessing

    rng = np.random.default_rng(3)
    uv, vw = rng.random((64, 300)), rng.random((300, 300))
    cv = rng.random(300)
    with _threads(2):
        want = minplus.series_min(uv, cv, vw)  # the parent's pool exists now
        context = multiprocessing.get_context("fork")
        with context.Pool(1) as pool:
            got = pool.apply_async(minplus.series_min, (uv, cv, vw)).get(timeout=60)
    assert got.tobytes() == want.tobytes()
