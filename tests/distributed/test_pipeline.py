"""Pipeline stages on real gloo ranks train exactly like one process.

``autoparallelize(..., pipeline=dict(stages, microbatches, schedule))`` on tiny 4-block GPT
(embedding tied to the output layer: a parameter shared by the first and last stage) and LLaMA
models; checked against the single process at fp32 rtol 1e-5 / atol 1e-6: the loss returned on
every rank, every gradient (gathered whole over the stage's submesh), and the parameters after 3
SGD steps. One spawn per world size runs every case of that size.

The cross product is covered sparsely: every schedule (GPipe, 1F1B, interleaved 1F1B with 2
stages per rank; the split-backward zero-bubble, ZBV and DualPipeV with 2 stages per rank), every microbatch count (2, 4, 8), every mesh (pp=2; pp=4; pp=2 x dp=2;
pp=2 x tp=2; pp=2 x dp=2 x tp=2 on 8 ranks), ZeRO on and off, recomputation inside stages on
and off each appear at least once (see CASES). Bad input (one line each) runs in the 2-rank spawn.
Mixed precision on pipelines without a data-parallel axis (refused until session 23) runs in
``test_mixed_precision_meshes.py``.
"""

from __future__ import annotations

import functools
import json
import pathlib
import tempfile
from typing import Any

import pytest
import torch

from tests.distributed.launcher import run_cases
from tests.distributed.reference import assert_close_named, full_grads, sgd_reference

RTOL, ATOL = 1e-5, 1e-6
NUM_STEPS = 3
LR = 0.1

# fmt: off
# name -> (mesh shape, axis names, model, stages, microbatches, schedule, plan options)
CASES: dict[int, dict[str, tuple]] = {
    2: {
        "pp2/gpt/gpipe/mb2": ((2,), ("pp",), "gpt", 2, 2, "gpipe", {}),
        "pp2/llama/1f1b/mb4/recompute": ((2,), ("pp",), "llama", 2, 4, "1f1b", {"checkpoint": "all"}),
        "pp2/gpt/interleaved/mb4": ((2,), ("pp",), "gpt", 2, 4, "interleaved-1f1b", {}),
        "pp2/gpt/zero-bubble/mb2": ((2,), ("pp",), "gpt", 2, 2, "zero-bubble", {}),
        "pp2/llama/dualpipev/mb4": ((2,), ("pp",), "llama", 2, 4, "dualpipev", {}),
    },
    4: {
        "pp4/gpt/1f1b/mb4": ((4,), ("pp",), "gpt", 4, 4, "1f1b", {}),
        "pp4/llama/gpipe/mb8": ((4,), ("pp",), "llama", 4, 8, "gpipe", {}),
        "pp2xdp2/llama/1f1b/mb2/zero3": ((2, 2), ("pp", "dp"), "llama", 2, 2, "1f1b", {"recipe": "fsdp"}),
        "pp2xdp2/gpt/gpipe/mb4/ddp+recompute": ((2, 2), ("pp", "dp"), "gpt", 2, 4, "gpipe", {"recipe": "ddp", "checkpoint": "all"}),
        "pp2xtp2/gpt/1f1b/mb4/megatron": ((2, 2), ("pp", "tp"), "gpt", 2, 4, "1f1b", {"recipe": "megatron"}),
        "pp2xtp2/llama/interleaved/mb2/megatron": (
            (2, 2), ("pp", "tp"), "llama", 2, 2, "interleaved-1f1b", {"recipe": "megatron"},
        ),
        "pp2xdp2/llama/zero-bubble/mb4/zero3": (
            (2, 2), ("pp", "dp"), "llama", 2, 4, "zero-bubble", {"recipe": "fsdp"},
        ),
        "pp2xdp2/gpt8/zbv/mb8/ddp+recompute": (
            (2, 2), ("pp", "dp"), "gpt8", 2, 8, "zbv", {"recipe": "ddp", "checkpoint": "all"},
        ),
        "pp2xtp2/gpt/zbv/mb2/megatron": ((2, 2), ("pp", "tp"), "gpt", 2, 2, "zbv", {"recipe": "megatron"}),
        # The tied embedding / head under ZeRO-3: summed shard by shard over the pp ranks (1F1B)
        # and within rank 0, which runs the first and last stage (ZBV).
        "pp2xdp2/gpt/1f1b/mb2/zero3-tied": ((2, 2), ("pp", "dp"), "gpt", 2, 2, "1f1b", {"recipe": "fsdp"}),
        "pp2xdp2/gpt/zbv/mb4/zero3-tied": ((2, 2), ("pp", "dp"), "gpt", 2, 4, "zbv", {"recipe": "fsdp"}),
    },
    8: {
        "pp2xdp2xtp2/llama/1f1b/mb4/fsdp+tp": (
            (2, 2, 2), ("pp", "dp", "tp"), "llama", 2, 4, "1f1b", {"recipe": "fsdp+tp"},
        ),
    },
}
# fmt: on


def _build(name: str) -> Any:
    """``gpt`` / ``llama``: 4 blocks; ``gpt8`` / ``llama8``: 8 (2 blocks per stage on 2 ranks
    with 2 stages each, so recomputation inside a stage has a segment to recompute)."""
    from tests import models

    build = models.tiny_gpt if name.startswith("gpt") else models.tiny_llama
    return build(layers=8 if name.endswith("8") else 4)


@functools.cache
def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
    import autopar

    return autopar.Mesh.from_world(shape, names, device="h100")


def _close(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert_close_named(what, got, want, rtol=RTOL, atol=ATOL)


def check_pipeline(rank: int, world_size: int, case: Any) -> dict[str, Any]:
    """One case on every rank (module docstring); returns what this rank checked."""
    import autopar

    if case[0] == "bad":
        return check_bad_input(case[1])
    if case[0] == "dcp":
        return check_dcp(*case[1:])
    if case[0] == "saved":
        return check_saved_plan(case[1])
    if case[0] == "saved-v":
        return check_saved_v_plan(case[1])
    if case[0] == "eval":
        return check_eval(case[1])
    if case[0] == "trace":
        return check_trace(case[1], rank)
    if case[0] == "shared-groups":
        return check_shared_groups()
    shape, names, model_name, stages, microbatches, schedule, options = case
    model, args, kwargs = _build(model_name)
    want = sgd_reference(model, args, kwargs, lr=LR, steps=NUM_STEPS)
    model, args, kwargs = _build(model_name)
    pipeline = {"stages": stages, "microbatches": microbatches, "schedule": schedule}
    pmodel = autopar.autoparallelize(
        model,
        _mesh(shape, names),
        args,
        kwargs,
        pipeline=pipeline,
        optimizer="sgd",
        price_baselines=False,
        **options,
    )
    # The options reached the stages: recomputed segments (some stage of this rank: a
    # one-block stage may have none), ZeRO and tensor-parallel layouts (every stage).
    recomputes = [bool(p.plan.checkpoint_segments()) for p in pmodel.pmodules]
    assert any(recomputes) == ("checkpoint" in options), recomputes
    # A stage that recomputes runs the one-call weight pass (runtime/pipeline_backward.py).
    assert [s.recomputes for s in pmodel._stages] == recomputes
    for pmodule in pmodel.pmodules:
        assert (pmodule.zero is not None) == options.get("recipe", "").startswith("fsdp")
        layouts = set(pmodule.plan.param_placements().values())
        assert any("S" in p for p in layouts) == ("tp" in names), layouts
    checked = _train_and_compare(pmodel, args, kwargs, want)
    if schedule in ("zbv", "dualpipev"):  # torch's V schedules cannot run eval: one line
        with pytest.raises(ValueError, match=r"^eval mode does not run under schedule [^\n]*$"):
            pmodel.eval()
    return checked


def _train_and_compare(pmodel: Any, args: Any, kwargs: Any, want: dict) -> dict[str, Any]:
    """One step (loss, every gradient of this rank's stages), then 2 more SGD steps (every
    parameter), against the single process ``want``; returns what this rank checked."""
    loss = _timed_step(pmodel, args, kwargs)
    _close("loss", loss, want["loss"])
    checked: list[str] = []
    for pmodule in pmodel.pmodules:
        for name, grad in full_grads(pmodule).items():
            _close(f"grad of {name}", grad, want["grads"][name])
            checked.append(name)
    opt = torch.optim.SGD(pmodel.parameters(), lr=LR)
    opt.step()
    for _ in range(NUM_STEPS - 1):
        opt.zero_grad()
        _timed_step(pmodel, args, kwargs)
        opt.step()
    state = pmodel.state_dict()
    for name, value in state.items():
        _close(f"{name} after {NUM_STEPS} SGD steps", value, want["state"][name])
    return {"grads": sorted(checked), "state": sorted(state), "loss": float(loss)}


def _timed_step(pmodel: Any, args: Any, kwargs: Any) -> torch.Tensor:
    """``pmodel.step``, checking its measured busy time (the measured bubble's numerator): the
    stages' work of THIS step (reset every step), positive and inside the step's wall time."""
    import time

    start = time.perf_counter()
    loss = pmodel.step(*args, **kwargs)
    wall = time.perf_counter() - start
    assert 0.0 < pmodel.busy_s < wall, (pmodel.busy_s, wall)
    return loss


@pytest.mark.parametrize("world_size", [2, 4, pytest.param(8, marks=pytest.mark.slow)])
def test_pipeline_numerics(world_size: int, tmp_path: Any) -> None:
    cases = [(name, case) for name, case in CASES[world_size].items()]
    if world_size == 2:
        cases += [(f"bad/{what}", ("bad", what)) for what in BAD_INPUT]
    if world_size == 2:
        cases.append(("saved", ("saved", str(tmp_path / "plan.json"))))
        cases.append(("saved-v", ("saved-v", str(tmp_path / "plan-v.json"))))
        cases.append(("eval", ("eval", "zero-bubble")))
        cases.append(("trace", ("trace", str(tmp_path / "trace"))))
        cases.append(("shared-groups", ("shared-groups",)))
    if world_size == 4:
        cases.append(("dcp", ("dcp", str(tmp_path / "ckpt"))))
        # GPT's head tied to its embedding, ZeRO-3 shards of it in both stages.
        cases.append(("dcp-tied", ("dcp", str(tmp_path / "ckpt-tied"), "gpt")))
    results = run_cases(check_pipeline, world_size, cases, timeout_s=600)
    for name, case in CASES[world_size].items():
        values = results[name].check()
        model, _, _ = _build(case[2])
        every = {n for n, _ in model.named_parameters()}
        # Every parameter's gradient and value was checked on some rank.
        assert set().union(*(v["grads"] for v in values)) == every, name
        assert set().union(*(v["state"] for v in values)) >= every, name
    if world_size == 4:
        assert results["dcp"].check()[0] > 0
        assert results["dcp-tied"].check()[0] > 0
    if world_size == 2:
        saved = results["saved"].check()
        # The stored stage plans ran on both ranks without a solve; the older plan's 4 stages
        # were planned on rank 0 only, the twin middle stages once.
        assert [v["solves"] for v in saved] == [(0, 3), (0, 0)], saved
        assert len(results["eval"].check()) == 2
        # Every rank recorded its posts and waits: each microbatch's send or receive, both ways.
        assert list(results["shared-groups"].check()) == [0, 0]
        for got in results["trace"].check():
            assert got["fwd"] == 2 and got["bwd"] == 2 and got["waits"] >= 4, got
        assert [v["stages"] for v in results["saved-v"].check()] == [[0, 3], [1, 2]]
    for what in BAD_INPUT if world_size == 2 else ():
        results[f"bad/{what}"].check()


def check_saved_plan(path: str) -> dict[str, Any]:
    """A plan saved by ``autopar.plan`` with stages (rank 0 plans and saves it) runs as saved:
    each stage lowered with its stored intra-op plan, no solve on any rank, the numerics of one
    process; the same plan without ``stage_plans`` (an older plan) still runs, rank 0 planning
    the stages; a model whose stage graphs differ and a mesh of another shape are refused with
    one line. Returns the solves counted (stored, older) and the errors."""
    import torch.distributed as dist

    import autopar
    from autopar.errors import PlanMismatchError
    from autopar.plan.document import Plan
    from autopar.planner.driver import Driver

    model, args, kwargs = _build("llama")
    want = sgd_reference(model, args, kwargs, lr=LR, steps=NUM_STEPS)
    if dist.get_rank() == 0:
        offline = autopar.Mesh.spec((2,), ("pp",))
        saved = autopar.plan(
            model, offline, args, stages=2, microbatches=2, schedule="interleaved-1f1b"
        )
        saved.save(path)
    dist.barrier()
    stored = Plan.load(path)
    # The twin middle stages: stage 2 is stored as stage 1's plan, renamed on load.
    assert stored.data["pipeline"]["stage_plans"][2] == {"renamed_from": 1}
    mesh = _mesh((2, 1, 1), ("pp", "dp", "tp"))
    solves: list[int] = []
    solve = Driver.plan

    def counted(self: Any, *a: Any, **k: Any) -> Any:
        solves.append(1)
        return solve(self, *a, **k)

    Driver.plan = counted  # type: ignore[method-assign]
    try:
        counts = []
        for plan in (path, _without_stage_plans(stored)):
            before = len(solves)
            model, args, kwargs = _build("llama")
            pmodel = autopar.autoparallelize(model, mesh, args, kwargs, plan=plan)
            counts.append(len(solves) - before)
            if plan == path:
                index = pmodel.stage_indices[0]
                data = stored.data["pipeline"]["stage_plans"][index]
                assert pmodel.pmodules[0].plan.data["nodes"] == data["nodes"]
            _train_and_compare(pmodel, args, kwargs, want)
        errors = []
        model, args, kwargs = _build("llama")
        short = tuple(a[:, :8].contiguous() for a in args)  # other shapes: other stage graphs
        for other_args, other_mesh in ((short, mesh), (args, _mesh((2,), ("pp",)))):
            with pytest.raises(PlanMismatchError) as error:
                autopar.autoparallelize(model, other_mesh, other_args, plan=path)
            errors.append(str(error.value))
    finally:
        Driver.plan = solve  # type: ignore[method-assign]
    assert "other input shapes" in errors[0] and "from_world((2, 1, 1)" in errors[1], errors
    assert not any("\n" in e for e in errors), errors
    return {"solves": tuple(counts), "errors": errors}


def check_saved_v_plan(path: str) -> dict[str, Any]:
    """A V schedule (ZBV) planned by ``autopar.plan`` runs as saved: its stages fold back onto
    the ranks (0, 1, 1, 0), as torch's V schedules place them (the plan placed them 0, 1, 0, 1
    until session 22, which the runtime refused), with the numerics of one process."""
    import torch.distributed as dist

    import autopar
    from autopar.plan.document import Plan

    model, args, kwargs = _build("llama")
    want = sgd_reference(model, args, kwargs, lr=LR, steps=NUM_STEPS)
    if dist.get_rank() == 0:
        offline = autopar.Mesh.spec((2,), ("pp",))
        autopar.plan(
            model, offline, args, stages=2, microbatches=2, schedule="zbv", optimizer="sgd"
        ).save(path)
    dist.barrier()
    assert [s["pp_rank"] for s in Plan.load(path).data["pipeline"]["stages"]] == [0, 1, 1, 0]
    model, args, kwargs = _build("llama")
    mesh = _mesh((2, 1, 1), ("pp", "dp", "tp"))
    pmodel = autopar.autoparallelize(model, mesh, args, kwargs, plan=path)
    checked = _train_and_compare(pmodel, args, kwargs, want)
    return {**checked, "stages": list(pmodel.stage_indices)}


def check_trace(directory: str, rank: int) -> dict[str, int]:
    """With ``AUTOPAR_P2P_TRACE`` set, the pipeline trains as without it and each rank records
    its point-to-point posts and waits (autopar/runtime/p2p_trace.py); counts of the record."""
    import os

    from autopar.runtime import p2p_trace

    os.environ[p2p_trace.ENV] = directory
    try:
        case = ((2,), ("pp",), "gpt", 2, 2, "gpipe", {})
        check_pipeline(rank, 2, case)
    finally:
        del os.environ[p2p_trace.ENV]
        p2p_trace.uninstall()
    with open(os.path.join(directory, f"p2p-{rank}.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    posts = [x[1] for x in lines if x[0] == "post" and x[2] > 0]
    return {"fwd": sum(d.startswith("fwd") for d in posts) // NUM_STEPS,
            "bwd": sum(d.startswith("bwd") for d in posts) // NUM_STEPS,
            "waits": sum(x[0] == "wait" for x in lines)}  # fmt: skip


def check_shared_groups() -> int:
    """A second pipeline module on the same mesh makes no new process group (its stage mesh
    and point-to-point group are the first's) and still trains; returns the groups added."""
    from torch.distributed import distributed_c10d

    import autopar

    def build() -> Any:
        model, args, kwargs = _build("gpt")
        pmodel = autopar.autoparallelize(
            model, _mesh((2,), ("pp",)), args, kwargs,
            pipeline={"stages": 2, "microbatches": 2, "schedule": "gpipe"},
            optimizer="sgd", price_baselines=False,
        )  # fmt: skip
        assert torch.isfinite(pmodel.step(*args, **kwargs))
        return pmodel

    first = build()
    before = len(distributed_c10d._world.pg_map)
    second = build()
    assert second._stages[0].group is first._stages[0].group
    return len(distributed_c10d._world.pg_map) - before


def check_eval(schedule: str) -> float:
    """``pmodel.eval()`` then ``step``: forward only through the stages' eval-mode graphs (a GPT
    with dropout 0.1, captured in train mode: eval erases the dropout) returns the single
    process's eval loss on every rank and leaves no gradient; back in train mode the first
    training step's loss (dropout active) is finite. Returns the eval loss."""
    import autopar
    from tests import models

    model, args, kwargs = models.tiny_gpt(dropout=0.1, layers=4)
    model.eval()
    with torch.no_grad():
        want = model(*args, **kwargs)
    model.train()
    pmodel = autopar.autoparallelize(
        model,
        _mesh((2,), ("pp",)),
        args,
        kwargs,
        pipeline={"microbatches": 2, "schedule": schedule},
        optimizer="sgd",
        price_baselines=False,
    )
    pmodel.eval()
    for _ in range(2):  # the second pass reuses the prepared eval graphs
        got = pmodel(*args, **kwargs)
        _close("eval loss", got, want)
    assert all(p.grad is None for p in pmodel.parameters())
    pmodel.train()
    assert torch.isfinite(pmodel.step(*args, **kwargs))
    assert any(p.grad is not None for p in pmodel.parameters())
    return float(got)


def _without_stage_plans(plan: Any) -> Any:
    from autopar.plan.document import Plan

    data = json.loads(plan.to_json())
    del data["pipeline"]["stage_plans"]
    return Plan.from_dict(data)


def check_dcp(path: str, model_name: str = "llama") -> int:
    """``state_dict(sharded=True)`` of pp=2 x dp=2 (ZeRO-3 inside the stages, after a step)
    saved with ``dcp.save`` loads into pp=4 and into a one-stage 2x2 module (TP): every tensor
    equal. Returns the number of tensors compared."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import autopar

    model, args, _ = _build(model_name)
    saved = autopar.autoparallelize(
        model,
        _mesh((2, 2), ("pp", "dp")),
        args,
        recipe="fsdp",
        optimizer="sgd",
        pipeline={"microbatches": 2, "schedule": "1f1b"},
        price_baselines=False,
    )
    opt = torch.optim.SGD(saved.parameters(), lr=LR)
    saved.step(*args)
    opt.step()
    mine = {k: v.clone() for k, v in saved.state_dict().items()}
    every: list[dict[str, torch.Tensor]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(every, mine)
    want = {k: v for part in every for k, v in part.items()}
    dcp.save(saved.state_dict(sharded=True), checkpoint_id=path)
    compared = 0
    for mesh, pipeline in (
        (_mesh((4,), ("pp",)), {"microbatches": 4, "schedule": "gpipe"}),
        (_mesh((2, 2), ("dp", "tp")), None),
    ):
        model, args, _ = _build(model_name)
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        options = {"recipe": "megatron"} if pipeline is None else {}
        loaded = autopar.autoparallelize(
            model,
            mesh,
            args,
            optimizer="sgd",
            pipeline=pipeline,
            price_baselines=False,
            **options,
        )
        template = loaded.state_dict(sharded=True)
        dcp.load(template, checkpoint_id=path)
        loaded.load_state_dict(template)
        for name, value in loaded.state_dict().items():
            torch.testing.assert_close(value, want[name], rtol=0, atol=0, msg=name)
            compared += 1
    return compared


BAD_INPUT = {
    "more stages than blocks": "more pipeline stages than blocks",
    "microbatches do not divide the batch": "do not divide the batch",
    "one block": "with one block",
    "wrong world size": "but the world size is 2",
    "wrong world size, plan file": "but the world size is 2",
    "dualpipev, fewer microbatches than stages": "ScheduleDualPipeV refuses 2 microbatches on 4",
    "zbv, 3 stages per rank": "runs exactly 2 stages per pipeline rank",
}


def check_bad_input(what: str) -> str:
    """Each bad input raises one clear line on every rank, before any collective hangs."""
    import autopar
    from autopar.plan.document import Plan
    from autopar.planner.stages import even_stages
    from tests import models

    mesh = _mesh((2,), ("pp",))
    model, args, _ = models.tiny_llama(layers=2)
    kwargs: dict[str, Any] = {"pipeline": {"stages": 2, "microbatches": 2, "schedule": "1f1b"}}
    if what == "more stages than blocks":
        kwargs["pipeline"] = {"stages": 2, "virtual_stages": 2, "schedule": "interleaved-1f1b"}
    elif what == "microbatches do not divide the batch":
        kwargs["pipeline"] = {"stages": 2, "microbatches": 3, "schedule": "gpipe"}
    elif what == "one block":
        model, args, _ = models.tiny_llama(layers=1)
    elif what == "wrong world size":
        pipeline = even_stages(
            stack="layers", num_blocks=4, num_stages=4, microbatches=2, schedule="1f1b"
        )
        data = {"mesh": {"shape": [4]}, "pipeline": pipeline.to_json()}
        kwargs = {"pipeline": None, "plan": Plan(data=data)}
    elif what == "wrong world size, plan file":  # a saved plan: read on rank 0 only
        model, args, _ = models.tiny_llama(layers=4)
        offline = autopar.Mesh.spec((4,), ("pp",))
        saved = autopar.plan(
            model, offline, args, stages=4, microbatches=2, schedule="gpipe", stage_plans=False
        )
        path = pathlib.Path(tempfile.mkdtemp()) / "plan.json"
        saved.save(path)
        kwargs = {"pipeline": None, "plan": str(path)}
    elif what == "dualpipev, fewer microbatches than stages":
        model, args, _ = models.tiny_llama(layers=4)
        kwargs["pipeline"] = {"stages": 2, "microbatches": 2, "schedule": "dualpipev"}
    elif what == "zbv, 3 stages per rank":
        model, args, _ = models.tiny_llama(layers=6)
        kwargs["pipeline"] = {"microbatches": 2, "schedule": "zbv", "virtual_stages": 3}
    with pytest.raises(Exception) as error:
        autopar.autoparallelize(model, mesh, args, price_baselines=False, **kwargs)
    message = str(error.value)
    assert BAD_INPUT[what] in message, message
    assert "\n" not in message, message
    return message
