"""autoparallelize end to end on real gloo ranks: the planner's plans train exactly like one process.

For each mesh, one spawn of ranks runs every (model, recipe) case: rank 0 plans with the real
planner (device figures of an H100, so the cost model is not the CPU's), broadcasts the plan,
every rank lowers it and trains. Checked against the single-process model (fp32, rtol 1e-5,
atol 1e-6): the loss, every parameter's gradient (gathered to full), and the parameters after 3
SGD steps.

Matrix (sized to the CI budget of ~4 minutes on 2 cores):

* meshes (2,) and (2, 2): every model (MLP, GPT, LLaMA, HF GPT-2, HF LLaMA) under ``auto``,
  ``ddp`` and ``megatron``; on (2,) also MLP and GPT under ``fsdp`` (the plan's ZeRO stage
  reaches the runtime; loss and parameters after the steps are compared);
* mesh (4,): every model under the three recipes; and ``gpt/memory``:
  after ``autoparallelize`` and ``del model`` the original parameters are freed and the new live
  tensor storages are the plan's shards (the module once kept the whole original model);
* mesh (2, 2, 2): MLP and GPT under the three recipes (the tiny GPT plans in about 7 s on a
  3-D mesh; the tiny LLaMA, whose rotary tables make the ILP far larger there, is left out).

The ``megatron`` plans of the GPT and LLaMA keep the logits vocab-sharded into the cross
entropy (the vocab-parallel cross entropy: asserted from the plan and the lowered code; the
loss, gradients and steps are checked as above). Tiny models under the plain auto plan are
all-Replicate (kernel overheads dominate); the ``auto-budget`` cases give the planner a memory
budget of about 60% of the replicated peak with ZeRO off, which forces sharded layouts, and
assert that the plan is not all-Replicate (the GPT's, at about 40%, also that it takes the
vocab-parallel cross entropy).
Train/eval switching (eval graph without dropout, under ``torch.no_grad()``) runs on (2, 2);
batch-sharded outputs (``output_placements=``) with a local loss on (2,).
"""

from __future__ import annotations

import functools
import math
import time
from typing import Any

import pytest
import torch

from tests.distributed.reference import assert_close_named, model_loss, sgd_reference, sgd_steps

RTOL, ATOL = 1e-5, 1e-6
NUM_STEPS = 3
LR = 0.1
RECIPES = ("auto", "ddp", "megatron")
BUDGETS = {"mlp": 340_000, "gpt": 1_300_000}
"""Memory budgets (bytes) of the ``auto-budget`` cases: about 60% of the all-Replicate peak for
the MLP; about 40% for the GPT (2x2 only). Whether the GPT's auto plan then takes the
vocab-parallel cross entropy is a near-tie (its proven optimum at gap 0 keeps ``R,R`` logits,
0.01% faster than the ``R,S1`` plan found within the 1% gap), so it is not asserted here; the
megatron cases and ``test_conformance`` pin that path."""
TRAIN_EVAL_BUDGET = 2_100_000
"""Memory budget of ``gpt/train-eval`` (2x2): about 60% of the all-Replicate peak."""

ALL = ("mlp", "gpt", "llama", "hf_gpt2", "hf_llama")
MESHES: dict[str, tuple[tuple[int, ...], list[str]]] = {
    "mesh2": (
        (2,),
        [f"{m}/{r}" for m in ALL for r in RECIPES]
        + ["mlp/auto-budget", "mlp/fsdp", "gpt/fsdp", "mlp/sharded-output"],
    ),
    "mesh2x2": (
        (2, 2),
        [f"{m}/{r}" for m in ALL for r in RECIPES]
        + ["mlp/auto-budget", "gpt/auto-budget", "gpt/train-eval"],
    ),
    "mesh4": (
        (4,),
        [f"{m}/{r}" for m in ALL for r in RECIPES] + ["gpt/memory"],
    ),
    "mesh2x2x2": ((2, 2, 2), [f"{m}/{r}" for m in ("mlp", "gpt") for r in RECIPES]),
}


def _build(model_name: str, dropout: float = 0.0) -> Any:
    from tests import models

    if model_name == "gpt" and dropout:
        return models.tiny_gpt(dropout=dropout)
    builders = {"mlp": models.tiny_mlp, "gpt": models.tiny_gpt, "llama": models.tiny_llama}
    return (builders.get(model_name) or getattr(models, model_name))()


_loss = model_loss


def _close(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert_close_named(what, got, want, rtol=RTOL, atol=ATOL)


def _reference(model_name: str) -> dict[str, Any]:
    model, args, kwargs = _build(model_name)
    return sgd_reference(model, args, kwargs, lr=LR, steps=NUM_STEPS)


@functools.cache
def _mesh(mesh_shape: tuple[int, ...]) -> Any:
    import autopar

    return autopar.Mesh.from_world(mesh_shape, device="h100")


def check_training(model_name: str, recipe: str, mesh: Any) -> dict[str, Any]:
    """Loss, gradients and 3 SGD steps of the autoparallelized model vs one process."""
    import autopar
    from autopar.runtime.module import gather_full

    # Only the requested recipe is solved: pricing the others is the planner tests' job.
    options: dict[str, Any] = {"recipe": recipe, "optimizer": "sgd", "price_baselines": False}
    if recipe == "auto-budget":
        # Budgets are sized for the default optimizer's state (AdamW); ZeRO off forces sharding.
        options = {"memory_budget": BUDGETS[model_name], "zero_stage": 0, "price_baselines": False}
    want = _reference(model_name)
    model, args, kwargs = _build(model_name)
    pmodel = autopar.autoparallelize(model, mesh, args, kwargs, **options)
    assert isinstance(pmodel.plan, autopar.Plan)
    layouts = sorted(set(pmodel.plan.param_placements().values()))
    assert [n for n, _ in pmodel.named_parameters()] == [n for n, _ in model.named_parameters()]
    if recipe == "ddp":
        assert all(set(p.split(",")) == {"R"} for p in layouts), layouts
    if recipe in ("megatron", "auto-budget"):
        assert any("S" in p for p in layouts), f"{recipe} plan is all-Replicate: {layouts}"
    # The loss's logits layout: the megatron recipe keeps them vocab-sharded (S1 on the
    # tensor-parallel axis) and the lowering runs the vocab-parallel cross entropy, where the
    # model returns only the loss (Hugging Face models also return the logits, gathered anyway).
    loss_inputs = [
        n["inputs"][0]
        for n in pmodel.plan.data["nodes"]
        if n["op"] == "aten.cross_entropy_loss.default"
    ]
    vocab_parallel = "autopar_vocab_parallel_cross_entropy" in pmodel.lowered.gm.code
    assert vocab_parallel == any("S1" in p.split(",") for p in loss_inputs), loss_inputs
    if recipe == "megatron" and model_name in ("gpt", "llama"):
        assert loss_inputs[0].split(",")[-1] == "S1", f"megatron loss logits {loss_inputs}"
    if recipe == "megatron" and model_name == "gpt":
        # The fused qkv is section-sharded (q, k, v each split): attention on local heads.
        qkv = pmodel.plan.param_placements()["blocks.0.attn.qkv.weight"]
        assert qkv.split(",")[-1].startswith("S0["), qkv

    local = pmodel.shard_inputs(*args, **kwargs)
    local_args, local_kwargs = local if kwargs else (local, {})
    loss = _loss(pmodel(*local_args, **local_kwargs))
    _close("loss", loss.detach(), want["loss"])
    loss.backward()
    placements = pmodel.lowered.param_placements
    group_of = pmodel.groups.groups.__getitem__
    zero_stage = pmodel.plan.zero["stage"]
    if zero_stage:
        # ZeRO keeps parameters in chunk shards: the plan reached the runtime, and the state
        # dict after the SGD steps (below) is compared instead of per-parameter gradients.
        assert pmodel.zero is not None
    for name, param in pmodel.named_parameters() if not zero_stage else ():
        grad = gather_full(param.grad, placements[name], group_of)
        _close(f"grad of {name}", grad, want["grads"][name])
    sgd_steps(pmodel, local_args, local_kwargs, lr=LR, steps=NUM_STEPS)
    state = pmodel.state_dict()
    for name, param in want["params"].items():
        _close(f"{name} after {NUM_STEPS} SGD steps", state[name], param.detach())
    return {
        "layouts": layouts,
        "inputs": [i["placements"] for i in pmodel.plan.data["inputs"]],
        "loss_logits": loss_inputs,
    }


def check_train_eval(mesh: Any) -> dict[str, Any]:
    """A GPT with dropout 0.5 captured in train mode: .eval() builds a graph without dropout
    whose output under torch.no_grad() equals the single-process eval output; .train() goes
    back to the first graph and its parameters."""
    import autopar

    model, args, kwargs = _build("gpt", dropout=0.5)
    pmodel = autopar.autoparallelize(
        model,
        mesh,
        args,
        kwargs,
        memory_budget=TRAIN_EVAL_BUDGET,
        zero_stage=0,
        price_baselines=False,
    )
    train_graph = pmodel.lowered
    assert "aten.dropout" in train_graph.gm.code or "autopar_dropout" in train_graph.gm.code
    local = pmodel.shard_inputs(*args)
    model.eval()
    with torch.no_grad():
        want = model(*args)
    pmodel.eval()
    with torch.no_grad():
        got = pmodel(*local)
    assert pmodel.lowered is not train_graph
    assert "dropout" not in pmodel.lowered.gm.code, pmodel.lowered.gm.code
    assert pmodel.lowered.param_placements == train_graph.param_placements
    _close("eval loss", got, want)
    pmodel.train()
    loss = pmodel(*local)
    assert pmodel.lowered is train_graph
    loss.backward()
    assert all(p.grad is not None for p in pmodel.parameters())
    return {"eval_loss": float(got)}


def check_sharded_output(mesh: Any) -> dict[str, Any]:
    """``output_placements=("S0",)``: each rank gets its batch block of the MLP's output and a
    loss on it; gradients follow DDP's convention and equal the global mean loss's."""
    import torch.distributed as dist
    import torch.nn.functional as F

    import autopar
    from autopar.runtime.module import gather_full

    model, (x, y), _ = _build("mlp")
    F.mse_loss(model(x), y).backward()
    want = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    sharded = ",".join(["S0"] * mesh.ndim)
    pmodel = autopar.autoparallelize(
        model, mesh, (x,), recipe="ddp", output_placements=(sharded,), price_baselines=False
    )
    (local_x,) = pmodel.shard_inputs(x)
    out = pmodel(local_x)
    local_y = y.chunk(dist.get_world_size())[dist.get_rank()]
    assert out.shape == local_y.shape, (out.shape, local_y.shape)
    _close(
        "sharded output",
        out.detach(),
        model(x).detach().chunk(dist.get_world_size())[dist.get_rank()],
    )
    F.mse_loss(out, local_y).backward()
    group_of = pmodel.groups.groups.__getitem__
    for name, param in pmodel.named_parameters():
        grad = gather_full(param.grad, pmodel.lowered.param_placements[name], group_of)
        _close(f"grad of {name} (local loss)", grad, want[name])
    return {"output_shape": tuple(out.shape)}


def _live_storages() -> dict[int, int]:
    """data pointer -> bytes of every live CPU tensor storage the garbage collector can see."""
    import gc

    gc.collect()
    out: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            try:
                storage = obj.untyped_storage()
                out[storage.data_ptr()] = storage.nbytes()
            except (RuntimeError, NotImplementedError):  # fake / functional tensors
                continue
    return out


def check_memory(mesh: Any) -> dict[str, Any]:
    """After autoparallelize (megatron plan: parameters sharded 4 ways) and ``del model``, the
    original parameters are freed and the new live tensor storages on this rank are the plan's
    shards (+10%: buffers, small graph constants), not the full model."""
    import weakref

    import autopar

    model, args, kwargs = _build("gpt")
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    before = _live_storages()
    originals = [weakref.ref(p) for p in model.parameters()]
    pmodel = autopar.autoparallelize(
        model, mesh, args, kwargs, recipe="megatron", optimizer="sgd", price_baselines=False
    )
    del model
    new = sum(n for ptr, n in _live_storages().items() if ptr not in before)
    alive = sum(ref() is not None for ref in originals)
    assert alive == 0, f"{alive} original parameters are kept alive by the ParallelModule"
    shard_bytes = 0
    for name, _ in pmodel.named_parameters():  # tied parameters once
        info = pmodel.plan.data["params"][name]
        numel = math.prod(info["shape"])
        for axis, p in enumerate(info["placement"].split(",")):
            if p.startswith("S"):
                numel //= pmodel.lowered.mesh_shape[axis]
        shard_bytes += numel * 4
    held = sum(p.numel() * 4 for p in pmodel.parameters())
    assert held == shard_bytes, (held, shard_bytes)
    assert shard_bytes < 0.6 * full_bytes, (shard_bytes, full_bytes)
    assert new <= 1.1 * shard_bytes + 65536, (new, shard_bytes, full_bytes)
    return {"new_bytes": new, "shard_bytes": shard_bytes, "full_bytes": full_bytes}


def run_case(rank: int, world_size: int, case: str, mesh_shape: tuple[int, ...]) -> Any:
    """Body of one case on one rank (raises on the first mismatch)."""
    start = time.perf_counter()
    mesh = _mesh(mesh_shape)
    model_name, recipe = case.split("/")
    if recipe == "train-eval":
        out = check_train_eval(mesh)
    elif recipe == "sharded-output":
        out = check_sharded_output(mesh)
    elif recipe == "memory":
        out = check_memory(mesh)
    else:
        out = check_training(model_name, recipe, mesh)
    return {**out, "seconds": time.perf_counter() - start}


@functools.cache
def _results(mesh_name: str) -> dict[str, Any]:
    from tests.distributed.launcher import run_cases

    mesh_shape, cases = MESHES[mesh_name]
    return run_cases(
        run_case,
        math.prod(mesh_shape),
        [(case, case) for case in cases],
        mesh_shape,
        timeout_s=600,
        env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"},
    )


PARAMS = [
    pytest.param(mesh_name, case, id=f"{mesh_name}-{case}")
    for mesh_name, (_, cases) in MESHES.items()
    for case in cases
]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(("mesh_name", "case"), PARAMS)
def test_autoparallelized_model_trains_like_one_process(mesh_name: str, case: str) -> None:
    _results(mesh_name)[case].check()


@pytest.mark.distributed
@pytest.mark.slow
def test_memory_budget_makes_the_auto_plan_shard() -> None:
    """The auto plan under a binding budget is not all-Replicate, on every mesh it ran on."""
    for mesh_name in ("mesh2", "mesh2x2"):
        values = _results(mesh_name)["mlp/auto-budget"].check()
        assert any("S" in layout for layout in values[0]["layouts"]), values[0]
