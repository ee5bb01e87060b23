"""A weight tied across pipeline stages whose stages hold it in different tensor-parallel
layouts (issue 15): GPT's head tied to its embedding on pp=2 x tp=2, the Megatron plan saved and
one stage's copy changed to Replicate (the other keeps its vocabulary split), as a plan from
another tool or an edited one could have it. The copies' gradients are summed as full tensors
(``runtime.pipeline_tied.sum_tied_whole``): the loss, every gradient and the parameters after 3
SGD steps match the single process at rtol 1e-5. With 1F1B the two copies are on different
ranks; with ZBV the ranks at pp coordinate 0 run the first and the last stage, so both copies
are on one rank. (Under ZeRO copies of different layouts are still refused: their shards could
not be summed shard by shard.)"""

from __future__ import annotations

import json
from typing import Any

from tests.distributed.launcher import run_cases
from tests.distributed.reference import sgd_reference
from tests.distributed.test_pipeline import LR, NUM_STEPS, _mesh, _train_and_compare

TIED = ("wte.weight", "lm_head.weight")


def _edited_plan(path: str, schedule: str, microbatches: int, changed_stage: int) -> None:
    """Rank 0: the Megatron plan of the tiny GPT with stages, the tied weight's copy in stage
    ``changed_stage`` (-1: the last) made Replicate on the tp axis, saved at ``path``."""
    import autopar
    from autopar.plan.document import Plan
    from tests.models import tiny_gpt

    model, args, kwargs = tiny_gpt(layers=4)
    offline = autopar.Mesh.spec((2, 2), ("pp", "tp"), device="h100")
    plan = autopar.plan(
        model, offline, args, kwargs, stages=2, microbatches=microbatches,
        schedule=schedule, recipe="megatron",
    )  # fmt: skip
    data = json.loads(plan.to_json())
    stage_plans = data["pipeline"]["stage_plans"]
    index = len(stage_plans) - 1 if changed_stage < 0 else changed_stage
    layouts = []
    for i, stage in enumerate(stage_plans):
        for node in stage.get("nodes", ()):
            if node.get("fqn") in TIED:  # the weight and, in the first stage, its alias
                if i == index:
                    node["outputs"] = ["R,R"]
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
