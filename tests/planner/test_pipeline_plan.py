"""The stage planner end to end on a tiny model (one process, fake tensors): the mesh search's
ranked table, megatron-3d never faster than the auto plan, the pipelined plan JSON (version 2,
round trip, version 1 still loads), the stages' in-flight memory, and bad input."""

from __future__ import annotations

import json

import pytest

import autopar
from autopar.mesh import Mesh
from autopar.plan.document import PLAN_VERSION, Plan
from tests.models import BATCH, tiny_gpt, tiny_llama


def _tiny_llama_on_4(budget: str, **options) -> Plan:
    """The tiny LLaMA's stage search on 4 devices, 2 per node: 2 stages, 4 microbatches."""
    model, args, _ = tiny_llama(layers=4)
    return autopar.plan(
        model,
        None,
        args,
        devices=4,
        per_node=2,
        device="cpu",
        model_name="tiny-llama",
        stages=2,
        microbatches=4,
        memory_budget=budget,
        **options,
    )


@pytest.fixture(scope="module")
def searched() -> Plan:
    # The search is tested here; stored stage plans in test_pipeline.
    return _tiny_llama_on_4("64MiB", stage_plans=False)


def test_mesh_search_ranks_every_factorisation(searched):
    rows = searched.data["stage_search"]["candidates"]
    steps = [r["step_s"] for r in rows]
    assert steps == sorted(steps)
    assert {tuple(r["mesh"]) for r in rows} == {(2, 2, 1), (2, 1, 2)}
    assert {r["schedule"] for r in rows} >= {"gpipe", "1f1b", "interleaved-1f1b"}
    best = rows[0]
    assert searched.data["predicted"]["step_s"] == pytest.approx(best["step_s"])
    assert searched.data["mesh"]["shape"] == best["mesh"]


def test_auto_is_never_predicted_slower_than_megatron_3d(searched):
    search = searched.data["stage_search"]
    assert search["megatron_3d"] is not None
    assert search["candidates"][0]["step_s"] <= search["megatron_3d"]["step_s"] * (1 + 1e-12)
    assert search["megatron_3d"]["schedule"] == "1f1b"
    assert search["megatron_3d"]["mesh"][2] == 2  # tensor parallel fills the node


def test_pipelined_plan_json_round_trips(searched, tmp_path):
    assert searched.data["version"] == PLAN_VERSION == 2
    path = tmp_path / "plan.json"
    searched.save(path)
    loaded = Plan.load(path, expected_hash=searched.graph_hash)
    pipe = loaded.pipeline
    assert pipe == searched.pipeline and pipe is not None
    ranks = searched.data["mesh"]["shape"][0]
    assert {s.pp_rank for s in pipe.stages} == set(range(ranks))
    assert ranks * pipe.virtual_stages == pipe.num_stages
    assert pipe.stages[0].blocks[0] == 0 and pipe.stages[-1].blocks[1] == 4
    owned = [f for s in pipe.stages for f in s.param_fqns]
    assert len(owned) == len(set(owned))
    for stage in pipe.stages:
        for fqn in stage.param_fqns:
            if fqn.startswith("layers."):
                assert stage.blocks[0] <= int(fqn.split(".")[1]) < stage.blocks[1]
    assert "tok_embeddings.weight" in pipe.stages[0].param_fqns
    assert "output.weight" in pipe.stages[-1].param_fqns
    text = loaded.summary()
    assert "Where the time goes" in text and "bubble" in text and "megatron-3d" in text


def test_stages_keep_their_schedules_in_flight_activations(searched):
    pipe = searched.pipeline
    m, p = pipe.microbatches, pipe.num_stages
    for stage in pipe.stages:
        flight = stage.predicted["in_flight"]
        if pipe.schedule == "1f1b":
            assert flight == min(p - stage.pp_rank, m)
        elif pipe.schedule == "interleaved-1f1b":
            v = pipe.virtual_stages
            assert flight == min(m * v, 2 * (p // v - stage.pp_rank - 1) + (v - 1) * p // v + 1)
        assert stage.predicted["peak_memory_bytes"] == pytest.approx(
            sum(v for k, v in stage.predicted.items() if k.startswith("memory_"))
        )


def test_version_1_plans_still_load(searched):
    # A version 1 plan is a version 2 plan without the pipeline entries.
    data = json.loads(searched.to_json())
    data = {k: v for k, v in data.items() if k not in ("pipeline", "stage_search")}
    data["version"] = 1
    plan = Plan.from_dict(data)
    assert plan.pipeline is None
    data["version"] = 3
    with pytest.raises(ValueError, match="plan version 3 is not supported"):
        Plan.from_dict(data)


def test_wrong_world_size_is_one_line(searched):
    searched.check_world_size(4)
    with pytest.raises(ValueError, match=r"needs 4 ranks but the job has 8") as info:
        searched.check_world_size(8)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("layers", "kwargs", "message"),
    [
        (4, {"stages": 5}, "5 pipeline stages for a stack of 4 blocks"),
        (
            4,
            {"stages": 2, "microbatches": 3},
            f"3 microbatches do not divide the global batch of {BATCH}",
        ),
        (1, {"stages": 2}, "the model has one block"),
        (4, {"stages": 2, "schedule": "zigzag"}, "unknown schedule 'zigzag'"),
        (4, {"stages": 2, "microbatches": 1, "schedule": "1f1b"}, "1f1b with 1 microbatches"),
    ],
)
def test_bad_pipeline_options_are_one_line_errors(layers, kwargs, message):
    model, args, _ = tiny_gpt(layers=layers)
    with pytest.raises(ValueError, match=message) as info:
        autopar.plan(model, Mesh.spec((2, 1, 2), ("pp", "dp", "tp"), device="cpu"), args, **kwargs)
    assert "\n" not in str(info.value)


def _pricer(budget: float, *, dp: int = 1, params=()):
    from autopar.planner.stage_pricing import Part, Parts, StagePricer
    from cost_models.hardware import get_link

    block = Part(
        forward_s=1.0,
        backward_s=2.0,
        activation_bytes=10.0,
        boundary_bytes=2.0,
        recompute_s=1.0,
        params=list(params),
    )
    parts = Parts(head=Part(), block=block, tail=Part(), layouts="auto", num_probe_blocks=2)
    link = get_link("nvlink")
    return StagePricer(
        options=(parts,),
        dp=dp,
        dp_link=link,
        pp_link=link,
        optimizer="sgd",
        mixed_precision=None,
        budget=budget,
    )


def test_stage_memory_counts_in_flight_activations_and_recomputes_to_fit():
    roomy = _pricer(1e9).price(blocks=3, first=True, last=True, in_flight=4, microbatches=8)
    assert roomy.memory["activations"] == 3 * 10.0 * 4
    assert roomy.detail["recomputed_blocks"] == 0 and roomy.backward_s == 6.0
    # Budget 100: 120 bytes in flight; recomputing one block keeps its 2-byte input instead of
    # 10 bytes per microbatch (saves 32) and holds one block (10) again in backward: 98 bytes.
    tight = _pricer(100.0).price(blocks=3, first=True, last=True, in_flight=4, microbatches=8)
    assert tight.detail["recomputed_blocks"] == 1
    assert tight.memory["activations"] == (3 * 10.0 - 8.0) * 4
    assert tight.peak_memory_bytes == pytest.approx(98.0)
    assert tight.backward_s == pytest.approx(6.0 + 1.0)
    assert _pricer(30.0).price(blocks=3, first=True, last=True, in_flight=4, microbatches=8) is None


def test_zero_on_dp_shards_the_stage_state():
    params = [(1e6, 4)]  # one 1M-element fp32 parameter per block
    pricer = _pricer(1e12, dp=4, params=params)
    block = pricer.options[0].block
    full, no_gather, sync = pricer._state([(block, 2)], 0)
    sharded, gather, _ = pricer._state([(block, 2)], 3)
    assert full == pytest.approx(2 * 1e6 * 4 * 2)  # sgd: fp32 parameters and gradients
    assert sharded == pytest.approx(full / 4)
    assert sync > 0 and no_gather == 0 and gather > 0
    # Half the unsharded state as the budget: only a ZeRO stage on dp fits.
    fits = _pricer(full / 2, dp=4, params=params).price(
        blocks=2, first=True, last=True, in_flight=1, microbatches=4
    )
    assert fits is not None and fits.detail["zero_stage"] in (2, 3)


def test_cli_needs_a_mesh_or_devices(capsys):
    from autopar.tools.cli import main

    assert main(["plan", "mlp"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "autopar: error: give --mesh (e.g. --mesh 8x8) or --devices N [--per-node K]"


def test_cli_searches_stages_on_devices(capsys, tmp_path):
    from autopar.tools.cli import main

    argv = [
        "plan",
        "gpt2-small-2l",
        "--devices",
        "2",
        "--per-node",
        "2",
        "--device",
        "cpu",
        "--batch",
        "4",
        "--seq",
        "16",
        "--stages",
        "2",
        "--microbatches",
        "2",
        "--html",
        str(tmp_path / "report.html"),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "2 pipeline stages x 2 microbatches" in out and "Stage search:" in out
    assert "pipeline bubble" in (tmp_path / "report.html").read_text()


def test_one_stage_gives_the_ordinary_plan_of_the_winning_mesh():
    model, args, _ = tiny_gpt()
    plan = autopar.plan(
        model, None, args, devices=2, per_node=2, device="cpu", stages=1, microbatches=2
    )
    assert plan.pipeline is None and "nodes" in plan.data and plan.data["nodes"]
    search = plan.data["stage_search"]
    best = search["candidates"][0]
    assert all(row["stages"] == 1 for row in search["candidates"])
    assert search["accumulate"] == best["microbatches"] == 2
    assert plan.data["mesh"]["shape"] == best["mesh"][1:]
    assert "Stage search:" in plan.summary()


def test_stage_p2p_uses_the_calibrated_point_to_point_transfer():
    """A calibrated link's ``broadcast`` fit (``autopar calibrate`` measures the pipeline's
    point-to-point transfer under that name) prices a stage's sends; a preset link (no fit)
    keeps the alpha-beta formula, so plans on presets do not move."""
    import dataclasses

    from cost_models import LinkSpec, collective_time_s

    preset = _pricer(1e9)
    calibrated_link = LinkSpec(
        name="calibrated-pp",
        bandwidth_Bps=1e9,
        latency_s=1e-4,
        collectives={"broadcast": (5e-3, 1e-9)},
    )
    calibrated = dataclasses.replace(preset, pp_link=calibrated_link, memo={})
    kw = dict(blocks=1, first=False, last=False, in_flight=1, microbatches=4)
    middle = calibrated.price(**kw)
    assert middle.p2p_s == pytest.approx(2 * (5e-3 + 1e-9 * 2.0))  # activation and gradient sends
    assert calibrated.price(**{**kw, "first": True}).p2p_s == pytest.approx(5e-3 + 2e-9)
    # A send is posted asynchronously: the link's wait between computations (sync_s) is not
    # charged on it (README "Session 29").
    waiting = dataclasses.replace(calibrated_link, sync_s=3e-3)
    with_sync = dataclasses.replace(preset, pp_link=waiting, memo={}).price(**kw)
    assert with_sync.p2p_s == pytest.approx(middle.p2p_s)
    formula = collective_time_s("broadcast", 2.0, 2, preset.pp_link)
    assert preset.price(**kw).p2p_s == pytest.approx(2 * formula)
    assert formula < 1e-3


def test_ranks_sharing_cores_price_the_pipeline_with_their_solo_speed():
    """A device with a measured ``busy_rank_speed`` (CPU ranks sharing cores) prices GPipe by
    the simulated schedule: the same cuts and stage prices as without it, a shorter step
    (a stage computing alone runs faster), equal to ``shared_schedule_time`` of the stages with
    the device's wait per task, and the step's tail: the loss broadcast over the 2 ranks."""
    import dataclasses

    from autopar.planner.pipeline_schedule import StageCost
    from autopar.planner.shared_cores import shared_schedule_time
    from cost_models import collective_time_s
    from cost_models.hardware import get_device

    model, args, _ = tiny_gpt(layers=2)
    plain = get_device("cpu")
    # With calibration's wait per task too (README, "Session 10").
    shared = dataclasses.replace(plain, busy_rank_speed={"1": 2.0, "2": 1.0}, task_wait_s=2e-5)
    kw = dict(stages=2, microbatches=2, schedule="gpipe", memory_budget="1GiB")
    before = autopar.plan(model, Mesh.spec((2,), ("pp",), device=plain), args, **kw).pipeline
    after = autopar.plan(model, Mesh.spec((2,), ("pp",), device=shared), args, **kw).pipeline
    assert [s.blocks for s in after.stages] == [s.blocks for s in before.stages]
    assert [s.predicted for s in after.stages] == [s.predicted for s in before.stages]
    stages = [
        StageCost(forward_s=s.predicted["forward_s"], backward_s=s.predicted["backward_s"],
                  p2p_s=s.predicted["p2p_s"], step_s=s.predicted["grad_sync_s"])
        for s in after.stages
    ]  # fmt: skip
    mesh = Mesh.spec((2,), ("pp",), device=shared)
    tail = collective_time_s("broadcast", 4, 2, mesh.links[0])
    expected, no_wait = (
        shared_schedule_time(stages, microbatches=2, schedule="gpipe",
                             busy_rank_speed=shared.busy_rank_speed, task_wait_s=wait,
                             tail_s=tail)
        for wait in (shared.task_wait_s, 0.0)
    )  # fmt: skip
    assert after.predicted["tail_s"] == pytest.approx(tail) and tail > 0
    assert after.predicted["head_s"] == 0.0
    assert after.predicted["step_s"] == pytest.approx(expected.step_s)
    assert after.predicted["step_s"] > no_wait.step_s + 5 * shared.task_wait_s
    assert after.predicted["step_s"] < 0.9 * before.predicted["step_s"]


def test_stages_sharing_a_rank_are_priced_to_fit_together():
    """A V schedule puts chunks 0 and 3 on rank 0: the rank holds both chunks' state. Each
    chunk alone fits the budget unsharded; the two together do not, so the pairing must shard
    (ZeRO on dp) or refuse, and what the rank holds must fit."""
    from autopar.planner.pipeline import _rank_shared_stages
    from autopar.planner.stages import stage_rank

    params = [(1e6, 4)]  # 8 MB of SGD state per block unsharded (parameters and gradients)
    full = 2 * 1e6 * 4 * 2  # two blocks per chunk
    budget = 1.5 * full  # one chunk's unsharded state fits, two do not
    pricer = _pricer(budget, dp=4, params=params)
    alone = pricer.price(blocks=2, first=True, last=False, in_flight=3, microbatches=4)
    assert alone is not None and alone.detail["zero_stage"] == 0
    stages = _rank_shared_stages(pricer, "zbv", [2, 2, 2, 2], p=2, m=4, v=2)
    assert stages is not None
    ranks = [stage_rank("zbv", c, 2) for c in range(4)]
    assert ranks[0] == ranks[3] and ranks[1] == ranks[2]
    for rank in set(ranks):
        mine = [s for s, r in zip(stages, ranks, strict=True) if r == rank]
        held = sum(s.memory["state"] + s.memory["inputs_buffers"] for s in mine)
        busiest = max(s.memory["activations"] + s.memory["transient"] for s in mine)
        assert held + busiest <= budget
        assert all(s.memory["other_stages"] > 0 for s in mine)
        assert any(s.detail["zero_stage"] > 0 for s in mine)
    # Without room for a second chunk at all, the candidate is refused.
    assert (
        _rank_shared_stages(_pricer(0.6 * full, dp=1, params=params), "zbv", [2] * 4, 2, 4, 2)
        is None
    )


def test_stage_plans_are_solved_as_the_search_priced_them():
    """The stored stage plans take the ZeRO stage the search priced on dp, count the
    microbatches the schedule keeps in flight, keep out of their budget what the rank's other
    stages hold, and fit. 1 MiB: the search needs ZeRO-2 on dp in both stages."""
    from autopar.api import stage_plan_options
    from autopar.options import PlanOptions
    from autopar.planner.stages import PipelinePlan

    plan = _tiny_llama_on_4("1MiB")
    pipeline = PipelinePlan.from_json(plan.data["pipeline"])
    stored = plan.data["pipeline"]["stage_plans"]
    budget = plan.data["memory_budget_bytes"]
    per_stage = stage_plan_options(PlanOptions(memory_budget="1MiB"), pipeline, budget)
    assert [int(s.predicted["zero_stage"]) for s in pipeline.stages] == [2, 2]
    assert [int(s.predicted["in_flight"]) for s in pipeline.stages] == [2, 1]
    assert plan.warnings == []
    for stage, options in zip(pipeline.stages, per_stage, strict=True):
        priced = stage.predicted
        assert options.zero_stage == (("dp", int(priced["zero_stage"])),)
        assert options.in_flight == int(priced["in_flight"])
        assert options.accumulation == pipeline.microbatches == 4
        others = priced.get("memory_other_stages_bytes", 0.0)
        assert options.memory_budget == int(budget - others)
        entry = stored[stage.index]
        entry = stored[entry["renamed_from"]] if "renamed_from" in entry else entry
        assert entry["zero"]["stages"]["dp"] == int(priced["zero_stage"])
        assert entry["options"].get("in_flight", 1) >= options.in_flight
        assert entry["predicted"]["peak_memory_bytes"] + others <= budget
        # A boundary goes to the next stage in the layout it reads: no gather priced on it.
        last = stage.index == len(pipeline.stages) - 1
        assert entry["options"]["output_placements"] == (None if last else ["*"])
        if not last:
            assert entry["predicted"]["breakdown"]["output_comm_s"] == 0.0


def test_in_flight_counts_the_activations_that_many_times():
    """``PlanOptions.in_flight`` multiplies the activations a plan keeps (and what
    recomputation frees), not the state; a budget that fits one microbatch's activations but
    not four makes the 4-in-flight plan recompute or shard more."""
    model, args, _ = tiny_gpt(layers=2)
    mesh = Mesh.spec((2,), device="cpu")
    one = autopar.plan(model, mesh, args, recipe="ddp", checkpoint="none", optimizer="sgd")
    four = autopar.plan(
        model, mesh, args, recipe="ddp", checkpoint="none", optimizer="sgd", in_flight=4
    )
    m1, m4 = one.data["predicted"]["memory"], four.data["predicted"]["memory"]
    assert m4["activations"] == pytest.approx(4 * m1["activations"])
    assert m4["params"] == m1["params"] and m4["grads"] == m1["grads"]
    assert four.data["options"]["in_flight"] == 4 and "in_flight" not in one.data["options"]
    with pytest.raises(ValueError, match="in_flight must be an integer >= 1"):
        autopar.plan(model, mesh, args, in_flight=0)


@pytest.mark.parametrize(("schedule", "ranks"), [("zbv", [0, 1, 1, 0]), ("1f1b", [0, 1])])
def test_planned_stages_sit_on_the_ranks_their_schedule_runs_them(schedule, ranks):
    model, args, _ = tiny_llama(layers=4)
    plan = autopar.plan(
        model,
        Mesh.spec((2,), ("pp",), device="cpu"),
        args,
        stages=2,
        microbatches=2,
        schedule=schedule,
        stage_plans=False,
    )
    stages = plan.data["pipeline"]["stages"]
    assert [s["pp_rank"] for s in stages] == ranks
    assert [s["ranks"] for s in stages] == [[r] for r in ranks]


def test_accumulation_shares_the_gradient_sync_between_microbatches():
    """``PlanOptions.accumulation``: the gradient sync, once per optimizer step, counts 1/m in
    the per-microbatch plan; nothing else moves (ddp's layouts fixed)."""
    model, args, _ = tiny_gpt(layers=2)
    mesh = Mesh.spec((2,), device="cpu")
    one = autopar.plan(model, mesh, args, recipe="ddp", optimizer="sgd")
    four = autopar.plan(model, mesh, args, recipe="ddp", optimizer="sgd", accumulation=4)
    b1, b4 = one.data["predicted"]["breakdown"], four.data["predicted"]["breakdown"]
    assert b1["grad_sync_s"] > 0
    assert b4["grad_sync_s"] == pytest.approx(b1["grad_sync_s"] / 4)
    assert b4["compute_s"] == pytest.approx(b1["compute_s"])
    assert four.data["options"]["accumulation"] == 4 and "accumulation" not in one.data["options"]


def test_a_stage_plan_that_is_not_the_priced_stage_is_a_warning():
    from autopar.api import stage_plan_warnings
    from autopar.planner.stages import PipelinePlan, even_stages

    pipeline = even_stages(
        stack="layers", num_blocks=2, num_stages=2, microbatches=2, schedule="1f1b"
    ).to_json()
    pipeline["stages"][0]["predicted"] = {"in_flight": 2.0, "recomputed_blocks": 1.0}
    pipeline["stages"][1]["predicted"] = {"in_flight": 1.0, "recomputed_blocks": 0.0}
    pipeline = PipelinePlan.from_json(pipeline)
    over = Plan(data={"predicted": {"peak_memory_bytes": 2e9}, "checkpoint": {"segments": []}})
    fits = Plan(data={"predicted": {"peak_memory_bytes": 5e8}, "checkpoint": {"segments": []}})
    warnings = stage_plan_warnings(pipeline, [over, fits], 1e9)
    assert len(warnings) == 2 and all(w.startswith("stage 0: ") for w in warnings)
    assert "holds about 1.86 GiB of the 0.93 GiB budget" in warnings[0]
    assert "recomputes 0 segment(s) where the stage search priced 1" in warnings[1]
    assert stage_plan_warnings(pipeline, [fits, fits], 1e9) == [warnings[1]]
