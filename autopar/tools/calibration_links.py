"""Calibration of the links: alpha-beta per collective on every mesh axis.

Every rank runs this at the same time: each collective is timed on every group of a mesh axis at
once over the message sizes of ``CalibrationConfig.collective_bytes``, the slowest rank counts,
and ``cost_models.fit_alpha_beta`` turns the timings into ``links[axis].collectives[kind]``.

Each kind is timed with the call the runtime makes (``autopar.comm.collectives`` and ZeRO gather
and scatter with ``all_gather_single`` / ``reduce_scatter_single``, one flat buffer), not the
list forms, which take other code paths in gloo. At each size the kinds are timed in turn within
every trial (one timing of each kind, then the next trial), so that load from other processes,
which drifts over seconds, falls on every kind alike: the planner chooses between kinds (an
all-reduce, or a reduce-scatter and an all-gather), so their ratio is what must be right. Timed
one kind after the other over all sizes, a 2x2 calibration on a loaded machine measured the
all-reduce's latency at twice the runtime's and priced gloo's reduce-scatter below its
all-reduce, which it is not (README, "The auto plan vs the recipes, measured").

``broadcast`` is measured as what the planner prices with it: a pipeline stage's
point-to-point transfer to its neighbour (``planner.stage_pricing``'s ``p2p_s``). Neighbouring
group ranks (0-1, 2-3, ...) exchange a tensor with ``dist.batch_isend_irecv``, as torch's
pipeline schedules do, in a ping-pong; half its round trip is one transfer: the latency of a
waiting rank picking up a message (on an oversubscribed CPU, its wake-up) plus the copy.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from autopar.tools.calibration_sync import measure_sync, sync_segment_matmuls
from autopar.tools.timing import max_over_ranks, mean_over_ranks, sync_device, time_queued
from cost_models import LinkSpec, collective_steps_and_wire_bytes, collective_time_s, fit_alpha_beta
from cost_models.calibrate import fit_link_kind, link_from_fits, paired_spreads, relative_spread
from solver.parallel import usable_cores

if TYPE_CHECKING:
    from autopar.tools.calibration import CalibrationConfig

__all__ = [
    "CALIBRATED_COLLECTIVES",
    "RUNTIME_CALLS",
    "cpu_weight",
    "interleaved_medians",
    "measure_links",
    "shares_cores",
    "sync_segment_matmuls",
]

CALIBRATED_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")

RUNTIME_CALLS = {
    "all_reduce": "all_reduce",
    "all_gather": "all_gather_single",
    "reduce_scatter": "reduce_scatter_single",
    "all_to_all": "all_to_all_single",
    "broadcast": "batch_isend_irecv ping-pong",
}
"""The ``torch.distributed`` call timed for each kind: the one the runtime makes."""


def message_bytes(kind: str, nbytes: int, size: int) -> int:
    """The bytes a timing of ``kind`` asked for ``nbytes`` moves on a group of ``size``: whole
    fp32 elements, for the kinds that split the tensor a whole number of them per rank."""
    if kind in ("all_reduce", "broadcast"):
        return max(nbytes // 4, 1) * 4
    return _split_bytes(nbytes, size)


def _split_bytes(nbytes: int, size: int) -> int:
    """``nbytes`` as whole fp32 elements, at least one and the same number per rank of
    ``size``: a size every kind can be timed at alike."""
    return max(nbytes // 4 // size, 1) * size * 4


def _run_collective(
    kind: str, nbytes: int, group: Any, size: int, device: torch.device
) -> Callable[[], None]:
    numel = message_bytes(kind, nbytes, size) // 4
    full = torch.randn(numel, device=device)
    part = torch.randn(numel // size, device=device)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(full, group=group)
    if kind == "all_gather":
        gathered = torch.empty_like(full)
        return lambda: dist.all_gather_single(gathered, part, group=group)
    if kind == "reduce_scatter":
        return lambda: dist.reduce_scatter_single(part, full, group=group)
    if kind == "all_to_all":
        out = torch.empty_like(full)
        return lambda: dist.all_to_all_single(out, full, group=group)
    if kind == "broadcast":
        return _ping_pong(full, group, size)
    raise ValueError(f"unknown collective {kind!r}; known: {CALIBRATED_COLLECTIVES}")


def _ping_pong(tensor: torch.Tensor, group: Any, size: int) -> Callable[[], None]:
    """One round trip between neighbouring group ranks (module docstring); a rank without a
    neighbour (the last of an odd group) does nothing."""
    me = dist.get_rank(group)
    peer = me + 1 if me % 2 == 0 else me - 1
    if peer >= size:
        return lambda: None
    peer_global = dist.get_global_rank(group, peer)
    reply = torch.empty_like(tensor)

    def exchange(send_first: bool) -> None:
        ops = (
            [dist.P2POp(dist.isend, tensor, peer_global, group)]
            if send_first
            else [dist.P2POp(dist.irecv, reply, peer_global, group)]
        )
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    def round_trip() -> None:
        exchange(me % 2 == 0)
        exchange(me % 2 == 1)

    return round_trip


def measure_links(
    config: CalibrationConfig,
    groups: Any,
    device: torch.device,
    log: Callable[[str], None],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Per mesh axis (size > 1): alpha-beta per collective kind, as a LinkSpec."""
    links: dict[str, Any] = {}
    details: dict[str, Any] = {}
    for axis, (name, size) in enumerate(zip(groups.axis_names, groups.mesh_shape)):
        if size < 2:
            continue
        group = groups.groups[axis]
        fits: dict[str, tuple[float, float]] = {}
        smallest: dict[str, tuple[float, float]] = {}
        sizes = [float(_split_bytes(b, size)) for b in config.collective_bytes]
        per_size = [
            _time_kinds_interleaved(group, size, int(nbytes), device, config) for nbytes in sizes
        ]
        # Per pair of kinds and size, the spread of their per-trial ratio (the least steady
        # rank): what DeviceSpec.paired_error is fitted from.
        pairs = list(per_size[0][2]) if per_size else []
        details[f"{name}/paired"] = {
            "bytes": sizes,
            "paired_spread": {p: max_over_ranks([spread[p] for _, _, spread in per_size], device) for p in pairs},
        }  # fmt: skip
        for kind in CALIBRATED_COLLECTIVES:
            times = max_over_ranks([timed[kind] for timed, _, _ in per_size], device)
            if kind == "broadcast":  # a round trip is two transfers
                times = [t / 2 for t in times]
            details[f"{name}/{kind}"] = {
                "bytes": sizes,
                "seconds": times,
                "call": RUNTIME_CALLS[kind],
                # Per size, the trials' relative median deviation (the least steady rank):
                # what DeviceSpec.step_error is fitted from.
                "spread": max_over_ranks([spread[kind] for _, spread, _ in per_size], device),
            }
            fits[kind], flat = fit_link_kind(sizes, times, kind, size)
            if flat:
                log(f"axis {name}: {kind} timings do not grow with size; latency only")
            smallest[kind] = (sizes[0], times[0])
            alpha, beta = fits[kind]
            log(
                f"axis {name} (size {size}) {kind}: alpha {alpha * 1e6:.1f} us/step, {1 / beta / 1e9:.2f} GB/s"
            )
        if fits:
            source = f"autopar calibrate, {dist.get_backend()} on {platform.node()}"
            small = _small_messages(group, size, sizes[0], device, config)
            details[f"{name}/small_messages"] = small
            points = ", ".join(
                f"{b:.0f} B {t * 1e3:.2f} ms" for b, t in small.get("all_reduce", [])
            )
            log(f"axis {name} (size {size}) all_reduce below the fit's sizes: {points or 'none'}")
            link = link_from_fits(f"calibrated-{name}", fits, source=source, smallest=smallest,
                                  small_messages=small)  # fmt: skip
            cpu_fits = _cpu_fits(name, size, sizes, per_size, device, details)
            link = dataclasses.replace(link, cpu_collectives=cpu_fits)
            sync_s, sync_details = measure_sync(groups, axis, link, device, config)
            details[f"{name}/sync"] = sync_details
            log(
                f"axis {name} (size {size}) wait per collective between computations: {sync_s * 1e6:.1f} us"
            )
            links[name] = dataclasses.replace(link, sync_s=sync_s)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    if links and shares_cores(dist.get_backend(), local, config.cores):
        # Recorded, not priced: on the same measurements the wall model ordered the recipes
        # better than this weight on the CPU line did (README "Session 30"). A profile that
        # sets ``cpu_weight`` on its links prices by the CPU line.
        syncs = {name: details[f"{name}/sync"] for name in links}
        weight = cpu_weight(links, syncs)
        for name in links:
            syncs[name]["cpu_weight"] = weight
        log(f"ranks share cores: a collective cost the step {weight:.2f}x the CPU it burns "
            "(recorded)")  # fmt: skip
    return links, details


def _small_messages(
    group: Any, size: int, fitted_from: float, device: torch.device, config: CalibrationConfig
) -> dict[str, list[tuple[float, float]]]:
    """``LinkSpec.small_messages``: per kind, ``(bytes, seconds)`` at each size of
    ``config.small_message_bytes`` whose message (:func:`message_bytes`) is below
    ``fitted_from`` (the fit's smallest size), the slowest rank's median, kinds interleaved as
    the fit's sizes are."""
    wanted = [b for b in config.small_message_bytes if b < fitted_from]
    timed = [_time_kinds_interleaved(group, size, b, device, config)[0] for b in wanted]
    points: dict[str, list[tuple[float, float]]] = {}
    for kind in CALIBRATED_COLLECTIVES:
        seconds = max_over_ranks([t[kind] for t in timed], device) if timed else []
        if kind == "broadcast":  # a round trip is two transfers
            seconds = [t / 2 for t in seconds]
        table: dict[float, float] = {}
        for b, t in zip(wanted, seconds):
            nbytes = float(message_bytes(kind, b, size))
            if nbytes < fitted_from:
                table.setdefault(nbytes, t)  # sizes that round alike: the first timing
        if table:
            points[kind] = sorted(table.items())
    return points


def shares_cores(backend: str, local_ranks: int, cores: int | None) -> bool:
    """Whether a host's ``local_ranks`` outnumber the ``cores`` they share (None: this
    process's CPU affinity): gloo ranks on CPU only (a GPU rank computes on its device)."""
    return backend == "gloo" and local_ranks > (cores or usable_cores())


def cpu_weight(links: dict[str, LinkSpec], syncs: dict[str, dict[str, Any]]) -> float:
    """``LinkSpec.cpu_weight``, one for every axis (it is the host's: how the ranks share its
    cores): the median over every axis's chain trials (``calibration_sync``) of the excess per
    all-reduce between computations over the CPU the axis's ``cpu_collectives`` prices that
    all-reduce at. The weighted CPU line then prices the chain's collective at about what the
    chain measured (as ``sync_s`` anchors the wall model there), and other kinds and sizes by
    the CPU they burn. Per axis, 9 trials' medians moved 3.5-6.7 between calibrations on 2x2
    (the CPU line's value at the chain's size is the noisy part); pooled, the axes agree by
    construction (README "Session 30")."""
    ratios = []
    for name, link in links.items():
        sync = syncs[name]
        unit = dataclasses.replace(link, cpu_weight=1.0)
        burnt = collective_time_s("all_reduce", sync["bytes"], sync["group_size"], unit)
        if burnt > 0:
            ratios += [max(excess, 0.0) / burnt for excess in sync["excess_per_call"]]
    return statistics.median(ratios) if ratios else 0.0


def _cpu_fits(
    name: str,
    size: int,
    sizes: list[float],
    per_size: list[tuple[dict[str, float], Any, Any]],
    device: torch.device,
    details: dict[str, Any],
) -> dict[str, tuple[float, float]]:
    """``LinkSpec.cpu_collectives``: per kind but ``broadcast`` (a pipeline's send keeps the
    wall model), the ranks' mean CPU seconds per call at each size, fitted as the wall times
    are (steps and wire bytes); recorded under ``details[f"{name}/{kind}"]["cpu_seconds"]``."""
    fits: dict[str, tuple[float, float]] = {}
    for kind in CALIBRATED_COLLECTIVES:
        if kind == "broadcast":
            continue
        cpu = mean_over_ranks([timed[f"cpu/{kind}"] for timed, _, _ in per_size], device)
        details[f"{name}/{kind}"]["cpu_seconds"] = cpu
        try:
            fits[kind] = fit_alpha_beta(sizes, cpu, kind, size)
        except ValueError:  # flat: the per-call CPU alone
            steps = collective_steps_and_wire_bytes(kind, 0.0, size)[0]
            fits[kind] = (statistics.median(cpu) / steps, 0.0)
    return fits


def _time_kinds_interleaved(
    group: Any, size: int, nbytes: int, device: torch.device, config: CalibrationConfig
) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """Seconds per call of every kind of ``CALIBRATED_COLLECTIVES`` at ``nbytes`` on this rank:
    the median over ``config.trials`` trials, each timing every kind once in turn (module
    docstring), and under ``"cpu/<kind>"`` the median CPU seconds per call; per kind the trials' ``relative_spread``; and per pair of kinds the spread of
    their per-trial ratios (``cost_models.calibrate.paired_spreads``). Collectives must be called the same number of times on every rank: each kind's
    count is sized by one probe call and agreed by MAX over ranks, not ``time_callable``'s loop."""
    fns = {
        kind: _run_collective(kind, nbytes, group, size, device) for kind in CALIBRATED_COLLECTIVES
    }
    probes = []
    for fn in fns.values():
        fn()
        sync_device(device)
        start = time.perf_counter()
        fn()
        sync_device(device)
        probes.append(time.perf_counter() - start)
    probes = max_over_ranks(probes, device)
    counts = {
        kind: int(min(max(config.min_time_s / max(p, 1e-7), 2), 200))
        for kind, p in zip(fns, probes)
    }
    cpu: dict[str, list[float]] = {}
    times = interleaved_times(fns, counts, config.trials, dist.barrier, device, cpu)
    medians = {key: statistics.median(values) for key, values in times.items()}
    medians.update({f"cpu/{key}": statistics.median(values) for key, values in cpu.items()})
    spreads = {key: relative_spread(values) for key, values in times.items()}
    return medians, spreads, paired_spreads(times)


def interleaved_times(
    fns: dict[str, Callable[[], Any]],
    counts: dict[str, int],
    trials: int,
    between: Callable[[], Any],
    device: torch.device,
    cpu: dict[str, list[float]] | None = None,
) -> dict[str, list[float]]:
    """Per key, one figure per trial (``trials`` of them): the mean seconds per call of
    ``counts[key]`` calls of ``fns[key]``; every trial times each key once, in order, with
    ``between()`` (a barrier) before each timing. With ``cpu`` given, the same calls' process
    CPU seconds per call (every thread of this rank: gloo's included) are appended to it."""
    times: dict[str, list[float]] = {key: [] for key in fns}
    for _ in range(max(trials, 1)):
        for key, fn in fns.items():
            between()
            start = time.process_time()
            times[key].append(time_queued(fn, device, counts[key], 1))
            if cpu is not None:
                cpu.setdefault(key, []).append((time.process_time() - start) / counts[key])
    return times


def interleaved_medians(
    fns: dict[str, Callable[[], Any]],
    counts: dict[str, int],
    trials: int,
    between: Callable[[], Any],
    device: torch.device,
) -> dict[str, float]:
    """Per key, the median over the trials of :func:`interleaved_times`."""
    times = interleaved_times(fns, counts, trials, between, device)
    return {key: statistics.median(values) for key, values in times.items()}
