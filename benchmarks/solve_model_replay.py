"""Where a plan's seconds go, and the ILP model calls (presolve, build, HiGHS) replayed.

    python benchmarks/solve_model_replay.py phases plan llama-8l-2048 --mesh 2x4 --budget 2549919748 --no-cache
    python benchmarks/solve_model_replay.py record calls.pkl plan gpt2-small-2l --mesh 2x2 --budget 1.5GiB --no-cache
    PYTHONPATH=TREE python benchmarks/solve_model_replay.py replay calls.pkl answers-TREE.pkl

``phases`` runs the CLI with wrappers round the planner's and solver's stages and prints the
CPU seconds of each (inclusive: a stage called inside another counts in both; a recursive
call counts once) and its number of calls. ``record`` pickles every ``solve_model`` call that
``solver/shrink.py`` makes (the priced budget-free LPs of the relaxation, the budget-free and
fixed MIPs; torch-free problems). ``replay`` solves them again with the solver on PYTHONPATH,
prints the CPU seconds and pickles the answers (status, choices, recomputed copies,
objective, bound, gap, variables, or the error's text), which ``cmp`` compares exactly.
"""

from __future__ import annotations

import collections
import importlib
import pickle
import sys
import time

STAGES = (  # (module, function, modules that imported it by name)
    ("solver", "solve", ()),
    ("solver.lagrangian", "relax", ("solver.budgeted",)),
    ("solver.shrink", "solve", ()),
    ("solver.ilp", "solve_model", ("solver.shrink",)),
    ("solver.presolve", "reduce_problem", ("solver.ilp",)),
    ("solver.highs_direct", "build", ()),
    ("solver.highs_direct", "run", ()),
    ("solver.eliminate", "eliminate", ("solver.shrink",)),
    ("solver.lagrangian", "fit_recompute", ()),
    ("solver.pattern_bounds", "pattern_terms", ("solver.lagrangian",)),
    ("autopar.presets", "build_preset", ()),
    ("autopar.capture.export", "capture", ("autopar.api",)),
    ("autopar.planner.space", "build_space", ("autopar.api", "autopar.planner.driver")),
    ("autopar.planner.checkpointing", "candidate_segments", ("autopar.planner.configurations",)),
    ("autopar.planner.problem", "build_problem", ("autopar.planner.configurations",)),
)


def phases(argv: list[str]) -> None:
    seconds: collections.Counter[str] = collections.Counter()
    calls: collections.Counter[str] = collections.Counter()

    def wrapped(label: str, fn):
        active = [False]

        def run(*args, **kwargs):
            if active[0]:
                return fn(*args, **kwargs)
            active[0] = True
            start = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[label] += time.process_time() - start
                calls[label] += 1
                active[0] = False

        return run

    start = time.process_time()
    from autopar.tools.cli import main

    for name, attr, users in STAGES:
        module = importlib.import_module(name)
        fn = getattr(module, attr)
        run = wrapped(f"{name}.{attr}", fn)
        setattr(module, attr, run)
        for user in users:
            other = importlib.import_module(user)
            if getattr(other, attr, None) is fn:
                setattr(other, attr, run)
    try:
        main(argv)
    finally:
        seconds["the whole command, in process"] = time.process_time() - start
        for label, s in seconds.most_common():
            print(f"{label:50s} {s:8.3f} s CPU  {calls[label]:5d} calls", file=sys.stderr)


def record(out: str, argv: list[str]) -> None:
    import solver.shrink as shrink
    from autopar.tools.cli import main

    recorded = []
    solve_model = shrink.solve_model

    def solve_recorded(problem, **options):
        recorded.append((problem, options))
        return solve_model(problem, **options)

    shrink.solve_model = solve_recorded
    try:
        main(argv)
    finally:
        with open(out, "wb") as f:
            pickle.dump(recorded, f)
        print(f"{len(recorded)} solve_model calls recorded in {out}")


def replay(calls_path: str, out: str) -> None:
    from solver.ilp import solve_model

    with open(calls_path, "rb") as f:
        recorded = pickle.load(f)
    answers = []
    start = time.process_time()
    for problem, options in recorded:
        try:
            s = solve_model(problem, **options)
            answers.append(
                (
                    s.status,
                    s.choices,
                    s.recomputed,
                    s.objective_s,
                    s.bound_s,
                    s.gap,
                    s.num_variables,
                )
            )
        except Exception as e:  # a budget no plan fits is an answer too
            answers.append(f"{type(e).__name__}: {e}")
    print(f"{len(recorded)} calls: {time.process_time() - start:.3f} s CPU")
    with open(out, "wb") as f:
        pickle.dump(answers, f)


def compare(a_path: str, b_path: str) -> None:
    with open(a_path, "rb") as f:
        a = pickle.load(f)
    with open(b_path, "rb") as f:
        b = pickle.load(f)
    same = sum(x == y for x, y in zip(a, b, strict=True))
    print(f"{same} of {len(a)} answers identical")


if __name__ == "__main__":
    command, rest = sys.argv[1], sys.argv[2:]
    if command == "phases":
        phases(rest)
    elif command == "record":
        record(rest[0], rest[1:])
    elif command == "replay":
        replay(rest[0], rest[1])
    elif command == "cmp":
        compare(rest[0], rest[1])
    else:
        raise SystemExit(f"unknown command {command!r}: phases, record, replay or cmp")
