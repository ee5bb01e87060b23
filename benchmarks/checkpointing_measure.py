"""Measured column of ``benchmarks/checkpointing.py``: run plans on gloo ranks, time and count.

``measure_plans(factory, plans)`` spawns one gloo job with as many ranks as the plans' mesh has
devices and, for each plan in turn (all plans share one mesh and one model), on every rank:
``autoparallelize(model, mesh, ..., plan=plan)``, one forward under
``autopar.lowering.checkpointing.count_saved_activation_bytes`` (distinct storages kept for backward,
parameters, buffers, inputs and ZeRO chunk buffers excluded; not measurable under ZeRO stage 3,
whose hooks take precedence: reported as None), then ``warmup + steps`` SGD steps. A step's time
is the slowest rank's (every rank waits at a barrier first); the figure is the median over the
timed steps. Each plan runs in alternation, step by step, with its twin without segments (same
layouts): ``Measured.overhead`` is the ratio of their medians (the recompute overhead).

    python benchmarks/checkpointing_measure.py     # a self-contained demo on the tiny GPT

``factory`` is ``"package.module:function"`` returning ``(model, args)`` or ``(model, args,
kwargs)`` with the same seed every call (the GLOBAL batch the plans were made for).
"""

from __future__ import annotations

import importlib
import json
import math
import statistics
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

__all__ = ["Measured", "measure_plans"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Measured:
    """One plan's figures on the live mesh."""

    step_s: float
    """Median over the timed steps of the slowest rank's step time (forward, backward, SGD)."""
    saved_bytes: int | None
    """Largest over ranks of the activation bytes kept for backward (None under ZeRO stage 3)."""
    predicted_activation_bytes: float
    """The plan's ``predicted.memory.activations`` (per device)."""
    predicted_step_s: float
    """The plan's ``predicted.step_s``."""
    num_segments: int
    """Segments the runtime wrapped in checkpoint."""
    reference_step_s: float
    """The same plan without segments (same layouts), timed in alternation with it."""

    @property
    def overhead(self) -> float:
        """Measured recompute overhead: step time over the reference's."""
        return self.step_s / self.reference_step_s


def _build(
    factory: str, factory_args: tuple[Any, ...] = ()
) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    module_name, _, function = factory.partition(":")
    built = getattr(importlib.import_module(module_name), function)(*factory_args)
    model, args = built[0], tuple(built[1])
    kwargs = dict(built[2]) if len(built) > 2 else {}
    return model, args, kwargs


def _loss(output: Any) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.loss


def _measure_one(
    rank: int,
    world_size: int,
    item: tuple[str, str],
    factory: str,
    factory_args: tuple[Any, ...],
    steps: int,
    warmup: int,
) -> dict[str, Any]:
    import torch.distributed as dist

    import autopar
    from autopar.lowering.checkpointing import CheckpointedSegment, count_saved_activation_bytes

    _, plan_json = item
    runs = []
    for text in (plan_json, without_segments(plan_json)):
        plan = autopar.Plan.from_json(text)
        mesh = autopar.Mesh.from_world(tuple(plan.data["mesh"]["shape"]))
        model, args, kwargs = _build(factory, factory_args)
        pmodel = autopar.autoparallelize(model, mesh, args, kwargs, plan=plan)
        local = pmodel.shard_inputs(*args, **kwargs)
        runs.append((pmodel, local if kwargs else (local, {})))
    pmodel, (local_args, local_kwargs) = runs[0]
    exclude = [*pmodel.parameters(), *pmodel.buffers()]
    exclude += [x for x in local_args if isinstance(x, torch.Tensor)]
    if pmodel.zero is not None:
        exclude += [c.full for c in pmodel.zero.chunks if c.full is not None]
    with count_saved_activation_bytes(pmodel.lowered.gm, exclude=exclude) as counter:
        loss = _loss(pmodel(*local_args, **local_kwargs))
    loss.backward()
    saved = None if pmodel.zero is not None and pmodel.zero.stage == 3 else counter.total_bytes
    optimizers = [torch.optim.SGD(run[0].parameters(), lr=1e-3) for run in runs]
    times: list[list[float]] = [[], []]
    # The plan and its twin without segments alternate step by step: the ratio of their
    # medians is robust to the load of a shared machine drifting during the run.
    for step in range(warmup + steps):
        for k, ((model_k, (a, kw)), opt) in enumerate(zip(runs, optimizers)):
            opt.zero_grad()
            dist.barrier()
            start = time.perf_counter()
            _loss(model_k(*a, **kw)).backward()
            opt.step()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if step >= warmup:
                times[k].append(float(elapsed))
    segments = sum(isinstance(m, CheckpointedSegment) for m in pmodel.lowered.gm.modules())
    return {
        "step_s": statistics.median(times[0]),
        "reference_step_s": statistics.median(times[1]),
        "saved_bytes": saved,
        "segments": segments,
    }


def measure_plans(
    factory: str,
    plans: Mapping[str, str],
    *,
    factory_args: tuple[Any, ...] = (),
    steps: int = 5,
    warmup: int = 2,
    timeout_s: float = 900.0,
) -> dict[str, Measured]:
    """Run every plan (name -> plan JSON, one mesh for all) on local gloo ranks (docstring);
    ``factory(*factory_args)`` builds the model and its global batch.

    Raises:
        ValueError: the plans were made for meshes of different shapes.
    """
    from tests.distributed.launcher import run_cases

    shapes = {tuple(json.loads(text)["mesh"]["shape"]) for text in plans.values()}
    if len(shapes) != 1:
        raise ValueError(f"measure_plans runs one mesh per call; the plans have shapes {shapes}")
    (shape,) = shapes
    results = run_cases(
        _measure_one,
        math.prod(shape),
        [(name, (name, text)) for name, text in plans.items()],
        factory,
        tuple(factory_args),
        steps,
        warmup,
        timeout_s=timeout_s,
    )
    out: dict[str, Measured] = {}
    for name, text in plans.items():
        per_rank = results[name].check()
        data = json.loads(text)
        saved = [v["saved_bytes"] for v in per_rank]
        out[name] = Measured(
            step_s=max(v["step_s"] for v in per_rank),
            saved_bytes=None if None in saved else max(saved),
            predicted_activation_bytes=float(data["predicted"]["memory"]["activations"]),
            predicted_step_s=float(data["predicted"]["step_s"]),
            num_segments=per_rank[0]["segments"],
            reference_step_s=max(v["reference_step_s"] for v in per_rank),
        )
    return out


def demo_gpt() -> tuple[Any, tuple[Any, ...]]:
    """The demo's model: a 4-layer GPT (width 128, sequence 64, global batch 8), seed 0."""
    from autopar.models import GPT, GPTConfig

    torch.manual_seed(0)
    config = GPTConfig(vocab_size=512, block_size=64, n_layer=4, n_head=4, n_embd=128)
    idx = torch.randint(0, 512, (8, 64), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 512, (8, 64), generator=torch.Generator().manual_seed(2))
    return GPT(config), (idx, targets)


def _demo() -> None:
    import autopar
    from autopar.capture.export import capture

    model, args = demo_gpt()
    mesh = autopar.Mesh.spec((2, 2), ("dp", "tp"), device="h100")
    base = json.loads(autopar.plan(model, mesh, args, recipe="megatron", optimizer="sgd").to_json())
    gm = capture(model, args).gm
    blocks: dict[str, list[str]] = {}
    for node in gm.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        path = list(stack.values())[-1][0] if stack else ""
        parts = path.split(".")
        if node.op == "call_function" and len(parts) >= 2 and parts[0] == "blocks":
            blocks.setdefault(".".join(parts[:2]), []).append(node.name)
    plans = {"baseline": json.dumps(base)}
    for count in (2, 4):
        data = json.loads(json.dumps(base))
        data["checkpoint"]["segments"] = [
            {
                "module_path": path,
                "nodes": nodes,
                "keep": [],
                "policy": "full",
                "saved_bytes": 0.0,
                "recompute_s": 0.0,
            }
            for path, nodes in list(blocks.items())[:count]
        ]
        plans[f"{count} blocks"] = json.dumps(data)
    measured = measure_plans("benchmarks.checkpointing_measure:demo_gpt", plans)
    print(
        f"{'plan':12s} {'step ms':>8s} {'overhead':>8s} {'saved KiB':>10s} {'predicted KiB':>14s}"
    )
    for name, m in measured.items():
        saved = "-" if m.saved_bytes is None else f"{m.saved_bytes / 1024:.0f}"
        print(
            f"{name:12s} {m.step_s * 1e3:8.1f} {m.overhead:8.3f} {saved:>10s} "
            f"{m.predicted_activation_bytes / 1024:14.0f}"
        )


def plan_json_of(space: Any, solved: Any, budget: float) -> str:
    """Plan JSON of one of ``benchmarks/checkpointing.py``'s solved rows (``autopar.planner.driver.Solved``)."""
    from autopar.plan.build import plan_document
    from autopar.planner.configurations import log_entry

    data = plan_document(
        space,
        solved,
        {},
        budget=budget,
        model_name="GPT",
        log=[log_entry(solved)],
        warnings=[],
        timings={"capture_s": 0.0, "strategies_s": 0.0, "solve_s": 0.0},
    )
    return json.dumps(data)


def without_segments(plan_json: str) -> str:
    """The same plan (layouts, ZeRO) with no recomputed segment: the overhead's reference."""
    data = json.loads(plan_json)
    data["checkpoint"]["segments"] = []
    return json.dumps(data)


def _sweep(layers: int, points: int, steps: int) -> None:
    """Measure benchmarks/checkpointing.py's sweep: every fitting (budget, policy) plan and its
    twin without segments, on 4 gloo ranks."""
    from benchmarks.checkpointing import sweep_rows

    rows = [r for r in sweep_rows(layers, points) if r["fits"]]
    from autopar.capture.export import capture
    from autopar.mesh import Mesh
    from autopar.options import PlanOptions
    from autopar.planner.problem import build_space
    from benchmarks.checkpointing import gpt

    model, args, kwargs = gpt(layers)
    space = build_space(
        capture(model, args, kwargs),
        Mesh.spec((2, 2), ("dp", "tp")),
        PlanOptions(checkpoint="auto", zero_stage=0),
    )
    plans: dict[str, str] = {}
    for k, row in enumerate(rows):
        plans[f"{k}"] = plan_json_of(space, row["solved"], row["budget"])
    measured = measure_plans(
        "benchmarks.checkpointing:gpt", plans, factory_args=(layers,), steps=steps
    )
    print(
        f"{'budget MiB':>10s} {'policy':24s} {'segs':>4s} {'pred ovh':>8s} {'meas ovh':>8s} "
        f"{'pred act KiB':>12s} {'meas act KiB':>12s}"
    )
    for k, row in enumerate(rows):
        got = measured[f"{k}"]
        recompute = row["recompute_s"] or 0.0
        predicted_overhead = row["step_s"] / max(row["step_s"] - recompute, 1e-12)
        saved = "-" if got.saved_bytes is None else f"{got.saved_bytes / 1024:.0f}"
        print(
            f"{row['budget'] / 2**20:10.3f} {row['policy'][:24]:24s} {got.num_segments:4d} "
            f"{predicted_overhead:8.3f} {got.overhead:8.3f} "
            f"{got.predicted_activation_bytes / 1024:12.0f} {saved:>12s}"
        )


if __name__ == "__main__":
    if "--sweep" in sys.argv:
        _sweep(layers=4, points=3, steps=9)
    else:
        _demo()
