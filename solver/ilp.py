"""The sharding ILP: choose one strategy per node, minimising predicted step time under a budget.

Notation: nodes i with strategies s in S_i; node cost c_i[s] (seconds), resident memory
m_i[s] and transient memory r_i[s] (bytes); edges k from u_k to v_k with cost matrix C_k,
where C_k[s][t] = None forbids the pair; A_k = {(s, t) : C_k[s][t] is not None};
M0 = memory_offset_bytes, B = memory_budget_bytes.

Variables
    x[i,s] in {0, 1}       node i uses strategy s
    e[k,g,h] in [0, 1]     edge k carries a pair of the block (g, h), only for allowed blocks
    T >= 0                 the largest transient (only when a memory row is built)

Objective
    minimise  sum_i sum_s c_i[s] x[i,s]  +  sum_k sum_{(g,h) allowed} C_k[g][h] e[k,g,h]

Constraints (family: the function of solver/rows.py that builds it)
    one-hot     sum_s x[i,s] = 1                          every node i        build_rows
    edge-src    sum_h e[k,g,h] = sum_{s in g} x[u_k,s]    every k, group g    _add_edge_links
    edge-dst    sum_g e[k,g,h] = sum_{t in h} x[v_k,t]    every k, group h    _add_edge_links
    transient   T >= sum_s r_i[s] x[i,s]                  every i with r_i    _add_memory
    memory      M0 + sum_i sum_s m_i[s] x[i,s] + T <= B   if B is not None    _add_memory
    checkpoint  per segment bit: F <= A(x), F <= M b, P >= F, R >= T(x) - M (1 - b);
                memory -= 2^j F, += P; objective += 2^j R;
                one row per clique of overlapping segments  segment_rows.add_segments
                (Problem.segments; the model in solver/checkpointing.py)

Groups (exact edge compression, presolve._line_groups): the src strategies of edge k are
partitioned into groups g of identical rows of C_k (same costs, same forbidden pairs), the dst
strategies into groups h of identical columns; every entry of a block (g, h) is then the same,
C_k[g][h]. An edge's cost depends only on the producer's output and the consumer's input
placement, so a node with 40 strategies often has a handful of groups per edge.

This is Alpa's linearization of the quadratic edge term: with x one-hot at both ends the edge
rows form a transportation polytope with one-hot margins, whose only point is e[k,g*,h*] = 1
(the groups of the chosen strategies), so e may be continuous (only x is branched on) and a
forbidden pair, having no variable, makes the combination (s*, t*) infeasible. The minimum-peak model (used to report the smallest budget
that fits when B is too small) drops the memory row and minimises M0 + sum m x + T instead.

Presolve (presolve.reduce_problem), exact, before any variable exists: parallel edges (either
orientation) are merged by adding matrices (None wins); strategies that no allowed pair of some
edge supports are removed until nothing changes (arc consistency); an edge with a single
allowed strategy at one end becomes linear cost on the other end; an edge whose allowed pairs
are all pairs of the remaining strategies and whose costs are all equal (e.g. all zero) becomes
a constant; an edge whose rows (or columns) form one group costs what one end alone decides
and becomes linear cost on that end; a node left with one strategy is a constant, not a
variable. Costs and bytes are divided by powers of two (exact) so that the solver's absolute
tolerances act on numbers of order one. Continuous e solved a 2,000-node, 8-strategy chain
with a memory row about 5x faster than binary e in HiGHS, with the same optimum. Presolve also
removes dominated strategies (presolve._prune_dominated).

Before all that, solver/shrink.py ``solve`` shrinks the problem exactly (elimination of leaf
and series nodes, tie classes contracted or solved as counts per strategy) and calls
``solve_model`` here on what is left. solver/rows.py writes the model once for both backends:
with HiGHS, checkpoint rows included, it is handed over in bulk (solver/highs_direct.py); pulp
holds it for CBC and for the minimum-peak model that reports the smallest budget.

Determinism: the model is built in a fixed order from the Problem alone and both solvers are
deterministic for a fixed model (single search, fixed seeds), so a Problem always gets the same
choices unless a time limit cuts the search. _polish then makes single-node moves, each to a
strictly cheaper strategy or to a lower index at equal cost (allowed pairs, within budget, exact
fsum check): it removes what the solvers' tolerances leave (costs below about 1e-9 of the
largest cost are invisible to them) and breaks ties towards low indices, mostly alike across
backends. objective_s and peak_memory_bytes are recomputed exactly (math.fsum) from the final
choices; bound_s is the solver's bound mapped back to seconds and never above objective_s.
"""

from __future__ import annotations

import math
import os
import re
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass

import pulp

from solver import highs_direct
from solver.errors import (
    InfeasibleBudgetError,
    InfeasibleError,
    SolverStoppedError,
    SolverTimeoutError,
)
from solver.presolve import (
    Reduced,
    plan_objective_s,
    plan_peak_memory_bytes,
    reduce_problem,
    validate,
)
from solver.problem import Problem, Solution
from solver.rows import build_rows


def _drop_import_tracebacks() -> None:
    """Forget the tracebacks of the exceptions pulp keeps from its own import.

    pulp stores, on the class of each solver it could not load, the exception raised while
    loading it (``COPT_DLL.err``, ``CPLEX_PY.err``). That traceback holds the frames of pulp's
    import, and through their ``f_back`` every frame that was running when pulp was first
    imported, with its locals. autopar imports this module on the first solve, so without this
    the caller's frames (``autoparallelize`` holding the user's unsharded model and example
    inputs) lived as long as the process. pulp uses only the message (``str(err)``).
    """
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "pulp" or name.startswith("pulp.")):
            continue
        for value in list(vars(module).values()):
            # module-level values, and the class attributes of its classes
            for item in list(vars(value).values()) if isinstance(value, type) else [value]:
                if isinstance(item, BaseException):
                    _clear_traceback(item)


def _clear_traceback(exc: BaseException) -> None:
    seen: set[int] = set()
    stack: list[BaseException | None] = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        e.__traceback__ = None
        stack += [e.__context__, e.__cause__]


_drop_import_tracebacks()

BACKENDS = ("highs", "cbc")

_ABS_GAP = 1e-9
"""Absolute gap (in scaled objective units, i.e. of the largest single cost) used at gap 0."""

ZERO_GAP = 1e-9
"""A relative gap below this is the solver's float noise and is reported as 0."""

_MAX_POLISH_PASSES = 8


@dataclass(frozen=True, kw_only=True, slots=True)
class _Model:
    lp: pulp.LpProblem
    x: dict[tuple[int, int], pulp.LpVariable]
    """Only for nodes with two or more allowed strategies."""
    objective_scale: float
    num_variables: int
    segment_bits: tuple[tuple[tuple[pulp.LpVariable, int], ...], ...] = ()
    """Per Problem.segments entry: (bit, weight) pairs whose sum is the copies recomputed."""


class _PulpSink:
    """solver/rows.py's Sink on a pulp model: columns are LpVariables, rows LpConstraints."""

    def __init__(self, lp: pulp.LpProblem) -> None:
        self.lp = lp
        self.num_variables = 0

    def column(
        self, name: str, lower: float, upper: float | None, *, integer: bool = False
    ) -> pulp.LpVariable:
        self.num_variables += 1
        cat = pulp.LpInteger if integer else pulp.LpContinuous
        return pulp.LpVariable(name, lowBound=lower, upBound=upper, cat=cat)

    def row(
        self,
        name: str,
        terms: Sequence[tuple[pulp.LpVariable, float]],
        lower: float | None,
        upper: float | None,
    ) -> None:
        if lower is None:
            sense, rhs = pulp.LpConstraintLE, upper
        elif upper is None:
            sense, rhs = pulp.LpConstraintGE, lower
        else:
            assert lower == upper, f"ranged row {name}: pulp takes one sense per row"
            sense, rhs = pulp.LpConstraintEQ, lower
        self.lp.addConstraint(
            pulp.LpConstraint(pulp.LpAffineExpression(list(terms)), sense, name, rhs)
        )


def _decode_recomputed(model: _Model) -> tuple[int, ...]:
    return tuple(
        sum(w for b, w in bits if (b.varValue or 0.0) > 0.5) for bits in model.segment_bits
    )


def _build(problem: Problem, red: Reduced, *, minimise_peak: bool) -> _Model:
    """The time model (with the budget row if any) or the minimum-peak model (no budget),
    written by solver/rows.py into pulp."""
    lp = pulp.LpProblem("autopar_peak" if minimise_peak else "autopar_time", pulp.LpMinimize)
    sink = _PulpSink(lp)
    rows = build_rows(problem, red, sink, minimise_peak=minimise_peak)
    lp.setObjective(pulp.LpAffineExpression(rows.objective))
    return _Model(
        lp=lp,
        x=rows.x,
        objective_scale=rows.objective_scale,
        num_variables=sink.num_variables,
        segment_bits=rows.segment_bits,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class _Outcome:
    status: str
    """'optimal', 'feasible', 'infeasible' or 'timeout'."""
    bound: float | None
    """The solver's best bound in model units, where the backend reports one."""


def _run(
    model: _Model, *, backend: str, time_limit_s: float | None, gap: float, msg: bool
) -> _Outcome:
    lp = model.lp
    if not model.num_variables:  # nothing to decide: every node is fixed
        return _Outcome(status="optimal", bound=0.0)
    abs_gap = _ABS_GAP if gap == 0.0 else None
    bound = None
    log = ""
    if backend == "highs":
        lp.solve(pulp.HiGHS(msg=msg, timeLimit=time_limit_s, gapRel=gap, gapAbs=abs_gap))
        dual_bound = lp.solverModel.getInfo().mip_dual_bound
        bound = dual_bound if math.isfinite(dual_bound) else None
    else:
        with tempfile.TemporaryDirectory(prefix="autopar_cbc_") as tmp:
            log_path = os.path.join(tmp, "cbc.log")
            lp.solve(
                pulp.PULP_CBC_CMD(
                    msg=False, timeLimit=time_limit_s, gapRel=gap, gapAbs=abs_gap, logPath=log_path
                )
            )
            with open(log_path) as f:
                log = f.read()
        if msg:
            print(log)
    if lp.status == pulp.LpStatusInfeasible:
        return _Outcome(status="infeasible", bound=None)
    if lp.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        if time_limit_s is None:
            reason = pulp.LpStatus[lp.status]
            raise SolverStoppedError(
                f"{backend} stopped without a plan: {reason}; raise the gap (--gap), set "
                f"--time-limit, or plan on a machine with more memory",
                reason,
            )
        return _Outcome(status="timeout", bound=None)
    status = "optimal" if lp.sol_status == pulp.LpSolutionOptimal else "feasible"
    objective = pulp.value(lp.objective) or 0.0
    if backend == "cbc":
        bound = _cbc_bound(log, objective)
    if status == "optimal" and gap == 0.0:  # proven: the bound is the objective itself
        bound = objective
    return _Outcome(status=status, bound=bound)


def _cbc_bound(log: str, objective: float) -> float | None:
    """CBC's best bound, read from its log (pulp does not return it)."""
    exited = re.findall(r"Exiting as integer gap of ([-+0-9.eE]+)", log)
    if exited:  # stopped by the relative gap: the absolute gap is printed in full
        return objective - float(exited[-1])
    partial = re.findall(
        r"Partial search - best objective \S+ \(best possible ([-+0-9.eE]+)\)", log
    )
    if partial:  # stopped by the time limit
        return float(partial[-1])
    return objective if "Optimal solution found" in log else None


def _decode(red: Reduced, model: _Model) -> tuple[int, ...]:
    choices = []
    for i, allowed in enumerate(red.allowed):
        if len(allowed) == 1:
            choices.append(allowed[0])
        else:  # the largest value, lowest index on ties, tolerates 0.9999999
            choices.append(max(allowed, key=lambda s: (model.x[i, s].varValue or 0.0, -s)))
    return tuple(choices)


def _polish(
    problem: Problem, red: Reduced, choices: tuple[int, ...], recomputed: tuple[int, ...] = ()
) -> tuple[tuple[int, ...], int]:
    """Single-node moves: to a strictly cheaper strategy, or to a lower index at equal cost.

    A move must keep every edge pair allowed and the plan within budget. Its cost change is
    summed with math.fsum, whose correctly rounded result has the sign of the exact change, so
    no move raises the exact objective. This removes what the solver's tolerances leave behind
    (costs below ~1e-9 of the largest one) and breaks ties the same way on every run. Returns
    the choices and the number of moves. Nodes of recomputed segments (and their edges'
    ends) stay put: their choice also sets the freed bytes and recompute seconds.
    """
    frozen: set[int] = set()
    for seg, count in zip(problem.segments, recomputed):
        if count:
            frozen.update(seg.nodes)
            frozen.update(n for e in seg.edges for n in (e.src, e.dst))
    incident: list[list[int]] = [[] for _ in problem.nodes]
    for k, edge in enumerate(problem.edges):
        incident[edge.src].append(k)
        if edge.dst != edge.src:
            incident[edge.dst].append(k)
    budget = problem.memory_budget_bytes
    current = list(choices)
    moves = 0
    for _ in range(_MAX_POLISH_PASSES):
        moved = False
        for i, node in enumerate(problem.nodes):
            if i in frozen:
                continue
            old = current[i]
            best, best_change = old, 0.0
            for s in red.allowed[i]:
                if s == old:
                    continue
                current[i] = s
                change = [node.cost_s[s], -node.cost_s[old]]
                for k in incident[i]:
                    edge = problem.edges[k]
                    new_cost = edge.cost_s[current[edge.src]][current[edge.dst]]
                    old_cost = edge.cost_s[old if edge.src == i else current[edge.src]][
                        old if edge.dst == i else current[edge.dst]
                    ]
                    if new_cost is None or old_cost is None:
                        change.append(math.inf)
                        break
                    change += [new_cost, -old_cost]
                total = math.fsum(change)
                if (total < best_change or (total == best_change and s < best)) and (
                    budget is None
                    or (
                        node.memory_bytes[s] <= node.memory_bytes[old]
                        and (
                            not node.transient_bytes
                            or node.transient_bytes[s] <= node.transient_bytes[old]
                        )
                    )
                    or plan_peak_memory_bytes(problem, tuple(current), recomputed) <= budget
                ):
                    best, best_change = s, total
            current[i] = best
            if best != old:
                moves += 1
                moved = True
        if not moved:
            break
    return tuple(current), moves


def resolve_backend(backend: str) -> tuple[str, bool]:
    """The backend to use and whether HiGHS was asked for but is unavailable."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown solver backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "highs" and not pulp.HiGHS().available():
        return "cbc", True
    return backend, False


def solve_model(
    problem: Problem,
    *,
    backend: str,
    time_limit_s: float | None,
    gap: float,
    msg: bool,
    start_plan: tuple[int, ...] | None = None,
    relaxation: bool = False,
) -> Solution:
    """Presolve, build and run the ILP (the module docstring's model). ``start_plan``: a plan's
    choices to begin the search from (HiGHS only; strategies presolve removed are left out).
    ``relaxation`` (HiGHS only): the LP relaxation's optimum as the bound, the plan decoded
    from its values (the Lagrangian relaxation needs bounds, not proofs)."""
    backend, fell_back = resolve_backend(backend)
    start = time.perf_counter()
    validate(problem)
    red = reduce_problem(problem)
    # HiGHS gets the model in bulk (solver/highs_direct.py), checkpoint segments included.
    direct = backend == "highs" and highs_direct.supports(problem)
    if direct:
        model = highs_direct.build(problem, red, minimise_peak=False)
    else:
        model = _build(problem, red, minimise_peak=False)
    built = time.perf_counter()
    if direct:
        outcome = highs_direct.run(
            model,
            time_limit_s=time_limit_s,
            gap=gap,
            abs_gap=_ABS_GAP if gap == 0.0 else None,
            msg=msg,
            start=None if start_plan is None else _start_columns(red, model.x_index, start_plan),
            relaxation=relaxation,
        )
    else:
        outcome = _run(model, backend=backend, time_limit_s=time_limit_s, gap=gap, msg=msg)
    if outcome.status == "timeout":
        raise SolverTimeoutError(
            f"{backend} found no plan within {time_limit_s} s ({len(problem.nodes)} nodes); raise "
            f"time_limit_s or pass gap > 0"
        )
    if outcome.status == "infeasible":
        _raise_infeasible(problem, red, backend=backend, time_limit_s=time_limit_s, msg=msg)
    if direct:
        recomputed = highs_direct.decode_recomputed(model, outcome.values)
        decoded = highs_direct.decode(red, model, outcome.values)
    else:
        recomputed, decoded = _decode_recomputed(model), _decode(red, model)
    choices, moves = _polish(problem, red, decoded, recomputed)
    solved = time.perf_counter()
    objective = plan_objective_s(problem, choices, recomputed)
    bound = objective
    if outcome.bound is not None:
        bound = min(
            objective, outcome.bound * model.objective_scale + red.constant_s + _fixed_cost_s(red)
        )
    # Below the solver's absolute tolerance (relative to the largest cost) a gap is float noise.
    noise = objective - bound <= _ABS_GAP * model.objective_scale
    relative_gap = 0.0 if noise else (objective - bound) / abs(objective)
    details = {
        "presolved_edges": float(len(problem.edges) - len(red.edges)),
        "polish_moves": float(moves),
    }
    if fell_back:
        details["highs_unavailable"] = 1.0
    relative_gap = 0.0 if relative_gap < ZERO_GAP else relative_gap
    return Solution(
        choices=choices,
        objective_s=objective,
        bound_s=bound,
        gap=relative_gap,
        # HiGHS says 'optimal' when it stops within the requested gap; the plan is optimal only
        # at gap 0 (configurations._within_gap accepts either within the gap).
        status="feasible" if outcome.status == "optimal" and relative_gap > 0.0 else outcome.status,
        backend=backend,
        peak_memory_bytes=plan_peak_memory_bytes(problem, choices, recomputed),
        num_variables=model.num_variables,
        num_constraints=model.num_constraints if direct else len(model.lp.constraints),
        build_s=built - start,
        solve_s=solved - built,
        details=details,
        recomputed=recomputed,
    )


def _start_columns(
    red: Reduced, x_index: dict[tuple[int, int], int], start: tuple[int, ...]
) -> dict[int, float]:
    """The strategy columns of the plan ``start``: 1 for the chosen, 0 for the others, on the
    nodes whose chosen strategy survived presolve."""
    columns: dict[int, float] = {}
    for i, allowed in enumerate(red.allowed):
        if len(allowed) > 1 and start[i] in allowed:
            for s in allowed:
                columns[x_index[i, s]] = 1.0 if s == start[i] else 0.0
    return columns


def _fixed_cost_s(red: Reduced) -> float:
    """Cost of nodes left with one strategy: a constant the model does not see."""
    return math.fsum(next(iter(c.values())) for c in red.node_cost_s if len(c) == 1)


def _raise_infeasible(
    problem: Problem, red: Reduced, *, backend: str, time_limit_s: float | None, msg: bool
) -> None:
    """Tell a budget that is too small from forbidden pairs that rule out everything."""
    budget = problem.memory_budget_bytes
    structural = InfeasibleError(
        f"no plan exists: the edges' forbidden pairs (None costs) rule out every combination of "
        f"strategies of the {len(problem.nodes)} nodes; allow more pairs"
    )
    if budget is None:
        raise structural
    model = _build(problem, red, minimise_peak=True)
    outcome = _run(model, backend=backend, time_limit_s=time_limit_s, gap=0.0, msg=msg)
    if outcome.status == "infeasible":
        raise structural
    if outcome.status == "timeout":
        raise SolverTimeoutError(
            f"the memory budget {budget:.6g} bytes cannot be met, and {backend} found no plan at "
            f"all within {time_limit_s} s; raise time_limit_s"
        )
    choices = _decode(red, model)
    raise InfeasibleBudgetError(
        min_budget_bytes=plan_peak_memory_bytes(problem, choices, _decode_recomputed(model)),
        budget_bytes=budget,
        proven=outcome.status == "optimal",
    )
