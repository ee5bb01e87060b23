"""The compute model alone: a pipeline's predicted stage work vs the model timed in one process.

    PYTHONPATH=. python benchmarks/stage_alone_check.py PROFILE.json [--models gpt llama]

For the 4-block GPT and LLaMA of ``pipeline_cost_check.py`` and m = 2, 4, 8 microbatches of its
global batch 16 x 128: the plan's 2 stages (``autopar.plan(..., stages=2, microbatches=m)`` with
the profile's device) give the predicted forward and backward seconds of one microbatch (both
stages summed); the same model is then timed forward and forward + backward on one microbatch in
this process (one thread, nothing else of ours computing; median of 5 after a warm-up). A matmul
probe (512^3, every call of it timed) is printed against the profile's ``peak_flops`` first: the
ratio is how much faster one rank alone is now than the profile's all-ranks-busy figure.

What it answers: whether measured / predicted depends on the microbatch's size (a per-op fixed
cost the model misses would make small microbatches relatively slower), apart from the speed
level.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch

import autopar
from benchmarks.pipeline_cost_check import build
from cost_models import load_profile


def median_s(fn: Callable[[], object], runs: int = 5) -> float:
    fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile")
    parser.add_argument("--models", nargs="+", default=["gpt", "llama"], choices=["gpt", "llama"])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    profile = load_profile(args.profile)
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"load: {uptime}")
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    probe = 2 * 512**3 / median_s(lambda: a @ b, 20)
    calibrated = profile.device.peak_flops["float32"]
    print(f"matmul alone now {probe / 1e9:.1f} GFLOP/s; profile {calibrated / 1e9:.1f} "
          f"(ratio {probe / calibrated:.2f})")  # fmt: skip
    print(
        "| model | m | rows | predicted fwd / bwd ms | measured fwd / bwd ms | measured / predicted"
    )
    for name in args.models:
        for m in (2, 4, 8):
            model, batch = build(name, 16, 128)
            mesh = autopar.Mesh.spec((2,), ("pp",), profile=profile)
            plan = autopar.plan(model, mesh, batch, stages=2, microbatches=m, schedule="gpipe",
                                optimizer="sgd")  # fmt: skip
            stages = plan.pipeline.stages
            forward = sum(s.predicted["forward_s"] for s in stages)
            backward = sum(s.predicted["backward_s"] for s in stages)
            rows = 16 // m
            micro = tuple(t[:rows] for t in batch)
            model, _ = build(name, 16, 128)
            fwd = median_s(lambda model=model, micro=micro: model(*micro))
            both = median_s(lambda model=model, micro=micro: model(*micro).backward())
            print(f"| {name} | {m} | {rows} | {forward * 1e3:.0f} / {backward * 1e3:.0f} | "
                  f"{fwd * 1e3:.0f} / {(both - fwd) * 1e3:.0f} | "
                  f"{fwd / forward:.2f} / {(both - fwd) / backward:.2f} |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
