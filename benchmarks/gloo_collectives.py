"""gloo's collectives on each axis of a 2x2 mesh, the kinds interleaved: wall and CPU per call.

Both groups of an axis run at once (as in a training step). Per axis and size, every trial
times 10 calls of each variant in turn (all_reduce; reduce_scatter as the list form and as the
flat ``reduce_scatter_single`` the runtime calls; all_gather likewise), so load drifting over
seconds falls on every variant alike. Prints the slowest rank's median wall milliseconds per
call and the ranks' mean process CPU milliseconds per call (all threads, gloo's included).

    PYTHONPATH=. python benchmarks/gloo_collectives.py --trials 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

SIZES = (1 << 18, 1 << 20, 1 << 21, 1 << 22)


def _variants(group: object, nbytes: int) -> dict[str, Callable[[], object]]:
    full = torch.randn(nbytes // 4)
    part = torch.randn(nbytes // 8)
    parts = [torch.empty_like(part) for _ in range(2)]
    gathered = torch.empty_like(full)
    return {
        "all_reduce": lambda: dist.all_reduce(full, group=group),
        "reduce_scatter (list)": lambda: dist.reduce_scatter(
            part, list(full.chunk(2)), group=group
        ),
        "reduce_scatter_single": lambda: dist.reduce_scatter_single(part, full, group=group),
        "all_gather (list)": lambda: dist.all_gather(parts, part, group=group),
        "all_gather_single": lambda: dist.all_gather_single(gathered, part, group=group),
    }


def _rank(rank: int, world: int, trials: int) -> dict[str, tuple[float, float]]:
    from autopar.comm.process_groups import axis_groups

    groups = axis_groups((2, 2), ("a0", "a1"), key="gloo-collectives")
    out = {}
    for axis in (0, 1):
        group = groups.groups[axis]
        for nbytes in SIZES:
            fns = _variants(group, nbytes)
            times: dict[str, list[tuple[float, float]]] = {k: [] for k in fns}
            for fn in fns.values():
                fn()
            for _ in range(trials):
                for key, fn in fns.items():
                    dist.barrier()
                    wall, cpu = time.perf_counter(), time.process_time()
                    for _ in range(10):
                        fn()
                    times[key].append(
                        ((time.perf_counter() - wall) / 10, (time.process_time() - cpu) / 10)
                    )
            for key, values in times.items():
                out[f"a{axis} {nbytes >> 10:5d} KiB {key}"] = (
                    statistics.median(v[0] for v in values),
                    statistics.median(v[1] for v in values),
                )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5)
    args = parser.parse_args(argv)
    from autopar.runtime.spawn import spawn_ranks

    print(f"load average before: {os.getloadavg()}")
    res = spawn_ranks(_rank, 4, args.trials, timeout_s=600, env={"OMP_NUM_THREADS": "1"})
    print(f"load average after: {os.getloadavg()}")
    for key in res[0]:
        wall = max(r[key][0] for r in res)
        cpu = statistics.mean(r[key][1] for r in res)
        print(f"{key:40s} wall {wall * 1e3:6.2f} ms   cpu {cpu * 1e3:5.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
