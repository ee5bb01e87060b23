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

    PYTHONPATH=. python benchmarks/stage_alone_check.py PROFILE.json --per-op [--rows 8 2]

Per op family instead: the model planned on one device with the profile at a microbatch of
``rows`` x 128, then every op of its graph timed alone forward + backward at that shape
(``autopar.tools.bench_cost.measure_ops``, the per-op mode of ``autopar bench-cost``) against
the node's planned compute seconds, summed per family and per ATen target. "x speed" multiplies
the ratio by the matmul probe's speed now over the profile's ``peak_flops`` (a 768^3 matmul,
calibration's largest, before and after), so the machine's load drift since calibration is
taken out of the per-family ratio.
"""

from __future__ import annotations

import argparse
import collections
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


def per_op(profile: object, names: list[str], rows_list: list[int], top: int) -> None:
    """Per family (and the ``top`` ATen targets by predicted time): predicted vs measured."""
    from autopar.capture.export import capture
    from autopar.tools.bench_cost import BenchConfig, measure_ops
    from autopar.tools.timing import time_callable

    cpu = torch.device("cpu")
    n = 768
    a = torch.randn(n, n)

    def probe() -> float:
        return 2 * n**3 / time_callable(lambda: a @ a, device=cpu, min_time_s=0.05, trials=3)

    calibrated = profile.device.peak_flops["float32"]
    for name in names:
        for rows in rows_list:
            model, batch = build(name, rows, 128)
            mesh = autopar.Mesh.spec((1,), ("pp",), profile=profile)
            plan = autopar.plan(model, mesh, batch, optimizer="sgd")
            before = probe()
            ops = measure_ops(capture(model, batch), plan.data, BenchConfig(op_repeat_s=0.02), cpu)
            speed = (before * probe()) ** 0.5 / calibrated
            sums: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
            for op in ops["ops"]:
                for key in (op["family"], f"  {op['family']} {op['target']}"):
                    sums[key][0] += op["count"] * op["predicted_s"]
                    sums[key][1] += op["count"] * op["measured_s"]
                    sums[key][2] += op["count"]
            predicted = sum(v[0] for k, v in sums.items() if not k.startswith(" "))
            measured = sum(v[1] for k, v in sums.items() if not k.startswith(" "))
            print(f"{name}, {rows} rows x 128: probe now / profile {speed:.2f}; all ops "
                  f"predicted {predicted * 1e3:.1f} ms, measured {measured * 1e3:.1f} ms, "
                  f"ratio {measured / predicted:.2f} (x speed {measured * speed / predicted:.2f})")  # fmt: skip
            print("| family / target | ops | predicted ms | measured ms | measured / predicted "
                  "| x speed |")  # fmt: skip
            families = sorted((k for k in sums if not k.startswith(" ")), key=lambda k: -sums[k][0])
            targets = sorted((k for k in sums if k.startswith(" ")), key=lambda k: -sums[k][0])
            for key in families + targets[:top]:
                p, m, c = sums[key]
                # Ops that return their input are priced at 0 (README "Session 9").
                ratio = f"{m / p:.2f} | {m * speed / p:.2f}" if p > 0 else "- | -"
                print(f"| {key} | {c:.0f} | {p * 1e3:.2f} | {m * 1e3:.2f} | {ratio} |",
                      flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile")
    parser.add_argument("--models", nargs="+", default=["gpt", "llama"], choices=["gpt", "llama"])
    parser.add_argument("--per-op", action="store_true", help="per op family (module docstring)")
    parser.add_argument("--rows", nargs="+", type=int, default=[8, 2])
    parser.add_argument("--top", type=int, default=12, help="ATen targets listed per case")
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
    if args.per_op:
        print(f"op_efficiency: {dict(profile.device.op_efficiency)}")
        per_op(profile, args.models, args.rows, args.top)
        print(f"load at end: {subprocess.run(['uptime'], capture_output=True, text=True).stdout}")
        return 0
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
