"""Record every ILP a plan solves, solve them again with another tree's solver, compare.

    python benchmarks/solve_record.py record calls.pkl plan llama3-8b --mesh 8x8 ...  # autopar CLI
    PYTHONPATH=TREE python benchmarks/solve_record.py solve calls.pkl answers-TREE.pkl
    python benchmarks/solve_record.py compare answers-A.pkl answers-B.pkl
    PYTHONPATH=TREE python benchmarks/solve_record.py budgeted calls.pkl   # the budgeted calls

``record`` runs the CLI with the planner's ``solver.solve`` and ``solve_all`` wrapped (each
problem and its options pickled; solver problems are torch-free). ``solve`` answers each
recorded call in this process with the solver found on PYTHONPATH and prints its CPU seconds.
``compare`` prints, per call, whether status, choices, recomputed copies, objective, bound and
gap are identical (floats compared exactly) and both CPU times. ``budgeted`` solves again
only the calls with a budget and checkpoint segments and prints, per call, the priced
budget-free solves of the relaxation (``relaxation=True``), its evaluations, the result and
whether a MIP ran: counts that do not depend on the machine's load.
"""

from __future__ import annotations

import pickle
import sys
import time


def record(out: str, argv: list[str]) -> None:
    import autopar.planner.configurations as configurations
    from autopar.tools.cli import main

    calls = []
    solve, solve_all = configurations.solver.solve, configurations.solve_all

    def solve_recorded(problem, **options):
        calls.append((problem, options))
        return solve(problem, **options)

    def solve_all_recorded(problems, **options):
        kept = {k: v for k, v in options.items() if k not in ("workers", "return_exceptions")}
        calls.extend((problem, kept) for problem in problems)
        return solve_all(problems, **options)

    configurations.solver.solve = solve_recorded
    configurations.solve_all = solve_all_recorded
    try:
        main(argv)
    finally:
        with open(out, "wb") as f:
            pickle.dump(calls, f)
        print(f"{len(calls)} calls recorded in {out}")


def answer(calls_path: str, out: str) -> None:
    import solver

    with open(calls_path, "rb") as f:
        calls = pickle.load(f)
    answers = []
    for problem, options in calls:
        start = time.process_time()
        try:
            sol = solver.solve(problem, **options)
            result = (
                sol.status,
                sol.choices,
                sol.recomputed,
                sol.objective_s,
                sol.bound_s,
                sol.gap,
            )
        except Exception as error:  # noqa: BLE001 - the error is the answer to compare
            result = ("raise", type(error).__name__, str(error))
        answers.append((result, time.process_time() - start))
    with open(out, "wb") as f:
        pickle.dump(answers, f)
    print(f"{out}: {len(answers)} calls, {sum(t for _, t in answers):.2f} s CPU")


def compare(a_path: str, b_path: str) -> None:
    with open(a_path, "rb") as f:
        a = pickle.load(f)
    with open(b_path, "rb") as f:
        b = pickle.load(f)
    same = 0
    for k, ((x, tx), (y, ty)) in enumerate(zip(a, b, strict=True)):
        same += x == y
        print(f"call {k}: {'identical' if x == y else 'DIFFERENT'}  CPU {tx:.2f} vs {ty:.2f} s")
    print(
        f"{same} of {len(a)} identical; CPU {sum(t for _, t in a):.2f} vs {sum(t for _, t in b):.2f} s"
    )


def budgeted(calls_path: str) -> None:
    import solver
    import solver.shrink as shrink

    with open(calls_path, "rb") as f:
        calls = pickle.load(f)
    solve, count = shrink.solve, [0]

    def counted(problem, **options):
        count[0] += bool(options.get("relaxation"))
        return solve(problem, **options)

    shrink.solve = counted
    for k, (problem, options) in enumerate(calls):
        if problem.memory_budget_bytes is None or not problem.segments:
            continue
        count[0] = 0
        try:
            sol = solver.solve(problem, **options)
        except solver.InfeasibleError as error:
            print(f"call {k}: {type(error).__name__}")
            continue
        d = sol.details
        print(
            f"call {k}: {count[0]} priced solves, {int(d.get('lagrangian_solves', 0))} "
            f"evaluations, {sol.objective_s * 1e3:.4f} ms, bound {sol.bound_s * 1e3:.4f} ms, "
            f"gap {sol.gap:.3%}, cut off {sol.cut_off}, MIP {'lagrangian_then_mip' in d}"
        )


if __name__ == "__main__":
    command, args = sys.argv[1], sys.argv[2:]
    if command == "record":
        record(args[0], args[1:])
    elif command == "solve":
        answer(args[0], args[1])
    elif command == "compare":
        compare(args[0], args[1])
    elif command == "budgeted":
        budgeted(args[0])
    else:
        raise SystemExit(
            "usage: solve_record.py record|solve|compare|budgeted ... (see the docstring)"
        )
