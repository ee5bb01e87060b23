"""A real (minimal) calibration on 2 gloo ranks gives a profile the planner accepts."""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Any

import pytest


def _calibrate(rank: int, world_size: int) -> dict[str, Any]:
    import dataclasses
    import os

    from autopar.tools.calibration import CalibrationConfig, calibrate_on_rank

    leads = os.getsid(0) == os.getpid()  # spawn_ranks' doing, before calibration's own setsid
    # One core for the two ranks: the links' shared-cores figures are measured (cpu_weight).
    config = dataclasses.replace(CalibrationConfig.tiny(), cores=1)
    data = calibrate_on_rank((2,), ("tp",), config, verbose=False)
    data["meta"]["rank_leads_its_session"] = leads
    return data


@pytest.mark.distributed
def test_tiny_calibration_gives_a_profile_the_planner_uses(tmp_path) -> None:
    from autopar.mesh import Mesh
    from autopar.tools.calibration import CALIBRATED_FAMILIES
    from autopar.tools.calibration_level import (
        CPU_LEVEL_RANGE,
        cpu_compute_level,
        foreign_threads,
        shared_core_speed,
    )
    from autopar.tools.calibration_links import CALIBRATED_COLLECTIVES, cpu_weight
    from autopar.tools.calibration_pipeline import (
        LEVEL_RANGE,
        pipeline_busy_rank_speed,
        pipeline_compute_level,
        priced_stage_tasks,
    )
    from cost_models import collective_time_s, load_profile, save_profile
    from cost_models.calibrate import STEP_ERROR_MAX
    from cost_models.hardware import MAX_OP_EFFICIENCY
    from tests.distributed.launcher import run_distributed

    results = run_distributed(_calibrate, 2, timeout_s=120)
    same = [{k: v for k, v in r.items() if k != "meta"} for r in results]
    assert same[0] == same[1], "every rank returns the same device and links"
    profile = load_profile(results[0])  # validates against PROFILE_SCHEMA
    device = profile.device
    assert device is not None
    assert device.peak_flops["float32"] > 1e8
    assert device.mem_bandwidth_Bps > 1e8
    assert set(device.op_efficiency) == set(CALIBRATED_FAMILIES)
    assert all(0 < e <= MAX_OP_EFFICIENCY for e in device.op_efficiency.values())
    # Interleaved rounds (CalibrationConfig.trials), each timing every op once; the pointwise
    # family is fitted over add and mul, the activation family over gelu and silu, each round
    # against its own peak.
    for family in ("pointwise", "activation"):
        timed_rounds = profile.meta["measurements"][f"op_{family}"]["seconds"]
        assert len(timed_rounds) == 2 and all(len(r) == 2 and min(r) > 0 for r in timed_rounds)
    fits = profile.meta["measurements"]["fits_per_round"]
    assert device.peak_flops["float32"] == pytest.approx(
        sum(fits["float32"]) / 2, rel=1e-12
    )  # the median of the 2 rounds' peaks (statistics.median's rounding may differ in the last bit)
    # Per-rank speed with 1 and 2 ranks computing (ranks sharing this CPU), at the level of
    # calibration's pipeline (its tasks against their price; checked below).
    assert set(device.busy_rank_speed) == {"1", "2"}
    assert 0 < device.busy_rank_speed["1"] < 100 and 0 < device.busy_rank_speed["2"] < 100
    assert profile.meta["measurements"]["busy_rank_speed"]["cpu_count"] >= 1
    # Each rank its own session (scheduling group), as torchrun starts them: spawn_ranks makes
    # every rank lead one, so tests, autoparallelize spawns and calibration share scheduling.
    assert profile.meta["measurements"]["busy_rank_speed"]["sessions"] == 2
    assert all(r["meta"]["rank_leads_its_session"] for r in results)
    # A pipeline's wait per task: a short GPipe run on both ranks, the gap measured between
    # its tasks; busy_rank_speed: the probe's, scaled to how much faster its lone tasks ran.
    task_wait = profile.meta["measurements"]["task_wait"]
    assert task_wait["schedule"] == "gpipe" and len(task_wait["rounds"]) == 3
    assert all(r["step_s"] > 0 and min(r["forward_s"] + r["backward_s"]) > 0
               and r["gap_s"] >= 0 and r["fitted_task_wait_s"] >= 0
               for r in task_wait["rounds"])  # fmt: skip
    assert device.task_wait_s == statistics.median(r["task_wait_s"] for r in task_wait["rounds"])
    probe = profile.meta["measurements"]["busy_rank_speed"]["probe"]
    shaped = pipeline_busy_rank_speed(probe, task_wait["lone_speedup"], task_wait["together_ranks"])
    assert shaped["2"] == 1.0
    # The level: the pipeline's tasks against the planner's price of them on this profile.
    world, rows, width = 2, task_wait["rows"], task_wait["width"]
    priced = priced_stage_tasks(device, width=width, rows=rows, layers=task_wait["layers"],
                                world=world)  # fmt: skip
    assert task_wait["priced_forward_s"] + task_wait["priced_backward_s"] == pytest.approx(
        priced[0] + priced[1], rel=1e-9
    )
    assert all(len(r["forward_ranks"]) == world and 1 <= min(r["backward_ranks"])
               and max(r["forward_ranks"]) <= world for r in task_wait["rounds"])  # fmt: skip
    level = task_wait["compute_level"]
    assert level == pipeline_compute_level(task_wait["rounds"], *priced, shaped)
    # Recorded only: the level against the matmul rate probed before each round.
    assert all(r["matmul_flops"] > 1e8 for r in task_wait["rounds"])
    assert task_wait["compute_level_at_round_rate"] == pipeline_compute_level(
        task_wait["rounds"], *priced, shaped, peak_flops=device.peak_flops["float32"]
    )
    # Recorded only (session 15): the level in thread CPU seconds and the tasks' CPU share.
    assert all(len(r["forward_cpu_s"]) == world and min(r["backward_cpu_s"]) > 0
               for r in task_wait["rounds"])  # fmt: skip
    assert task_wait["cpu_compute_level"] == cpu_compute_level(task_wait["rounds"], *priced)
    assert 0 < task_wait["cpu_share"] <= 1
    assert 0 < task_wait["ops_cpu_share"] <= 1 and task_wait["ops_cpu_flops"] > 1e8
    level = min(max(level, LEVEL_RANGE[0]), LEVEL_RANGE[1])
    wall = {k: v * level for k, v in shaped.items()}
    assert task_wait["wall_level_speed"] == pytest.approx(wall)  # session 24's, recorded only
    # Session 25: the CPU level times each count's share of the cores beside the other
    # threads the quietest round met.
    cores = task_wait["cores"]
    foreign = foreign_threads(task_wait["rounds"], cores)
    assert task_wait["foreign_threads"] == foreign and foreign >= 0 and cores >= 1
    cpu_level = min(max(task_wait["cpu_compute_level"], CPU_LEVEL_RANGE[0]), CPU_LEVEL_RANGE[1])
    assert dict(device.busy_rank_speed) == pytest.approx(
        shared_core_speed(cpu_level, world, cores, foreign)
    )
    assert device.task_wait_s >= 0 and device.task_wait_s < min(
        r["step_s"] for r in task_wait["rounds"]
    )
    assert profile.to_dict()["device"].get("task_wait_s", 0.0) == device.task_wait_s
    mix = profile.meta["measurements"]["busy_rank_speed"]["op_mix_speed"]
    assert set(mix) == {"1", "2"} and mix["2"] == 1.0 and 0 < mix["1"] < 100
    link = profile.links["tp"]
    assert set(link.collectives) == set(CALIBRATED_COLLECTIVES)
    assert all(alpha >= 0 and beta > 0 for alpha, beta in link.collectives.values())
    sync = profile.meta["measurements"]["tp/sync"]["seconds_per_call"]
    assert link.sync_s >= 0 and all(len(v) >= 3 and min(v) > 0 for v in sync.values())
    timed = profile.meta["measurements"]
    assert timed["tp/reduce_scatter"]["call"] == "reduce_scatter_single"  # the runtime's call
    assert all(min(timed[f"tp/{kind}"]["seconds"]) > 0 for kind in CALIBRATED_COLLECTIVES)
    # The smallest size's timing, kept per kind for small messages (cost_models.comm).
    assert {k: v for k, v in link.smallest.items()} == {
        k: (timed[f"tp/{k}"]["bytes"][0], timed[f"tp/{k}"]["seconds"][0])
        for k in CALIBRATED_COLLECTIVES
    }
    # Session 37: sizes below the fit's, timed as the runtime calls them (a scalar all-reduce
    # is one element; an all-gather at least one element per rank), kept per kind.
    small = timed["tp/small_messages"]
    assert {k: tuple(tuple(p) for p in v) for k, v in small.items()} == dict(link.small_messages)
    assert [b for b, _ in link.small_messages["all_reduce"]] == [4.0, 64.0]
    assert [b for b, _ in link.small_messages["all_gather"]] == [8.0, 64.0]
    assert all(s > 0 for v in link.small_messages.values() for _, s in v)
    assert profile.meta["world_size"] == 2 and profile.meta["backend"] == "gloo"
    # The profile's own error: the standard error of its figures (spread of the trials).
    spreads = [timed[f"tp/{kind}"]["spread"] for kind in CALIBRATED_COLLECTIVES]
    assert all(len(s) == len(timed["tp/all_reduce"]["bytes"]) for s in spreads)
    assert 0 < device.step_error <= STEP_ERROR_MAX
    # The error of a difference: spreads of per-trial ratios of kinds timed in the same trials.
    paired = timed["tp/paired"]["paired_spread"]
    assert len(paired) == len(CALIBRATED_COLLECTIVES) * (len(CALIBRATED_COLLECTIVES) - 1) // 2
    assert "compute/collective" in timed["tp/sync"]["paired_spread"]
    assert 0 < device.paired_error <= STEP_ERROR_MAX
    # sync_s is measured after computations of about CalibrationConfig.sync_segment_s.
    sync = timed["tp/sync"]
    assert sync["matmuls_per_segment"] >= 1 and sync["segment_s"] > 0

    # Session 30: ranks outnumbering their cores (cores=1 above). Per kind but broadcast the
    # CPU a rank burns per call, fitted over the same sizes; the weight that would price the
    # chain's all-reduce at the chain's measured excess per call is recorded, not set.
    assert set(link.cpu_collectives) == set(CALIBRATED_COLLECTIVES) - {"broadcast"}
    assert all(len(timed[f"tp/{k}"]["cpu_seconds"]) == len(timed[f"tp/{k}"]["bytes"])
               and min(timed[f"tp/{k}"]["cpu_seconds"]) > 0 for k in link.cpu_collectives)  # fmt: skip
    assert len(sync["cpu_excess_per_call"]) == 3 and sync["group_size"] == 2
    assert link.cpu_weight == 0.0 and sync["cpu_weight"] == cpu_weight({"tp": link}, {"tp": sync})
    weighted = dataclasses.replace(link, cpu_weight=sync["cpu_weight"])
    if sync["excess_median"] > 0:  # one axis, 3 trials: the median trial's excess
        assert collective_time_s("all_reduce", sync["bytes"], 2, weighted) == pytest.approx(
            sync["excess_median"], rel=1e-9
        )

    path = tmp_path / "profile.json"
    save_profile(profile, path)
    mesh = Mesh.parse("tp=2", device="h100", profile=str(path))
    assert mesh.device == device and mesh.link("tp") == link
    kind, (alpha, beta) = next(iter(link.collectives.items()))
    seconds = collective_time_s(kind, 2**20, 2, mesh.link("tp"))
    assert math.isfinite(seconds) and seconds >= alpha  # the wall model


@pytest.mark.distributed
def test_bench_cost_measures_every_plan_and_op_on_two_ranks(tmp_path, capsys) -> None:
    import json

    from autopar.tools.cli import main

    out = tmp_path / "bench.json"
    plots = tmp_path / "bench"
    code = main(
        [
            "bench-cost", "tests.models:tiny_factory", "--mesh", "2", "--device", "cpu",
            "--batch", "4", "--seq", "16", "--nproc", "2", "--steps", "2", "--op-time", "0.002",
            "--json", str(out), "--plots", str(plots),
        ]
    )  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "Spearman" in printed and "step MAPE" in printed
    data = json.loads(out.read_text())
    plans = data["result"]["plans"]
    assert {"auto", "ddp", "megatron"} <= set(plans)
    for figures in plans.values():
        assert figures["step_s"] > 0 and figures["predicted_step_s"] > 0
        assert figures["peak_memory_bytes"] > 0
        assert len(figures["step_times_s"]) == 2 and min(figures["step_times_s"]) > 0
    assert data["result"]["ops"], "per-op predicted vs measured times are missing"
    summary = data["summary"]
    assert -1.0 <= summary["spearman"] <= 1.0 and math.isfinite(summary["step_mape"])
    assert (tmp_path / "bench_ops.png").stat().st_size > 0
    assert (tmp_path / "bench_steps.png").stat().st_size > 0
