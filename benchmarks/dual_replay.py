"""Replay the dual side of a budget-bound row on pickled problems: the budget-free solve, the
pattern D at one multiplier (solver.budgeted.priced_bound, as a configuration is bounded), the
cost of hashing the whole problem, and how many pruning products recur across the priced solves.

    python benchmarks/dual_replay.py build DIR llama3-70b --mesh 8x16x8 --device h100 \\
        --budget 80GiB --batch 256 --seq 8192       # DIR/222.pkl, DIR/332.pkl + hash(problem) CPU
    python benchmarks/dual_replay.py free DIR/222.pkl          # budget-free solve, CPU s
    python benchmarks/dual_replay.py bound DIR/222.pkl 2.064e-11   # pattern D there, CPU s
    python benchmarks/dual_replay.py repeats DIR/222.pkl 2.064e-11 # products formed again

The pickles are this machine's own files; load only those. Run each tree with its own
PYTHONPATH, from its root, base and branch alternated (README: timing rules).
"""

from __future__ import annotations

import dataclasses
import hashlib
import pickle
import resource
import sys
import time

CONFIGURATIONS = [(2, 2, 2), (3, 3, 2)]


def build(folder: str, argv: list[str]) -> None:
    from autopar.capture.export import capture
    from autopar.options import PlanOptions
    from autopar.planner.driver import Driver
    from autopar.planner.problem import ZeroConfig
    from autopar.planner.space import build_space
    from autopar.presets import build_preset
    from autopar.tools.cli import _build_mesh, build_parser

    args = build_parser().parse_args(["plan", *argv])
    options = PlanOptions(memory_budget=args.budget, mixed_precision=args.mixed_precision)
    model, inputs, kwargs = build_preset(args.model, batch=args.batch, seq=args.seq)
    captured = capture(model, inputs, kwargs, check_splice=False)
    driver = Driver(build_space(captured, _build_mesh(args), options))
    for stages in CONFIGURATIONS:
        problem = driver.configurations.budgeted_problem(ZeroConfig(stages=stages), driver.budget)
        with open(f"{folder}/{''.join(map(str, stages))}.pkl", "wb") as f:
            pickle.dump(problem, f, protocol=5)
        for part in ("problem", "edges", "segments", "nodes"):
            whole = problem if part == "problem" else getattr(problem, part)
            clock = time.process_time()
            hash(whole)
            print(f"{stages} hash({part}): {time.process_time() - clock:.2f} s CPU", flush=True)


def repeats(problem, lam: float) -> str:
    """priced_bound with every product pruning and elimination form digested: how many were
    formed before (the series memo had let them go) and their series_min CPU."""
    import solver.eliminate as eliminate
    from solver.budgeted import priced_bound

    product, seen, counts = eliminate.series_min, set(), [0, 0, 0.0, 0.0]

    def digested(uv, cv, vw):
        digest = hashlib.sha1(repr((uv.shape, vw.shape)).encode())
        for array in (uv, cv, vw):
            digest.update(array.tobytes())
        clock = time.process_time()
        out = product(uv, cv, vw)
        spent = time.process_time() - clock
        again = digest.digest() in seen
        seen.add(digest.digest())
        counts[0] += 1
        counts[1] += again
        counts[2] += spent
        counts[3] += spent if again else 0.0
        return out

    eliminate.series_min = digested
    bound = priced_bound(problem, lam)
    return (
        f"{bound}; {counts[0]:,} products formed, {counts[1]:,} of them formed before; "
        f"series_min {counts[2]:.1f} s CPU, {counts[3]:.1f} s on those"
    )


def main() -> None:
    what = sys.argv[1]
    if what == "build":
        build(sys.argv[2], sys.argv[3:])
        return
    import solver
    from solver.budgeted import priced_bound

    with open(sys.argv[2], "rb") as f:
        problem = pickle.load(f)
    clock = time.process_time()
    if what == "free":
        sol = solver.solve(dataclasses.replace(problem, memory_budget_bytes=None), gap=0.01)
        plan = hashlib.sha1(repr(sol.choices).encode()).hexdigest()[:12]
        out = f"objective {sol.objective_s!r}, bound {sol.bound_s!r}, plan {plan}"
    elif what == "bound":
        out = f"(bound, step of a plan that fits) {priced_bound(problem, float(sys.argv[3]))}"
    else:
        out = repeats(problem, float(sys.argv[3]))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    print(f"{what}: {out}; {time.process_time() - clock:.1f} s CPU, max RSS {rss:.2f} GB")


if __name__ == "__main__":
    main()
