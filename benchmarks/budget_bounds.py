"""The Lagrangian bound per budgeted ZeRO configuration: node by node vs per recompute pattern.

    python benchmarks/budget_bounds.py                       # gpt2-small-2l, 2x2, 1.5 GiB
    python benchmarks/budget_bounds.py --model gpt2-small-2l --mesh 2x2 --budget 1.5GiB
    python benchmarks/budget_bounds.py --fixing    # also reduced-cost fixing and the MIP after it

For every ZeRO configuration whose budget-free plan does not fit, the budgeted problem the
driver solves is relaxed twice (solver/lagrangian.py relax): with the separable segment term
only (``max_pattern_evaluations=0``, the bound before the pattern D) and with the pattern D
after it (the default). Printed: the bound, the best plan the relaxation found, its gap, the
budget-free solves and the seconds each took. No MIP is run: see the README section
"Stronger bounds and cutoffs" for what the planner does with these bounds.
"""

from __future__ import annotations

import argparse
import time

from autopar.capture.export import capture
from autopar.mesh import Mesh
from autopar.options import PlanOptions
from autopar.planner.driver import Driver
from autopar.planner.space import build_space
from autopar.planner.zero_choice import zero_candidates
from autopar.presets import build_preset
from solver import solve
from solver.fixing import fix, restrict_budgeted
from solver.lagrangian import recompute_patterns, relax


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt2-small-2l")
    parser.add_argument("--mesh", default="2x2")
    parser.add_argument("--budget", default="1.5GiB")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--fixing", action="store_true", help="also reduced-cost fixing + MIP")
    args = parser.parse_args()
    model, example_args, example_kwargs = build_preset(args.model, batch=args.batch, seq=args.seq)
    mesh = Mesh.parse(args.mesh, device="h100")
    options = PlanOptions(memory_budget=args.budget)
    driver = Driver(build_space(capture(model, example_args, example_kwargs), mesh, options))
    solves = [0]

    def solve_free(problem):
        solves[0] += 1
        sol = solve(problem)
        return sol.choices, sol.objective_s, sol.bound_s

    print("zero config       patterns  D          bound_s    plan_s     gap     solves  seconds")
    for zero in zero_candidates(mesh.ndim, mesh.shape):
        free = driver.configurations.solve(zero, name="auto", budget=None)
        if free.evaluation.peak_memory_bytes <= driver.budget:
            continue
        _, problem = driver.configurations._prepare(
            zero, budget=driver.budget, spec=None, tied=driver.tied
        )
        patterns = recompute_patterns(problem)
        for label, extra in (("separable", 0), ("pattern", 8)):
            solves[0] = 0
            start = time.perf_counter()
            found = relax(problem, solve_free, target_gap=0.01, max_pattern_evaluations=extra)
            seconds = time.perf_counter() - start
            gap = (found.objective_s - found.bound_s) / found.objective_s
            print(
                f"{zero.label(mesh.axis_names):<17} {len(patterns or ()):>8}  {label:<9}  "
                f"{found.bound_s:.7f}  {found.objective_s:.7f}  {gap:6.2%}  {solves[0]:>6}  "
                f"{seconds:7.2f}",
                flush=True,
            )
        if args.fixing:
            _fixing_row(problem, found, patterns)


def _fixing_row(problem, found, patterns) -> None:
    """Reduced-cost fixing (solver/fixing.py) at the relaxation's multiplier against its best
    plan, and the MIP at gap 0.01 over what stays vs over everything (budgeted.solve_relaxed
    runs the first)."""
    start = time.perf_counter()
    keep = fix(problem, found.multiplier, found.choices, found.objective_s, patterns)
    fix_s = time.perf_counter() - start
    plan = tuple(k.index(c) for k, c in zip(keep, found.choices, strict=True))
    start = time.perf_counter()
    fixed = solve(restrict_budgeted(problem, keep), gap=0.01, relax_first=False, start_plan=plan)
    fixed_s = time.perf_counter() - start
    start = time.perf_counter()
    whole = solve(problem, gap=0.01, relax_first=False, start_plan=found.choices)
    whole_s = time.perf_counter() - start
    kept = sum(len(k) for k in keep)
    total = sum(n.num_choices for n in problem.nodes)
    print(
        f"  fixing: {kept}/{total} strategies kept ({fix_s:.2f} s); MIP over them "
        f"{fixed.num_variables} variables, {fixed.objective_s:.7f} (bound {fixed.bound_s:.7f}) "
        f"{fixed_s:.2f} s; over all {whole.num_variables} variables, {whole.objective_s:.7f} "
        f"(bound {whole.bound_s:.7f}) {whole_s:.2f} s",
        flush=True,
    )


if __name__ == "__main__":
    main()
