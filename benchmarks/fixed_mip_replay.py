"""The fixed MIP of a budgeted solve (solver/budgeted.py ``_fixed_mip``) on its own.

    python benchmarks/fixed_mip_replay.py dump DIR/p20.pkl OUT.pkl  # relaxation and fixing, no MIP
    python benchmarks/fixed_mip_replay.py solve OUT.pkl [TIME_S]     # the fixed MIP, HiGHS's log

``dump`` replays a problem pickled by benchmarks/relax_replay.py (its solve keyword arguments)
with ``_fixed_mip`` replaced by a hook that runs the reduced-cost fixing and pickles what the
MIP would get (the problem, the strategies kept, the relaxation's plan, the limit), then stops.
``solve`` restricts the problem to the strategies kept, starts from the plan made alike
(solver/alike.py) and prints sizes, HiGHS's log, the answer and CPU seconds. The pickles are
this machine's own files; load only those.
"""

from __future__ import annotations

import pickle
import sys
import time
from collections import Counter

import solver.budgeted as budgeted
from solver import solve
from solver.alike import make_alike, split_mixed
from solver.checkpointing import contract_segments
from solver.fixing import fix, restrict_budgeted
from solver.lagrangian import recompute_patterns
from solver.tying import contract


def dump(path: str, out: str) -> None:
    with open(path, "rb") as f:
        problem, kwargs = pickle.load(f)

    def hook(problem, multiplier, counted, plan, limit, details, **options):
        clock = time.process_time()
        patterns = None if counted is not None else recompute_patterns(problem)
        keep = fix(problem, multiplier, plan, limit, patterns, counted, options.get("floors"))
        print(f"fixing: {time.process_time() - clock:.1f} s CPU; relaxation: {details}")
        with open(out, "wb") as f:
            pickle.dump((problem, keep, plan, limit), f, protocol=pickle.HIGHEST_PROTOCOL)
        raise SystemExit(0)

    budgeted._fixed_mip = hook
    found = solve(problem, **kwargs)
    print(f"no fixed MIP: objective {found.objective_s!r}, bound {found.bound_s!r}")


def solve_fixed(path: str, time_limit_s: float) -> None:
    with open(path, "rb") as f:
        problem, keep, plan, limit = pickle.load(f)
    kept = sum(len(k) for k in keep)
    total = sum(n.num_choices for n in problem.nodes)
    print(f"limit {limit * 1e3:.3f} ms; {kept:,} of {total:,} strategies kept")
    restricted = restrict_budgeted(problem, keep)
    contracted = contract(restricted)
    merged = split_mixed(restricted, *contract_segments(restricted, contracted.node_map))[0]
    print(
        f"contracted: {len(contracted.problem.nodes)} nodes, {len(contracted.problem.edges)} "
        f"edges, segments' copies {sorted(Counter(s.copies for s in merged).items())}"
    )
    alike = make_alike(problem, plan)
    start = tuple(k.index(c) for k, c in zip(keep, alike, strict=True))
    clock = time.process_time()
    found = solve(
        restricted, gap=0.01, time_limit_s=time_limit_s, msg=True, relax_first=False,
        start_plan=start,
    )  # fmt: skip
    print(
        f"fixed MIP: {found.status}, objective {found.objective_s * 1e3:.3f} ms, bound "
        f"{found.bound_s * 1e3:.3f} ms, {found.num_variables:,} columns, "
        f"{found.num_constraints:,} rows, {time.process_time() - clock:.1f} s CPU"
    )


if __name__ == "__main__":
    if sys.argv[1] == "dump":
        dump(sys.argv[2], sys.argv[3])
    else:
        solve_fixed(sys.argv[2], float(sys.argv[3]) if len(sys.argv) > 3 else 600.0)
