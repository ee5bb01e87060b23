"""The wait per collective between computations (``LinkSpec.sync_s``): fitted from timings,
charged once per collective call by the cost model and the planner, absent (0) from datasheet
links so that plans made with presets do not move."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from cost_models import LINKS, LinkSpec, collective_time_s, load_profile
from cost_models.calibrate import fit_sync_s, link_from_fits
from cost_models.profile import PROFILE_VERSION


def test_fit_sync_s_recovers_the_wait_per_call() -> None:
    rng = random.Random(0)
    compute = [1e-3 * (1 + 0.05 * rng.random()) for _ in range(5)]
    collective = [200e-6 * (1 + 0.05 * rng.random()) for _ in range(5)]
    mixed = [c + k + 3e-3 + 1e-5 * rng.random() for c, k in zip(compute, collective)]
    assert fit_sync_s(mixed, compute, collective) == pytest.approx(3e-3, rel=0.01)


def test_fit_sync_s_is_zero_when_collectives_overlap_computation() -> None:
    assert fit_sync_s([1.0e-3, 1.1e-3, 0.9e-3], [1e-3] * 3, [0.5e-3] * 3) == 0.0


def test_fit_sync_s_refuses_unpaired_trials() -> None:
    with pytest.raises(ValueError, match="one mixed, compute and collective time per trial"):
        fit_sync_s([1.0], [1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="per trial"):
        fit_sync_s([], [], [])


@pytest.mark.parametrize("kind", ["all_reduce", "all_gather", "reduce_scatter", "all_to_all"])
def test_the_wait_is_charged_once_per_call(kind: str) -> None:
    fits = {kind: (100e-6, 1e-9)}
    plain = link_from_fits("l", fits)
    waiting = link_from_fits("l", fits, sync_s=2e-3)
    for group_size in (2, 4):
        for nbytes in (1e3, 1e6):
            extra = collective_time_s(kind, nbytes, group_size, waiting) - collective_time_s(
                kind, nbytes, group_size, plain
            )
            assert extra == pytest.approx(2e-3)
    assert collective_time_s(kind, 1e6, 1, waiting) == 0.0  # a group of one: no collective


def test_gradient_buckets_pay_the_wait_once_per_bucket() -> None:
    from autopar.mesh import Mesh
    from autopar.planner.pricing import GRAD_BUCKET_BYTES, CommPricer

    fits = {"all_reduce": (100e-6, 1e-9)}
    device = Mesh.spec((4,), device="cpu").device

    def grad_sync_s(sync_s: float, nbytes: float) -> float:
        link = link_from_fits("l", fits, sync_s=sync_s)
        mesh = Mesh(shape=(4,), axis_names=("dp",), device=device, links=(link,))
        return CommPricer(mesh, None).grad_sync_s(nbytes, 0)

    for fraction in (1.0, 0.25):
        nbytes = fraction * GRAD_BUCKET_BYTES
        assert grad_sync_s(5e-3, nbytes) - grad_sync_s(0.0, nbytes) == pytest.approx(
            5e-3 * fraction
        )


def test_datasheet_links_have_no_wait_and_keep_their_json() -> None:
    for link in LINKS.values():
        assert link.sync_s == 0.0
        assert "sync_s" not in link.to_dict()
    with pytest.raises(ValueError, match="sync_s must be >= 0"):
        LinkSpec(name="l", bandwidth_Bps=1e9, latency_s=0.0, sync_s=-1.0)


def test_a_calibrated_wait_round_trips_through_the_profile(tmp_path) -> None:
    link = link_from_fits("calibrated-a0", {"all_reduce": (1e-4, 1e-9)}, sync_s=1.5e-3)
    data = {"version": 1, "links": {"a0": link.to_dict()}}
    assert load_profile(data).links["a0"] == link
    with pytest.raises(ValueError, match="sync_s"):
        load_profile({"version": 1, "links": {"a0": {**link.to_dict(), "sync_s": -1}}})


def _auto_conversions(links: list[LinkSpec]) -> list[int]:
    """Per link (4 ranks on it): the layout conversions in the auto plan of a 3-layer MLP."""
    from autopar.capture.export import capture
    from autopar.mesh import Mesh
    from autopar.models import MLP, MLPConfig
    from autopar.options import PlanOptions
    from autopar.tools.report import plans_for_recipes

    torch.manual_seed(0)
    model = MLP(MLPConfig(in_features=256, hidden=1024, out_features=256, num_layers=3))
    captured = capture(model, (torch.randn(64, 256), torch.randn(64, 256)), {})
    device = Mesh.spec((4,), device="cpu").device
    counts = []
    for link in links:
        mesh = Mesh(shape=(4,), axis_names=("a0",), device=device, links=(link,))
        plans = plans_for_recipes(captured, mesh, PlanOptions(), recipes=["auto"],
                                  model_name="mlp")  # fmt: skip
        counts.append(len(plans["auto"].conversions()))
    return counts


def test_a_wait_per_collective_makes_the_planner_use_fewer_collectives() -> None:
    """Tensor parallelism trades gradient bytes for activation collectives: where every call
    waits (ranks sharing cores), the planner keeps fewer of them, down to none."""
    links = [LinkSpec(name="l", bandwidth_Bps=2e9, latency_s=1e-4, sync_s=sync_s)
             for sync_s in (0.0, 1e-3, 1e-2)]  # fmt: skip
    counts = _auto_conversions(links)
    assert counts[0] > counts[1] > counts[2] == 0, counts


def test_a_message_no_larger_than_the_smallest_calibrated_costs_at_most_its_timing() -> None:
    # Fitted line: 0.95 ms per step (6 steps on 4 ranks) plus bandwidth; the 16 KiB all-reduce
    # measured 4.2 ms (session 19's 4-rank calibration): a scalar is priced 4.2 ms, not 5.7.
    fits = {"all_reduce": (0.95e-3, 7e-10)}
    smallest = {"all_reduce": (16384.0, 4.2e-3)}
    line = link_from_fits("l", fits, sync_s=2e-3)
    anchored = link_from_fits("l", fits, sync_s=2e-3, smallest=smallest)
    assert collective_time_s("all_reduce", 8, 4, line) == pytest.approx(
        6 * 0.95e-3 + 2e-3, rel=1e-3
    )
    assert collective_time_s("all_reduce", 8, 4, anchored) == pytest.approx(4.2e-3 + 2e-3)
    assert collective_time_s("all_reduce", 16384, 4, anchored) == pytest.approx(4.2e-3 + 2e-3)
    # Larger messages keep the fitted line; a measurement above the line never raises a price.
    for nbytes in (16385, 2**20, 2**24):
        assert collective_time_s("all_reduce", nbytes, 4, anchored) == collective_time_s(
            "all_reduce", nbytes, 4, line
        )
    slow = link_from_fits("l", fits, smallest={"all_reduce": (16384.0, 9e-3)})
    assert collective_time_s("all_reduce", 8, 4, slow) == collective_time_s(
        "all_reduce", 8, 4, link_from_fits("l", fits)
    )
    # Kept through the JSON (and absent from links without it, whose JSON stays as it was).
    assert LinkSpec.from_dict(anchored.to_dict()) == anchored
    assert "smallest" not in line.to_dict()
    with pytest.raises(ValueError, match="without a calibrated fit"):
        link_from_fits("l", fits, smallest={"all_gather": (16384.0, 1e-3)})


def _cpu_link(alpha: float, *, sync_s: float = 0.0) -> LinkSpec:
    """A wall-time link (2 GB/s, 100 us a step) whose ranks share cores: every kind but
    broadcast burns ``alpha`` CPU seconds a step and 0.1 ns a wire byte, weighted 4x."""
    kinds = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
    return LinkSpec(name="l", bandwidth_Bps=2e9, latency_s=1e-4, sync_s=sync_s,
                    cpu_collectives={k: (alpha, 1e-10) for k in kinds}, cpu_weight=4.0)  # fmt: skip


def test_ranks_sharing_cores_pay_a_calls_cpu_once_per_gradient_bucket() -> None:
    """Session 30: under ``cpu_weight`` a bucket's per-call CPU is paid once per
    ``GRAD_BUCKET_BYTES``, its bytes at the weighted CPU per byte, and no ``sync_s``."""
    from autopar.mesh import Mesh
    from autopar.planner.pricing import GRAD_BUCKET_BYTES, CommPricer

    device = Mesh.spec((4,), device="cpu").device

    def grad_sync_s(alpha: float, nbytes: float) -> float:
        mesh = Mesh(shape=(4,), axis_names=("dp",), device=device,
                    links=(_cpu_link(alpha, sync_s=5e-3),))  # fmt: skip
        return CommPricer(mesh, None).grad_sync_s(nbytes, 0)

    for fraction in (1.0, 0.25):
        nbytes = fraction * GRAD_BUCKET_BYTES
        bytes_s = 4.0 * 1e-10 * 2 * 3 / 4 * nbytes  # weight x beta x all-reduce wire bytes
        assert grad_sync_s(0.0, nbytes) == pytest.approx(bytes_s)
        assert grad_sync_s(1e-3, nbytes) - grad_sync_s(0.0, nbytes) == pytest.approx(
            4.0 * 1e-3 * 6 * fraction
        )


def test_the_cpu_a_call_burns_makes_the_planner_use_fewer_collectives() -> None:
    """The same wall-time link; the more CPU each call burns on ranks sharing cores, the
    fewer collectives the planner keeps (it prices the CPU line, not the wall time)."""
    counts = _auto_conversions([_cpu_link(alpha) for alpha in (0.0, 2.5e-4, 2.5e-3)])
    assert counts[0] > counts[1] > counts[2] == 0, counts


def test_calibration_weights_cpu_only_where_ranks_outnumber_their_cores() -> None:
    from autopar.tools.calibration_links import cpu_weight, shares_cores

    assert shares_cores("gloo", 4, 2) and not shares_cores("gloo", 2, 2)
    assert not shares_cores("nccl", 8, 1)  # a GPU rank computes on its device
    # The weight is the median over every axis's trials of the excess per call over the CPU
    # the axis's line prices the chain's all-reduce at (one weight for the host's axes).
    a0 = dataclasses.replace(_cpu_link(2e-4), cpu_weight=0.0)
    a1 = dataclasses.replace(_cpu_link(1e-4), cpu_weight=0.0)
    burnt = {"a0": 2 * 2e-4 + 1e-10 * 524288.0, "a1": 2 * 1e-4 + 1e-10 * 524288.0}
    excess = {"a0": [3e-3, 1e-3, 4e-3], "a1": [2e-3, -1e-3, 5e-3]}
    syncs = {a: {"bytes": 524288.0, "group_size": 2, "excess_per_call": excess[a]} for a in excess}
    ratios = sorted(max(e, 0.0) / burnt[a] for a in excess for e in excess[a])
    weight = cpu_weight({"a0": a0, "a1": a1}, syncs)
    assert weight == pytest.approx((ratios[2] + ratios[3]) / 2)
    weighted = dataclasses.replace(a0, cpu_weight=weight)
    assert collective_time_s("all_reduce", 524288.0, 2, weighted) == pytest.approx(
        weight * burnt["a0"]
    )
    assert cpu_weight({"a0": a0}, {"a0": {**syncs["a0"], "excess_per_call": [-1e-3]}}) == 0.0


def test_fit_sync_s_leaves_out_trials_whose_computation_was_slowed() -> None:
    """Session 36's 2-rank calibration: six of nine trials ran their computation 1.5x slower
    (another process on the cores) and waited 8-13 ms per call, the other three 2-4 ms; the
    wait is the steady trials' (and every trial's where fewer than three are steady)."""
    compute = [30e-3, 29e-3, 32e-3, 28e-3, 30e-3, 31e-3, 19.4e-3, 19.3e-3, 19.6e-3]
    excess = [12.0e-3, 13.1e-3, 8.3e-3, 13.4e-3, 11.7e-3, 9.7e-3, 2.3e-3, 3.4e-3, 4.1e-3]
    mixed = [c + e for c, e in zip(compute, excess)]
    collective = [1.9e-3] * 9
    assert fit_sync_s(mixed, compute, collective) == pytest.approx(3.4e-3 - 1.9e-3, rel=1e-9)
    # Two steady trials are too few: the median of all eight.
    two = slice(0, 8)
    assert fit_sync_s(mixed[two], compute[two], collective[two]) == pytest.approx(
        (9.7e-3 + 11.7e-3) / 2 - 1.9e-3, rel=1e-9
    )


def test_a_message_below_the_fit_costs_what_the_small_timings_interpolate_to() -> None:
    # Session 37's 4-rank profile: gloo's ring all-reduce of one fp32 element took 0.63 ms, of
    # two 1.07, of sixteen 7.6, against the line's 7.2 ms (6 steps of 1.2 ms) and 8.3 at 16 KiB.
    fits = {"all_reduce": (1.2e-3, 7e-10), "all_gather": (1.25e-3, 1.2e-9)}
    small = {"all_reduce": [(4.0, 0.63e-3), (8.0, 1.07e-3), (64.0, 7.6e-3)]}
    smallest = {"all_reduce": (16384.0, 8.3e-3), "all_gather": (16384.0, 3.7e-3)}
    link = link_from_fits("l", fits, sync_s=2e-3, smallest=smallest, small_messages=small)
    line = link_from_fits("l", fits, sync_s=2e-3, smallest=smallest)

    def price(nbytes: float, on: LinkSpec = link, kind: str = "all_reduce") -> float:
        return collective_time_s(kind, nbytes, 4, on) - 2e-3

    assert price(4) == pytest.approx(0.63e-3)
    assert price(2) == pytest.approx(0.63e-3)  # below the first timing: that timing
    assert price(6) == pytest.approx(0.85e-3)  # halfway between 4 and 8 bytes
    assert price(36) == pytest.approx(min(1.07e-3 + 0.5 * 6.53e-3, 6 * 1.2e-3 + 27e-9))
    # Between the last small timing and the fit's smallest size, the line where lower.
    assert price(1024) == pytest.approx(6 * 1.2e-3 + 1.5 * 1024 * 7e-10)
    # Above the fit's smallest size, and on kinds without small timings: as before.
    for nbytes in (16385.0, 2.0**20):
        assert price(nbytes) == price(nbytes, line)
    assert price(4, kind="all_gather") == price(4, line, kind="all_gather")
    assert price(4, line) == pytest.approx(6 * 1.2e-3 + 1.5 * 4 * 7e-10)
    # Kept through the JSON and the profile schema; absent where not calibrated.
    assert LinkSpec.from_dict(link.to_dict()) == link
    assert "small_messages" not in line.to_dict()
    loaded = load_profile({"version": PROFILE_VERSION, "links": {"a0": link.to_dict()}})
    assert loaded.links["a0"] == link
    for bad, match in (
        ({"all_to_all": [(4.0, 1e-3)]}, "without a calibrated fit"),
        ({"all_reduce": [(8.0, 1e-3), (4.0, 1e-3)]}, "ascending bytes below"),
        ({"all_reduce": [(16384.0, 1e-3)]}, "ascending bytes below"),
        ({"all_reduce": [(0.0, 1e-3)]}, "bytes > 0"),
    ):
        with pytest.raises(ValueError, match=match):
            link_from_fits("l", fits, smallest=smallest, small_messages=bad)
