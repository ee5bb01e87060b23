"""Replay the Lagrangian relaxation (solver/lagrangian.py relax) on the budgeted problems a
plan command solves, counting priced solves, recompute fits and CPU seconds.

    python benchmarks/relax_replay.py dump DIR plan llama3-70b --mesh 8x16x8 --device h100 \\
        --budget 80GiB --batch 256 --seq 8192 --no-cache      # pickles every solver.solve input
    python benchmarks/relax_replay.py replay DIR/p20.pkl     # relax(problem, target_gap=0.01)
    python benchmarks/relax_replay.py solve DIR/p20.pkl ...  # solver.solve(problem, **as dumped)
    python benchmarks/relax_replay.py products DIR/p20.pkl OUT.pkl 300   # record min-plus products
    python benchmarks/relax_replay.py minplus OUT.pkl        # plain loop vs solver.minplus, timed

``dump`` runs ``autopar`` with ``solver.solve`` wrapped: each top-level call's problem goes to
DIR/p<k>.pkl (k counts every call, nested ones too), and one line per call to stderr. The
pickles are this machine's own files; load only those.
"""

from __future__ import annotations

import hashlib
import pickle
import runpy
import sys
import time

import solver
import solver.lagrangian as lagrangian
import solver.shrink as shrink
from solver.presolve import plan_objective_s


def dump(folder: str, argv: list[str]) -> None:
    original, count, depth = shrink.solve, [0], [0]

    def wrapped(problem, **kwargs):
        k, top = count[0], depth[0] == 0
        count[0] += 1
        depth[0] += 1
        if top:
            with open(f"{folder}/p{k}.pkl", "wb") as f:
                pickle.dump((problem, kwargs), f)
        clock = time.process_time()
        try:
            out = original(problem, **kwargs)
        finally:
            depth[0] -= 1
        if top:
            print(
                f"[dump] p{k} budget={problem.memory_budget_bytes} -> {out.status} "
                f"{out.objective_s:.6f} cpu {time.process_time() - clock:.2f} s",
                file=sys.stderr,
                flush=True,
            )
        return out

    shrink.solve = solver.solve = wrapped
    sys.argv = ["autopar", *argv]
    runpy.run_module("autopar", run_name="__main__")


def replay(path: str) -> None:
    with open(path, "rb") as f:
        problem, _ = pickle.load(f)
    fit, fits = lagrangian.fit_recompute, [0, 0.0]

    def timed_fit(p, choices):
        clock = time.process_time()
        out = fit(p, choices)
        fits[0] += 1
        fits[1] += time.process_time() - clock
        return out

    def solve_free(priced):
        sol = solver.solve(priced)
        # The pattern phase over count patterns solves the contracted problem: no plan here.
        plain = (
            f"{plan_objective_s(problem, sol.choices):.6f}"
            if len(sol.choices) == len(problem.nodes)
            else "(contracted)"
        )
        print(f"  priced solve: value {sol.objective_s:.6f}, plan {plain}", flush=True)
        return sol.choices, sol.objective_s, sol.bound_s

    lagrangian.fit_recompute = timed_fit
    clock = time.process_time()
    found = lagrangian.relax(problem, solve_free, target_gap=0.01)
    gap = (found.objective_s - found.bound_s) / found.objective_s
    print(
        f"bound {found.bound_s:.6f} s, plan {found.objective_s:.6f} s, gap {gap:.2%}, "
        f"{found.evaluations} priced solves, {fits[0]} recompute fits ({fits[1]:.1f} s CPU), "
        f"{time.process_time() - clock:.1f} s CPU in all"
    )


def solve_again(paths: list[str]) -> None:
    """Each dumped problem solved again as the plan command solved it (its own keyword
    arguments, the cutoff included): CPU seconds, objective, bound, gap, variables."""
    total = 0.0
    for path in paths:
        with open(path, "rb") as f:
            problem, kwargs = pickle.load(f)
        clock = time.process_time()
        sol = solver.solve(problem, **kwargs)
        cpu = time.process_time() - clock
        total += cpu
        print(
            f"{path}: {cpu:.2f} s CPU, objective {sol.objective_s * 1e3:.4f} ms, bound "
            f"{sol.bound_s * 1e3:.4f} ms, gap {sol.gap:.3%}, {sol.num_variables:,} variables, "
            f"MIP {'yes' if 'lagrangian_then_mip' in sol.details else 'no'}, "
            f"cut off {'yes' if 'cutoff' in sol.details else 'no'}",
            flush=True,
        )
        # The exact floats and a digest of the plan, to compare two trees' answers.
        plan = hashlib.sha1(repr((sol.choices, sol.recomputed)).encode()).hexdigest()[:12]
        print(f"  exact: objective {sol.objective_s!r}, bound {sol.bound_s!r}, plan {plan}")
    print(f"{total:.2f} s CPU in all")


def record_products(path: str, out: str, count: int, smallest: int = 1_000_000) -> None:
    """Every third series min-plus product of at least ``smallest`` (s, t, r) entries that
    solving the dumped problem forms (elimination and pruning), until ``count`` are kept."""
    import solver.eliminate as eliminate

    product, kept, seen = eliminate.series_min, [], [0]

    class _Enough(Exception):
        pass

    def recorded(uv, cv, vw):
        if uv.shape[0] * uv.shape[1] * vw.shape[1] >= smallest:
            seen[0] += 1
            if seen[0] % 3 == 0:
                kept.append((uv.copy(), cv.copy(), vw.copy()))
            if len(kept) >= count:
                raise _Enough
        return product(uv, cv, vw)

    eliminate.series_min = recorded
    with open(path, "rb") as f:
        problem, kwargs = pickle.load(f)
    try:
        solver.solve(problem, **kwargs)
    except _Enough:
        pass
    with open(out, "wb") as f:
        pickle.dump(kept, f, protocol=5)
    print(f"{len(kept)} products of {seen[0]} at least {smallest:,} entries kept in {out}")


def time_products(path: str, rounds: int = 2) -> None:
    """The recorded products by the plain loop and by solver.minplus.series_min, alternated,
    CPU seconds per round; every result compared bit for bit."""
    from solver.minplus import series_min, series_min_plain

    with open(path, "rb") as f:
        products = pickle.load(f)
    plain = [series_min_plain(*p) for p in products]
    for k in range(rounds):
        for name, product in (("plain", series_min_plain), ("minplus", series_min)):
            clock = time.process_time()
            for p, want in zip(products, plain, strict=True):
                assert product(*p).tobytes() == want.tobytes(), name
            print(f"round {k}: {name} {time.process_time() - clock:.2f} s CPU", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "dump":
        dump(sys.argv[2], sys.argv[3:])
    elif sys.argv[1] == "solve":
        solve_again(sys.argv[2:])
    elif sys.argv[1] == "products":
        record_products(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    elif sys.argv[1] == "minplus":
        time_products(sys.argv[2])
    else:
        replay(sys.argv[2])
