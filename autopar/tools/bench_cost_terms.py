"""Predicted vs measured per term: which part of a step makes two plans swap places.

``bench-cost`` times whole steps; to find where the cost model misjudges the ORDER of two
plans, a step has to be split the way the model splits it. On every rank, every collective the
step issues (``all_reduce``, ``all_gather_single``, ``reduce_scatter_single``,
``all_to_all_single``, ``broadcast``: the ZeRO refresh on gloo; asynchronous ones until their
``wait()`` returns) is timed, wall and
process CPU; a step's measured terms are then

- ``comm``: the wall time the rank spent inside collectives (the exposed communication, the
  predicted ``resharding + activation_grad_comm + output_comm + zero_comm + grad_sync``), and
  the number of calls (each costs a latency and, between computations, ``LinkSpec.sync_s``);
- ``rest``: the step's wall time outside collectives (the predicted ``compute_s`` plus what the
  model does not price: Python dispatch, copies, allocation).

All plans run in one spawn, one step of each in turn, so load from other processes falls on
every plan alike; per plan the median over steps of the slowest rank's step and the mean over
ranks of each term's median, and per step the ratio to a reference plan of the same round.

    PYTHONPATH=. python -m autopar.tools.bench_cost_terms benchmarks.cost_model:llama \\
        --mesh 2x2 --profile p_2x2.json --recipes ddp,megatron,fsdp+tp --steps 12

``--auto-margin 0`` times the ILP's own plan as "auto" even where the near-tie rule would
choose a recipe's layout (``planner.auto_margin``).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from typing import Any

TIMED_CALLS = (
    "all_reduce",
    "all_gather_single",
    "reduce_scatter_single",
    "all_to_all_single",
    "broadcast",
)
COMM_TERMS = (
    "resharding_s",
    "activation_grad_comm_s",
    "output_comm_s",
    "zero_comm_s",
    "grad_sync_s",
)


class _Clock:
    """Per step on this rank: wall and CPU seconds inside collectives, and the calls."""

    def __init__(self) -> None:
        self.wall = 0.0
        self.cpu = 0.0
        self.calls = 0

    def add(self, wall: float, cpu: float, calls: int = 0) -> None:
        self.wall += wall
        self.cpu += cpu
        self.calls += calls


class _TimedWork:
    """An asynchronous collective's handle whose ``wait()`` is timed into the clock."""

    def __init__(self, work: Any, clock: _Clock) -> None:
        self._work = work
        self._clock = clock

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        wall, cpu = time.perf_counter(), time.process_time()
        out = self._work.wait(*args, **kwargs)
        self._clock.add(time.perf_counter() - wall, time.process_time() - cpu)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _instrument(dist: Any, clock: _Clock) -> None:
    """Wrap the collectives the lowered graphs and the runtime call (they look them up on
    ``torch.distributed`` at call time) so that each call's wall and CPU go into ``clock``."""
    for name in TIMED_CALLS:
        original = getattr(dist, name)

        def call(*args: Any, _fn: Any = original, **kwargs: Any) -> Any:
            wall, cpu = time.perf_counter(), time.process_time()
            out = _fn(*args, **kwargs)
            clock.add(time.perf_counter() - wall, time.process_time() - cpu, 1)
            return _TimedWork(out, clock) if out is not None else out

        setattr(dist, name, call)


RUNTIME_COLLECTIVE_MODULES = (
    "autopar.runtime.zero_layout",
    "autopar.runtime.zero_backward",
    "autopar.runtime.zero_gather",
    "autopar.runtime.grad_sync",
)
"""Where the runtime issues ZeRO's chunk collectives and the gradient buckets' all-reduces,
each through ``autopar.comm.collective_check.run_collective``."""


class CollectiveLog:
    """Records every collective of :data:`RUNTIME_COLLECTIVE_MODULES` on this rank as
    ``(op, what, group size, bytes)``, bytes as ``cost_models.collective_time_s`` takes them
    (an all-gather's full output; the rest their input). The collectives still run:
    :meth:`install` wraps ``run_collective`` where those modules look it up."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, int, int]] = []

    def install(self) -> None:
        import importlib

        import torch.distributed as dist

        for name in RUNTIME_COLLECTIVE_MODULES:
            module = importlib.import_module(name)
            original = module.run_collective

            def logged(op, what, tensor, group, axis_label, call, _run=original):  # type: ignore[no-untyped-def]
                size = dist.get_world_size(group)
                nbytes = (
                    tensor.numel() * tensor.element_size() * (size if op == "all_gather" else 1)
                )
                self.calls.append((op, what, size, nbytes))
                return _run(op, what, tensor, group, axis_label, call)

            module.run_collective = logged


def issued_per_step(
    prepared: dict[str, Any], log: CollectiveLog, warmup: int = 2
) -> dict[str, Any]:
    """Per prepared plan (``bench_cost.PreparedPlan``), the collectives ``log`` sees in one
    training step (forward, backward, optimizer step) after ``warmup`` steps."""
    out = {}
    for name, plan in prepared.items():
        for _ in range(warmup):
            plan.step()
            plan.update()
        log.calls.clear()
        plan.step()
        plan.update()
        out[name] = list(log.calls)
    return out


def _count_rank(rank: int, world: int, factory: str, batch: int, seq: int,
                mesh: tuple[int, ...], datas: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """:func:`issued_per_step` of every plan of ``datas`` (name -> plan JSON) on this rank."""
    import torch

    from autopar.capture.export import capture
    from autopar.comm.process_groups import axis_groups
    from autopar.presets import build_preset
    from autopar.tools.bench_cost import prepare_plan

    log = CollectiveLog()
    log.install()
    torch.manual_seed(0)
    model, args, kwargs = build_preset(factory, batch=batch, seq=seq)
    captured = capture(model, args, kwargs)
    groups = axis_groups(mesh, tuple(f"a{i}" for i in range(len(mesh))), key="count")
    prepared = {n: prepare_plan(captured, model, args, kwargs, d, groups) for n, d in datas.items()}
    return issued_per_step(prepared, log)


def count_collectives(factory: str, batch: int, seq: int, mesh: tuple[int, ...],
                      plans: dict[str, Any], *, timeout_s: float = 300) -> dict[str, Any]:  # fmt: skip
    """Run one step of each plan (name -> plan JSON) on ``prod(mesh)`` gloo ranks; per plan
    the runtime collectives of rank 0's step (:class:`CollectiveLog`; every rank issues the
    same ones)."""
    from autopar.runtime.spawn import spawn_ranks

    res = spawn_ranks(_count_rank, math.prod(mesh), factory, batch, seq, mesh, plans,
                      timeout_s=timeout_s, env={"OMP_NUM_THREADS": "1"})  # fmt: skip
    return res[0]


def _rank(rank: int, world: int, factory: str, batch: int, seq: int, mesh: tuple[int, ...],
          datas: dict[str, Any], steps: int) -> dict[str, Any]:  # fmt: skip
    import torch
    import torch.distributed as dist

    from autopar.capture.export import capture
    from autopar.comm.process_groups import axis_groups
    from autopar.presets import build_preset
    from autopar.tools.bench_cost import prepare_plan

    clock = _Clock()
    _instrument(dist, clock)
    torch.manual_seed(0)
    model, args, kwargs = build_preset(factory, batch=batch, seq=seq)
    captured = capture(model, args, kwargs)
    groups = axis_groups(mesh, tuple(f"a{i}" for i in range(len(mesh))), key="terms")
    plans = {n: prepare_plan(captured, model, args, kwargs, d, groups) for n, d in datas.items()}
    for plan in plans.values():
        for _ in range(2):
            plan.step()
            plan.update()
    keys = ("wall", "cpu", "comm_wall", "comm_cpu", "calls")
    out: dict[str, dict[str, list[float]]] = {n: {k: [] for k in keys} for n in plans}
    for _ in range(steps):
        for name, plan in plans.items():
            dist.barrier()
            clock.__init__()
            start, start_cpu = time.perf_counter(), time.process_time()
            plan.step()
            figures = (time.perf_counter() - start, time.process_time() - start_cpu,
                       clock.wall, clock.cpu, float(clock.calls))  # fmt: skip
            for key, value in zip(keys, figures):
                out[name][key].append(value)
            plan.update()
    return out


def measure_terms(
    factory: str,
    batch: int,
    seq: int,
    mesh: tuple[int, ...],
    plans: dict[str, Any],
    steps: int,
) -> dict[str, Any]:
    """Run ``plans`` (name -> Plan) interleaved on ``prod(mesh)`` gloo ranks; per plan the
    predicted and measured terms (module docstring) and every step's slowest-rank wall."""
    from autopar.runtime.spawn import spawn_ranks

    datas = {n: p.data for n, p in plans.items()}
    res = spawn_ranks(_rank, math.prod(mesh), factory, batch, seq, mesh, datas, steps,
                      timeout_s=330, env={"OMP_NUM_THREADS": "1"})  # fmt: skip
    out: dict[str, Any] = {}
    for name, plan in plans.items():
        pred = plan.data["predicted"]["breakdown"]
        slow = [max(r[name]["wall"][i] for r in res) for i in range(steps)]
        med = {k: statistics.mean(statistics.median(r[name][k]) for r in res) for k in res[0][name]}
        out[name] = {
            "predicted_step_s": plan.data["predicted"]["step_s"],
            "predicted_compute_s": pred["compute_s"] + pred.get("recompute_s", 0.0),
            "predicted_comm_s": sum(pred.get(k, 0.0) for k in COMM_TERMS),
            "step_s": statistics.median(slow),
            "step_times_s": slow,
            "comm_s": med["comm_wall"],
            "comm_cpu_s": med["comm_cpu"],
            "rest_s": med["wall"] - med["comm_wall"],
            "cpu_s": med["cpu"],
            "calls": med["calls"],
        }
    return out


def terms_table(terms: dict[str, Any], reference: str) -> str:
    """Markdown: per plan predicted vs measured step, comm and compute (rest), calls, and the
    per-step ratio to ``reference`` (median, min-max)."""
    ref = terms[reference]["step_times_s"]
    lines = [
        "| plan | step pred / meas ms | compute pred / rest meas ms | comm pred / meas ms "
        f"| collectives per step | comm CPU ms | / {reference} per step: median (min-max) |",
        "|---|---|---|---|---:|---:|---|",
    ]
    for name, t in sorted(terms.items(), key=lambda kv: kv[1]["step_s"]):
        ratios = [a / b for a, b in zip(t["step_times_s"], ref)]
        lines.append(
            f"| {name} | {t['predicted_step_s'] * 1e3:.1f} / {t['step_s'] * 1e3:.1f} "
            f"| {t['predicted_compute_s'] * 1e3:.1f} / {t['rest_s'] * 1e3:.1f} "
            f"| {t['predicted_comm_s'] * 1e3:.1f} / {t['comm_s'] * 1e3:.1f} | {t['calls']:.0f} "
            f"| {t['comm_cpu_s'] * 1e3:.1f} | {statistics.median(ratios):.3f} "
            f"({min(ratios):.3f}-{max(ratios):.3f}) |"
        )
    return "\n".join(lines)


def plans_from_command_line(
    description: str, argv: list[str] | None, *, recipes: str, auto: bool = True
) -> tuple[argparse.Namespace, Any, dict[str, Any]]:
    """Parse ``MODEL --mesh --profile --recipes --batch --seq --steps --json`` and plan MODEL's
    recipes (and the auto plan, first, where ``auto``) on the mesh with the profile's device
    and links; returns the arguments, that Mesh (axes ``a0``, ``a1``, ...) and the Plans."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("model", help="package.module:factory or a preset")
    parser.add_argument("--mesh", default="2")
    parser.add_argument("--profile", required=True, help="calibrated profile of this mesh")
    parser.add_argument("--recipes", default=recipes)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--json", help="write the measurements here")
    parser.add_argument("--auto-margin", type=float, default=None,
                        help="PlanOptions.auto_margin (0: the ILP's own plan as auto)")  # fmt: skip
    args = parser.parse_args(argv)
    from autopar.capture.export import capture
    from autopar.mesh import Mesh
    from autopar.options import PlanOptions
    from autopar.presets import build_preset
    from autopar.tools.report import plans_for_recipes
    from cost_models import load_profile

    base = Mesh.parse(args.mesh, device="cpu")
    profile = load_profile(args.profile)
    names = tuple(f"a{i}" for i in range(base.ndim))
    mesh = Mesh(shape=base.shape, axis_names=names, device=profile.device,
                links=tuple(profile.links[n] for n in names))  # fmt: skip
    model, margs, kwargs = build_preset(args.model, batch=args.batch, seq=args.seq)
    captured = capture(model, margs, kwargs)
    names = [r for r in args.recipes.split(",") if r and r != "auto"]
    options = PlanOptions(auto_margin=args.auto_margin)
    plans = plans_for_recipes(captured, mesh, options, recipes=(["auto"] if auto else []) + names,
                              model_name=args.model)  # fmt: skip
    return args, mesh, plans


def main(argv: list[str] | None = None) -> int:
    import json
    import os

    args, mesh, plans = plans_from_command_line(
        __doc__.splitlines()[0], argv, recipes="ddp,megatron,fsdp,fsdp+tp"
    )
    print(f"load average before: {os.getloadavg()}")
    terms = measure_terms(args.model, args.batch, args.seq, mesh.shape, plans, args.steps)
    print(f"load average after: {os.getloadavg()}")
    print(terms_table(terms, "auto"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(terms, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
