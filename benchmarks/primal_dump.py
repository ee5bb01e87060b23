"""Dump a row's budgeted problems, one per ZeRO configuration, with each configuration's
budget-free plan, for solver/primal.py to be tried on without planning again.

    python benchmarks/primal_dump.py OUT.pkl llama3-70b --mesh 8x16x8 --device h100 \
        --budget 80GiB --batch 256 --seq 8192 [--mixed-precision bf16]
    python benchmarks/primal_dump.py --try OUT.pkl      # the primal heuristic on each, timed

OUT.pkl: a list of (stages, budgeted solver.Problem, budget-free choices, budget-free bound s)
pickled together (the configurations share edges and segments). This machine's own file:
load only those.
"""

import pickle
import sys
import time


def dump(out: str, argv: list[str]) -> None:
    from autopar.capture.export import capture
    from autopar.options import PlanOptions
    from autopar.planner.driver import Driver
    from autopar.planner.space import build_space
    from autopar.planner.zero_choice import zero_candidates
    from autopar.presets import build_preset
    from autopar.tools.cli import _build_mesh, build_parser

    args = build_parser().parse_args(["plan", *argv])
    mesh = _build_mesh(args)
    options = PlanOptions(memory_budget=args.budget, mixed_precision=args.mixed_precision)
    m, a, k = build_preset(args.model, batch=args.batch, seq=args.seq)
    d = Driver(build_space(capture(m, a, k, check_splice=False), mesh, options))
    c = d.configurations
    rows = []
    for zero in zero_candidates(mesh.ndim, mesh.shape):
        t = time.perf_counter()
        free = c.solve(zero, name="auto", budget=None)
        problem = c.budgeted_problem(zero, d.budget)
        rows.append((zero.stages, problem, free.choice, free.solution.bound_s))
        print(
            zero.stages,
            f"free {free.solution.bound_s * 1e3:.3f} ms",
            f"{time.perf_counter() - t:.1f} s",
            flush=True,
        )
        c.release()
    with open(out, "wb") as f:
        pickle.dump(rows, f, protocol=pickle.HIGHEST_PROTOCOL)


def try_primal(path: str) -> None:
    from solver.primal import best_fit, search

    with open(path, "rb") as f:
        rows = pickle.load(f)
    low = min(r[3] for r in rows)
    print(f"lowest budget-free bound {low * 1e3:.3f} ms; closes at {low / 0.99 * 1e3:.3f} ms")
    plans = [r[2] for r in rows]
    for stages, problem, _, bound in rows:
        t = time.perf_counter()
        first = best_fit(problem, plans)
        t1 = time.perf_counter()
        best = search(problem, plans)
        t2 = time.perf_counter()
        print(
            f"{stages}: budget-free bound {bound * 1e3:.3f} ms; best fit "
            f"{'none' if first is None else f'{first.objective_s * 1e3:.3f} ms'} ({t1 - t:.1f} s); "
            f"search {'none' if best is None else f'{best.objective_s * 1e3:.3f} ms'} "
            f"({t2 - t1:.1f} s)",
            flush=True,
        )


if __name__ == "__main__":
    if sys.argv[1] == "--try":
        try_primal(sys.argv[2])
    else:
        dump(sys.argv[1], sys.argv[2:])
