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

Constraints (family: the function that builds it)
    one-hot     sum_s x[i,s] = 1                          every node i        _add_one_hot
    edge-src    sum_h e[k,g,h] = sum_{s in g} x[u_k,s]    every k, group g    _add_edge_links
    edge-dst    sum_g e[k,g,h] = sum_{t in h} x[v_k,t]    every k, group h    _add_edge_links
    transient   T >= sum_s r_i[s] x[i,s]                  every i with r_i    _add_memory
    memory      M0 + sum_i sum_s m_i[s] x[i,s] + T <= B   if B is not None    _add_memory
    checkpoint  per segment bit: F <= A(x), F <= M b, P >= F, R >= T(x) - M (1 - b);
                memory -= 2^j F, += P; objective += 2^j R;
                one row per clique of overlapping segments               _add_segments
                (Problem.segments; the model in solver/recompute.py)

Groups (exact edge compression, presolve._group_pairs): the src strategies of edge k are
partitioned into groups g of identical rows of C_k (same costs, same forbidden pairs), the dst
strategies into groups h of identical columns; every entry of a block (g, h) is then the same,
C_k[g][h]. An edge's cost depends only on the producer's output and the consumer's input
placement, so a node with 40 strategies often has a handful of groups per edge.

This is Alpa's linearization of the quadratic edge term: with x one-hot at both ends the edge
rows form a transportation polytope with one-hot margins, whose only point is e[k,g*,h*] = 1
(the groups of the chosen strategies), so e may be continuous (only x is branched on) and a forbidden pair, having no variable, makes the
combination (s*, t*) infeasible. The minimum-peak model (used to report the smallest budget
that fits when B is too small) drops the memory row and minimises M0 + sum m x + T instead.

Presolve (presolve.reduce_problem), exact, before any variable exists: parallel edges (either
orientation) are merged by adding matrices (None wins); strategies that no allowed pair of some
edge supports are removed until nothing changes (arc consistency); an edge with a single
allowed strategy at one end becomes linear cost on the other end; an edge whose allowed pairs
are all pairs of the remaining strategies and whose costs are all equal (e.g. all zero) becomes
a constant; an edge whose rows (or columns) form one group costs what one end alone decides
and becomes linear cost on that end; a node left with one strategy is a constant, not a
variable. Costs and bytes are divided by powers of two (exact) so that the solver's absolute tolerances act on numbers of
order one. Continuous e solved a 2,000-node, 8-strategy chain with a memory row about 5x faster
than binary e in HiGHS, with the same optimum.

Before all that, solve() shrinks the problem exactly: without a budget, leaf and series nodes
are eliminated by min-plus dynamic programming (solver/eliminate.py: parameters, pointwise
chains); tie classes (Problem.tied, repeated layers) are contracted into one node each
(solver/tying.py), and elimination runs again on the contracted graph. The choices are
expanded back and objective_s and peak_memory_bytes recomputed on the original problem.
With a budget (HiGHS, no checkpoint segments) tie classes are solved as counts per strategy
instead (tying.solve_counts, _solve_counts): layers may differ, the model's size does not
depend on depth, and its bound is a lower bound on the untied optimum; a mixed plan is
realised by a small ILP over each member's class strategies. Presolve also removes dominated
strategies (presolve._prune_dominated). With HiGHS the model, checkpoint rows included, is
handed over in bulk (solver/highs_direct.py); pulp builds it for CBC and for the minimum-peak
model that reports the smallest budget.

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

import dataclasses
import math
import os
import re
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass

import pulp

from solver import highs_direct
from solver.eliminate import Eliminated, back_substitute, eliminate
from solver.errors import InfeasibleBudgetError, InfeasibleError, SolverTimeoutError
from solver.presolve import (
    Reduced,
    plan_objective_s,
    plan_peak_memory_bytes,
    reduce_problem,
    validate,
)
from solver.problem import Problem, SegmentEdge, Solution
from solver.recompute import (
    conflict_cliques,
    contract_segments,
    expand_recomputed,
    validate_segments,
)
from solver.tying import ACCEPT_GAP, contract, expand, restrict, solve_counts

BACKENDS = ("highs", "cbc")

_ABS_GAP = 1e-9
"""Absolute gap (in scaled objective units, i.e. of the largest single cost) used at gap 0."""

_ZERO_GAP = 1e-9
"""A relative gap below this is the solver's float noise and is reported as 0."""

_MAX_POLISH_PASSES = 8


def _power_of_two_scale(values: list[float]) -> float:
    """A power of two near the largest magnitude, so dividing by it is exact."""
    largest = max((abs(v) for v in values), default=0.0)
    return (
        1.0
        if largest == 0.0 or not math.isfinite(largest)
        else math.ldexp(1.0, math.frexp(largest)[1])
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class _Model:
    lp: pulp.LpProblem
    x: dict[tuple[int, int], pulp.LpVariable]
    """Only for nodes with two or more allowed strategies."""
    objective_scale: float
    num_variables: int
    segment_bits: tuple[tuple[tuple[pulp.LpVariable, int], ...], ...] = ()
    """Per Problem.segments entry: (bit, weight) pairs whose sum is the copies recomputed."""


def _add_one_hot(
    lp: pulp.LpProblem, red: Reduced, x: dict[tuple[int, int], pulp.LpVariable]
) -> None:
    for i, choices in enumerate(red.allowed):
        if len(choices) > 1:
            lp.addConstraint(
                pulp.LpConstraint(
                    pulp.LpAffineExpression([(x[i, s], 1.0) for s in choices]),
                    pulp.LpConstraintEQ,
                    f"onehot_{i}",
                    1.0,
                )
            )


def _add_edge_links(
    lp: pulp.LpProblem, red: Reduced, x: dict[tuple[int, int], pulp.LpVariable], edges: list[int]
) -> dict[tuple[int, int, int], pulp.LpVariable]:
    """Alpa's linearization over grouped strategies; returns the pair variables e[k,g,h]."""
    pair_vars = {}
    for k in edges:
        edge = red.edges[k]
        by_src: list[list[tuple[pulp.LpVariable, float]]] = [
            [(x[edge.src, s], -1.0) for s in group] for group in edge.src_groups
        ]
        by_dst: list[list[tuple[pulp.LpVariable, float]]] = [
            [(x[edge.dst, t], -1.0) for t in group] for group in edge.dst_groups
        ]
        for g, h in sorted(edge.group_cost_s):
            var = pulp.LpVariable(f"e_{k}_{g}_{h}", lowBound=0.0, upBound=1.0)
            pair_vars[k, g, h] = var
            by_src[g].append((var, 1.0))
            by_dst[h].append((var, 1.0))
        for family, rows in (("src", by_src), ("dst", by_dst)):
            for g, terms in enumerate(rows):
                lp.addConstraint(
                    pulp.LpConstraint(
                        pulp.LpAffineExpression(terms),
                        pulp.LpConstraintEQ,
                        f"{family}_{k}_{g}",
                        0.0,
                    )
                )
    return pair_vars


def _add_memory(
    lp: pulp.LpProblem,
    problem: Problem,
    red: Reduced,
    x: dict[tuple[int, int], pulp.LpVariable],
    budget: float | None,
    extra: Sequence[tuple[pulp.LpVariable, float]] = (),
) -> pulp.LpAffineExpression:
    """Transient rows and (with a budget) the memory row; returns the scaled peak expression.
    ``extra`` adds (variable, bytes per unit) terms to the peak (checkpoint segments)."""
    nodes = problem.nodes
    scale = _power_of_two_scale(
        [problem.memory_offset_bytes, budget or 0.0]
        + [c for _, c in extra]
        + [b for n in nodes for b in n.memory_bytes]
        + [b for n in nodes for b in n.transient_bytes]
    )
    fixed_bytes = problem.memory_offset_bytes
    fixed_transient = 0.0
    resident = []
    for i, choices in enumerate(red.allowed):
        if len(choices) == 1:
            fixed_bytes += nodes[i].memory_bytes[choices[0]]
        else:
            resident += [
                (x[i, s], nodes[i].memory_bytes[s] / scale)
                for s in choices
                if nodes[i].memory_bytes[s]
            ]
        transients = (
            [nodes[i].transient_bytes[s] for s in choices] if nodes[i].transient_bytes else []
        )
        if len(set(transients)) == 1:  # the same whatever the choice: a lower bound on T
            fixed_transient = max(fixed_transient, transients[0])
    transient = pulp.LpVariable("transient", lowBound=fixed_transient / scale)
    for i, choices in enumerate(red.allowed):
        transients = (
            [nodes[i].transient_bytes[s] for s in choices] if nodes[i].transient_bytes else []
        )
        if len(choices) > 1 and len(set(transients)) > 1:
            terms = [(x[i, s], -b / scale) for s, b in zip(choices, transients) if b]
            lp.addConstraint(
                pulp.LpConstraint(
                    pulp.LpAffineExpression([(transient, 1.0), *terms]),
                    pulp.LpConstraintGE,
                    f"transient_{i}",
                    0.0,
                )
            )
    peak = pulp.LpAffineExpression([*resident, (transient, 1.0), *((v, c / scale) for v, c in extra)])
    if budget is not None:
        lp.addConstraint(
            pulp.LpConstraint(peak, pulp.LpConstraintLE, "memory", (budget - fixed_bytes) / scale)
        )
    return peak


@dataclass(frozen=True, kw_only=True, slots=True)
class _SegmentRows:
    memory: list[tuple[pulp.LpVariable, float]]
    """(variable, bytes per unit) terms of the peak."""
    time: list[tuple[pulp.LpVariable, float]]
    """(variable, seconds per unit) terms of the objective."""
    bits: tuple[tuple[tuple[pulp.LpVariable, int], ...], ...]
    num_variables: int


def _choice_expr(
    red: Reduced, x: dict[tuple[int, int], pulp.LpVariable], i: int, values, scale: float
) -> pulp.LpAffineExpression:
    """sum_s values[s] x[i,s] / scale; a constant when presolve left node i one strategy."""
    allowed = red.allowed[i]
    if len(allowed) == 1:
        return pulp.LpAffineExpression(constant=values[allowed[0]] / scale)
    return pulp.LpAffineExpression([(x[i, s], values[s] / scale) for s in allowed if values[s]])


def _segment_edge_expr(
    lp: pulp.LpProblem,
    red: Reduced,
    x: dict[tuple[int, int], pulp.LpVariable],
    edge: SegmentEdge,
    scale: float,
    name: str,
    pair_vars: dict[tuple[int, int, int], pulp.LpVariable],
    pair_index: dict[tuple[int, int], int],
) -> tuple[pulp.LpAffineExpression, int]:
    """Forward seconds of a segment edge: linear where one end is fixed; else through the
    model's pair variables e[k,g,h] where the forward cost is constant on each block; else
    one variable z: with X_g (X_h) the indicator of
    the src (dst) strategies of row group g (column group h) of identical costs c[g][h],

        z >= sum_g c[g][h] X_g - M_h (1 - X_h)   for every h,  M_h = max_g c[g][h]

    is exactly z >= c[g*][h*] at the chosen pair (the other rows are <= 0), and z is pushed
    down by the recompute row it feeds. One variable per edge, one row per column group."""
    if edge.src == edge.dst:
        diagonal = [edge.cost_s[s][s] for s in range(len(edge.cost_s))]
        return _choice_expr(red, x, edge.src, diagonal, scale), 0
    src_allowed, dst_allowed = red.allowed[edge.src], red.allowed[edge.dst]
    if len(src_allowed) == 1 or len(dst_allowed) == 1:  # linear in the other end
        if len(src_allowed) == 1:
            row = [edge.cost_s[src_allowed[0]][t] for t in range(len(edge.cost_s[0]))]
            return _choice_expr(red, x, edge.dst, row, scale), 0
        column = [edge.cost_s[s][dst_allowed[0]] for s in range(len(edge.cost_s))]
        return _choice_expr(red, x, edge.src, column, scale), 0
    k = pair_index.get((min(edge.src, edge.dst), max(edge.src, edge.dst)))
    if k is not None:  # the model's pair variables, where the forward cost is constant per block
        pair = red.edges[k]
        flip = pair.src != edge.src
        terms = []
        for (g, h), _ in sorted(pair.group_cost_s.items()):
            values = {
                edge.cost_s[t][s] if flip else edge.cost_s[s][t]
                for s in pair.src_groups[g]
                for t in pair.dst_groups[h]
                if (s, t) in pair.cost_s
            }
            if len(values) != 1:
                break
            if (value := values.pop()) > 0.0:
                terms.append((pair_vars[k, g, h], value / scale))
        else:
            return pulp.LpAffineExpression(terms), 0
    rows_of: dict[tuple, list[int]] = {}
    cols_of: dict[tuple, list[int]] = {}
    for s in src_allowed:
        rows_of.setdefault(tuple(edge.cost_s[s][t] for t in dst_allowed), []).append(s)
    for t in dst_allowed:
        cols_of.setdefault(tuple(edge.cost_s[s][t] for s in src_allowed), []).append(t)

    def indicator(i: int, group: list[int], weight: float) -> list[tuple[pulp.LpVariable, float]]:
        return [] if len(red.allowed[i]) == 1 else [(x[i, s], weight) for s in group]

    z = pulp.LpVariable(f"{name}_z", lowBound=0.0)
    for h, dst_group in enumerate(cols_of.values()):
        costs = [(g, edge.cost_s[g[0]][dst_group[0]] / scale) for g in rows_of.values()]
        big = max(c for _, c in costs)
        if big <= 0.0:
            continue
        terms = [(z, 1.0)]
        constant = 0.0
        for group, c in costs:
            if c:
                if len(red.allowed[edge.src]) == 1:
                    constant += c  # src fixed: its only group is chosen
                else:
                    terms += indicator(edge.src, group, -c)
        if len(red.allowed[edge.dst]) == 1:
            rhs = constant  # dst fixed: X_h = 1
        else:
            terms += indicator(edge.dst, dst_group, -big)
            rhs = constant - big
        lp.addConstraint(
            pulp.LpConstraint(pulp.LpAffineExpression(terms), pulp.LpConstraintGE, f"{name}_{h}", rhs)
        )
    return pulp.LpAffineExpression([(z, 1.0)]), 1


def _add_segments(
    lp: pulp.LpProblem,
    problem: Problem,
    red: Reduced,
    x: dict[tuple[int, int], pulp.LpVariable],
    pair_vars: dict[tuple[int, int, int], pulp.LpVariable] | None,
) -> _SegmentRows:
    """Checkpoint rows (solver/recompute.py). For segment k with L copies, bits b_j (j <
    bit_length(L)) give the copies recomputed r = sum 2^j b_j <= L, and per bit, exactly
    without pair variables (A_k, T_k linear in x; P the peak term):

        f_j <= A_k(x),  f_j <= M_A b_j,  P >= f_j        memory  -= 2^j f_j, += P
        t_j >= T_k(x) - M_T (1 - b_j),  t_j >= 0         time    += 2^j t_j

    Each clique C of overlapping segments: sum_{k in C} r_k lcm/L_k <= lcm (all L_k).
    Without ``pair_vars`` (the minimum-peak model) the time rows are left out."""
    segments = problem.segments
    mem_scale = _power_of_two_scale([b for seg in segments for row in seg.freed_bytes for b in row])
    time_scale = _power_of_two_scale(
        [t for seg in segments for row in seg.recompute_s for t in row]
        + [c for seg in segments for e in seg.edges for row in e.cost_s for c in row]
    )
    peak = pulp.LpVariable("ckpt_peak", lowBound=0.0)
    memory: list[tuple[pulp.LpVariable, float]] = [(peak, mem_scale)]
    time_terms: list[tuple[pulp.LpVariable, float]] = []
    all_bits = []
    num_variables = 1
    pair_index = {(e.src, e.dst): k for k, e in enumerate(red.edges)}
    for k, seg in enumerate(segments):
        freed = pulp.lpSum(
            _choice_expr(red, x, n, row, mem_scale) for n, row in zip(seg.nodes, seg.freed_bytes)
        )
        again = pulp.lpSum(
            _choice_expr(red, x, n, row, time_scale) for n, row in zip(seg.nodes, seg.recompute_s)
        )
        for e, edge in enumerate(seg.edges):
            if pair_vars is None:  # the minimum-peak model prices no time
                break
            expr, num = _segment_edge_expr(
                lp, red, x, edge, time_scale, f"ckpt_{k}_e{e}", pair_vars, pair_index
            )
            again += expr
            num_variables += num
        big_freed = math.fsum(max(row) for row in seg.freed_bytes) / mem_scale
        big_time = (
            math.fsum(max(row) for row in seg.recompute_s)
            + math.fsum(max(max(row) for row in e.cost_s) for e in seg.edges)
        ) / time_scale
        bits = []
        for j in range(seg.copies.bit_length()):
            b = pulp.LpVariable(f"ckpt_b_{k}_{j}", cat=pulp.LpBinary)
            f = pulp.LpVariable(f"ckpt_f_{k}_{j}", lowBound=0.0)
            num_variables += 2
            lp.addConstraint(f - freed <= 0.0, f"ckpt_freed_{k}_{j}")
            lp.addConstraint(f - big_freed * b <= 0.0, f"ckpt_on_{k}_{j}")
            lp.addConstraint(peak - f >= 0.0, f"ckpt_peak_{k}_{j}")
            memory.append((f, -(2**j) * mem_scale))
            bits.append((b, 2**j))
            if pair_vars is not None:
                t = pulp.LpVariable(f"ckpt_t_{k}_{j}", lowBound=0.0)
                num_variables += 1
                lp.addConstraint(t - again - big_time * b >= -big_time, f"ckpt_time_{k}_{j}")
                time_terms.append((t, 2**j * time_scale))
        count = pulp.LpAffineExpression([(b, float(w)) for b, w in bits])
        if seg.copies < 2 ** len(bits) - 1:
            lp.addConstraint(count <= seg.copies, f"ckpt_copies_{k}")
        if seg.min_copies:
            lp.addConstraint(count >= seg.min_copies, f"ckpt_min_{k}")
        all_bits.append(tuple(bits))
    for c, clique in enumerate(conflict_cliques(segments)):
        lcm = math.lcm(*(segments[k].copies for k in clique))
        lp.addConstraint(
            pulp.LpAffineExpression(
                [(b, float(w * (lcm // segments[k].copies))) for k in clique for b, w in all_bits[k]]
            )
            <= lcm,
            f"ckpt_overlap_{c}",
        )
    return _SegmentRows(
        memory=memory, time=time_terms, bits=tuple(all_bits), num_variables=num_variables
    )


def _decode_recomputed(model: _Model) -> tuple[int, ...]:
    return tuple(
        sum(w for b, w in bits if (b.varValue or 0.0) > 0.5) for bits in model.segment_bits
    )


def _build(problem: Problem, red: Reduced, *, minimise_peak: bool) -> _Model:
    """The time model (with the budget row if any) or the minimum-peak model (no budget)."""
    lp = pulp.LpProblem("autopar_peak" if minimise_peak else "autopar_time", pulp.LpMinimize)
    x = {
        (i, s): pulp.LpVariable(f"x_{i}_{s}", cat=pulp.LpBinary)
        for i, choices in enumerate(red.allowed)
        if len(choices) > 1
        for s in choices
    }
    _add_one_hot(lp, red, x)
    if minimise_peak:  # edges whose pairs are all allowed cannot change the peak
        pair_vars = _add_edge_links(
            lp, red, x, [k for k, e in enumerate(red.edges) if not e.all_pairs_allowed]
        )
        seg = _add_segments(lp, problem, red, x, None) if problem.segments else None
        seg_memory = seg.memory if seg else []
        seg_bits = seg.bits if seg else ()
        seg_variables = seg.num_variables if seg else 0
        lp.setObjective(_add_memory(lp, problem, red, x, None, seg_memory))
        return _Model(
            lp=lp,
            x=x,
            objective_scale=1.0,
            num_variables=len(x) + len(pair_vars) + 1 + seg_variables,
            segment_bits=seg_bits,
        )
    pair_vars = _add_edge_links(lp, red, x, list(range(len(red.edges))))
    seg = _add_segments(lp, problem, red, x, pair_vars) if problem.segments else None
    seg_memory = seg.memory if seg else []
    seg_bits = seg.bits if seg else ()
    num_variables = len(x) + len(pair_vars) + (seg.num_variables if seg else 0)
    if problem.memory_budget_bytes is not None:
        _add_memory(lp, problem, red, x, problem.memory_budget_bytes, seg_memory)
        num_variables += 1
    terms = [
        (x[i, s], c)
        for i, costs in enumerate(red.node_cost_s)
        if len(costs) > 1
        for s, c in costs.items()
    ]
    terms += [(var, red.edges[k].group_cost_s[g, h]) for (k, g, h), var in pair_vars.items()]
    if seg:
        terms += seg.time
    scale = _power_of_two_scale([c for _, c in terms])
    lp.setObjective(pulp.LpAffineExpression([(v, c / scale) for v, c in terms if c]))
    return _Model(
        lp=lp, x=x, objective_scale=scale, num_variables=num_variables, segment_bits=seg_bits
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
            raise RuntimeError(f"{backend} stopped without a plan: {pulp.LpStatus[lp.status]}")
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


def _resolve_backend(backend: str) -> tuple[str, bool]:
    """The backend to use and whether HiGHS was asked for but is unavailable."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown solver backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "highs" and not pulp.HiGHS().available():
        return "cbc", True
    return backend, False


def solve(
    problem: Problem,
    *,
    backend: str = "highs",
    time_limit_s: float | None = None,
    gap: float = 0.0,
    msg: bool = False,
) -> Solution:
    """Choose one strategy per node, minimising step time within the memory budget.

    Args:
        problem: the nodes, edges and budget.
        backend: "highs" (falls back to "cbc" when highspy is missing; Solution.backend and
            details["highs_unavailable"] say so) or "cbc".
        time_limit_s: stop after this many seconds with the best plan found (status 'feasible').
        gap: relative gap at which the search may stop; 0 proves optimality.
        msg: show the solver's log.

    Raises:
        InfeasibleBudgetError: no allowed plan fits the budget; carries the smallest that fits.
        InfeasibleError: the edges' forbidden pairs rule out every combination.
        SolverTimeoutError: the time limit ran out before any plan was found.
    """
    if gap < 0.0:
        raise ValueError(f"gap must be >= 0, got {gap}")
    if time_limit_s is not None and time_limit_s <= 0.0:
        raise ValueError(f"time_limit_s must be positive or None, got {time_limit_s}")
    if problem.segments:
        validate_segments(problem)
        if problem.memory_budget_bytes is None and not any(
            seg.min_copies for seg in problem.segments
        ):  # recomputing only costs time: without a budget nothing is recomputed
            inner = solve(
                dataclasses.replace(problem, segments=()),
                backend=backend,
                time_limit_s=time_limit_s,
                gap=gap,
                msg=msg,
            )
            return dataclasses.replace(inner, recomputed=(0,) * len(problem.segments))
    if problem.memory_budget_bytes is None and problem.edges and not problem.segments:
        validate(problem)
        start = time.perf_counter()
        elim = eliminate(problem)
        if len(elim.kept) < len(problem.nodes):
            return _solve_eliminated(
                problem,
                elim,
                time.perf_counter() - start,
                backend=backend,
                time_limit_s=time_limit_s,
                gap=gap,
                msg=msg,
            )
    if problem.tied:
        validate(problem)
        if problem.memory_budget_bytes is not None and backend == "highs":
            counted = _solve_counts(problem, time_limit_s=time_limit_s, gap=gap, msg=msg)
            if counted is not None:
                return counted
        return _solve_tied(problem, backend=backend, time_limit_s=time_limit_s, gap=gap, msg=msg)
    return _solve_model(problem, backend=backend, time_limit_s=time_limit_s, gap=gap, msg=msg)


def _solve_model(
    problem: Problem, *, backend: str, time_limit_s: float | None, gap: float, msg: bool
) -> Solution:
    """Presolve, build and run the ILP (the module docstring's model)."""
    backend, fell_back = _resolve_backend(backend)
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
    return Solution(
        choices=choices,
        objective_s=objective,
        bound_s=bound,
        gap=0.0 if relative_gap < _ZERO_GAP else relative_gap,
        status=outcome.status,
        backend=backend,
        peak_memory_bytes=plan_peak_memory_bytes(problem, choices, recomputed),
        num_variables=model.num_variables,
        num_constraints=model.num_constraints if direct else len(model.lp.constraints),
        build_s=built - start,
        solve_s=solved - built,
        details=details,
        recomputed=recomputed,
    )


def _solve_eliminated(
    problem: Problem,
    elim: Eliminated,
    eliminate_s: float,
    *,
    backend: str,
    time_limit_s: float | None,
    gap: float,
    msg: bool,
) -> Solution:
    """Solve what elimination (solver/eliminate.py) left and substitute back."""
    if elim.problem.nodes:
        solve_next = _solve_tied if elim.problem.tied else _solve_model
        inner = solve_next(
            elim.problem, backend=backend, time_limit_s=time_limit_s, gap=gap, msg=msg
        )
    else:
        inner = Solution(
            choices=(),
            objective_s=0.0,
            bound_s=0.0,
            gap=0.0,
            status="optimal",
            backend=_resolve_backend(backend)[0],
            peak_memory_bytes=0.0,
            num_variables=0,
            num_constraints=0,
            build_s=0.0,
            solve_s=0.0,
        )
    choices = back_substitute(elim, inner.choices)
    objective = plan_objective_s(problem, choices)
    details = dict(inner.details)
    details["eliminated_nodes"] = float(len(problem.nodes) - len(elim.kept))
    return dataclasses.replace(
        inner,
        choices=choices,
        objective_s=objective,
        bound_s=min(objective, inner.bound_s + elim.constant_s),
        peak_memory_bytes=plan_peak_memory_bytes(problem, choices),
        build_s=inner.build_s + eliminate_s,
        details=details,
    )


def _solve_counts(
    problem: Problem, *, time_limit_s: float | None, gap: float, msg: bool
) -> Solution | None:
    """Tie classes under a budget as counts per strategy (solver/tying.py solve_counts): the
    members of a class may choose differently. A mixed plan further than tying.ACCEPT_GAP
    from the counts bound is compared with the classes forced alike and the better kept; the
    bound reported is the counts bound, a lower bound on the untied optimum. None when the
    counts model does not apply (the caller forces the classes alike)."""
    if problem.segments or not highs_direct.supports(problem):
        return None  # segments: the classes are forced alike (tying.solve_counts docstring)
    out = solve_counts(problem, time_limit_s=time_limit_s, gap=gap, msg=msg)
    if out is None:
        return None
    choices, objective = out.choices, out.objective_s
    details = {"counts_mixed_classes": float(out.mixed_classes), "tied_classes": float(len(problem.tied))}
    build_s, solve_s = out.build_s, out.solve_s
    if out.mixed_classes and (choices is None or objective > out.bound_s + _ZERO_GAP * abs(objective)):
        # The best plan whose members take only their class's strategies (a small ILP: the
        # other nodes are fixed); the realised counts are one of its points.
        keep = out.used
        if choices is not None:
            keep = tuple(k if len(k) > 1 else (c,) for k, c in zip(keep, choices, strict=True))
        try:
            inner = _solve_model(
                restrict(problem, keep), backend="highs", time_limit_s=time_limit_s, gap=gap, msg=msg
            )
        except InfeasibleError:
            inner = None
        if inner is not None:
            realised = tuple(k[c] for k, c in zip(keep, inner.choices, strict=True))
            value = plan_objective_s(problem, realised)
            build_s += inner.build_s
            solve_s += inner.solve_s
            details["counts_realised_by_ilp"] = 1.0
            if choices is None or value < objective:
                choices, objective = realised, value
    if choices is None or (out.mixed_classes and objective > out.bound_s + ACCEPT_GAP * abs(objective)):
        forced = _solve_tied(problem, backend="highs", time_limit_s=time_limit_s, gap=gap, msg=msg)
        build_s += forced.build_s
        solve_s += forced.solve_s
        details["counts_forced_compared"] = 1.0
        if choices is None or forced.objective_s < objective:
            choices, objective = forced.choices, forced.objective_s
    relative_gap = (objective - out.bound_s) / abs(objective) if objective else 0.0
    return Solution(
        choices=choices,
        objective_s=objective,
        bound_s=min(out.bound_s, objective),
        gap=0.0 if relative_gap < _ZERO_GAP or out.bound_s >= objective else relative_gap,
        status=out.status,
        backend="highs",
        peak_memory_bytes=plan_peak_memory_bytes(problem, choices),
        num_variables=out.num_variables,
        num_constraints=out.num_constraints,
        build_s=build_s,
        solve_s=solve_s,
        details=details,
    )


def _solve_tied(
    problem: Problem, *, backend: str, time_limit_s: float | None, gap: float, msg: bool
) -> Solution:
    """Solve the contracted problem (solver/tying.py) and expand its choices to every node."""
    start = time.perf_counter()
    contracted = contract(problem)
    inner_problem = contracted.problem
    groups: tuple[tuple[int, ...], ...] = ()
    if problem.segments:  # L identical layers' segments become one with L copies
        segments, groups = contract_segments(problem, contracted.node_map)
        inner_problem = dataclasses.replace(inner_problem, segments=segments)
    contract_s = time.perf_counter() - start
    # Contraction turns a node shared by every layer (RoPE tables) into a leaf: eliminate again.
    inner = solve(inner_problem, backend=backend, time_limit_s=time_limit_s, gap=gap, msg=msg)
    choices = expand(contracted, inner.choices)
    recomputed = (
        expand_recomputed(problem, groups, inner.recomputed) if problem.segments else ()
    )
    objective = plan_objective_s(problem, choices, recomputed)
    bound = min(objective, inner.bound_s)
    details = dict(inner.details)
    details["tied_classes"] = float(len(problem.tied))
    details["tied_nodes"] = float(sum(len(c) for c in problem.tied))
    details["contracted_nodes"] = float(len(contracted.problem.nodes))
    details["contracted_edges"] = float(len(contracted.problem.edges))
    return dataclasses.replace(
        inner,
        choices=choices,
        objective_s=objective,
        bound_s=bound,
        gap=inner.gap,  # the same plan's objective, summed in another order
        peak_memory_bytes=plan_peak_memory_bytes(problem, choices, recomputed),
        recomputed=recomputed,
        build_s=inner.build_s + contract_s,
        details=details,
    )


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
