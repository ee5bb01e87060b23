"""The rates calibration's pipeline is priced against: the fp32 matmul rate at a pipeline round
(:func:`matmul_rate_now`) and the planner's own price of the calibration pipeline's tasks
(:func:`priced_stage_tasks`). Split out of :mod:`autopar.tools.calibration_pipeline` (files
under 500 lines); :mod:`autopar.tools.calibration_level` compares these prices with the tasks'
wall and thread CPU seconds."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


def matmul_rate_now(sizes: Sequence[int], device: torch.device) -> float:
    """fp32 matmul FLOP/s now, fitted as calibration fits ``peak_flops`` (every rank timing each
    size at once, mean over ranks, through the origin; 0.1 s per size): the machine's rate at a
    pipeline round, against which :func:`pipeline_compute_level` can take the level apart from
    the load's drift since the peak was timed."""
    from autopar.tools.timing import mean_over_ranks, time_callable
    from cost_models.calibrate import fit_rate
    from cost_models.compute import matmul_flops

    times = []
    for n in sizes:
        a = torch.randn(n, n, device=device)
        dist.barrier()
        times.append(time_callable(lambda a=a: a @ a, device=device, min_time_s=0.1, trials=1))
    times = mean_over_ranks(times, device)
    return fit_rate([matmul_flops(n, n, n) for n in sizes], times, through_origin=True)[0]


def priced_stage_tasks(
    spec: Any, *, width: int, rows: int, layers: int, world: int
) -> tuple[list[float], list[float]]:
    """Per stage of calibration's pipeline, the seconds of one microbatch's forward and
    backward as the planner prices them on ``spec`` (every rank computing): each linear layer's
    roofline (``autopar.capture.flops.op_costs``, ``cost_models.compute_time_s``), stage 0's
    input needing no gradient; the last stage's loss (one square and one sum of a microbatch,
    under 1% of its work) is left out."""
    from autopar.capture.flops import op_costs
    from cost_models.compute import compute_time_s

    forward, backward = [], []
    for stage in range(world):
        f = b = 0.0
        for layer in range(layers):
            x = torch.empty(rows, width, device="meta", requires_grad=stage > 0 or layer > 0)
            w = torch.empty(width, width, device="meta", requires_grad=True)
            bias = torch.empty(width, device="meta", requires_grad=True)
            work = op_costs(torch.ops.aten.linear.default, [x, w, bias])
            f += compute_time_s(flops=work.fwd_flops, bytes_accessed=work.fwd_bytes,
                                device=spec, family=work.family)  # fmt: skip
            b += compute_time_s(flops=work.bwd_flops, bytes_accessed=work.bwd_bytes,
                                device=spec, family=work.family)  # fmt: skip
        forward.append(f)
        backward.append(b)
    return forward, backward


def matmul_cpu_share(sizes: Sequence[int], device: torch.device) -> tuple[float, float]:
    """The share of a core each rank gets while every rank computes at once, as calibration
    times its ops (``peak_flops``, the family efficiencies): every rank multiplies each size for
    0.2 s, recording thread CPU seconds beside wall seconds; returns ``(share, rate)``, the
    ranks' mean CPU over wall seconds and the fp32 FLOP/s per CPU second. The profile's prices
    are wall seconds at that share: a stage priced ``t`` needs ``t x share`` CPU seconds."""
    import time

    from autopar.tools.timing import mean_over_ranks
    from cost_models.compute import matmul_flops

    cpu = wall = flops = 0.0
    for n in sizes:
        a = torch.randn(n, n, device=device)
        a @ a  # warm-up
        dist.barrier()
        start, cpu_start, count = time.perf_counter(), time.thread_time(), 0
        while count < 2 or time.perf_counter() - start < 0.2:
            a @ a
            count += 1
        cpu += time.thread_time() - cpu_start
        wall += time.perf_counter() - start
        flops += count * matmul_flops(n, n, n)
    share, cpu_s = mean_over_ranks([min(1.0, cpu / wall), cpu], device)
    return share, flops / cpu_s
