"""How much faster one of two gloo ranks computes alone, in one session or in one each.

    PYTHONPATH=. python benchmarks/lone_rank_sessions.py [--pairs 2]

Two ranks (spawned as autopar.runtime.spawn spawns them: one session, one thread each) time
calibration's largest matmul (768^3; one call, then 10 calls back to back) in rounds: both
ranks computing, then rank 0 alone while rank 1 waits in an all-reduce (as ``autopar
calibrate``'s ``busy_rank_speed`` probe), in a point-to-point receive (as a pipeline stage
waits) or in ``time.sleep``. Printed: the time with both busy and the lone speed-up (both-busy
time over alone time, median of 5 rounds) per waiting mode. Each pair of runs does this once
with the ranks in the parent's session and once with each rank in its own session
(``os.setsid``, as torchrun starts ranks): Linux's autogroup scheduler shares the cores
between sessions, so the lone speed-up depends on it (README, "Session 9").
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from autopar.runtime.spawn import spawn_ranks
from autopar.tools.sessions import own_scheduling_group

MODES = ("both", "alone_allreduce", "alone_irecv", "alone_sleep")


def matmuls(a: torch.Tensor, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        a @ a
    return time.perf_counter() - start


def run_rank(rank: int, world: int, own_session: bool) -> dict[str, dict[str, float]]:
    if own_session:
        own_scheduling_group()
    out = {}
    for n, calls in ((768, 1), (768, 10)):
        a = torch.randn(n, n)
        for _ in range(3):
            a @ a
        timed: dict[str, list[float]] = {m: [] for m in MODES}
        for _ in range(5):
            for mode in MODES:
                dist.barrier()
                seconds = 0.0
                if mode == "both" or rank == 0:
                    seconds = matmuls(a, calls)
                    if mode == "alone_irecv":
                        dist.isend(torch.ones(1), 1).wait()
                elif mode == "alone_irecv":
                    dist.irecv(torch.zeros(1), 0).wait()
                elif mode == "alone_sleep":
                    time.sleep(0.3 if calls > 1 else 0.05)
                total = torch.tensor([seconds], dtype=torch.float64)
                dist.all_reduce(total)  # rank 1 waits here in "alone_allreduce"
                timed[mode].append(seconds)
        if rank != 0:
            continue  # rank 1 computes only when both do
        both = statistics.median(timed["both"])
        out[f"{n}^3 x {calls}"] = {
            "both_ms": both * 1e3,
            **{m: both / statistics.median(v) for m, v in timed.items() if m != "both"},
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2)
    args = parser.parse_args(argv)
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"load at start: {uptime}")
    print("| sessions | work | both busy ms | alone: all-reduce wait | p2p receive | sleep |")
    print("|---|---|---|---|---|---|")
    for _ in range(args.pairs):
        for own in (False, True):
            result = spawn_ranks(run_rank, 2, own, timeout_s=300, own_sessions=own)[0]
            for work, row in result.items():
                print(f"| {'one per rank' if own else 'one for both'} | {work} | "
                      f"{row['both_ms']:.1f} | {row['alone_allreduce']:.2f} | "
                      f"{row['alone_irecv']:.2f} | {row['alone_sleep']:.2f} |", flush=True)  # fmt: skip
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"load at end: {uptime}; os.cpu_count() = {os.cpu_count()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
