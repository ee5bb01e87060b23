"""Calibration of ``LinkSpec.sync_s``: what a collective costs between computations.

A step of a tensor-parallel plan issues its activations' all-reduces between matmul segments,
forward and backward, through the runtime's autograd collectives. Between computations a
collective costs more than back to back: it waits for the rank that arrives last (descheduled
where ranks share cores: 4 ranks on 2 cores here), and the CPU it burns in gloo is taken from
the ranks still computing. Timed back to back none of that shows.

So the measurement is such a step, on every group of the axis at once (README, "Session 26"):
a chain of ``SYNC_LAYERS`` blocks, each an identity-forward / all-reduce-backward
(``GradAllReduce``), ``matmuls`` row-block matmuls of about ``CalibrationConfig.sync_segment_s``
and an all-reduce-forward / identity-backward (``AllReduce``) of a ``SYNC_ROWS x SYNC_WIDTH``
fp32 activation, run forward and backward: ``2 * SYNC_LAYERS`` all-reduces per pass. The same
chain without the collectives is timed in the same trial, interleaved, so that load from other
processes falls on both alike. Per trial the slowest rank's excess per call is
``(mixed - compute) / calls``; ``sync_s`` is the median over ``config.sync_trials`` trials of
that excess less what the link's fit prices the same all-reduce back to back
(``cost_models.collective_time_s`` on the fitted alpha-beta, not a single back-to-back timing,
whose jitter on 2 loaded cores was 0.3-5 ms per call and made the old estimate swing 0.3-2.4 ms
from one calibration to the next). The planner then pays ``sync_s`` once per collective it
prices (``collective_time_s``): the activations' all-reduces and all-gathers of tensor
parallelism forward and backward, the gradient buckets and ZeRO's chunks alike.
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from autopar.tools.timing import max_over_ranks, mean_over_ranks, time_queued
from cost_models import LinkSpec
from cost_models.calibrate import chain_sync_s, paired_spreads

if TYPE_CHECKING:
    from autopar.tools.calibration import CalibrationConfig

__all__ = ["SYNC_LAYERS", "SYNC_ROWS", "SYNC_WIDTH", "measure_sync", "sync_segment_matmuls"]

SYNC_ROWS = 512
"""Rows of the activation each block all-reduces (with ``SYNC_WIDTH``: 512 KiB in fp32, the
size of a 2-layer GPT's activation at batch 4 x 128 tokens x 256 features)."""
SYNC_WIDTH = 256
"""Features of that activation; the matmuls are ``SYNC_ROWS x SYNC_WIDTH`` by square."""
SYNC_LAYERS = 4
"""Blocks of the chain: two all-reduces each per forward and backward."""
SYNC_PASS_S = 0.25
"""About how long one timing runs (passes of the chain repeated up to it)."""


def sync_segment_matmuls(matmul_s: float, segment_s: float) -> int:
    """How many matmuls of ``matmul_s`` seconds make a computation of ``segment_s`` between two
    collectives (at least one).

    Why the length matters: a blocking collective waits for its slowest rank, and a rank that
    shares its core with other processes falls behind when it is descheduled during the
    computation before it, so the wait grows with that computation until it spans a
    scheduler time slice (measured, 2 gloo ranks at load 6: 0.55 / 1.2 / 3.3 / 3.8 ms per call
    after 0.1 / 0.6 / 2.4 / 4.0 ms of matmul; README, "Session 11").
    """
    if not matmul_s > 0 or not segment_s > 0:
        raise ValueError(f"matmul_s and segment_s must be > 0, got {matmul_s}, {segment_s}")
    return max(1, round(segment_s / matmul_s))


def _chain(groups: Any, axis: int, weights: list[torch.Tensor], matmuls: int, with_comm: bool):
    """One forward and backward of the chain (module docstring); collectives only where
    ``with_comm``."""
    from autopar.comm.collectives import AllReduce, GradAllReduce

    # The input needs a gradient: the first block's backward all-reduce runs only then.
    x = torch.randn(SYNC_ROWS, SYNC_WIDTH, device=weights[0].device, requires_grad=True)

    def run() -> None:
        h = x
        for layer in range(SYNC_LAYERS):
            if with_comm:
                h = GradAllReduce.apply(h, groups, axis)
            for w in weights[layer * matmuls : (layer + 1) * matmuls]:
                h = torch.tanh(h @ w)
            if with_comm:
                h = AllReduce.apply(h, groups, axis)
        h.sum().backward()

    return run


def measure_sync(
    groups: Any, axis: int, link: LinkSpec, device: torch.device, config: CalibrationConfig
) -> tuple[float, dict[str, Any]]:
    """``LinkSpec.sync_s`` of mesh axis ``axis`` (module docstring), with ``link`` the axis's
    fitted link (its ``sync_s`` ignored); returns it and the details kept in the profile."""
    group, size = groups.groups[axis], groups.mesh_shape[axis]
    gen = torch.Generator().manual_seed(0)
    probe = torch.randn(SYNC_WIDTH, SYNC_WIDTH, generator=gen).to(device) / SYNC_WIDTH**0.5
    act = torch.randn(SYNC_ROWS, SYNC_WIDTH, generator=gen).to(device)
    matmul_s = max_over_ranks([time_queued(lambda: act @ probe, device, 5, 3)], device)[0]
    matmuls = sync_segment_matmuls(matmul_s, config.sync_segment_s)
    weights = [
        (torch.randn(SYNC_WIDTH, SYNC_WIDTH, generator=gen) / SYNC_WIDTH**0.5)
        .to(device)
        .requires_grad_()
        for _ in range(SYNC_LAYERS * matmuls)
    ]
    mixed = _chain(groups, axis, weights, matmuls, True)
    compute = _chain(groups, axis, weights, matmuls, False)
    small = torch.zeros(SYNC_ROWS * SYNC_WIDTH, device=device)

    def collective() -> None:
        dist.all_reduce(small, group=group)

    calls = 2 * SYNC_LAYERS
    # Passes per timing: about SYNC_PASS_S (a pass is 3x the forward's matmuls, fwd + bwd).
    passes = max(1, min(10, round(SYNC_PASS_S / (3 * SYNC_LAYERS * matmuls * matmul_s))))
    mixed()
    compute()
    times: dict[str, list[float]] = {"mixed": [], "compute": [], "collective": []}
    cpu: dict[str, list[float]] = {"mixed": [], "compute": []}
    for _ in range(config.sync_trials):
        for key, fn, count in (("mixed", mixed, passes), ("compute", compute, passes),
                               ("collective", collective, calls)):  # fmt: skip
            dist.barrier()
            start = time.process_time()
            per = time_queued(fn, device, count, 1)
            times[key].append(per / calls if key != "collective" else per)
            if key in cpu:  # this rank's CPU per call, recorded beside the wall time
                cpu[key].append((time.process_time() - start) / count / calls)
    cpu_excess = mean_over_ranks([m - c for m, c in zip(cpu["mixed"], cpu["compute"])], device)
    paired = paired_spreads({"compute": times["compute"], "collective": times["collective"]})
    for key in times:
        times[key] = max_over_ranks(times[key], device)
    nbytes = float(SYNC_ROWS * SYNC_WIDTH * 4)
    sync_s, priced = chain_sync_s(link, times["mixed"], times["compute"], nbytes, size)
    excess = [m - c for m, c in zip(times["mixed"], times["compute"])]
    details = {
        "sync_s": sync_s,
        "seconds_per_call": times,
        "excess_per_call": excess,
        "excess_median": statistics.median(excess),
        "priced_back_to_back_s": priced,
        "back_to_back_median": statistics.median(times["collective"]),
        "cpu_excess_per_call": cpu_excess,
        "calls": calls,
        "passes": passes,
        "bytes": nbytes,
        "group_size": size,
        "matmuls_per_segment": matmuls,
        "segment_s": matmuls * matmul_s,
        "paired_spread": {k: max_over_ranks([v], device)[0] for k, v in paired.items()},
    }
    return sync_s, details
