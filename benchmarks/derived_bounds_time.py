"""CPU seconds of a derived ZeRO bound (solver/derived_bounds.py) on a row's budgeted problems:
build the first configuration's problem and keep a reference of it, then build and derive the
next ones through ConfigurationSolver, as autopar/planner/zero_search.py does.

    python benchmarks/derived_bounds_time.py MULTIPLIER BOUND_S llama3-70b --mesh 8x16x8 \
        --device h100 --budget 80GiB --batch 256 --seq 8192

MULTIPLIER, BOUND_S: a reference's multiplier and bound (e.g. the first configuration's
relaxation's, from the plan's progress lines). Times only: the bounds printed come from that
given reference.
"""

import sys
import time

from autopar.capture.export import capture
from autopar.options import PlanOptions
from autopar.planner.driver import Driver
from autopar.planner.problem import ZeroConfig
from autopar.planner.space import build_space
from autopar.presets import build_preset
from autopar.tools.cli import _build_mesh, build_parser

lam, bound = float(sys.argv[1]), float(sys.argv[2])
args = build_parser().parse_args(["plan", *sys.argv[3:]])
mesh = _build_mesh(args)
options = PlanOptions(memory_budget=args.budget, mixed_precision=args.mixed_precision)
m, a, k = build_preset(args.model, batch=args.batch, seq=args.seq)
d = Driver(build_space(capture(m, a, k, check_splice=False), mesh, options))
c = d.configurations
for n, stages in enumerate([(2, 2, 2), (2, 2, 3), (3, 2, 2)]):
    zero = ZeroConfig(stages=stages)
    t = time.process_time()
    problem = c.budgeted_problem(zero, d.budget)
    built = time.process_time() - t
    t = time.process_time()
    derived = c.derived_bound(zero, d.budget, ())[0] if n else bound
    spent = time.process_time() - t
    c._keep_reference(problem, lam, derived)
    print(stages, f"built {built:.2f} s CPU, derived {derived * 1e3:.3f} ms in {spent:.2f} s CPU")
    c.release()
