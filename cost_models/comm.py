"""Time of one collective on one mesh axis: ring / alpha-beta formulas.

With ``n`` devices in the group, ``B`` the ``nbytes`` argument, ``bw`` the link's unidirectional
bandwidth per device and ``lat`` its per-step latency, a collective takes ``steps`` communication
steps and puts ``wire`` bytes through each device's link:

=============== ==================================== ========= ===============
kind            meaning of ``nbytes``                 steps     wire bytes
=============== ==================================== ========= ===============
all_reduce      the tensor (same on every device)    2(n-1)    2(n-1)/n * B
all_gather      the FULL gathered tensor             n-1       (n-1)/n * B
reduce_scatter  the FULL tensor before scattering    n-1       (n-1)/n * B
all_to_all      the bytes each device holds          n-1       (n-1)/n * B
broadcast       the tensor                           n-1       B
=============== ==================================== ========= ===============

and ``time = steps * lat + wire / bw``, plus the link's ``sync_s`` once per call (the wait for
the last rank when collectives run between computations; 0 unless calibrated). Ring all-reduce is a reduce-scatter then an all-gather;
all-to-all sends (n-1)/n of each device's data in n-1 pairwise exchanges; broadcast is a pipelined
ring (chain) whose bytes cross each link once, after n-1 hops of latency.

Opt-in, for ranks that outnumber the cores they share (gloo on CPU): where the link carries a
``cpu_weight`` and a ``cpu_collectives[kind] = (alpha, beta)`` fit of the CPU one rank burns in
the call, a collective costs ``cpu_weight * (alpha * steps + beta * wire)`` and no ``sync_s``
(a rank waiting in a collective leaves its core to the ranks still computing). ``autopar
calibrate`` fits ``cpu_collectives`` and records the weight it measures without setting it: on
the same measured steps this model ordered the recipes worse than the wall-time one (README
"Session 30"). A pipeline's send (:func:`send_time_s`) always keeps the wall-time model.

If the link carries a calibrated ``collectives[kind] = (alpha, beta)``, the time is
``alpha * steps + beta * wire`` with the same ``steps`` and ``wire`` (alpha in seconds per step,
beta in seconds per wire byte); ``fit_alpha_beta`` fits exactly that model. Up to the smallest
size of that fit, a message costs no more than the link's timings of small messages
(``smallest``, ``small_messages``) interpolate to, linearly in bytes: the line, steered by the
large sizes, misses how a backend moves a few elements (gloo's ring all-reduce of a scalar on
4 ranks: a tenth of its time from 64 bytes up). A group of one device, or zero bytes, costs 0.
"""

from __future__ import annotations

from collections.abc import Sequence

from cost_models.hardware import COLLECTIVE_KINDS, LinkSpec


def collective_steps_and_wire_bytes(kind: str, nbytes: float, group_size: int) -> tuple[int, float]:
    """``(steps, wire bytes per device)`` of a collective, as tabulated in the module docstring."""
    if kind not in COLLECTIVE_KINDS:
        raise ValueError(f"unknown collective {kind!r}; known: {', '.join(COLLECTIVE_KINDS)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    n = group_size
    if kind == "all_reduce":
        return 2 * (n - 1), 2.0 * (n - 1) / n * nbytes
    if kind == "broadcast":
        return n - 1, float(nbytes) if n > 1 else 0.0
    return n - 1, (n - 1) / n * nbytes


def collective_time_s(kind: str, nbytes: float, group_size: int, link: LinkSpec) -> float:
    """Seconds for collective ``kind`` over ``group_size`` devices joined by ``link``.

    Args:
        kind: one of "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast".
        nbytes: all_reduce and broadcast: the tensor's bytes; all_gather and reduce_scatter: the
            FULL (unsharded) tensor's bytes; all_to_all: the bytes each device holds.
        group_size: devices in the group (the size of the mesh axis).
        link: the axis's link; its calibrated ``collectives[kind]`` wins over the formula.
    """
    steps, wire = collective_steps_and_wire_bytes(kind, nbytes, group_size)  # validates
    if group_size == 1 or nbytes == 0:
        return 0.0
    cpu = link.cpu_collectives.get(kind) if link.cpu_weight else None
    if cpu is not None:  # ranks sharing cores: the CPU the call burns, weighted (docstring)
        return link.cpu_weight * (cpu[0] * steps + cpu[1] * wire)
    return _transfer_s(kind, nbytes, group_size, link) + link.sync_s


def _transfer_s(kind: str, nbytes: float, group_size: int, link: LinkSpec) -> float:
    """:func:`collective_time_s` without the link's ``sync_s`` (0 for an empty collective)."""
    steps, wire = collective_steps_and_wire_bytes(kind, nbytes, group_size)
    if group_size == 1 or nbytes == 0:
        return 0.0
    calibrated = link.collectives.get(kind)
    if calibrated is not None:
        alpha, beta = calibrated
        line = alpha * steps + beta * wire
        measured = _measured_small_s(kind, nbytes, link)
        return line if measured is None else min(line, measured)
    return steps * link.latency_s + wire / link.bandwidth_Bps


def _measured_small_s(kind: str, nbytes: float, link: LinkSpec) -> float | None:
    """What the link's timings of small messages (``small_messages`` then ``smallest``, bytes
    ascending) say ``nbytes`` costs: the first timing up to its size, linear between two sizes;
    None above the largest (the fitted line alone prices it)."""
    points = link.small_messages.get(kind, ())
    if kind in link.smallest:
        points = (*points, link.smallest[kind])
    if not points or nbytes > points[-1][0]:
        return None
    below = (0.0, points[0][1])
    for at in points:
        if nbytes <= at[0]:
            share = (nbytes - below[0]) / (at[0] - below[0])
            return below[1] + share * (at[1] - below[1])
        below = at
    raise AssertionError("unreachable: nbytes is at most the last point's bytes")


def send_time_s(nbytes: float, link: LinkSpec) -> float:
    """Seconds for one pipeline send of ``nbytes`` to the next stage over ``link``: the link's
    ``broadcast`` (its calibrated fit is a point-to-point ping-pong) between two devices,
    without ``sync_s``. ``sync_s`` is what a blocking collective costs between computations
    while every rank of its group waits for the last; a pipeline's send is posted
    asynchronously, and the receiver's wake-up and the schedule's work between tasks are the
    device's ``task_wait_s``, measured on a pipeline by ``autopar calibrate`` (README "Session
    29"). Charging ``sync_s`` here too counted that wait twice and moved a pipeline's predicted
    idle share with ``sync_s``'s spread between calibrations."""
    return _transfer_s("broadcast", nbytes, 2, link)


OUTLIER_RATIO = 0.5
""":func:`fit_alpha_beta` leaves out the one timing furthest off the line through the others
when it is off by more than this fraction of that line's time (with four or more sizes)."""


def _line(wires: Sequence[float], times_s: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``(intercept, slope)`` of time against wire bytes; a negative intercept
    clamped to 0 with the slope refitted through the origin."""
    count = len(wires)
    mean_w = sum(wires) / count
    mean_t = sum(times_s) / count
    cov = sum((w - mean_w) * (t - mean_t) for w, t in zip(wires, times_s))
    var = sum((w - mean_w) ** 2 for w in wires)
    beta = cov / var
    intercept = mean_t - beta * mean_w
    if intercept < 0:
        intercept = 0.0
        beta = sum(w * t for w, t in zip(wires, times_s)) / sum(w * w for w in wires)
    return intercept, beta


def _outlier(wires: list[float], times_s: list[float]) -> int | None:
    """With four or more sizes: of the timings, the one furthest (in seconds) from the line
    fitted through the others, if it is off by more than :data:`OUTLIER_RATIO` of that line's
    time there; else None."""
    if len(set(wires)) < 4:
        return None
    worst, worst_s = None, 0.0
    for i in range(len(wires)):
        intercept, beta = _line(wires[:i] + wires[i + 1 :], times_s[:i] + times_s[i + 1 :])
        expected = intercept + beta * wires[i]
        off = abs(times_s[i] - expected)
        if beta > 0 and expected > 0 and off > OUTLIER_RATIO * expected and off > worst_s:
            worst, worst_s = i, off
    return worst


def fit_alpha_beta(
    sizes_bytes: Sequence[float], times_s: Sequence[float], kind: str, group_size: int
) -> tuple[float, float]:
    """Least-squares ``(alpha, beta)`` of ``time = alpha * steps + beta * wire`` from timings.

    ``sizes_bytes`` mean what ``nbytes`` means for ``collective_time_s``. ``steps`` is the same for
    every size, so this is a straight-line fit of time against wire bytes whose intercept is
    ``alpha * steps``. A negative intercept (noise on tiny latencies) is clamped: alpha = 0 and
    beta is refitted through the origin. With four or more sizes, the one timing furthest off
    the line through the others is left out where it is off by more than
    :data:`OUTLIER_RATIO` of that line (a rank descheduled while the largest size ran tripled
    a reduce-scatter's slope on a shared machine: README, "Session 36").

    Raises:
        ValueError: fewer than two distinct sizes, a group of one, mismatched lengths, or
            timings that do not grow with size (beta <= 0).
    """
    if len(sizes_bytes) != len(times_s):
        raise ValueError(f"{len(sizes_bytes)} sizes but {len(times_s)} timings")
    if group_size < 2:
        raise ValueError(f"fitting needs a group of at least 2 devices, got {group_size}")
    if len(set(sizes_bytes)) < 2:
        raise ValueError("fitting needs timings at two or more distinct sizes")
    steps = collective_steps_and_wire_bytes(kind, 0.0, group_size)[0]
    wires = [collective_steps_and_wire_bytes(kind, s, group_size)[1] for s in sizes_bytes]
    times = list(times_s)
    off = _outlier(wires, times)
    if off is not None:
        del wires[off], times[off]
    intercept, beta = _line(wires, times)
    if beta <= 0:
        raise ValueError(
            f"{kind} timings do not grow with message size (beta={beta:.3g}); "
            "measure larger messages or more repetitions"
        )
    return intercept / steps, beta
