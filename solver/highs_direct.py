"""The sharding ILP of solver/ilp.py built for highspy directly, in bulk (no pulp).

solver/rows.py writes the model (read ilp's module docstring for it) into a ``_HighsSink``:
columns are indices, rows go into a CSR matrix, and the whole model is handed to HiGHS with
one ``addCols`` and one ``addRows`` call, so building costs no Python object per variable and
per coefficient (pulp's objects were about half of a solve's time). The columns and rows are
pulp's model's, in the same order; ``decode_recomputed`` reads the checkpoint counts back.

HiGHS writes a banner to the C-level stdout when the first ``Highs`` of a process is made,
whatever ``output_flag`` (there is no option to set before construction): ``_quiet_banner``
makes that first one at import with stdout pointed at /dev/null, so it stays out of
``autopar plan``'s output. Nothing else is written then; solver logs (``msg=True``) and errors
are untouched.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from solver.errors import SolverStoppedError
from solver.presolve import Reduced
from solver.problem import Problem
from solver.rows import build_rows

try:
    import highspy
except ImportError:  # pragma: no cover - highspy is a dependency; pulp falls back to CBC
    highspy = None


def _quiet_banner() -> None:
    """Make the process's first Highs with file descriptor 1 on /dev/null (the banner)."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no stdout at all: nothing to keep clean
        highspy.Highs()
        return
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 1)
            highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)


if highspy is not None:
    _quiet_banner()


def available() -> bool:
    """Whether highspy can be imported."""
    return highspy is not None


def supports(problem: Problem) -> bool:
    """Whether the direct builder covers every field of ``problem`` (else use pulp)."""
    return highspy is not None


@dataclass(frozen=True, kw_only=True, slots=True)
class DirectModel:
    """A built HiGHS model and what decoding needs."""

    highs: object
    x_index: dict[tuple[int, int], int]
    """(node, strategy) -> column, only for nodes with two or more allowed strategies."""
    segment_bits: tuple[tuple[tuple[int, int], ...], ...] = ()
    """Per Problem.segments entry: (column, weight) of the bits whose sum is the copies
    recomputed."""
    objective_scale: float
    num_variables: int
    num_constraints: int
    budgeted: bool = False
    """The model has the budget row (run() tunes HiGHS for it when a gap is allowed)."""
    integer_columns: np.ndarray | None = None
    """Budget-free models without segments (assignment rows and edge links only): their
    integer columns, for run()'s linear relaxation first."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DirectOutcome:
    status: str
    """'optimal', 'feasible', 'infeasible' or 'timeout'."""
    bound: float | None
    """The dual bound in model units (finite only)."""
    values: np.ndarray | None
    """Column values (None without a solution)."""


class _HighsSink:
    """solver/rows.py's Sink (and BulkSink) for HiGHS: columns are indices, rows a CSR matrix
    with bounds, kept as chunks of arrays (one per call or block) and joined once."""

    def __init__(self) -> None:
        self.num_cols = 0
        self.col_lower: list[np.ndarray] = []
        self.col_upper: list[np.ndarray] = []
        self.integer: list[int] = []
        self.num_rows = 0
        self.num_nonzeros = 0
        self.starts: list[np.ndarray] = []
        self.index: list[np.ndarray] = []
        self.value: list[np.ndarray] = []
        self.row_lower: list[np.ndarray] = []
        self.row_upper: list[np.ndarray] = []

    def column(self, name: str, lower: float, upper: float | None, *, integer: bool = False) -> int:
        upper = highspy.kHighsInf if upper is None else upper
        return self.column_block(1, lower, upper, integer=integer)

    def column_block(self, count: int, lower: float, upper: float, *, integer: bool = False) -> int:
        first = self.num_cols
        self.num_cols += count
        self.col_lower.append(np.full(count, lower, dtype=np.float64))
        self.col_upper.append(np.full(count, upper, dtype=np.float64))
        if integer:
            self.integer.extend(range(first, first + count))
        return first

    def row(
        self,
        name: str,
        terms: Sequence[tuple[int, float]],
        lower: float | None,
        upper: float | None,
    ) -> None:
        self.row_block(
            np.zeros(1, dtype=np.int64),
            np.array([c for c, _ in terms], dtype=np.int64),
            np.array([v for _, v in terms], dtype=np.float64),
            -highspy.kHighsInf if lower is None else lower,
            highspy.kHighsInf if upper is None else upper,
        )

    def row_block(
        self, starts: np.ndarray, index: np.ndarray, value: np.ndarray, lower: float, upper: float
    ) -> None:
        self.starts.append(np.asarray(starts, dtype=np.int64) + self.num_nonzeros)
        self.index.append(np.asarray(index, dtype=np.int64))
        self.value.append(np.asarray(value, dtype=np.float64))
        self.row_lower.append(np.full(len(starts), lower, dtype=np.float64))
        self.row_upper.append(np.full(len(starts), upper, dtype=np.float64))
        self.num_rows += len(starts)
        self.num_nonzeros += len(index)


def _joined(chunks: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(chunks).astype(dtype, copy=False) if chunks else np.zeros(0, dtype)


def _check(status, call: str) -> None:
    """HiGHS reports a refused call (a bad index, a column twice in a row) only by status."""
    if status == highspy.HighsStatus.kError:
        raise RuntimeError(
            f"HiGHS refused {call} while building the sharding model (a bug in "
            f"solver/rows.py or solver/highs_direct.py); pass backend='cbc' to plan meanwhile"
        )


def build(problem: Problem, red: Reduced, *, minimise_peak: bool) -> DirectModel:
    """The time model (with the budget row if any) or the minimum-peak model (no budget)."""
    sink = _HighsSink()
    rows = build_rows(problem, red, sink, minimise_peak=minimise_peak)
    num_cols = sink.num_cols
    objective = np.zeros(num_cols)
    for c, v in rows.objective:
        objective[c] += v
    if rows.objective_block is not None:
        np.add.at(objective, *rows.objective_block)
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    if problem.memory_budget_bytes is None and not problem.segments:
        # Assignment rows and edge links only: solver/presolve.py has reduced all it can
        # (HiGHS's presolve removed nothing from llama3-70b's 626k-column model and took
        # 40% of the time), and the root LP of such models is usually integral (it was
        # there), so the feasibility-jump heuristic that runs before it is wasted time.
        h.setOptionValue("presolve", "off")
        h.setOptionValue("mip_heuristic_run_feasibility_jump", False)
    _check(
        h.addCols(
            num_cols,
            objective,
            _joined(sink.col_lower, np.float64),
            _joined(sink.col_upper, np.float64),
            0,
            np.zeros(0, dtype=np.int32),
            np.zeros(0, dtype=np.int32),
            np.zeros(0, dtype=np.float64),
        ),
        "addCols",
    )
    if sink.num_rows:
        _check(
            h.addRows(
                sink.num_rows,
                _joined(sink.row_lower, np.float64),
                _joined(sink.row_upper, np.float64),
                sink.num_nonzeros,
                _joined(sink.starts, np.int32),
                _joined(sink.index, np.int32),
                _joined(sink.value, np.float64),
            ),
            "addRows",
        )
    if sink.integer:
        _check(
            h.changeColsIntegrality(
                len(sink.integer),
                np.array(sink.integer, dtype=np.int32),
                np.full(len(sink.integer), highspy.HighsVarType.kInteger.value, dtype=np.uint8),
            ),
            "changeColsIntegrality",
        )
    return DirectModel(
        highs=h,
        x_index=rows.x,
        segment_bits=rows.segment_bits,
        objective_scale=rows.objective_scale,
        num_variables=num_cols,
        num_constraints=sink.num_rows,
        budgeted=problem.memory_budget_bytes is not None and not minimise_peak,
        integer_columns=(
            np.array(sink.integer, dtype=np.int32)
            if problem.memory_budget_bytes is None and not problem.segments and sink.integer
            else None
        ),
    )


def run(
    model: DirectModel,
    *,
    time_limit_s: float | None,
    gap: float,
    abs_gap: float | None,
    msg: bool,
    start: dict[int, float] | None = None,
    relaxation: bool = False,
) -> DirectOutcome:
    """Solve; the status words are ilp._Outcome's. ``start``: column -> value of a known plan
    (its strategy columns only; HiGHS completes the rest), handed over as a starting solution.
    ``relaxation``: solve the LP relaxation only (its optimum is the bound; its values, maybe
    fractional, are decoded as usual)."""
    h = model.highs
    if not model.num_variables:
        return DirectOutcome(status="optimal", bound=0.0, values=np.zeros(0))
    h.setOptionValue("output_flag", bool(msg))
    h.setOptionValue("mip_rel_gap", float(gap))
    if abs_gap is not None:
        h.setOptionValue("mip_abs_gap", float(abs_gap))
    if time_limit_s is not None:
        h.setOptionValue("time_limit", float(time_limit_s))
    if model.budgeted and gap > 0.0:
        # The budgeted MIPs with segments close their bound in a handful of nodes; the restart
        # HiGHS makes after root cuts (dropping fixed columns) cost more than it saved there
        # (gpt2-small-2l's two budgeted configurations, README "Stronger bounds and cutoffs").
        # Not at gap 0, whose proven plans tests/planner/stored_plans pin.
        h.setOptionValue("mip_allow_restart", False)
    if relaxation:
        h.setOptionValue("solve_relaxation", True)
    if start:
        columns = np.fromiter(start.keys(), dtype=np.int32, count=len(start))
        values = np.fromiter(start.values(), dtype=np.float64, count=len(start))
        _check(h.setSolution(len(start), columns, values), "setSolution")
    elif model.integer_columns is not None and not relaxation:  # solve_relaxation runs it
        relaxed = _integral_relaxation(h, model.integer_columns)
        if relaxed is not None:
            return relaxed
    h.run()
    status = h.getModelStatus()
    ms = highspy.HighsModelStatus
    info = h.getInfo()
    if status in (ms.kInfeasible, ms.kUnboundedOrInfeasible):
        return DirectOutcome(status="infeasible", bound=None, values=None)
    has_solution = info.primal_solution_status == 2  # kSolutionStatusFeasible
    if status == ms.kOptimal and has_solution:
        kind = "optimal"
    elif has_solution and status in (ms.kTimeLimit, ms.kInterrupt, ms.kIterationLimit):
        kind = "feasible"
    elif time_limit_s is not None and status in (ms.kTimeLimit, ms.kInterrupt):
        return DirectOutcome(status="timeout", bound=None, values=None)
    else:
        reason = h.modelStatusToString(status)
        raise SolverStoppedError(
            f"highs stopped without a plan: {reason} ({model.num_variables:,} variables); "
            f"raise the gap (--gap), set --time-limit, or plan on a machine with more memory",
            reason,
        )
    bound = info.mip_dual_bound
    values = np.asarray(h.getSolution().col_value, dtype=np.float64)
    if relaxation and kind == "optimal":
        bound = info.objective_function_value  # the LP's optimum: below every integer plan
    elif kind == "optimal" and gap == 0.0:  # proven: the bound is the objective itself
        bound = info.objective_function_value
    elif math.isfinite(bound):
        bound = _offset_bound(h, values, info.objective_function_value, bound)
    return DirectOutcome(status=kind, bound=bound if math.isfinite(bound) else None, values=values)


def _offset_bound(h: Any, values: np.ndarray, primal: float, dual: float) -> float:
    """The dual bound in the model's own units. A MIP started from a plan (setSolution) may
    report its primal and dual bounds without its presolve's objective offset (seen on the
    llama3-70b b256 bf16 row's fixed MIP: "MIP start solution is feasible: objective value
    is 0.3518 ... in the reduced space: 0.3045", then primal and dual bound 0.3045, gap 0,
    while the returned columns cost 0.3518): the gap it proved is primal - dual in its
    space, so the bound is the returned plan's own cost less that gap."""
    cost = np.asarray(h.getLp().col_cost_, dtype=np.float64)
    own = float(cost @ values)
    if abs(own - primal) <= 1e-9 * max(1.0, abs(own)):
        return dual
    return own - (primal - dual)


_INTEGRAL_TOL = 1e-9


def _integral_relaxation(h: Any, integer: np.ndarray) -> DirectOutcome | None:
    """The linear relaxation of a budget-free model, solved first: its root LP is usually
    integral (every layout model of the presets was), and then its optimum is the MIP's,
    proven (its bound is its objective), at a tenth of the MIP's time (llama3-8b b32 8x8:
    0.06 vs 0.7 s; the MIP spends the rest on symmetry detection and heuristics before it
    reads the same root). None when the relaxation is fractional: the integrality comes back
    and the caller runs the MIP."""
    count = len(integer)
    continuous = np.full(count, highspy.HighsVarType.kContinuous.value, dtype=np.uint8)
    _check(h.changeColsIntegrality(count, integer, continuous), "changeColsIntegrality")
    h.run()
    status = h.getModelStatus()
    if status == highspy.HighsModelStatus.kOptimal:
        values = np.asarray(h.getSolution().col_value, dtype=np.float64)
        picked = values[integer]
        if np.all(np.abs(picked - np.round(picked)) <= _INTEGRAL_TOL):
            values[integer] = np.round(picked)
            bound = h.getInfo().objective_function_value
            return DirectOutcome(status="optimal", bound=bound, values=values)
    kinds = np.full(count, highspy.HighsVarType.kInteger.value, dtype=np.uint8)
    _check(h.changeColsIntegrality(count, integer, kinds), "changeColsIntegrality")
    _check(h.clearSolver(), "clearSolver")
    return None


def decode(red: Reduced, model: DirectModel, values: np.ndarray) -> tuple[int, ...]:
    """Chosen strategy per node: the largest x, lowest index on ties (as ilp._decode)."""
    choices = []
    for i, allowed in enumerate(red.allowed):
        if len(allowed) == 1:
            choices.append(allowed[0])
        else:
            choices.append(max(allowed, key=lambda s: (values[model.x_index[i, s]], -s)))
    return tuple(choices)


def decode_recomputed(model: DirectModel, values: np.ndarray) -> tuple[int, ...]:
    """Copies recomputed per Problem.segments entry (bits above one half, as ilp's decode)."""
    return tuple(sum(w for c, w in bits if values[c] > 0.5) for bits in model.segment_bits)
