"""Torch-free fitting for calibration, and the metrics that judge a cost model.

The measuring side (``autopar/calibration.py``) times real kernels and collectives; this module
turns timings into the numbers of a profile and scores predictions against measurements:

- ``fit_rate``: a throughput (FLOP/s, bytes/s) from ``time = work / rate + overhead`` at several
  sizes (a least-squares line; its slope is ``1 / rate``).
- ``fit_efficiency``: the per-family ``op_efficiency`` of ``cost_models.compute``: with a known
  per-op overhead, ``time - overhead = ideal / e`` is a line through the origin in ``ideal``.
- ``fit_alpha_beta`` (in ``cost_models.comm``) fits collectives; ``link_from_fits`` turns the
  fits of one axis into a ``LinkSpec``.
- ``mape`` and ``spearman``: prediction error and rank agreement.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from cost_models.comm import collective_steps_and_wire_bytes, collective_time_s, fit_alpha_beta
from cost_models.hardware import DeviceSpec, LinkSpec
from cost_models.profile import Profile

__all__ = [
    "build_profile",
    "chain_sync_s",
    "fit_efficiency",
    "fit_link_kind",
    "fit_rate",
    "fit_step_error",
    "link_from_fits",
    "mape",
    "paired_error_of",
    "paired_spreads",
    "rank",
    "relative_spread",
    "spearman",
    "step_error_of",
]


def _check_pairs(xs: Sequence[float], ys: Sequence[float], what: str) -> None:
    if len(xs) != len(ys):
        raise ValueError(f"{what}: {len(xs)} x values but {len(ys)} y values")
    if not xs:
        raise ValueError(f"{what}: no data points")


def fit_rate(
    work: Sequence[float], times_s: Sequence[float], *, through_origin: bool = False
) -> tuple[float, float]:
    """``(rate, overhead_s)`` of ``time = work / rate + overhead`` by least squares.

    With ``through_origin`` (large sizes, where the overhead is negligible and a two-point
    slope would amplify noise), with one distinct work size, or when the fitted line has a
    negative intercept (noise), the line goes through the origin instead (overhead 0).

    Raises:
        ValueError: mismatched or empty inputs, or times that do not grow with work.
    """
    _check_pairs(work, times_s, "fit_rate")
    n = len(work)
    mean_w = sum(work) / n
    mean_t = sum(times_s) / n
    var = sum((w - mean_w) ** 2 for w in work)
    slope = sum((w - mean_w) * (t - mean_t) for w, t in zip(work, times_s)) / var if var else 0.0
    intercept = mean_t - slope * mean_w
    if through_origin or var == 0 or intercept < 0:
        intercept = 0.0
        slope = sum(w * t for w, t in zip(work, times_s)) / sum(w * w for w in work)
    if slope <= 0:
        raise ValueError(f"timings do not grow with work (slope {slope:.3g}); measure larger sizes")
    return 1.0 / slope, intercept


def fit_efficiency(
    ideal_s: Sequence[float],
    times_s: Sequence[float],
    overhead_s: Sequence[float] | float = 0.0,
    *,
    max_efficiency: float = 1.0,
) -> float:
    """The fraction ``e`` of the ideal roofline reached: least squares of
    ``time - overhead = ideal / e`` over the measurements, clamped to [1e-3, max_efficiency].

    Args:
        ideal_s: per measurement, ``max(flops / peak, bytes / bandwidth)`` summed over the
            kernels timed (forward plus backward), as ``cost_models.compute`` defines it.
        times_s: the measured seconds.
        overhead_s: the launch overhead included in each measurement (one value, or one each).

        max_efficiency: the largest value returned. A family faster than the roofline (its
            ideal underestimates it, e.g. data that stays in cache) gets ``e > 1`` up to this
            (calibration passes ``hardware.MAX_OP_EFFICIENCY``); 1 by default.
    """
    _check_pairs(ideal_s, times_s, "fit_efficiency")
    overheads = (
        [float(overhead_s)] * len(ideal_s)
        if isinstance(overhead_s, (int, float))
        else list(overhead_s)
    )
    _check_pairs(ideal_s, overheads, "fit_efficiency overheads")
    num = sum(i * i for i in ideal_s)
    if num <= 0:
        raise ValueError("fit_efficiency: every ideal time is 0; time ops that do work")
    den = sum(i * max(t - o, 0.0) for i, t, o in zip(ideal_s, times_s, overheads))
    if den <= 0:
        return max_efficiency
    return min(max_efficiency, max(1e-3, num / den))


STEADY_COMPUTE = 0.25
""":func:`fit_sync_s` keeps the trials whose computation alone ran within this fraction of the
fastest one's time (at least :data:`STEADY_TRIALS` of them; else every trial)."""

STEADY_TRIALS = 3


def fit_sync_s(
    mixed_s: Sequence[float], compute_s: Sequence[float], collective_s: Sequence[float]
) -> float:
    """Per-call seconds a collective costs between computations beyond its back-to-back time.

    Each argument holds one figure per trial, all per iteration: ``mixed_s`` a computation
    followed by a small collective, ``compute_s`` the computation alone, ``collective_s`` the
    collective alone, called back to back. The result, ``median(mixed - compute - collective)``
    clamped at 0, is ``LinkSpec.sync_s``: the wait for ranks that arrive late (descheduled on
    shared cores, or slower), which back-to-back timings do not see. Trials whose computation
    alone ran more than :data:`STEADY_COMPUTE` slower than the fastest are left out (another
    process took the cores for a while: six of nine trials of a 2-rank calibration ran their
    computation 1.5x slower and waited 8-13 ms per call against 2-4 in the others; README,
    "Session 36"), unless fewer than :data:`STEADY_TRIALS` would remain.

    Raises:
        ValueError: the sequences are empty or of different lengths.
    """
    if not mixed_s or not len(mixed_s) == len(compute_s) == len(collective_s):
        raise ValueError("fit_sync_s needs one mixed, compute and collective time per trial")
    trials = list(zip(mixed_s, compute_s, collective_s))
    fastest = min(compute_s)
    steady = [t for t in trials if t[1] <= fastest * (1.0 + STEADY_COMPUTE)]
    if len(steady) >= min(STEADY_TRIALS, len(trials)):
        trials = steady
    excess = sorted(m - c - k for m, c, k in trials)
    middle = len(excess) // 2
    median = excess[middle] if len(excess) % 2 else (excess[middle - 1] + excess[middle]) / 2
    return max(0.0, median)


def fit_link_kind(
    sizes_bytes: Sequence[float], times_s: Sequence[float], kind: str, group_size: int
) -> tuple[tuple[float, float], bool]:
    """A link's ``collectives[kind]``: :func:`~cost_models.comm.fit_alpha_beta` of the timings,
    or where they do not grow with size (noise on a loaded machine, or latency-bound at these
    sizes) the latency alone with bandwidth free, rather than drop the collective; with
    whether it was the latency alone."""
    try:
        return fit_alpha_beta(sizes_bytes, times_s, kind, group_size), False
    except ValueError:
        steps = collective_steps_and_wire_bytes(kind, 0.0, group_size)[0]
        return (_median(times_s) / steps, 1e-12), True


def chain_sync_s(
    link: LinkSpec, mixed_s: Sequence[float], compute_s: Sequence[float], nbytes: float,
    group_size: int,
) -> tuple[float, float]:  # fmt: skip
    """``LinkSpec.sync_s`` from the sync chain's per-trial seconds per call
    (``autopar.tools.calibration_sync``): :func:`fit_sync_s` less what ``link`` prices the
    chain's all-reduce of ``nbytes`` back to back (its own ``sync_s`` left out); with that
    price."""
    unsynced = dataclasses.replace(link, sync_s=0.0)
    priced = collective_time_s("all_reduce", nbytes, group_size, unsynced)
    return fit_sync_s(mixed_s, compute_s, [priced] * len(mixed_s)), priced


STEP_ERROR_MAX = 0.5
"""Cap of :func:`fit_step_error`: beyond it the profile is too noisy to rank plans at all."""


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def relative_spread(values: Sequence[float]) -> float:
    """The median absolute deviation of repeated measurements of one quantity, relative to
    their median (robust: one trial descheduled by another process does not move it); 0 for
    fewer than two values or a median of 0."""
    if len(values) < 2:
        return 0.0
    median = _median(values)
    return _median([abs(v - median) for v in values]) / median if median > 0 else 0.0


def fit_step_error(spreads: Sequence[float], trials: int) -> float:
    """``DeviceSpec.step_error``: the relative standard error of the calibrated figures, each
    the median of ``trials`` repeated measurements, taken as the median over the calibrated
    quantities (peak FLOP/s, bandwidth, op efficiencies per round; every collective kind and
    size per trial) of their :func:`relative_spread` ``r``: for normal noise sigma = 1.4826 r
    and the median of n draws has standard error 1.2533 sigma / sqrt(n). Capped at
    :data:`STEP_ERROR_MAX`. Plans predicted closer than this cannot be ranked by the profile.

    Given the :func:`paired_spreads` of quantities timed in the same trials instead, the same
    formula is ``DeviceSpec.paired_error``: the standard error of a calibrated RATIO between two
    measured things (the error of a difference between two plans priced with the profile).

    Raises:
        ValueError: no spreads, a negative one, or fewer than one trial.
    """
    if not spreads:
        raise ValueError("fit_step_error needs at least one spread")
    if any(s < 0 for s in spreads):
        raise ValueError(f"spreads must be >= 0, got {min(spreads)}")
    if trials < 1:
        raise ValueError(f"trials must be >= 1, got {trials}")
    return min(STEP_ERROR_MAX, 1.4826 * 1.2533 * _median(spreads) / math.sqrt(trials))


def paired_spreads(times: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """Per pair of keys ``"a/b"``: the :func:`relative_spread` of the per-trial ratios
    ``times[a][t] / times[b][t]`` of quantities timed in the same trials (interleaved).

    Load that drifts between trials scales both figures of a trial alike and cancels in their
    ratio, so this is the noise of a DIFFERENCE between two measured things (what deciding
    between two plans needs), not the noise of one figure. Trials where either figure is not
    positive are left out; a pair with fewer than two usable trials has spread 0.

    Raises:
        ValueError: the keys' sequences differ in length.
    """
    keys = list(times)
    lengths = {len(times[k]) for k in keys}
    if len(lengths) > 1:
        raise ValueError(f"paired_spreads: trials differ in number between keys: {sorted(lengths)}")
    out: dict[str, float] = {}
    for i, a in enumerate(keys):
        for b in keys[i + 1 :]:
            ratios = [x / y for x, y in zip(times[a], times[b]) if x > 0 and y > 0]
            out[f"{a}/{b}"] = relative_spread(ratios)
    return out


def step_error_of(
    device_details: Mapping[str, Any], link_details: Mapping[str, Any], trials: int
) -> float:
    """``DeviceSpec.step_error`` from a calibration's measurements: the spreads of every
    per-round device fit (``device_details["fits_per_round"]``: peak FLOP/s, bandwidth, launch
    overhead, op efficiencies) and of every collective kind and size per trial (the ``spread``
    lists of ``link_details``), through :func:`fit_step_error`; 0 without any."""
    spreads = [relative_spread(v) for v in device_details.get("fits_per_round", {}).values()]
    for entry in link_details.values():
        spreads += entry.get("spread", [])
    return fit_step_error(spreads, max(trials, 1)) if spreads else 0.0


def paired_error_of(link_details: Mapping[str, Any], trials: int) -> float:
    """``DeviceSpec.paired_error`` from a calibration's measurements: :func:`fit_step_error`'s
    formula over the :func:`paired_spreads` it kept (``paired_spread`` of ``link_details``
    entries: per pair of collective kinds a list over sizes, or one figure per pair, as for
    compute against a collective); 0 without any."""
    spreads: list[float] = []
    for entry in link_details.values():
        for value in entry.get("paired_spread", {}).values():
            spreads += value if isinstance(value, list) else [value]
    return fit_step_error(spreads, max(trials, 1)) if spreads else 0.0


def link_from_fits(
    name: str,
    fits: Mapping[str, tuple[float, float]],
    *,
    source: str = "",
    sync_s: float = 0.0,
    smallest: Mapping[str, tuple[float, float]] | None = None,
    small_messages: Mapping[str, Sequence[tuple[float, float]]] | None = None,
) -> LinkSpec:
    """A LinkSpec carrying calibrated ``(alpha, beta)`` per collective, the measured
    ``sync_s``, ``smallest`` ((bytes, seconds) at the smallest size of the fit, per kind) and
    ``small_messages`` (such points below it); its plain ``latency_s`` / ``bandwidth_Bps`` come
    from the all-reduce fit (else the first one)."""
    if not fits:
        raise ValueError(f"link {name!r}: no collective fits to build it from")
    alpha, beta = fits.get("all_reduce") or next(iter(fits.values()))
    return LinkSpec(
        name=name,
        bandwidth_Bps=1.0 / beta,
        latency_s=alpha,
        collectives=dict(fits),
        smallest=dict(smallest or {}),
        small_messages={k: tuple(v) for k, v in (small_messages or {}).items()},
        source=source,
        sync_s=sync_s,
    )


def build_profile(
    *,
    device: DeviceSpec,
    links: Mapping[str, LinkSpec],
    meta: Mapping[str, Any] | None = None,
) -> Profile:
    """The calibration's result as a Profile (``save_profile`` writes the JSON that
    ``load_profile`` and ``Mesh.spec(profile=)`` read)."""
    return Profile(device=device, links=dict(links), meta=dict(meta or {}))


def mape(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Mean absolute percentage error, in percent: ``100 * mean(|p - m| / m)``.

    Raises:
        ValueError: mismatched or empty inputs, or a measured value <= 0.
    """
    _check_pairs(predicted, measured, "mape")
    if any(m <= 0 for m in measured):
        raise ValueError("mape: measured values must be > 0")
    return 100.0 * sum(abs(p - m) / m for p, m in zip(predicted, measured)) / len(measured)


def rank(values: Sequence[float]) -> list[float]:
    """Ranks starting at 1, ties sharing their average rank (as Spearman's rho needs)."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2.0 + 1.0
        i = j + 1
    return ranks


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Spearman's rank correlation: Pearson's correlation of the ranks (ties averaged).

    Returns NaN when either side is constant (no ordering to agree with).

    Raises:
        ValueError: mismatched inputs or fewer than two points.
    """
    _check_pairs(xs, ys, "spearman")
    if len(xs) < 2:
        raise ValueError("spearman needs at least two points")
    rx, ry = rank(xs), rank(ys)
    n = len(rx)
    mx, my = sum(rx) / n, sum(ry) / n
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    vx = sum((a - mx) ** 2 for a in rx)
    vy = sum((b - my) ** 2 for b in ry)
    if vx == 0 or vy == 0:
        return math.nan
    return cov / math.sqrt(vx * vy)
