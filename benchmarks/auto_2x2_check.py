"""The auto plan vs the recipes on one mesh, per collective and per step, interleaved.

Plans a model of ``benchmarks/cost_model.py`` on a mesh (default 2x2, 4 gloo ranks) with one or
more calibrated profiles (``--profile NAME=PATH``: the auto plan of each profile, e.g. before and
after a calibration change) and the recipes of the first profile, then runs all plans in one
spawn, one step of each in turn, and prints per plan:

- the slowest rank's median step and, per step, the ratio to the fastest recipe's step of the
  same round (median and quartiles of the paired ratios: load that drifts between rounds cancels);
- each rank's process CPU seconds per step (all threads: gloo's included), summed over ranks;
- every collective the step issued (``all_reduce``, ``all_gather_single``,
  ``reduce_scatter_single``, ``all_to_all_single``; the asynchronous gradient buckets are counted
  at their call only): shape, calls, wall and CPU milliseconds per step on each rank.

    PYTHONPATH=. python benchmarks/auto_2x2_check.py mlp --profile new=p_2x2.json \\
        --profile old=old_2x2.json --steps 30
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

_CALLS: list[tuple[str, tuple[int, ...], float, float]] = []
TIMED = ("all_reduce", "all_gather_single", "reduce_scatter_single", "all_to_all_single")


def _timed(name: str, fn: Any) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        wall, cpu = time.perf_counter(), time.process_time()
        out = fn(*args, **kwargs)
        shape = tuple(args[0 if name == "all_reduce" else 1].shape)
        _CALLS.append((name, shape, time.perf_counter() - wall, time.process_time() - cpu))
        return out

    return call


def _rank(
    rank: int, world: int, model_key: str, mesh: tuple[int, ...], datas: dict, steps: int
) -> dict:
    from autopar.capture.export import capture
    from autopar.comm.process_groups import axis_groups
    from autopar.presets import build_preset
    from autopar.tools.bench_cost import prepare_plan

    for name in TIMED:  # the lowered graphs and the runtime look these up on dist at call time
        setattr(dist, name, _timed(name, getattr(dist, name)))
    torch.manual_seed(0)
    model, args, kwargs = build_preset(f"benchmarks.cost_model:{model_key}", batch=8, seq=128)
    captured = capture(model, args, kwargs)
    names = tuple(f"a{i}" for i in range(len(mesh)))
    groups = axis_groups(mesh, names, key="check")
    plans = {n: prepare_plan(captured, model, args, kwargs, d, groups) for n, d in datas.items()}
    for plan in plans.values():
        for _ in range(2):
            plan.step()
            plan.update()
    wall: dict[str, list[float]] = {n: [] for n in plans}
    cpu: dict[str, list[float]] = {n: [] for n in plans}
    calls: dict[str, Any] = {n: collections.defaultdict(lambda: [0.0, 0.0, 0]) for n in plans}
    for _ in range(steps):
        for name, plan in plans.items():
            dist.barrier()
            _CALLS.clear()
            start, start_cpu = time.perf_counter(), time.process_time()
            plan.step()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
            for op, shape, w, c in _CALLS:
                entry = calls[name][f"{op} {'x'.join(map(str, shape))}"]
                entry[0] += w / steps
                entry[1] += c / steps
                entry[2] += 1 / steps
            plan.update()
    return {"wall": wall, "cpu": cpu, "calls": {n: dict(c) for n, c in calls.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=["mlp", "gpt", "llama"])
    parser.add_argument("--mesh", default="2x2")
    parser.add_argument("--profile", action="append", required=True, metavar="NAME=PATH")
    parser.add_argument("--recipes", default="ddp,megatron")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args(argv)
    from autopar.capture.export import capture
    from autopar.mesh import Mesh
    from autopar.options import PlanOptions
    from autopar.presets import build_preset
    from autopar.runtime.spawn import spawn_ranks
    from autopar.tools.report import plans_for_recipes
    from cost_models import load_profile

    base = Mesh.parse(args.mesh, device="cpu")
    model, margs, kwargs = build_preset(f"benchmarks.cost_model:{args.model}", batch=8, seq=128)
    captured = capture(model, margs, kwargs)
    plans: dict[str, Any] = {}
    for index, item in enumerate(args.profile):
        label, path = item.split("=", 1)
        profile = load_profile(path)
        links = tuple(profile.links.values())  # in axis order, whatever the axes were named
        mesh = Mesh(shape=base.shape, axis_names=tuple(f"a{i}" for i in range(base.ndim)),
                    device=profile.device, links=links)  # fmt: skip
        recipes = ["auto", *args.recipes.split(",")] if index == 0 else ["auto"]
        made = plans_for_recipes(
            captured, mesh, PlanOptions(), recipes=recipes, model_name=args.model
        )
        for recipe, plan in made.items():
            plans[f"auto[{label}]" if recipe == "auto" else recipe] = plan
    print(f"load average before: {os.getloadavg()}")
    res = spawn_ranks(_rank, math.prod(base.shape), args.model, base.shape, {n: p.data for n, p in plans.items()},
                      args.steps, timeout_s=600, env={"OMP_NUM_THREADS": "1"})  # fmt: skip
    print(f"load average after: {os.getloadavg()}")
    slow = {n: [max(r["wall"][n][i] for r in res) for i in range(args.steps)] for n in plans}
    recipes = [n for n in plans if not n.startswith("auto")]
    best = min(recipes, key=lambda n: statistics.median(slow[n]))
    for name, plan in plans.items():
        ratios = sorted(a / b for a, b in zip(slow[name], slow[best]))
        q = statistics.quantiles(ratios, n=4)
        cpu = sum(statistics.median(r["cpu"][name]) for r in res)
        print(f"== {name}: predicted {plan.predicted_step_s * 1e3:.1f} ms, measured "
              f"{statistics.median(slow[name]) * 1e3:.1f} ms; / {best} per round: median "
              f"{statistics.median(ratios):.3f} (quartiles {q[0]:.3f}-{q[2]:.3f}); CPU per step, "
              f"all ranks: {cpu * 1e3:.1f} ms")  # fmt: skip
        for key in res[0]["calls"][name]:
            cells = [r["calls"][name].get(key, (0.0, 0.0, 0)) for r in res]
            print(
                f"   {key:36s}"
                + " | ".join(
                    f"{w * 1e3:6.2f} wall {c * 1e3:5.2f} cpu x{k:.0f}" for w, c, k in cells
                )
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
