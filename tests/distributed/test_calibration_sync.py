"""``LinkSpec.sync_s`` is measured the way a tensor-parallel step incurs it (session 26):
all-reduces between matmul segments, forward and backward, through the runtime's autograd
collectives, less what the link's fit prices them back to back."""

from __future__ import annotations

import statistics
from typing import Any

import pytest


def _measure(rank: int, world_size: int) -> dict[str, Any]:
    import torch

    import autopar.comm.collectives as collectives
    from autopar.comm.process_groups import axis_groups
    from autopar.tools.calibration import CalibrationConfig
    from autopar.tools.calibration_sync import SYNC_LAYERS, _chain, measure_sync
    from cost_models import LinkSpec

    groups = axis_groups((2,), ("tp",), key="sync-test")
    ops: list[str] = []
    guarded = collectives._guarded

    def counted(op, groups, axis, t, call):  # type: ignore[no-untyped-def]
        ops.append(op)
        return guarded(op, groups, axis, t, call)

    collectives._guarded = counted
    try:
        weights = [torch.randn(256, 256, requires_grad=True) for _ in range(SYNC_LAYERS)]
        _chain(groups, 0, weights, 1, True)()
        with_comm = list(ops)
        ops.clear()
        _chain(groups, 0, weights, 1, False)()
        without = list(ops)
    finally:
        collectives._guarded = guarded
    config = CalibrationConfig.tiny()
    cheap = LinkSpec(name="cheap", bandwidth_Bps=1e15, latency_s=0.0)
    dear = LinkSpec(name="dear", bandwidth_Bps=1e15, latency_s=1.0)
    return {
        "with_comm": with_comm,
        "without": without,
        "cheap": measure_sync(groups, 0, cheap, torch.device("cpu"), config),
        "dear": measure_sync(groups, 0, dear, torch.device("cpu"), config),
    }


@pytest.fixture(scope="module")
def measured() -> list[dict[str, Any]]:
    from tests.distributed.launcher import run_distributed

    return run_distributed(_measure, 2, timeout_s=120)


def test_the_chain_all_reduces_twice_per_block_forward_and_backward(measured) -> None:
    from autopar.tools.calibration_sync import SYNC_LAYERS

    for result in measured:
        assert result["with_comm"] == ["all_reduce"] * (2 * SYNC_LAYERS)
        assert result["without"] == []


def test_sync_is_the_median_excess_per_call_less_the_priced_collective(measured) -> None:
    from cost_models import LinkSpec, collective_time_s

    for result in measured:
        for name, latency in (("cheap", 0.0), ("dear", 1.0)):
            sync_s, details = result[name]
            link = LinkSpec(name=name, bandwidth_Bps=1e15, latency_s=latency)
            priced = collective_time_s("all_reduce", details["bytes"], 2, link)
            assert details["priced_back_to_back_s"] == pytest.approx(priced)
            times = details["seconds_per_call"]
            excess = [m - c for m, c in zip(times["mixed"], times["compute"])]
            assert len(excess) == 3  # CalibrationConfig.tiny().sync_trials
            assert sync_s == details["sync_s"]
            assert sync_s == pytest.approx(max(0.0, statistics.median(excess) - priced))
            # Not the back-to-back timing: that is kept for comparison only.
            assert len(times["collective"]) == 3
        # Collectives between computations cost something; a link priced at a second per
        # step already covers it (clamped at 0).
        assert result["cheap"][0] > 0
        assert result["dear"][0] == 0.0
