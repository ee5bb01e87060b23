"""What one collective costs between computations, against back to back (issue 13).

    PYTHONPATH=. python benchmarks/collective_between_compute.py            # 4 ranks
    PYTHONPATH=. python benchmarks/collective_between_compute.py --world 2 --iters 3 20

gloo ranks on 127.0.0.1, one thread each. Per variant (none, all-reduces of a scalar (a
loss), of 16 elements and of 1 KiB, a 1 MiB all-gather of 256 KiB per rank), ``--iters`` iterations of a computation of 27 matmuls of
256 x 256 (about 10 ms on a shared core) followed by the collective, timed after a barrier;
and the collective alone, back to back. 7 trials, interleaved; the slowest rank's median per
iteration. "extra" is the time the collective adds between computations: what a training step
pays for it, which ``LinkSpec.sync_s`` plus the back-to-back time is meant to price.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _run(rank: int, world: int, port: int, iters: int) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    a = torch.randn(256, 256)
    small = torch.zeros(256)
    part = torch.randn(256, 256)
    full = torch.empty(256 * world, 256)

    def compute() -> None:
        for _ in range(27):
            torch.mm(a, a)

    scalar, sixteen = torch.zeros(1), torch.zeros(16)
    variants = {
        "none": lambda: None,
        "all_reduce 4 B": lambda: dist.all_reduce(scalar),
        "all_reduce 64 B": lambda: dist.all_reduce(sixteen),
        "all_reduce 1 KiB": lambda: dist.all_reduce(small),
        "all_gather 1 MiB": lambda: dist.all_gather_into_tensor(full, part),
    }
    mixed: dict[str, list[float]] = {k: [] for k in variants}
    alone: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(7):
        for name, collective in variants.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                compute()
                collective()
            mixed[name].append((time.perf_counter() - start) / iters)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                collective()
            alone[name].append((time.perf_counter() - start) / iters)
    names = list(variants)
    medians = torch.tensor(
        [statistics.median(mixed[k]) for k in names] + [statistics.median(alone[k]) for k in names]
    )
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    if rank == 0:
        base = float(medians[0])
        for i, name in enumerate(names):
            between, b2b = float(medians[i]), float(medians[len(names) + i])
            print(
                f"{world} ranks, {iters:3d} iterations  {name:17s} between computations "
                f"{between * 1e3:7.2f} ms/iter (extra {(between - base) * 1e3:5.2f} ms)  "
                f"back to back {b2b * 1e3:5.2f} ms"
            )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--iters", type=int, nargs="+", default=[3, 20])
    args = parser.parse_args()
    import torch.multiprocessing as mp

    from autopar.runtime.spawn import free_port

    for iters in args.iters:
        mp.spawn(_run, args=(args.world, free_port(), iters), nprocs=args.world)


if __name__ == "__main__":
    main()
