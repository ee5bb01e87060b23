"""Calibration of a pipeline's per-task wait (``DeviceSpec.task_wait_s``) on CPU ranks.

A pipeline rank does more than compute and send: between two of its tasks (one microbatch's
forward or backward) it waits to be woken by the receive it posted, gloo's threads run, and the
schedule's Python picks the next action. On ranks that share cores under load this was 7-11 ms
per task (README, "Session 9"), more than the transfer the link's ``broadcast`` fit prices.

Measured as it happens: every rank of the job runs one stage of a short GPipe pipeline
(torch's ``PipelineStage`` and ``ScheduleGPipe``, as :mod:`autopar.runtime.pipeline` drives
them) whose stage is one ``width x width`` linear layer at ``rows`` rows per microbatch, with
``width`` calibration's largest matmul size (a few milliseconds of compute per task, the
order of a small model's stage). Per step, each rank's compute is the wall time inside its
stage's microbatch forwards and backwards (``PipelineModule.busy_s``'s definition). The wait
is the ``task_wait_s`` for which the shared-cores simulation of that step, fed with the
measured compute per task (which already carries the contention, so at speed 1) and the
calibrated transfer of the activation, equals the measured step: bisection, the simulated step
grows monotonically with the wait. Median over rounds of a few steps; 0 when the model needs
no wait. GPUs and one rank: not measured (0).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

PIPELINE_ROWS = 128
"""Rows per microbatch of the calibration pipeline (its activation: ``rows x width`` fp32,
about 390 KiB at width 768, the size of a small model's stage boundary)."""
PIPELINE_MICROBATCHES = 4


def _timed_stage_class() -> type:
    from torch.distributed.pipelining import PipelineStage

    class TimedStage(PipelineStage):
        """Adds the wall seconds of the microbatch forwards and backwards to ``busy``."""

        busy: list[float]

        def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return super().forward_one_chunk(*args, **kwargs)
            finally:
                self.busy[0] += time.perf_counter() - start

        def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return super().backward_one_chunk(*args, **kwargs)
            finally:
                self.busy[1] += time.perf_counter() - start

    return TimedStage


def fit_task_wait(
    step_s: float,
    forward_s: list[float],
    backward_s: list[float],
    p2p_s: list[float],
    *,
    microbatches: int,
    schedule: str = "gpipe",
) -> float:
    """The ``task_wait_s`` that makes the simulated step of stages with these per-microbatch
    seconds equal ``step_s`` (0 if it is shorter already); bisection to 1e-7 s."""
    from autopar.planner.pipeline_schedule import StageCost
    from autopar.planner.shared_cores import shared_schedule_time

    stages = [
        StageCost(forward_s=f, backward_s=b, p2p_s=s)
        for f, b, s in zip(forward_s, backward_s, p2p_s, strict=True)
    ]

    def simulated(wait: float) -> float:
        return shared_schedule_time(
            stages, microbatches=microbatches, schedule=schedule, busy_rank_speed={},
            task_wait_s=wait,
        ).step_s  # fmt: skip

    low, high = 0.0, step_s
    if simulated(low) >= step_s:
        return 0.0
    while high - low > 1e-7:
        mid = (low + high) / 2
        low, high = (mid, high) if simulated(mid) < step_s else (low, mid)
    return (low + high) / 2


def measure_task_wait(
    width: int,
    links: Mapping[str, Any],
    device: torch.device,
    log: Callable[[str], None],
    *,
    rounds: int = 3,
    steps: int = 3,
    rows: int = PIPELINE_ROWS,
    layers: int = 1,
) -> tuple[float, Mapping[str, Any]]:
    """``DeviceSpec.task_wait_s`` (module docstring) and the measurements behind it.

    Args:
        width: the stage's layer width (calibration's largest matmul size).
        links: the calibrated links by axis name; a send is priced on ``pp``'s (else the
            first axis's) ``broadcast`` fit, as the planner prices a stage's sends.
    """
    from torch.distributed.pipelining import ScheduleGPipe

    from cost_models import collective_time_s

    world, rank = dist.get_world_size(), dist.get_rank()
    if device.type != "cpu" or world == 1:
        return 0.0, {}
    m = PIPELINE_MICROBATCHES
    torch.manual_seed(rank)
    group = dist.new_group(list(range(world)))
    layer_stack = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))
    stage = _timed_stage_class()(layer_stack, rank, world, device, group=group)
    stage.busy = [0.0, 0.0]
    schedule = ScheduleGPipe(stage, m, loss_fn=lambda out, target: (out - target).square().sum())
    x = torch.randn(m * rows, width)

    def one_step() -> list[float]:
        stage.busy[:] = [0.0, 0.0]
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=torch.zeros(m * rows, width))
        else:
            schedule.step()
        mine = torch.tensor([time.perf_counter() - start, *stage.busy], dtype=torch.float64)
        every = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(every, mine)
        return [float(v) for t in every for v in t]

    one_step()  # warm-up: shape inference, first-call costs
    link = links.get("pp") or next(iter(links.values()))
    send = collective_time_s("broadcast", float(rows * width * 4), 2, link)
    p2p = [send * ((i > 0) + (i < world - 1)) for i in range(world)]
    per_round: list[dict[str, Any]] = []
    for _ in range(rounds):
        timed = [one_step() for _ in range(steps)]
        step = statistics.median(max(t[0::3]) for t in timed)
        forward = [statistics.median(t[3 * r + 1] for t in timed) / m for r in range(world)]
        backward = [statistics.median(t[3 * r + 2] for t in timed) / m for r in range(world)]
        wait = fit_task_wait(step, forward, backward, p2p, microbatches=m)
        per_round.append({"step_s": step, "forward_s": forward, "backward_s": backward,
                          "task_wait_s": wait})  # fmt: skip
    wait = statistics.median(r["task_wait_s"] for r in per_round)
    log(f"pipeline wait per task (GPipe, {world} stages, m={m}): {wait * 1e3:.2f} ms")
    dist.destroy_process_group(group)
    detail = {"schedule": "gpipe", "microbatches": m, "rows": rows, "width": width, "layers": layers,
              "p2p_s": p2p, "rounds": per_round}  # fmt: skip
    return wait, detail
