"""cost_models: presets, profile JSON, roofline, FLOP formulas, collectives, training memory."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

import cost_models as cm
from cost_models import (
    DeviceSpec,
    LinkSpec,
    Profile,
    attention_flops,
    backward_flops_factor,
    collective_time_s,
    compute_time_s,
    fit_alpha_beta,
    get_device,
    get_link,
    load_profile,
    matmul_flops,
    save_profile,
    training_state_bytes,
)

T = 1e12
GiB = 2**30

# -- presets -----------------------------------------------------------------------------------


def test_cost_models_never_import_torch_or_autopar() -> None:
    code = "import sys, cost_models; print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'autopar')))"
    root = Path(cm.__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env, cwd=root
    )
    assert out.stdout.strip() == "[]"


def test_gpu_presets_have_datasheet_dense_figures() -> None:
    a100 = get_device("a100")
    assert a100.peak_flops["float32"] == 19.5 * T
    assert a100.peak_flops["tf32"] == 156 * T
    assert a100.peak_flops["bfloat16"] == a100.peak_flops["float16"] == 312 * T
    assert a100.mem_bandwidth_Bps == 2039e9 and a100.mem_capacity_bytes == 80 * GiB
    assert "float8" not in a100.peak_flops
    assert get_device("a100-40gb").mem_capacity_bytes == 40 * GiB
    h100 = get_device("h100")
    assert h100.peak_flops["float32"] == 67 * T
    assert h100.peak_flops["tf32"] == 494.5 * T
    assert h100.peak_flops["bfloat16"] == 989.5 * T
    assert h100.peak_flops["float8"] == 1979 * T
    assert h100.mem_bandwidth_Bps == 3.35e12
    pcie = get_device("h100-pcie")
    assert [pcie.peak_flops[d] for d in ("float32", "tf32", "bfloat16", "float8")] == [
        51 * T, 378 * T, 756 * T, 1513 * T,
    ]  # fmt: skip
    assert pcie.mem_bandwidth_Bps == 2.0e12
    h200 = get_device("h200")
    assert h200.peak_flops == h100.peak_flops
    assert h200.mem_bandwidth_Bps == 4.8e12 and h200.mem_capacity_bytes == 141 * GiB


@pytest.mark.parametrize("name", sorted(cm.DEVICES))
def test_every_preset_is_sane_and_names_its_source(name: str) -> None:
    dev = get_device(name)
    assert dev.name == name and dev.source
    assert dev.peak_flops["bfloat16"] >= dev.peak_flops["float32"]
    if name != "cpu":
        assert dev.peak_flops["bfloat16"] > dev.peak_flops["tf32"] > dev.peak_flops["float32"]
        assert "datasheet" in dev.source
        assert 0 < dev.matmul_efficiency <= 1 and dev.kernel_overhead_s > 0


def test_aliases_and_case_resolve_to_presets() -> None:
    assert get_device("A100-SXM-80GB") is get_device("a100")
    assert get_device("h100-sxm") is get_device("h100")
    assert get_device("h200-sxm") is get_device("h200")
    spec = get_device("cpu")
    assert get_device(spec) is spec


def test_link_presets() -> None:
    assert get_link("nvlink").bandwidth_Bps == 450e9
    assert get_link("nvlink3").bandwidth_Bps == 300e9
    assert get_link("infiniband").bandwidth_Bps == 50e9
    assert get_link("ethernet").bandwidth_Bps == 12.5e9
    assert (
        get_link("loopback").latency_s
        > get_link("infiniband").latency_s
        > get_link("nvlink").latency_s
    )


def test_unknown_names_list_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown device 'tpu-v5'.*h100"):
        get_device("tpu-v5")
    with pytest.raises(ValueError, match="unknown link 'pcie'.*nvlink"):
        get_link("pcie")


def test_specs_are_frozen_hashable_picklable_and_validated() -> None:
    h100 = get_device("h100")
    with pytest.raises(AttributeError):
        h100.name = "x"  # type: ignore[misc]
    assert {h100, get_device("h100")} == {h100}
    assert pickle.loads(pickle.dumps(h100)) == h100
    link = LinkSpec(
        name="l", bandwidth_Bps=1e9, latency_s=1e-6, collectives={"all_reduce": [1e-6, 1e-9]}
    )
    assert link.collectives["all_reduce"] == (1e-6, 1e-9)
    assert pickle.loads(pickle.dumps(link)) == link and hash(link) == hash(
        pickle.loads(pickle.dumps(link))
    )
    with pytest.raises(ValueError, match="matmul_efficiency"):
        DeviceSpec(
            name="d",
            peak_flops={"float32": 1.0},
            mem_bandwidth_Bps=1.0,
            mem_capacity_bytes=1,
            matmul_efficiency=1.5,
        )
    with pytest.raises(ValueError, match="unknown collective 'gossip'"):
        LinkSpec(name="l", bandwidth_Bps=1e9, latency_s=0.0, collectives={"gossip": (0.0, 0.0)})


def test_spec_dicts_round_trip_exactly() -> None:
    for dev in cm.DEVICES.values():
        assert DeviceSpec.from_dict(json.loads(json.dumps(dev.to_dict()))) == dev
    link = LinkSpec(
        name="ib",
        bandwidth_Bps=4.4e10,
        latency_s=7e-6,
        collectives={"all_gather": (2e-6, 2.1e-11)},
        source="calib",
    )
    assert LinkSpec.from_dict(json.loads(json.dumps(link.to_dict()))) == link


# -- profile JSON ------------------------------------------------------------------------------


def _profile_dict() -> dict:
    return {
        "version": 1,
        "device": {"name": "h100-tuned", "base": "h100", "op_efficiency": {"matmul": 0.78}},
        "links": {
            "tp": {
                "base": "nvlink",
                "bandwidth_Bps": 3.6e11,
                "collectives": {"all_reduce": [4e-6, 2.9e-12]},
            },
            "0": {"name": "ib-measured", "bandwidth_Bps": 4.5e10, "latency_s": 8e-6},
        },
        "meta": {"measured_by": "test", "when": "2026-01-01", "runs": [1, 2]},
    }


def test_profile_base_fills_unset_fields_and_merges_mappings() -> None:
    prof = load_profile(_profile_dict())
    assert prof.device is not None and prof.device.name == "h100-tuned"
    assert prof.device.peak_flops == get_device("h100").peak_flops
    assert prof.device.op_efficiency == {"matmul": 0.78}
    assert prof.device.source == "h100 preset with op_efficiency overridden"
    assert (
        DeviceSpec.from_dict({"base": "h100", "name": "mine"}).source == get_device("h100").source
    )
    assert prof.links["tp"].name == "nvlink" and prof.links["tp"].bandwidth_Bps == 3.6e11
    assert prof.links["tp"].latency_s == get_link("nvlink").latency_s
    assert prof.links["0"].name == "ib-measured"
    assert prof.meta["runs"] == [1, 2]


def test_profile_file_round_trip_is_lossless(tmp_path) -> None:
    prof = load_profile(_profile_dict())
    path = tmp_path / "profile.json"
    save_profile(prof, path)
    again = load_profile(path)
    assert again == prof
    jsonschema.validate(json.loads(path.read_text()), cm.PROFILE_SCHEMA)
    save_profile(again, path)
    assert load_profile(str(path)) == prof
    assert load_profile(Profile()) == Profile()


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"device": {"base": "h100"}}, "version"),
        ({"version": 2}, "at version"),
        ({"version": 1, "device": {"name": "x"}}, "needs a 'base' preset or all of"),
        (
            {"version": 1, "device": {"base": "h100", "matmul_efficiency": 1.2}},
            "device.matmul_efficiency",
        ),
        ({"version": 1, "device": {"base": "h100", "peak_flop": {}}}, "peak_flop"),
        ({"version": 1, "device": {"base": "tpu"}}, "unknown device 'tpu'"),
        (
            {"version": 1, "links": {"tp": {"base": "nvlink", "bandwidth_Bps": -1}}},
            "links.tp.bandwidth_Bps",
        ),
        (
            {"version": 1, "links": {"tp": {"base": "nvlink", "collectives": {"gossip": [1, 2]}}}},
            "gossip",
        ),
        (
            {"version": 1, "links": {"tp": {"base": "nvlink", "collectives": {"all_reduce": [1]}}}},
            "all_reduce",
        ),
        ({"version": 1, "links": {"tp": {"bandwidth_Bps": 1e9}}}, "each link needs"),
    ],
)
def test_invalid_profiles_raise_clear_errors(bad: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_profile(bad)


def test_malformed_profile_file_names_the_file(tmp_path) -> None:
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="broken.json.*not valid JSON"):
        load_profile(path)


# -- compute -----------------------------------------------------------------------------------


def test_roofline_large_matmul_is_compute_bound() -> None:
    h100 = get_device("h100")
    m = n = k = 8192
    flops = matmul_flops(m, n, k)
    nbytes = 2 * (m * k + k * n + m * n)
    t = compute_time_s(
        flops=flops, bytes_accessed=nbytes, device=h100, dtype="bfloat16", family="matmul"
    )
    expected = flops / (989.5 * T * h100.matmul_efficiency) + h100.kernel_overhead_s
    assert t == pytest.approx(expected)
    # fp32 is ~15x slower than bf16 on tensor cores
    t32 = compute_time_s(
        flops=flops, bytes_accessed=2 * nbytes, device=h100, dtype="float32", family="matmul"
    )
    assert t32 > 10 * t


def test_roofline_pointwise_is_memory_bound() -> None:
    h100 = get_device("h100")
    numel = 64 * 2**20
    nbytes = 3 * 4 * numel  # two reads and one write of fp32
    t = compute_time_s(flops=numel, bytes_accessed=nbytes, device=h100, family="pointwise")
    expected = nbytes / (3.35e12 * h100.memory_efficiency) + h100.kernel_overhead_s
    assert t == pytest.approx(expected)


def test_roofline_zero_work_costs_nothing_and_tiny_work_costs_the_launch() -> None:
    h100 = get_device("h100")
    assert compute_time_s(flops=0, bytes_accessed=0, device=h100) == 0.0
    assert compute_time_s(flops=1, bytes_accessed=4, device=h100) == pytest.approx(
        h100.kernel_overhead_s, rel=1e-3
    )
    with pytest.raises(ValueError):
        compute_time_s(flops=-1, bytes_accessed=0, device=h100)


def test_calibrated_op_efficiency_scales_the_ideal_roofline() -> None:
    dev = DeviceSpec.from_dict({"base": "h100", "op_efficiency": {"matmul": 0.5, "norm": 0.25}})
    flops, nbytes = 1e12, 1e6
    t = compute_time_s(
        flops=flops, bytes_accessed=nbytes, device=dev, dtype="bf16", family="matmul"
    )
    assert t == pytest.approx(flops / (989.5 * T) / 0.5 + dev.kernel_overhead_s)
    t_norm = compute_time_s(flops=1e6, bytes_accessed=1e9, device=dev, family="norm")
    assert t_norm == pytest.approx(1e9 / 3.35e12 / 0.25 + dev.kernel_overhead_s)


def test_activations_take_their_own_efficiency_or_else_the_pointwise_one() -> None:
    """A profile calibrated before "activation" existed timed gelu and silu in "pointwise":
    they are priced with that figure, as before; a profile with its own figure uses it."""
    old = DeviceSpec.from_dict({"base": "cpu", "op_efficiency": {"pointwise": 0.5}})
    new = DeviceSpec.from_dict(
        {"base": "cpu", "op_efficiency": {"pointwise": 0.5, "activation": 0.125}}
    )
    work = dict(flops=1e3, bytes_accessed=1e8)
    ideal = 1e8 / old.mem_bandwidth_Bps
    for dev, eff in ((old, 0.5), (new, 0.125)):
        t = compute_time_s(**work, device=dev, family="activation")
        assert t == pytest.approx(ideal / eff + dev.kernel_overhead_s)
        assert compute_time_s(**work, device=dev, family="pointwise") == pytest.approx(
            ideal / 0.5 + dev.kernel_overhead_s
        )
    datasheet = get_device("cpu")  # no calibrated figure: the same roofline as pointwise ops
    assert compute_time_s(**work, device=datasheet, family="activation") == compute_time_s(
        **work, device=datasheet, family="pointwise"
    )


def test_dtype_names_and_fallbacks() -> None:
    a100 = get_device("a100")
    assert cm.peak_flops_for(a100, "torch.bfloat16") == 312 * T
    assert cm.peak_flops_for(a100, "float8_e4m3fn") == 312 * T  # no fp8 on A100: bf16 rate
    assert cm.peak_flops_for(a100, "int64") == 19.5 * T
    cpu = get_device("cpu")
    assert cm.peak_flops_for(cpu, "tf32") == cpu.peak_flops["float32"]
    with pytest.raises(ValueError, match="no peak FLOP/s for dtype 'complex64'"):
        cm.peak_flops_for(cpu, "complex64")


def test_matmul_and_attention_flops() -> None:
    assert matmul_flops(2, 3, 4) == 48
    assert matmul_flops(2, 3, 4, batch=5) == 240
    full = attention_flops(2, 8, 1024, 1024, 64, causal=False)
    assert full == 4 * 2 * 8 * 1024 * 1024 * 64
    causal = attention_flops(2, 8, 1024, 1024, 64, causal=True)
    assert causal / full == pytest.approx((1024 * 1025 / 2) / (1024 * 1024))
    assert 0.5 < causal / full < 0.501
    # A value head size of its own: QK^T at head_dim, PV at v_head_dim.
    assert attention_flops(1, 2, 8, 8, 16, v_head_dim=4, causal=False) == 2 * 2 * 8 * 8 * (16 + 4)


def test_causal_pairs_match_a_brute_force_mask() -> None:
    for q_len, kv_len in [(1, 1), (4, 4), (3, 7), (7, 3), (5, 1), (1, 6)]:
        top_left = sum(1 for i in range(q_len) for j in range(kv_len) if j <= i)
        bottom_right = sum(
            1 for i in range(q_len) for j in range(kv_len) if j <= i + kv_len - q_len
        )
        assert cm.attention_pairs(q_len, kv_len, causal=True) == top_left
        assert cm.attention_pairs(q_len, kv_len, causal=True, bottom_right=True) == bottom_right
        assert cm.attention_pairs(q_len, kv_len, causal=False) == q_len * kv_len


def test_backward_flops_factors() -> None:
    assert backward_flops_factor("matmul", 2) == 2.0
    assert backward_flops_factor("matmul", 1) == 1.0
    assert backward_flops_factor("attention", 3) == 2.5
    assert backward_flops_factor("pointwise", 1) == 1.0
    assert backward_flops_factor("norm", 3) == 2.0
    assert backward_flops_factor("softmax", 1) == 1.0  # y * (dy - sum(dy * y)): 4 vs 5 per element
    assert backward_flops_factor("loss", 1) == 1.0
    assert backward_flops_factor("view", 1) == 0.0
    assert backward_flops_factor("something-new", 1) == 1.0
    assert backward_flops_factor("matmul", 0) == 0.0
    with pytest.raises(ValueError):
        backward_flops_factor("matmul", -1)


# -- communication -----------------------------------------------------------------------------

LINK = LinkSpec(name="test", bandwidth_Bps=100e9, latency_s=5e-6)


def test_a_pipeline_send_is_the_two_device_broadcast_without_the_wait_between_computations() -> (
    None
):
    import dataclasses

    from cost_models import send_time_s

    waiting = dataclasses.replace(LINK, sync_s=2e-3)
    plain = collective_time_s("broadcast", 4e6, 2, LINK)
    assert send_time_s(4e6, LINK) == pytest.approx(plain)
    assert collective_time_s("broadcast", 4e6, 2, waiting) == pytest.approx(plain + 2e-3)
    assert send_time_s(4e6, waiting) == pytest.approx(plain)  # sync_s left out
    assert send_time_s(0.0, waiting) == 0.0


def test_collective_formulas_known_values() -> None:
    n, nbytes = 8, 1e9
    ar = collective_time_s("all_reduce", nbytes, n, LINK)
    assert ar == pytest.approx(2 * 7 / 8 * 1e9 / 100e9 + 14 * 5e-6)
    ag = collective_time_s("all_gather", nbytes, n, LINK)
    assert ag == pytest.approx(7 / 8 * 1e9 / 100e9 + 7 * 5e-6)
    assert collective_time_s("reduce_scatter", nbytes, n, LINK) == pytest.approx(ag)
    assert collective_time_s("all_to_all", nbytes, n, LINK) == pytest.approx(ag)
    assert collective_time_s("broadcast", nbytes, n, LINK) == pytest.approx(1e9 / 100e9 + 7 * 5e-6)
    # all-reduce = reduce-scatter + all-gather
    assert ar == pytest.approx(2 * ag)
    nv = collective_time_s("all_reduce", 1e9, 8, get_link("nvlink"))
    assert nv == pytest.approx(1.75e9 / 450e9 + 14 * 3e-6)


def test_collective_degenerate_cases_and_errors() -> None:
    for kind in cm.COLLECTIVE_KINDS:
        assert collective_time_s(kind, 1e9, 1, LINK) == 0.0
        assert collective_time_s(kind, 0, 8, LINK) == 0.0
    with pytest.raises(ValueError, match="unknown collective 'allreduce'.*all_reduce"):
        collective_time_s("allreduce", 1.0, 2, LINK)
    with pytest.raises(ValueError, match="group_size"):
        collective_time_s("all_reduce", 1.0, 0, LINK)


def test_calibrated_alpha_beta_overrides_the_formula() -> None:
    link = LinkSpec(
        name="c", bandwidth_Bps=1.0, latency_s=1.0, collectives={"all_gather": (2e-6, 1e-11)}
    )
    assert collective_time_s("all_gather", 8e8, 4, link) == pytest.approx(3 * 2e-6 + 1e-11 * 6e8)
    # kinds without calibration still use the formula
    assert collective_time_s("all_reduce", 4.0, 4, link) == pytest.approx(6 * 1.0 + 6.0)


@pytest.mark.parametrize("kind", cm.COLLECTIVE_KINDS)
def test_fit_alpha_beta_recovers_known_parameters(kind: str) -> None:
    alpha, beta, n = 7e-6, 1 / 80e9, 4
    link = LinkSpec(
        name="truth", bandwidth_Bps=1.0, latency_s=1.0, collectives={kind: (alpha, beta)}
    )
    sizes = [2**p for p in range(10, 30, 2)]
    times = [collective_time_s(kind, s, n, link) for s in sizes]
    fit_a, fit_b = fit_alpha_beta(sizes, times, kind, n)
    assert fit_a == pytest.approx(alpha, rel=1e-6)
    assert fit_b == pytest.approx(beta, rel=1e-9)


def test_fit_alpha_beta_with_noise_and_errors() -> None:
    sizes = [1e3, 1e6, 1e8, 1e9]
    truth = LinkSpec(name="t", bandwidth_Bps=50e9, latency_s=5e-6)
    times = [
        collective_time_s("all_reduce", s, 8, truth) * f
        for s, f in zip(sizes, (1.02, 0.99, 1.01, 0.995))
    ]
    _, beta = fit_alpha_beta(sizes, times, "all_reduce", 8)
    assert beta == pytest.approx(1 / 50e9, rel=0.02)
    # a negative intercept is clamped to alpha = 0
    alpha, _ = fit_alpha_beta([1e6, 2e6], [1e-3, 2.5e-3], "all_gather", 2)
    assert alpha == 0.0
    with pytest.raises(ValueError, match="two or more distinct sizes"):
        fit_alpha_beta([1e6, 1e6], [1.0, 1.1], "all_reduce", 4)
    with pytest.raises(ValueError, match="do not grow"):
        fit_alpha_beta([1e6, 2e6], [2.0, 1.0], "all_reduce", 4)
    with pytest.raises(ValueError, match="at least 2"):
        fit_alpha_beta([1e6, 2e6], [1.0, 2.0], "all_reduce", 1)


def test_fit_alpha_beta_leaves_out_one_timing_far_off_the_others_line() -> None:
    """A rank descheduled while the largest size ran (session 36's 4-rank calibration: 60.8 ms
    where the others' line gives about 25) no longer sets the slope; the noise of a steady
    run (here +-10%) leaves every timing in, and three sizes are too few to judge one."""
    kind, n = "reduce_scatter", 4
    truth = LinkSpec(name="t", bandwidth_Bps=1.0, latency_s=1.0, collectives={kind: (2e-3, 2.5e-9)})
    sizes = [2e4, 1.3e5, 5.2e5, 2.1e6, 4.2e6, 8.4e6]
    times = [collective_time_s(kind, s, n, truth) for s in sizes]
    slow = [*times[:-1], times[-1] * 2.5]
    alpha, beta = fit_alpha_beta(sizes, slow, kind, n)
    assert beta == pytest.approx(2.5e-9, rel=1e-6) and alpha == pytest.approx(2e-3, rel=1e-6)
    noisy = [t * f for t, f in zip(times, (1.1, 0.9, 1.1, 0.9, 1.1, 0.9))]
    from cost_models import comm

    steps = comm.collective_steps_and_wire_bytes(kind, 0.0, n)[0]
    wires = [comm.collective_steps_and_wire_bytes(kind, s, n)[1] for s in sizes]
    intercept, slope = comm._line(wires, noisy)
    assert fit_alpha_beta(sizes, noisy, kind, n) == (intercept / steps, slope)
    assert fit_alpha_beta(sizes[-3:], slow[-3:], kind, n)[1] > 4e-9  # kept: too few to judge


# -- memory ------------------------------------------------------------------------------------


def test_fp32_adamw_is_16_bytes_per_param() -> None:
    mem = training_state_bytes(num_elements=1e9)
    assert (mem.params, mem.grads, mem.optimizer, mem.master) == (4e9, 4e9, 8e9, 0.0)
    assert mem.total == 16e9
    assert mem.to_dict()["total"] == 16e9


@pytest.mark.parametrize(
    ("optimizer", "buffers"),
    [
        ("sgd", 0),
        ("sgd-momentum", 1),
        ("adam", 2),
        ("adamw", 2),
        ("lamb", 2),
        ("lars", 1),
        ("adagrad", 1),
    ],
)
def test_optimizer_state_per_optimizer(optimizer: str, buffers: int) -> None:
    assert training_state_bytes(num_elements=10, optimizer=optimizer).optimizer == 40 * buffers
    assert optimizer in cm.OPTIMIZERS


def test_unknown_optimizer_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown optimizer 'shampoo'.*adamw"):
        training_state_bytes(num_elements=1, optimizer="shampoo")
    with pytest.raises(ValueError, match="mixed_precision"):
        training_state_bytes(num_elements=1, mixed_precision="fp8")


def test_bf16_mixed_precision_is_the_zero_paper_16_bytes() -> None:
    mem = training_state_bytes(num_elements=1, mixed_precision="bf16", optimizer="adam")
    assert (mem.params, mem.grads, mem.master, mem.optimizer) == (2, 4, 4, 8)
    assert mem.total == 18
    # pure bf16 training (no master copy) keeps torch's state in the param dtype
    pure = training_state_bytes(num_elements=1, param_dtype_bytes=2)
    assert (pure.params, pure.grads, pure.master, pure.optimizer) == (2, 2, 0, 4)


def test_zero_stages_divide_the_right_state() -> None:
    kw = {"num_elements": 8.0, "mixed_precision": "bf16", "zero_shards": 4}
    s0 = training_state_bytes(**kw, zero_stage=0)
    s1 = training_state_bytes(**kw, zero_stage=1)
    s2 = training_state_bytes(**kw, zero_stage=2)
    s3 = training_state_bytes(**kw, zero_stage=3)
    assert (s0.params, s0.grads, s0.master, s0.optimizer) == (16, 32, 32, 64)
    assert (s1.params, s1.grads, s1.master, s1.optimizer) == (16, 32, 8, 16)
    assert (s2.params, s2.grads, s2.master, s2.optimizer) == (16, 8, 8, 16)
    assert (s3.params, s3.grads, s3.master, s3.optimizer) == (4, 8, 8, 16)
    assert s0.total > s1.total > s2.total > s3.total == s0.total / 4
    with pytest.raises(ValueError, match="zero_stage"):
        training_state_bytes(num_elements=1, zero_stage=4)
    with pytest.raises(ValueError, match="zero_shards"):
        training_state_bytes(num_elements=1, zero_shards=0)


def test_ranks_sharing_cores_price_a_collective_by_the_cpu_it_burns() -> None:
    """Session 30: with a ``cpu_weight``, a collective costs the weight times its CPU line
    (``cpu_collectives``, over the same steps and wire bytes) and no ``sync_s``; kinds without
    a CPU fit, a weight of 0, and a pipeline's send keep the wall-time model."""
    import dataclasses

    from cost_models import send_time_s

    wall = LinkSpec(
        name="c", bandwidth_Bps=1e9, latency_s=1e-3, collectives={"all_gather": (2e-4, 1e-9)},
        sync_s=3e-3,
    )  # fmt: skip
    cpu = {"all_gather": (5e-5, 4e-10), "all_reduce": (1e-4, 2e-10)}
    shared = dataclasses.replace(wall, cpu_collectives=cpu, cpu_weight=4.0)
    # all_gather of 8e6 bytes over 4: 3 steps, 6e6 wire bytes
    assert collective_time_s("all_gather", 8e6, 4, shared) == pytest.approx(
        4.0 * (3 * 5e-5 + 6e6 * 4e-10)
    )
    assert collective_time_s("all_reduce", 8e6, 4, shared) == pytest.approx(
        4.0 * (6 * 1e-4 + 12e6 * 2e-10)
    )
    # no CPU fit for broadcast: alpha-beta (the plain formula) plus sync_s, as before
    plain = collective_time_s("broadcast", 8e6, 4, wall)
    assert collective_time_s("broadcast", 8e6, 4, shared) == pytest.approx(plain)
    assert send_time_s(8e6, shared) == send_time_s(8e6, wall)
    # the fits alone, without a weight, change nothing
    unweighted = dataclasses.replace(wall, cpu_collectives=cpu)
    for kind in ("all_gather", "all_reduce", "reduce_scatter"):
        assert collective_time_s(kind, 8e6, 4, unweighted) == collective_time_s(kind, 8e6, 4, wall)
    assert collective_time_s("all_gather", 8e6, 1, shared) == 0.0
    assert collective_time_s("all_gather", 0, 4, shared) == 0.0
    with pytest.raises(ValueError, match="group_size"):
        collective_time_s("all_gather", 1.0, 0, shared)
    # round trip, schema and one-line errors
    assert LinkSpec.from_dict(json.loads(json.dumps(shared.to_dict()))) == shared
    assert "cpu_weight" not in wall.to_dict() and "cpu_collectives" not in wall.to_dict()
    prof = load_profile({"version": 1, "links": {"a0": shared.to_dict()}})
    assert prof.links["a0"] == shared
    with pytest.raises(ValueError, match="cpu_weight must be >= 0, and > 0 only with"):
        dataclasses.replace(wall, cpu_weight=2.0)
    with pytest.raises(ValueError, match="cpu_weight"):
        dataclasses.replace(shared, cpu_weight=-1.0)
    with pytest.raises(ValueError, match=r"cpu_collectives\['all_gather'\] must be >= 0"):
        dataclasses.replace(shared, cpu_collectives={"all_gather": (-1.0, 0.0)})
    with pytest.raises(ValueError, match="unknown collective 'gossip'"):
        dataclasses.replace(shared, cpu_collectives={"gossip": (1.0, 0.0)})
    with pytest.raises(ValueError, match="links.a0.cpu_weight"):
        load_profile({"version": 1, "links": {"a0": {**shared.to_dict(), "cpu_weight": -1}}})
