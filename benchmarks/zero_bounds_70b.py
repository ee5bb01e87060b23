"""The bound a ZeRO configuration would be skipped on (ConfigurationSolver.priced_bound: the
pattern D, solver/budgeted.py) for two budgeted configurations of a row, at one multiplier.

    python benchmarks/zero_bounds_70b.py LAMBDA llama3-70b --mesh 8x16x8 --device h100 \
        --budget 80GiB --batch 256 --seq 8192

LAMBDA: a multiplier (e.g. the one the progress line "bound ZeRO ... at multiplier X" gave).
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

lam = float(sys.argv[1])
args = build_parser().parse_args(["plan", *sys.argv[2:]])
mesh = _build_mesh(args)
options = PlanOptions(memory_budget=args.budget, mixed_precision=args.mixed_precision)
m, a, k = build_preset(args.model, batch=args.batch, seq=args.seq)
cap = capture(m, a, k, check_splice=False)
d = Driver(build_space(cap, mesh, options))
for stages in [(2, 2, 3), (3, 3, 3)]:
    t, c = time.perf_counter(), time.process_time()
    bound, fits = d.configurations.priced_bound(ZeroConfig(stages=stages), d.budget, (lam, lam))
    print(
        stages,
        f"pattern D {bound * 1e3:.3f} ms, fits {fits}, {time.perf_counter() - t:.1f} s wall, {time.process_time() - c:.1f} s CPU",
        flush=True,
    )
