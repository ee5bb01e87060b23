"""A weight tied across pipeline stages whose stages hold it in different tensor-parallel
layouts (issue 15): GPT's head tied to its embedding on pp=2 x tp=2, the Megatron plan saved and
one stage's copy changed to Replicate (the other keeps its vocabulary split), as a plan from
another tool or an edited one could have it. The copies' gradients are summed as full tensors
(``runtime.pipeline_tied.sum_tied_whole``): the loss, every gradient and the parameters after 3
SGD steps match the single process at rtol 1e-5. With 1F1B the two copies are on different
ranks; with ZBV the ranks at pp coordinate 0 run the first and the last stage, so both copies
are on one rank. Under ZeRO copies of different layouts are refused, on every rank, with one
line naming the weight and both layouts: their shards could not be summed shard by shard."""

from __future__ import annotations

import json
from typing import Any

from tests.distributed.launcher import run_cases
from tests.distributed.reference import sgd_reference
from tests.distributed.test_pipeline import LR, NUM_STEPS, _mesh, _train_and_compare

TIED = ("wte.weight", "lm_head.weight")


def _edited_plan(
    path: str,
    schedule: str,
    microbatches: int,
    changed_stage: int,
    recipe: str = "megatron",
    layout: str = "R,R",
) -> None:
    """Rank 0: the ``recipe`` plan of the tiny GPT with stages, the tied weight's copy in stage
    ``changed_stage`` (-1: the last) given ``layout`` (dp, tp), saved at ``path``."""
    import autopar
    from autopar.plan.document import Plan
    from tests.models import tiny_gpt

    model, args, kwargs = tiny_gpt(layers=4)
    offline = autopar.Mesh.spec((2, 2), ("pp", "tp"), device="h100")
    plan = autopar.plan(
        model, offline, args, kwargs, stages=2, microbatches=microbatches,
        schedule=schedule, recipe=recipe,
    )  # fmt: skip
    data = json.loads(plan.to_json())
    stage_plans = data["pipeline"]["stage_plans"]
    index = len(stage_plans) - 1 if changed_stage < 0 else changed_stage
    layouts = []
    for i, stage in enumerate(stage_plans):
        for node in stage.get("nodes", ()):
            if node.get("fqn") in TIED:  # the weight and, in the first stage, its alias
                if i == index:
                    node["outputs"] = [layout]
                layouts.append(node["outputs"][0])
    assert len(set(layouts)) == 2, layouts  # the edit made the copies' layouts differ
    Plan.from_dict(data).save(path)


def check_tied_layouts(rank: int, world_size: int, case: Any) -> dict[str, Any]:
    import torch.distributed as dist

    import autopar
    from tests.models import tiny_gpt

    path, schedule, microbatches, changed_stage = case
    if rank == 0:
        _edited_plan(path, schedule, microbatches, changed_stage)
    dist.barrier()
    model, args, kwargs = tiny_gpt(layers=4)
    want = sgd_reference(model, args, kwargs, lr=LR, steps=NUM_STEPS)
    model, args, kwargs = tiny_gpt(layers=4)
    mesh = _mesh((2, 1, 2), ("pp", "dp", "tp"))  # the mesh the plan names
    pmodel = autopar.autoparallelize(model, mesh, args, kwargs, plan=path, optimizer="sgd")
    tied = [t for t in pmodel.shared if t.fqn == "lm_head.weight"]
    assert len(tied) == 1 and tied[0].whole, pmodel.shared
    on_this_rank = sum(
        "lm_head.weight" in dict(p.named_parameters(remove_duplicate=False))
        for p in pmodel.pmodules
    )
    checked = _train_and_compare(pmodel, args, kwargs, want)
    return {**checked, "copies": on_this_rank, "group": tied[0].group is not None}


def test_tied_weight_in_different_layouts_matches_one_process(tmp_path: Any) -> None:
    cases = {
        "1f1b/last-replicated": (str(tmp_path / "a.json"), "1f1b", 2, -1),
        "1f1b/first-replicated": (str(tmp_path / "b.json"), "1f1b", 4, 0),
        "zbv/last-replicated": (str(tmp_path / "c.json"), "zbv", 4, -1),
    }
    results = run_cases(check_tied_layouts, 4, cases, timeout_s=600)
    for name in ("1f1b/last-replicated", "1f1b/first-replicated"):
        values = results[name].check()
        # Every rank holds one copy; the sum runs over the pp group at its tp coordinate.
        assert [v["copies"] for v in values] == [1, 1, 1, 1], values
        assert all(v["group"] for v in values)
        assert set(TIED) & set().union(*(v["grads"] for v in values))  # its gradient checked
    zbv = results["zbv/last-replicated"].check()
    # Ranks 0 and 1 (pp coordinate 0) run stages 0 and 3: both copies, no group to sum over.
    assert [v["copies"] for v in zbv] == [2, 2, 0, 0], zbv
    assert [v["group"] for v in zbv] == [False, False, False, False], zbv


def check_tied_layouts_refused_under_zero(rank: int, world_size: int, path: str) -> str:
    import torch.distributed as dist

    import autopar
    from autopar.errors import UnsupportedModelError
    from tests.models import tiny_gpt

    if rank == 0:  # FSDP: ZeRO-3 on the tp axis, the copies Replicate; the first split by vocab
        _edited_plan(path, "1f1b", 2, 0, recipe="fsdp", layout="R,S0")
    dist.barrier()
    model, args, kwargs = tiny_gpt(layers=4)
    mesh = _mesh((2, 1, 2), ("pp", "dp", "tp"))
    try:
        autopar.autoparallelize(model, mesh, args, kwargs, plan=path, optimizer="sgd")
    except UnsupportedModelError as error:
        return str(error)
    raise AssertionError("tied copies in different layouts under ZeRO were not refused")


def test_tied_weight_in_different_layouts_under_zero_is_refused(tmp_path: Any) -> None:
    results = run_cases(
        check_tied_layouts_refused_under_zero, 4, {"fsdp": str(tmp_path / "z.json")},
        timeout_s=300,
    )  # fmt: skip
    messages = results["fsdp"].check()
    assert len(set(messages)) == 1, messages  # every rank refuses, with the same message
    message = messages[0]
    assert "\n" not in message, message
    assert "lm_head.weight" in message and "[R,S0] in stage 0" in message, message
    assert "[R,R] in stage 1" in message and "ZeRO" in message, message
