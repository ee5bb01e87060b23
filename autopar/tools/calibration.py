"""Calibration: time this machine's kernels and collectives and write a hardware profile.

Run on every rank of a job (torchrun, or :func:`spawn_local` for ranks on 127.0.0.1). Every rank
measures at the same time (so the figures include the contention a real step sees, e.g. ranks
sharing CPU cores) and the ranks' timings are averaged; collectives are timed on every group of
each mesh axis at once and the slowest rank counts. The result is a ``cost_models.Profile`` in the
schema ``cost_models.load_profile`` reads:

- ``device.peak_flops[dtype]``: large-matmul throughput (fp32; bf16 where it runs);
- ``device.mem_bandwidth_Bps``: large-copy bandwidth (read + write bytes per second);
- ``device.kernel_overhead_s``: the time of a one-element op;
- ``device.busy_rank_speed`` and ``device.task_wait_s`` (CPU ranks only): per-rank compute speed
  with 1, 2, 3, ... ranks computing at once, relative to the prices of the other figures (the
  CPU level of a short pipeline times each count's share of the cores), and a pipeline's wait
  per task (:mod:`autopar.tools.calibration_pipeline`), both priced by pipelines;
- ``device.op_efficiency[family]``: for matmul, attention, pointwise, activation, norm, softmax,
  embedding, reduction and loss, the fraction of the roofline ``max(flops / peak, bytes /
  bandwidth)`` that representative ops (pointwise: add, mul; activation: gelu, silu) reach
  forward plus backward (above 1, up to ``MAX_OP_EFFICIENCY``, where the data stays in cache),
  with FLOPs from ``autopar.capture.flops`` and bytes counted as the planner counts them (local
  inputs plus outputs, twice that in backward);
- ``links[axis]``: per collective kind ``(alpha, beta)`` fitted over message sizes, and the
  timings of small messages, by :mod:`autopar.tools.calibration_links`.

This module measures the device and drives the run; every timing goes through
:mod:`autopar.tools.timing`.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import platform
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from autopar.capture.flops import op_costs
from autopar.runtime.spawn import pg_timeout_s, spawn_ranks
from autopar.tools.calibration_links import measure_links
from autopar.tools.calibration_pipeline import with_pipeline_figures
from autopar.tools.sessions import own_scheduling_group, session_count
from autopar.tools.timing import fwd_bwd_callable, mean_over_ranks, time_callable
from cost_models import DeviceSpec, Profile
from cost_models.calibrate import (
    build_profile,
    fit_efficiency,
    fit_rate,
    paired_error_of,
    step_error_of,
)
from cost_models.compute import matmul_flops
from cost_models.hardware import MAX_OP_EFFICIENCY, backend_fields

aten = torch.ops.aten

CALIBRATED_FAMILIES = (
    "matmul", "attention", "pointwise", "activation", "norm", "softmax", "embedding", "reduction",
    "loss",
)  # fmt: skip


@dataclass(frozen=True, kw_only=True, slots=True)
class CalibrationConfig:
    """How much to measure (defaults: about 45 s for 4 CPU ranks on 2 cores)."""

    matmul_sizes: tuple[int, ...] = (256, 512, 768)
    """Square matmul sizes n (an n x n by n x n product) for the FLOP/s fit."""
    copy_bytes: tuple[int, ...] = (16 * 2**20, 64 * 2**20)
    """Sizes of the copies that measure memory bandwidth."""
    op_scales: tuple[int, ...] = (1, 2)
    """Multipliers of each family's base shape (the efficiency fit uses every scale)."""
    collective_bytes: tuple[int, ...] = tuple(k * 2**10 for k in (16, 128, 512, 2048, 4096, 8192))
    """Message sizes (the ``nbytes`` of ``cost_models.collective_time_s``)."""
    small_message_bytes: tuple[int, ...] = (4, 8, 16, 32, 64, 1024)
    """Sizes below ``collective_bytes``' for ``LinkSpec.small_messages`` (not the fit)."""
    min_time_s: float = 0.02
    """Each timing repeats its op until this many seconds have passed (at least 2 runs)."""
    trials: int = 5
    """Timings per measurement; the median is kept."""
    sync_segment_s: float = 0.01
    """Computation between two collectives where ``LinkSpec.sync_s`` is measured (as a step's)."""
    sync_trials: int = 9
    """Trials of the sync measurement; the median of the per-trial excess is kept."""
    cores: int | None = None
    """The cores one host's ranks share (None: this process's CPU affinity). Where ranks
    outnumber them, the collectives' CPU weight is measured (``LinkSpec.cpu_weight``)."""

    @classmethod
    def for_gpu(cls) -> CalibrationConfig:
        """Sizes for a data-center GPU: matmuls and copies large enough to leave launch
        overhead behind (8192^3 bf16 is about 1 ms on an H100), op shapes 16-64x the CPU's."""
        return cls(
            matmul_sizes=(2048, 4096, 8192),
            copy_bytes=(256 * 2**20, 1024 * 2**20),
            op_scales=(16, 64),
            collective_bytes=(1 * 2**20, 8 * 2**20, 32 * 2**20, 128 * 2**20),
            small_message_bytes=(4, 4096, 65536),
            min_time_s=0.05,
            trials=5,
        )

    @classmethod
    def tiny(cls) -> CalibrationConfig:
        """Minimal sizes for tests (a couple of seconds)."""
        return cls(
            matmul_sizes=(64, 128),
            copy_bytes=(4 * 2**20, 16 * 2**20),
            op_scales=(1,),
            collective_bytes=(32 * 2**10, 512 * 2**10, 2 * 2**20),
            small_message_bytes=(4, 64),
            min_time_s=0.003,
            trials=2,
            sync_segment_s=0.002,
            sync_trials=3,
        )


# --------------------------------------------------------------------------------------------
# Work of one op, as the planner prices it


def op_work(
    target: Any, args: Sequence[Any], kwargs: dict[str, Any] | None = None
) -> tuple[float, float, float, float]:
    """``(fwd_flops, bwd_flops, fwd_bytes, bwd_bytes)`` of ``target(*args)`` as the planner
    prices it: ``autopar.capture.flops.op_costs``, i.e. the formulas of ``cost_models.compute``."""
    work = op_costs(target, args, kwargs)
    return work.fwd_flops, work.bwd_flops, float(work.fwd_bytes), float(work.bwd_bytes)


def family_cases(
    scale: int, device: torch.device
) -> dict[str, list[tuple[Any, list[Any], dict[str, Any]]]]:
    """Representative ops per family at size ``scale``: family -> [(target, args, kwargs)].

    A family's efficiency is one number for all its members, so it is fitted over the members
    models use most: "pointwise" times add and mul (bytes at cache speed), "activation" gelu
    and silu (2-4x the time per byte on a CPU: erf, exp); one family for the four priced gelu
    at a third of its time in a step (README "Session 33")."""

    def t(*shape: int, grad: bool = True) -> torch.Tensor:
        return torch.randn(*shape, device=device, requires_grad=grad)

    s = scale
    tokens = 256 * s
    return {
        "matmul": [(aten.linear.default, [t(2 * tokens, 256), t(768, 256), t(768)], {})],
        "attention": [(
            aten.scaled_dot_product_attention.default,
            [t(2, 4, 64 * s, 32), t(2, 4, 64 * s, 32), t(2, 4, 64 * s, 32)],
            {"is_causal": True},
        )],
        "pointwise": [
            (aten.add.Tensor, [t(tokens, 512), t(tokens, 512)], {}),
            (aten.mul.Tensor, [t(tokens, 512), t(tokens, 512)], {}),
        ],
        "activation": [
            (aten.gelu.default, [t(tokens, 512)], {}),
            (aten.silu.default, [t(tokens, 512)], {}),
        ],
        "norm": [(aten.layer_norm.default, [t(tokens, 512), [512], t(512), t(512)], {})],
        "softmax": [(aten.softmax.int, [t(tokens, 512), -1], {})],
        "embedding": [(
            aten.embedding.default,
            [t(1024, 256), torch.randint(0, 1024, (tokens,), device=device)],
            {},
        )],
        "reduction": [(aten.sum.dim_IntList, [t(tokens, 512), [-1]], {})],
        "loss": [(
            aten.cross_entropy_loss.default,
            [t(tokens, 512), torch.randint(0, 512, (tokens,), device=device)],
            {},
        )],
    }  # fmt: skip


# --------------------------------------------------------------------------------------------
# The measurements (every rank runs them at the same time)
def _bf16_matmul_works(device: torch.device) -> bool:
    try:
        a = torch.ones(8, 8, dtype=torch.bfloat16, device=device)
        return bool(torch.isfinite((a @ a).float()).all())
    except RuntimeError:
        return False


def _time_round(
    config: CalibrationConfig, device: torch.device, dtypes: list[torch.dtype]
) -> dict[str, Any]:
    """One round of every device timing (each op once, ``min_time_s`` of calls), averaged over
    ranks: matmuls per dtype, copies, the one-element op and every family case."""
    timing = {"device": device, "min_time_s": config.min_time_s, "trials": 1}
    out: dict[str, Any] = {}
    for dtype in dtypes:
        times = []
        for n in config.matmul_sizes:
            a = torch.randn(n, n, device=device, dtype=dtype)
            b = torch.randn(n, n, device=device, dtype=dtype)
            times.append(time_callable(lambda a=a, b=b: a @ b, **timing))
        out[str(dtype).removeprefix("torch.")] = mean_over_ranks(times, device)
    times = []
    for nbytes in config.copy_bytes:
        src = torch.empty(nbytes // 4, device=device)
        dst = torch.empty_like(src)
        src.uniform_()
        times.append(time_callable(lambda s=src, d=dst: d.copy_(s), **timing))
    out["copy"] = mean_over_ranks(times, device)
    one = torch.ones(1, device=device)
    out["overhead"] = mean_over_ranks([time_callable(lambda: one.add(1.0), **timing)], device)[0]
    work: dict[str, list[tuple[float, float, float, float, int, int]]] = {}
    times = []
    for scale in config.op_scales:
        for family, cases in family_cases(scale, device).items():
            for target, args, kwargs in cases:
                fwd_flops, bwd_flops, fwd_bytes, bwd_bytes = op_work(target, args, kwargs)
                kernels = 2 if bwd_bytes > 0 else 1
                work.setdefault(family, []).append(
                    (fwd_flops, bwd_flops, fwd_bytes, bwd_bytes, kernels, len(times))
                )
                times.append(time_callable(fwd_bwd_callable(target, args, kwargs), **timing))
    times = mean_over_ranks(times, device)
    # Per family: (fwd_flops, bwd_flops, fwd_bytes, bwd_bytes, kernels, seconds).
    out["ops"] = {f: [(*w[:5], times[w[5]]) for w in entries] for f, entries in work.items()}
    return out


def measure_device(
    config: CalibrationConfig, device: torch.device, log: Callable[[str], None]
) -> tuple[DeviceSpec, dict[str, Any]]:
    """Peak FLOP/s per dtype, memory bandwidth, launch overhead and per-family efficiency.

    Measured in ``config.trials`` interleaved rounds, each timing everything once: a family's
    efficiency is fitted against the peak and bandwidth of ITS round and the median over rounds
    kept (as are the peak, bandwidth and overhead). On a machine whose load changes within
    seconds (ranks sharing cores with other processes) a family timed seconds after the peak
    otherwise carries the load change into its efficiency (2x swings seen)."""
    dtypes = [torch.float32] + ([torch.bfloat16] if _bf16_matmul_works(device) else [])
    names = [str(d).removeprefix("torch.") for d in dtypes]
    rounds = [_time_round(config, device, dtypes) for _ in range(max(config.trials, 1))]
    flops = [matmul_flops(n, n, n) for n in config.matmul_sizes]
    moved = [2.0 * nbytes for nbytes in config.copy_bytes]
    fits: dict[str, list[float]] = {}
    for timed in rounds:
        peak = {name: fit_rate(flops, timed[name], through_origin=True)[0] for name in names}
        bandwidth = fit_rate(moved, timed["copy"], through_origin=True)[0]
        for name in names:
            fits.setdefault(name, []).append(peak[name])
        fits.setdefault("bandwidth", []).append(bandwidth)
        fits.setdefault("overhead", []).append(timed["overhead"])
        for family, samples in timed["ops"].items():
            ideals = [
                max(ff / peak["float32"], fb / bandwidth)
                + (max(bf / peak["float32"], bb / bandwidth) if kernels == 2 else 0.0)
                for ff, bf, fb, bb, kernels, _ in samples
            ]
            efficiency = fit_efficiency(
                ideals,
                [t for *_, t in samples],
                [kernels * timed["overhead"] for *_, kernels, _ in samples],
                max_efficiency=MAX_OP_EFFICIENCY,
            )
            fits.setdefault(f"op_{family}", []).append(efficiency)
    median = {key: statistics.median(values) for key, values in fits.items()}
    for name in names:
        log(f"matmul {name}: {median[name] / 1e9:.1f} GFLOP/s")
    log(f"memory bandwidth: {median['bandwidth'] / 1e9:.2f} GB/s")
    log(f"kernel overhead: {median['overhead'] * 1e6:.1f} us")
    efficiency = {f: median[f"op_{f}"] for f in CALIBRATED_FAMILIES}
    log("op efficiency: " + ", ".join(f"{f} {e:.2f}" for f, e in efficiency.items()))
    details: dict[str, Any] = {
        **{f"matmul_{n}": {"flops": flops, "seconds": [r[n] for r in rounds]} for n in names},
        "copy": {"bytes": moved, "seconds": [r["copy"] for r in rounds]},
        "fits_per_round": fits,
    }
    for family in CALIBRATED_FAMILIES:
        details[f"op_{family}"] = {"seconds": [[s[-1] for s in r["ops"][family]] for r in rounds]}
    spec = DeviceSpec(
        name=f"calibrated-{device.type}",
        peak_flops={name: median[name] for name in names},
        mem_bandwidth_Bps=median["bandwidth"],
        mem_capacity_bytes=_memory_capacity(device),
        # The datasheet-style fields (families without a calibrated figure) stay fractions.
        matmul_efficiency=min(1.0, efficiency["matmul"]),
        memory_efficiency=min(1.0, efficiency["pointwise"]),
        kernel_overhead_s=median["overhead"],
        op_efficiency=efficiency,
        source=f"autopar calibrate on {platform.node()} ({_device_label(device)})",
    )
    return spec, details


def measure_busy_rank_speed(
    config: CalibrationConfig, device: torch.device, log: Callable[[str], None], rounds: int = 3
) -> tuple[dict[str, float], dict[str, Any]]:
    """``DeviceSpec.busy_rank_speed`` on CPU ranks: the largest matmul timed with only ranks
    ``0..k-1`` computing (the others wait in the all-reduce that collects the timings, as a
    pipeline's idle stages wait in a receive), for ``k`` = 1, 2, 4, ... and every rank; per-rank speed relative to every rank
    computing. The counts are interleaved over ``rounds`` rounds (median per count) so that a
    change in the machine's load hits them alike. Empty on GPUs and on one rank (each rank
    has its own device, or nothing shares it)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if device.type != "cpu" or world == 1:
        return {}, {}
    counts = sorted({2**e for e in range(world.bit_length()) if 2**e < world} | {world})
    n = max(config.matmul_sizes)
    a = torch.randn(n, n, device=device)
    calls = [fwd_bwd_callable(t, args, kw) for cases in family_cases(1, device).values()
             for t, args, kw in cases]  # fmt: skip
    workloads = {"matmul": lambda: a @ a, "op_mix": lambda: [call() for call in calls]}
    seconds = {w: {k: [] for k in counts} for w in workloads}
    for _ in range(rounds):
        for k in counts:
            for name, fn in workloads.items():
                dist.barrier()
                mine = 0.0
                if rank < k:
                    mine = time_callable(
                        fn, device=device, min_time_s=config.min_time_s, trials=config.trials
                    )
                total = torch.tensor([mine], dtype=torch.float64)
                dist.all_reduce(total)
                seconds[name][k].append(float(total[0]) / k)
    speeds = {}
    for name, timed in seconds.items():
        median = {k: statistics.median(v) for k, v in timed.items()}
        speeds[name] = {str(k): median[world] / median[k] for k in counts}
        log(f"speed per rank by ranks computing ({name}): "
            + ", ".join(f"{k}: {v:.2f}" for k, v in speeds[name].items()))  # fmt: skip
    # The profile keeps the matmul's figure; the op mix (every family case once, as a model's
    # stage runs them) is recorded beside it. Both measured about 2x alone on 2 shared cores,
    # while pipelines there fitted 1.0-1.5x (README "Per op family"): not the op mix.
    detail = {"matmul_n": n, "seconds": {str(k): v for k, v in seconds["matmul"].items()},
              "sessions": session_count(),  # own_scheduling_group: one per rank
              "op_mix_speed": speeds["op_mix"],
              "op_mix_seconds": {str(k): v for k, v in seconds["op_mix"].items()},
              "cpu_count": os.cpu_count()}  # fmt: skip
    return speeds["matmul"], detail


def _device_label(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"


def _memory_capacity(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    return int(total // max(local, 1))


def calibrate_on_rank(
    mesh_shape: Sequence[int],
    axis_names: Sequence[str],
    config: CalibrationConfig,
    *,
    verbose: bool = True,
) -> dict[str, Any]:
    """Measure on this rank (inside an initialized process group) and return the profile JSON
    (the same on every rank)."""
    from rich.console import Console

    from autopar.comm.process_groups import axis_groups

    start = time.perf_counter()
    console = Console(stderr=True, highlight=False)
    rank = dist.get_rank()

    def log(text: str) -> None:
        if verbose and rank == 0:
            console.print(f"[{time.perf_counter() - start:5.1f} s] {text}")

    if dist.get_backend() == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        own_scheduling_group()
    groups = axis_groups(tuple(mesh_shape), tuple(axis_names), key="autopar-calibrate")
    log(
        f"calibrating {dist.get_world_size()} ranks ({dist.get_backend()}) on mesh "
        + " x ".join(f"{n}={s}" for n, s in zip(axis_names, mesh_shape))
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spec, device_details = measure_device(config, device, log)
        speed, device_details["busy_rank_speed"] = measure_busy_rank_speed(config, device, log)
        spec = dataclasses.replace(spec, busy_rank_speed=speed)
        links, link_details = measure_links(config, groups, device, log)
        spec = with_pipeline_figures(spec, max(config.matmul_sizes), links, device, log,
                                     device_details, rounds=max(config.trials, 3),
                                     rate_sizes=config.matmul_sizes)  # fmt: skip
    step_error = step_error_of(device_details, link_details, config.trials)
    paired_error = paired_error_of(link_details, config.trials)
    spec = dataclasses.replace(spec, step_error=step_error, paired_error=paired_error,
                               **backend_fields(dist.get_backend()))  # fmt: skip
    log(f"step-time error (spread of repeated measurements): {spec.step_error:.1%}; "
        f"error of a difference (spread of paired ratios): {spec.paired_error:.1%}")  # fmt: skip
    profile = build_profile(
        device=spec,
        links=links,
        meta={
            "measured_by": "autopar calibrate",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": platform.node(),
            "backend": dist.get_backend(),
            "world_size": dist.get_world_size(),
            "mesh": {"shape": list(mesh_shape), "axis_names": list(axis_names)},
            "torch": torch.__version__,
            "seconds": time.perf_counter() - start,
            "measurements": {**device_details, **link_details},
        },
    )
    log(f"done in {time.perf_counter() - start:.1f} s")
    return profile.to_dict()


# --------------------------------------------------------------------------------------------
# Ranks on this machine


def spawn_local(
    fn: Callable[..., Any], nproc: int, *args: Any, timeout_s: float = 900.0
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` (a module-level function) on ``nproc`` gloo ranks on
    127.0.0.1 (one thread each; autopar.runtime.spawn) and return the results by rank.

    Raises:
        SpawnError: a rank failed (with its traceback) or the run passed ``timeout_s``.
    """
    return spawn_ranks(
        fn, nproc, *args, timeout_s=timeout_s, pg_timeout_s=pg_timeout_s(), grace_s=5.0
    )


def _calibrate_rank(
    rank: int,
    world_size: int,
    mesh_shape: tuple[int, ...],
    axis_names: tuple[str, ...],
    config: CalibrationConfig,
    verbose: bool,
) -> dict[str, Any] | None:
    data = calibrate_on_rank(mesh_shape, axis_names, config, verbose=verbose)
    return data if rank == 0 else None


def calibrate(
    mesh_shape: Sequence[int],
    axis_names: Sequence[str],
    *,
    config: CalibrationConfig | None = None,
    nproc: int | None = None,
    verbose: bool = True,
) -> Profile:
    """Calibrate and return the Profile.

    Inside an initialized process group (torchrun: this function initializes it from the
    environment when ``WORLD_SIZE`` is set) every rank measures; with ``nproc`` the ranks are
    spawned here on 127.0.0.1 with gloo.

    Raises:
        ValueError: the mesh's device count differs from the world size or ``nproc``.
    """
    from cost_models import load_profile

    config = config or CalibrationConfig()
    shape, names = tuple(int(s) for s in mesh_shape), tuple(axis_names)
    devices = math.prod(shape)
    if nproc is not None:
        if nproc != devices:
            raise ValueError(
                f"mesh {shape} has {devices} devices but --nproc is {nproc}; make them equal"
            )
        data = spawn_local(_calibrate_rank, nproc, shape, names, config, verbose)[0]
        return load_profile(data)
    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ:
            raise ValueError(
                "calibrate needs ranks: run it under torchrun (torchrun --nproc-per-node N "
                "-m autopar calibrate ...) or pass --nproc N to spawn them here"
            )
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=300))
    if dist.get_world_size() != devices:
        raise ValueError(
            f"mesh {shape} has {devices} devices but the job has {dist.get_world_size()} ranks"
        )
    return load_profile(calibrate_on_rank(shape, names, config, verbose=verbose))
