"""Calibration fits, cost-model metrics, the profile they produce, and ``autopar compare``."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from cost_models import (
    COLLECTIVE_KINDS,
    DeviceSpec,
    collective_steps_and_wire_bytes,
    collective_time_s,
    compute_time_s,
    fit_alpha_beta,
    load_profile,
    save_profile,
)
from cost_models.calibrate import (
    build_profile,
    fit_efficiency,
    fit_rate,
    link_from_fits,
    mape,
    rank,
    spearman,
)

SIZES = [4096.0, 65536.0, 2**20, 4 * 2**20, 16 * 2**20]


@pytest.mark.parametrize("kind", [k for k in COLLECTIVE_KINDS if k != "broadcast"])
@pytest.mark.parametrize("group_size", [2, 4, 8])
def test_fit_alpha_beta_recovers_known_latency_and_bandwidth(kind: str, group_size: int) -> None:
    alpha, beta = 40e-6, 1 / 2.5e9
    rng = random.Random(0)
    times = []
    for size in SIZES:
        steps, wire = collective_steps_and_wire_bytes(kind, size, group_size)
        times.append((alpha * steps + beta * wire) * (1 + rng.uniform(-0.01, 0.01)))
    got_alpha, got_beta = fit_alpha_beta(SIZES, times, kind, group_size)
    assert got_alpha == pytest.approx(alpha, rel=0.05)
    assert got_beta == pytest.approx(beta, rel=0.02)


def test_fit_alpha_beta_refuses_timings_that_do_not_grow() -> None:
    with pytest.raises(ValueError, match="do not grow"):
        fit_alpha_beta([1e3, 1e6], [2e-3, 1e-3], "all_reduce", 2)


def test_fit_rate_recovers_throughput_and_overhead() -> None:
    work = [1e8, 4e8, 1.6e9]
    times = [w / 25e9 + 3e-5 for w in work]
    rate, overhead = fit_rate(work, times)
    assert rate == pytest.approx(25e9, rel=1e-6)
    assert overhead == pytest.approx(3e-5, rel=1e-4)
    # Through the origin the overhead is folded into the rate (slightly lower).
    rate0, overhead0 = fit_rate(work, times, through_origin=True)
    assert overhead0 == 0.0 and 24e9 < rate0 < 25e9


@pytest.mark.parametrize("efficiency", [0.05, 0.3, 0.8])
def test_fit_efficiency_recovers_the_fraction_of_the_roofline(efficiency: float) -> None:
    """Synthetic timings made by the compute model itself with a known op_efficiency."""
    device = DeviceSpec(
        name="synthetic",
        peak_flops={"float32": 50e9},
        mem_bandwidth_Bps=10e9,
        mem_capacity_bytes=2**30,
        kernel_overhead_s=8e-6,
        op_efficiency={"norm": efficiency},
    )
    work = [(5e6, 4e6), (2e7, 1.6e7), (8e7, 6.4e7)]  # (flops, bytes): memory-bound
    times = [
        compute_time_s(flops=f, bytes_accessed=b, device=device, family="norm") for f, b in work
    ]
    ideal = [max(f / 50e9, b / 10e9) for f, b in work]
    assert fit_efficiency(ideal, times, overhead_s=8e-6) == pytest.approx(efficiency, rel=1e-9)


def test_fit_efficiency_clamps_to_one_when_faster_than_the_roofline() -> None:
    assert fit_efficiency([1e-3, 2e-3], [0.5e-3, 1e-3]) == 1.0


def test_fit_efficiency_above_one_for_data_in_cache_up_to_the_bound() -> None:
    """Calibration lets a family run faster than the copy-bandwidth roofline (cache-resident
    adds and muls), and fits one efficiency over the family's members."""
    from cost_models.hardware import MAX_OP_EFFICIENCY

    faster = fit_efficiency([1e-3, 2e-3], [0.5e-3, 1e-3], max_efficiency=MAX_OP_EFFICIENCY)
    assert faster == pytest.approx(2.0)
    # gelu at the roofline (e = 1) and an add 3x faster: least squares in between.
    mixed = fit_efficiency([1e-3, 1e-3], [1e-3, 1e-3 / 3], max_efficiency=MAX_OP_EFFICIENCY)
    assert 1.0 < mixed < 3.0
    assert fit_efficiency([1e-3], [1e-6], max_efficiency=MAX_OP_EFFICIENCY) == MAX_OP_EFFICIENCY


def test_op_efficiency_above_one_prices_faster_and_round_trips(tmp_path) -> None:
    from cost_models import load_profile, save_profile
    from cost_models.hardware import MAX_OP_EFFICIENCY

    base = dict(name="cpu", peak_flops={"float32": 50e9}, mem_bandwidth_Bps=10e9,
                mem_capacity_bytes=2**30, kernel_overhead_s=0.0)  # fmt: skip
    fast = DeviceSpec(**base, op_efficiency={"pointwise": 2.0})
    slow = DeviceSpec(**base, op_efficiency={"pointwise": 1.0})
    args = dict(flops=1e6, bytes_accessed=1e8, family="pointwise")
    assert compute_time_s(device=fast, **args) == pytest.approx(
        compute_time_s(device=slow, **args) / 2
    )
    profile = build_profile(device=fast, links={})
    save_profile(profile, tmp_path / "p.json")  # validates against the schema
    assert load_profile(tmp_path / "p.json").device.op_efficiency["pointwise"] == 2.0
    for bad in (0.0, MAX_OP_EFFICIENCY * 1.5):
        with pytest.raises(ValueError, match=r"op_efficiency\['pointwise'\] must be in \(0, 8"):
            DeviceSpec(**base, op_efficiency={"pointwise": bad})


def test_mape_and_spearman_on_known_data() -> None:
    assert mape([110.0, 90.0], [100.0, 100.0]) == pytest.approx(10.0)
    assert mape([1.0, 3.0], [2.0, 2.0]) == pytest.approx(50.0)
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # Textbook example: one swapped pair among 5 -> rho = 1 - 6 * 2 / (5 * 24) = 0.9.
    assert spearman([1, 2, 3, 4, 5], [1, 3, 2, 4, 5]) == pytest.approx(0.9)
    assert rank([3.0, 1.0, 3.0, 2.0]) == [3.5, 1.0, 3.5, 2.0]
    assert math.isnan(spearman([1, 2, 3], [5, 5, 5]))
    with pytest.raises(ValueError, match="measured values must be > 0"):
        mape([1.0], [0.0])


def test_calibrated_profile_round_trips_and_drives_the_mesh(tmp_path) -> None:
    from autopar.mesh import Mesh

    fits = {"all_reduce": (100e-6, 1e-9), "all_gather": (80e-6, 2e-9)}
    link = link_from_fits("calibrated-tp", fits)
    assert link.latency_s == 100e-6 and link.bandwidth_Bps == pytest.approx(1e9)
    device = DeviceSpec(
        name="calibrated-cpu",
        peak_flops={"float32": 30e9},
        mem_bandwidth_Bps=12e9,
        mem_capacity_bytes=8 * 2**30,
        op_efficiency={"matmul": 0.9, "pointwise": 0.4},
    )
    profile = build_profile(device=device, links={"tp": link}, meta={"measured_by": "test"})
    path = tmp_path / "profile.json"
    save_profile(profile, path)
    assert load_profile(path) == profile
    mesh = Mesh.parse("2x2", device="h100", profile=str(path))
    assert mesh.device == device
    assert mesh.link("tp") == link
    assert mesh.link("dp") != link  # an axis the profile does not name keeps its default link
    nbytes = 4 * 2**20
    steps, wire = collective_steps_and_wire_bytes("all_gather", nbytes, 2)
    assert collective_time_s("all_gather", nbytes, 2, mesh.link("tp")) == pytest.approx(
        80e-6 * steps + 2e-9 * wire
    )


def test_op_work_prices_a_linear_like_the_planner() -> None:
    from autopar.tools.calibration import op_work

    x = torch.randn(32, 16, requires_grad=True)
    w = torch.randn(8, 16, requires_grad=True)
    fwd_flops, bwd_flops, fwd_bytes, bwd_bytes = op_work(torch.ops.aten.linear.default, [x, w])
    assert fwd_flops == 2 * 32 * 16 * 8
    assert bwd_flops == 2 * fwd_flops  # dX and dW
    assert fwd_bytes == 4 * (32 * 16 + 8 * 16 + 32 * 8)
    assert bwd_bytes == 2 * fwd_bytes


def test_summarize_computes_family_mape_step_mape_and_spearman() -> None:
    from autopar.tools.bench_cost import summarize

    breakdown = {"compute_s": 0.0}
    result = {
        "ops": [
            {"family": "matmul", "count": 2, "predicted_s": 1.1, "measured_s": 1.0},
            {"family": "matmul", "count": 1, "predicted_s": 0.8, "measured_s": 1.0},
            {"family": "norm", "count": 1, "predicted_s": 0.5, "measured_s": 1.0},
        ],
        "plans": {
            "auto": {"step_s": 1.0, "predicted_step_s": 1.1, "peak_memory_bytes": 100.0,
                     "predicted_peak_memory_bytes": 110.0, "predicted_breakdown": breakdown},
            "ddp": {"step_s": 2.0, "predicted_step_s": 1.8, "peak_memory_bytes": None,
                    "predicted_peak_memory_bytes": 90.0, "predicted_breakdown": breakdown},
            "megatron": {"step_s": 3.0, "predicted_step_s": 3.0, "peak_memory_bytes": 100.0,
                         "predicted_peak_memory_bytes": 80.0, "predicted_breakdown": breakdown},
            "fsdp": {"skipped": "ZeRO not available", "predicted_step_s": 9.0,
                     "predicted_peak_memory_bytes": 1.0, "predicted_breakdown": breakdown},
        },
    }  # fmt: skip
    s = summarize(result)
    assert s["families"]["matmul"]["count"] == 3
    assert s["families"]["matmul"]["mape"] == pytest.approx(100 * (0.1 + 0.1 + 0.2) / 3)
    assert s["families"]["norm"]["mape"] == pytest.approx(50.0)
    assert s["step_mape"] == pytest.approx(100 * (0.1 + 0.1 + 0.0) / 3)
    assert s["spearman"] == pytest.approx(1.0)
    assert s["memory_mape"] == pytest.approx(100 * (0.1 + 0.2) / 2)
    assert s["num_plans"] == 3 and set(s["skipped_plans"]) == {"fsdp"}
    assert s["fastest_measured"] == "auto"


@pytest.fixture(scope="module")
def mlp_plans():
    from autopar.capture.export import capture
    from autopar.mesh import Mesh
    from autopar.models import MLP, MLPConfig
    from autopar.options import PlanOptions
    from autopar.tools.report import plans_for_recipes

    # A long batch and narrow layers: gradients are cheaper to reduce than inputs to gather, so
    # the ddp recipe is batch parallel throughout.
    torch.manual_seed(0)
    model = MLP(MLPConfig(in_features=16, hidden=64, out_features=16))
    captured = capture(model, (torch.randn(8192, 16), torch.randn(8192, 16)), {})
    mesh = Mesh.spec((2, 2), device="cpu")
    recipes = ["auto", "ddp", "fsdp", "megatron", "fsdp+tp"]
    return captured, plans_for_recipes(
        captured, mesh, PlanOptions(), recipes=recipes, model_name="mlp"
    )


def test_compare_table_lists_every_recipe(mlp_plans) -> None:
    from autopar.tools.report import compare_rows, compare_table

    _, plans = mlp_plans
    rows = compare_rows(plans)
    for markdown in (False, True):
        text = compare_table(rows, markdown=markdown, title="mlp")
        for recipe in plans:
            assert f" {recipe} " in text
        assert "bytes on dp" in text and "bytes on tp" in text
    # Recipes are restrictions of the auto plan's problem: never predicted faster.
    auto = next(r for r in rows if r["plan"] == "auto")
    assert all(auto["step_s"] <= r["step_s"] * (1 + 1e-9) for r in rows if r["fits"])
    assert plans["fsdp"].zero["stage"] == 3 and plans["ddp"].zero["stage"] == 0


def test_ddp_moves_each_gradient_once_per_axis(mlp_plans) -> None:
    """DDP on a 2x2 mesh: one all-reduce of every parameter gradient per axis; a ring
    all-reduce over 2 devices sends exactly the tensor's bytes, plus the loss's scalars."""
    from autopar.tools.report import comm_volume_by_axis

    captured, plans = mlp_plans
    param_bytes = sum(
        math.prod(n.meta["val"].shape) * 4
        for n in captured.gm.graph.nodes
        if n.name in captured.param_nodes
    )
    volume = comm_volume_by_axis(plans["ddp"])
    for axis in ("dp", "tp"):
        assert param_bytes <= volume[axis] <= param_bytes + 1024, (axis, volume, param_bytes)
    # Megatron moves activations on tp instead of parameter gradients.
    assert comm_volume_by_axis(plans["megatron"])["tp"] != volume["tp"]
    json.dumps(volume)


def test_plan_cli_uses_a_profile(tmp_path, capsys) -> None:
    from autopar.tools.cli import main

    data = {
        "version": 1,
        "device": {"name": "slow-cpu", "peak_flops": {"float32": 1e9}, "mem_bandwidth_Bps": 1e9,
                   "mem_capacity_bytes": 2**33},
        "links": {"a0": {"name": "slow-link", "bandwidth_Bps": 1e8, "latency_s": 1e-3}},
    }  # fmt: skip
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    out = tmp_path / "plan.json"
    assert (
        main(
            [
                "plan",
                "mlp-1l",
                "--mesh",
                "2",
                "--profile",
                str(path),
                "--batch",
                "8",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    plan = json.loads(out.read_text())
    assert plan["mesh"]["device"]["name"] == "slow-cpu"
    assert plan["mesh"]["links"][0]["name"] == "slow-link"


def test_calibration_times_the_collective_kinds_in_turn_within_each_trial() -> None:
    """Link calibration interleaves the kinds (one timing of each per trial), so that load
    drifting over seconds falls on every kind alike, and times each kind the runtime's way."""
    from autopar.tools.calibration_links import (
        CALIBRATED_COLLECTIVES,
        RUNTIME_CALLS,
        interleaved_medians,
    )

    order: list[str] = []
    fns = {key: (lambda key=key: order.append(key)) for key in ("all_reduce", "reduce_scatter")}
    between = []
    medians = interleaved_medians(
        fns,
        {"all_reduce": 2, "reduce_scatter": 3},
        3,
        lambda: between.append(1),
        torch.device("cpu"),
    )
    assert order == (["all_reduce"] * 2 + ["reduce_scatter"] * 3) * 3
    assert len(between) == 6 and set(medians) == set(fns)
    assert all(math.isfinite(s) and s >= 0 for s in medians.values())
    assert set(RUNTIME_CALLS) == set(CALIBRATED_COLLECTIVES)
    assert RUNTIME_CALLS["reduce_scatter"] == "reduce_scatter_single"
    assert RUNTIME_CALLS["all_gather"] == "all_gather_single"
