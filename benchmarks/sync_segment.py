"""The wait a blocking collective adds vs the computation before it (``LinkSpec.sync_s``).

On every rank at once, per trial: ``calls`` iterations of an ``n x n`` matmul followed by a
1 KiB all-reduce on the innermost mesh axis, of the matmul alone and of the all-reduce alone,
interleaved; the slowest rank's seconds per iteration; the excess ``mixed - compute -
collective`` (median over 7 trials) is the wait per call. Larger ``n`` = a longer computation
between two collectives. ``autopar calibrate`` measures ``sync_s`` after about
``CalibrationConfig.sync_segment_s`` of computation because of what this prints.

    PYTHONPATH=. python benchmarks/sync_segment.py 2        # or 2x2 (4 ranks on 2 cores)
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

SIZES = (128, 256, 384, 512)
TRIALS = 7


def _rank(rank: int, world: int, mesh: tuple[int, ...]) -> dict[int, tuple[float, float, float]]:
    from autopar.comm.process_groups import axis_groups

    groups = axis_groups(mesh, tuple(f"a{i}" for i in range(len(mesh))), key="sync-segment")
    group = groups.groups[-1]
    small = torch.zeros(256)
    out = {}
    for n in SIZES:
        a = torch.randn(n, n)
        calls = max(4, int(30 * (256 / n) ** 3))

        def compute(a: Any = a) -> None:
            torch.mm(a, a)

        def collective() -> None:
            dist.all_reduce(small, group=group)

        def mixed(a: Any = a) -> None:
            torch.mm(a, a)
            dist.all_reduce(small, group=group)

        times: dict[str, list[float]] = {"mixed": [], "compute": [], "collective": []}
        for _ in range(TRIALS):
            for key, fn in (("mixed", mixed), ("compute", compute), ("collective", collective)):
                dist.barrier()
                start = time.perf_counter()
                for _ in range(calls):
                    fn()
                times[key].append((time.perf_counter() - start) / calls)
        t = torch.tensor([times[k] for k in times], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        mixed_s, compute_s, collective_s = t.tolist()
        excess = [m - c - k for m, c, k in zip(mixed_s, compute_s, collective_s)]
        out[n] = (
            statistics.median(compute_s),
            statistics.median(collective_s),
            statistics.median(excess),
        )
    return out


def main(argv: list[str]) -> int:
    from autopar.runtime.spawn import spawn_ranks

    mesh = tuple(int(x) for x in (argv[0] if argv else "2").split("x"))
    print(f"load average before: {os.getloadavg()}")
    res = spawn_ranks(_rank, math.prod(mesh), mesh, timeout_s=200, env={"OMP_NUM_THREADS": "1"})
    print(f"load average after: {os.getloadavg()}")
    for n, (compute_s, collective_s, excess_s) in res[0].items():
        print(f"matmul {n}: compute {compute_s * 1e3:.2f} ms, 1 KiB all-reduce "
              f"{collective_s * 1e3:.2f} ms, wait per call {excess_s * 1e3:.2f} ms")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
