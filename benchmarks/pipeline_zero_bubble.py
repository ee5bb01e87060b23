"""Split-backward (zero-bubble) schedules against interleaved 1F1B on gloo, measured in one run.

    PYTHONPATH=. python benchmarks/pipeline_zero_bubble.py              # pp=2, 2 ranks
    PYTHONPATH=. python benchmarks/pipeline_zero_bubble.py --reps 5 --steps 4

One spawn of 2 ranks (one per core) builds an 8-block GPT (n_embd 256, seq 128, batch 16,
untied head) under every schedule with 2 stages per rank (``interleaved-1f1b``,
``zero-bubble``, ``zbv``, ``dualpipev``; 8 microbatches) and times ``pmodel.step``: ``--reps``
repetitions of ``--steps`` steps, the schedules interleaved within each repetition so load from
other processes hits them alike. A step's time is the slowest rank's (a barrier before each);
a repetition's figure is its median step; the table gives the median and min-max over
repetitions and each schedule's ratio to interleaved 1F1B (per repetition, then the median),
plus the busy share of the busiest rank (``PipelineModule.busy_s`` / step) and the largest loss
difference between the schedules (all run the same model on the same batch).

Predicted beside measured (issue 15: the split schedules priced): before the spawn each
schedule is planned for the same model, batch and microbatches on a 2-rank ``pp`` mesh
(``autopar.plan(..., stages=2, microbatches=8, schedule=...)``, 2 stages per rank), with
``--profile`` (a calibrated profile, e.g. from ``benchmarks/pipeline_cost_check.py --out``) or
the "cpu" preset; the table adds each schedule's predicted step, measured / predicted (median
over repetitions), and the predicted and measured ratios to interleaved 1F1B: the ratio is the
check that does not depend on the absolute calibration (the split schedules' extra weight-pass
work: planner/split_schedules.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SCHEDULES = ("interleaved-1f1b", "zero-bubble", "zbv", "dualpipev")


def _config():
    from autopar.models import GPTConfig

    return GPTConfig(
        vocab_size=512, block_size=128, n_layer=8, n_head=4, n_embd=256, tie_weights=False
    )


def predicted(profile: str | None) -> dict[str, float]:
    """Each schedule's predicted step (seconds) for the benchmark's model on 2 ``pp`` ranks."""
    import torch

    import autopar
    from autopar.models import GPT

    config = _config()
    mesh = (
        autopar.Mesh.spec((2,), ("pp",), profile=profile)
        if profile
        else autopar.Mesh.spec((2,), ("pp",), device="cpu")
    )
    batch = (torch.zeros(16, 128, dtype=torch.long), torch.zeros(16, 128, dtype=torch.long))
    out = {}
    for schedule in SCHEDULES:
        plan = autopar.plan(
            GPT(config), mesh, batch, stages=2, microbatches=8, schedule=schedule, optimizer="sgd"
        )
        out[schedule] = float(plan.pipeline.predicted["step_s"])
    return out


def _run(rank: int, world: int, reps: int, steps: int) -> dict:
    import torch
    import torch.distributed as dist

    import autopar
    from autopar.models import GPT

    torch.manual_seed(0)
    config = _config()
    idx = torch.randint(0, config.vocab_size, (16, 128))
    targets = torch.randint(0, config.vocab_size, (16, 128))
    mesh = autopar.Mesh.from_world((world,), ("pp",), device="cpu")
    models = {}
    for schedule in SCHEDULES:
        torch.manual_seed(0)
        model = GPT(config)
        models[schedule] = autopar.autoparallelize(
            model,
            mesh,
            (idx, targets),
            pipeline={"microbatches": 8, "schedule": schedule},
            optimizer="sgd",
            price_baselines=False,
        )
    times: dict[str, list[float]] = {s: [] for s in SCHEDULES}
    busy: dict[str, list[float]] = {s: [] for s in SCHEDULES}
    losses: dict[str, float] = {}
    for schedule, pmodel in models.items():  # warm-up
        losses[schedule] = float(pmodel.step(idx, targets))
    for _ in range(reps):
        for schedule, pmodel in models.items():
            per_step, shares = [], []
            for _ in range(steps):
                dist.barrier()
                start = time.perf_counter()
                pmodel.step(idx, targets)
                wall = torch.tensor([time.perf_counter() - start, pmodel.busy_s])
                every = [torch.zeros(2) for _ in range(world)]
                dist.all_gather(every, wall)
                step = max(float(w[0]) for w in every)
                per_step.append(step)
                shares.append(max(float(w[1]) for w in every) / step)
                for p in pmodel.parameters():
                    p.grad = None
            times[schedule].append(statistics.median(per_step))
            busy[schedule].append(statistics.median(shares))
    return {"times": times, "busy": busy, "losses": losses}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--profile", default=None, help="a calibrated profile (default: cpu)")
    args = parser.parse_args()
    from autopar.runtime.spawn import spawn_ranks

    plans = predicted(args.profile)
    result = spawn_ranks(_run, 2, args.reps, args.steps, timeout_s=1200)[0]
    times, busy, losses = result["times"], result["busy"], result["losses"]
    base = times["interleaved-1f1b"]
    print(
        "schedule           step s (median, min-max)   / interleaved-1f1b (median, min-max)"
        "   busy   predicted s   measured / predicted   predicted / interleaved-1f1b"
    )
    for schedule in SCHEDULES:
        t = times[schedule]
        ratios = [a / b for a, b in zip(t, base, strict=True)]
        print(
            f"{schedule:18s} {statistics.median(t):.3f} ({min(t):.3f}-{max(t):.3f})"
            f"            {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})"
            f"                  {statistics.median(busy[schedule]):.2f}"
            f"   {plans[schedule]:.3f}         {statistics.median(t) / plans[schedule]:.3f}"
            f"                  {plans[schedule] / plans['interleaved-1f1b']:.3f}"
        )
    spread = max(losses.values()) - min(losses.values())
    print(f"largest loss difference between the schedules: {spread:.2e}")


if __name__ == "__main__":
    main()
