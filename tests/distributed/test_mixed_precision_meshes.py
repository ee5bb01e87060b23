"""Mixed precision on meshes with no data-parallel axis trains like one process under autocast.

A parameter with no axis to shard its fp32 master over (every parameter of a pp-only pipeline
stage, whose submesh is (1,); every parameter on one rank; the tensor-parallel blocks of a
tp-only mesh) keeps its master whole in a ZeRO chunk of no axes (``autopar.runtime.zero``):
half compute copies, the optimizer stepping the fp32 masters. Until session 23 such plans were
refused ("replicates no parameter over an axis of size > 1").

Each case trains 3 SGD steps against one process with fp32 weights under
``torch.autocast(dtype)`` (fp16: with ``torch.amp.GradScaler``, the run with
``pmodel.grad_scaler``): the loss of every step, every gradient of the first step and every
parameter after the last within the bf16 tests' bar (``test_zero.bf16_against_autocast``: 1e-3,
far below bf16's 7.8e-3 epsilon), the compute copies in the half dtype, the masters fp32, and
the run not equal to fp32 (half precision was used). A tied weight whose master ZeRO shards
over ``dp`` (pp=2 x dp=2) sums its copies' gradient shards across the stages (refused until
session 23's lead change). The pp=2 bf16 run is saved with
``dcp.save`` and loaded into a fresh pp=2 bf16 module: equal masters, and the next step's loss
equal bit for bit (the compute copies were refreshed from the loaded masters).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from tests.distributed.launcher import run_cases
from tests.distributed.reference import assert_close_named, full_grads, model_loss

LR = 0.1
NUM_STEPS = 3
TOL = 1e-3
"""The bf16 bar of ``test_zero.bf16_against_autocast`` (loss rtol and atol, parameters atol)."""
GRAD_RTOL, GRAD_ATOL = 2.0**-7, 2.0**-8
"""Gradients within bf16's epsilon relative and its unit roundoff absolute: they are sums over
tokens computed in half precision in both runs, in other orders (tensor-parallel shards,
microbatches), and the compute copies' gradients are half before they reach the fp32 buffer."""

_HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}

# name -> (mesh shape, axis names, model, precision, autoparallelize options)
# fmt: off
CASES: dict[int, dict[str, tuple]] = {
    1: {
        "one rank/gpt/bf16": ((1,), ("dp",), "gpt", "bf16", {}),
    },
    2: {
        "pp2/gpt/gpipe/bf16": (
            (2,), ("pp",), "gpt", "bf16",
            {"pipeline": {"stages": 2, "microbatches": 2, "schedule": "gpipe"}},
        ),
        "pp2/llama/1f1b/bf16": (
            (2,), ("pp",), "llama", "bf16",
            {"pipeline": {"stages": 2, "microbatches": 4, "schedule": "1f1b"}},
        ),
        "pp2/llama/1f1b/fp16": (
            (2,), ("pp",), "llama", "fp16",
            {"pipeline": {"stages": 2, "microbatches": 2, "schedule": "1f1b"}},
        ),
        "tp2/gpt/megatron/bf16": ((2,), ("tp",), "gpt", "bf16", {"recipe": "megatron"}),
        "tp2/llama/megatron/fp16": ((2,), ("tp",), "llama", "fp16", {"recipe": "megatron"}),
    },
    4: {
        "pp2xtp2/llama/1f1b/megatron/bf16": (
            (2, 2), ("pp", "tp"), "llama", "bf16",
            {"recipe": "megatron", "pipeline": {"stages": 2, "microbatches": 2, "schedule": "1f1b"}},
        ),
        # The tied head's fp32 master sharded over dp (ZeRO-1 masters) in both stages.
        "pp2xdp2/gpt/1f1b/ddp/bf16-tied": (
            (2, 2), ("pp", "dp"), "gpt", "bf16",
            {"recipe": "ddp", "pipeline": {"stages": 2, "microbatches": 2, "schedule": "1f1b"}},
        ),
    },
}
# fmt: on


def _build(name: str) -> Any:
    from tests import models

    return (models.tiny_gpt if name == "gpt" else models.tiny_llama)(layers=4)


@functools.cache
def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
    import autopar

    return autopar.Mesh.from_world(shape, names, device="h100")


def _reference(model_name: str, precision: str) -> dict[str, Any]:
    """One process, fp32 weights, each step's forward under autocast (fp16: GradScaler)."""
    model, args, kwargs = _build(model_name)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16")
    losses, grads = [], {}
    for step in range(NUM_STEPS):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=_HALF[precision]):
            loss = model_loss(model(*args, **kwargs))
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        if step == 0:
            grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        scaler.step(opt)
        scaler.update()
        losses.append(loss.detach().float())
    fp32, args, kwargs = _build(model_name)
    fp32_loss = model_loss(fp32(*args, **kwargs))
    fp32_loss.backward()
    return {
        "losses": losses,
        "grads": grads,
        "state": model.state_dict(),
        "fp32 loss": fp32_loss.detach(),
        "fp32 grads": {name: p.grad.clone() for name, p in fp32.named_parameters()},
    }


def _check_masters(pmodel: Any, precision: str) -> int:
    """The mechanism: chunks of no axes hold whole fp32 masters with half compute copies.
    Returns the number of such chunks on this rank and of chunks sharded over some axis."""
    pmodules = getattr(pmodel, "pmodules", [pmodel])
    whole = 0
    sharded = 0
    for pmodule in pmodules:
        assert pmodule.zero is not None, "mixed precision keeps its masters in ZeRO chunks"
        for chunk in pmodule.zero.chunks:
            assert chunk.shard.dtype == torch.float32, "masters are fp32"
            if chunk.kept is not None:
                assert chunk.kept.dtype == _HALF[precision], chunk.kept.dtype
            if not chunk.zero_axes:
                assert chunk.kept.numel() == chunk.shard.numel() == chunk.numel
                whole += 1
            else:
                sharded += 1
    assert all(p.dtype == torch.float32 for p in pmodel.parameters())
    return whole, sharded


def _check_priced_memory(pmodel: Any) -> tuple[int, float]:
    """What each (stage) plan prices at ZeRO stage 0 under mixed precision (half parameters,
    fp32 gradients and master copy: 2 + 4 + 4 bytes an element) is what the chunks hold after
    a step: half compute copies, fp32 gradient buffers, fp32 masters (whole where the chunk
    has no axes; a chunk sharded over a data-parallel axis holds a shard, less than priced).
    Returns the bytes held and priced (parameters, gradients, masters) on this rank."""
    total = [0, 0.0]
    for pmodule in getattr(pmodel, "pmodules", [pmodel]):
        priced = pmodule.plan.data["predicted"]["memory"]
        chunks = pmodule.zero.chunks
        held = {
            "params": sum(c.kept.nbytes for c in chunks),
            "grads": sum(c.grad_buffer.nbytes for c in chunks),
            "master": sum(c.shard.nbytes for c in chunks),
        }
        padding = sum(c.numel - sum(s.numel for s in c.slots) for c in chunks)
        assert 0 <= held["params"] - priced["params"] <= 2 * padding, (held, priced)
        assert 0 <= held["grads"] - priced["grads"] <= 4 * padding, (held, priced)
        if all(not c.zero_axes for c in chunks):
            assert held["master"] == priced["master"], (held, priced)
        else:
            assert held["master"] < priced["master"], (held, priced)
        total[0] += sum(held.values())
        total[1] += sum(priced[key] for key in held)
    return (total[0], total[1])


def _step(pmodel: Any, args: Any, kwargs: Any, opt: Any) -> tuple[torch.Tensor, dict]:
    """One training step (pipelined: ``pmodel.step``); returns the loss and, unscaled, every
    gradient of this rank's stages gathered whole."""
    scaler = pmodel.grad_scaler
    if hasattr(pmodel, "pmodules"):
        loss = pmodel.step(*args, **kwargs)  # scales each microbatch loss under fp16
        pmodules = pmodel.pmodules
    else:
        loss = model_loss(pmodel(*pmodel.shard_inputs(*args), **kwargs))
        pmodel.scale_loss(loss).backward()
        pmodules = [pmodel]
    scaler.unscale_(opt)
    grads = {name: g for p in pmodules for name, g in full_grads(p).items()}
    scaler.step(opt)
    scaler.update()
    return loss.detach().float(), grads


def _parallelize(case: tuple, model: Any, args: Any, kwargs: Any) -> Any:
    import autopar

    shape, names, _, precision, options = case
    return autopar.autoparallelize(
        model,
        _mesh(shape, names),
        args,
        kwargs,
        optimizer="sgd",
        mixed_precision=precision,
        price_baselines=False,
        **options,
    )


def check_case(rank: int, world_size: int, case: tuple, path: str) -> dict[str, Any]:
    _, _, model_name, precision, options = case
    want = _reference(model_name, precision)
    model, args, kwargs = _build(model_name)
    pmodel = _parallelize(case, model, args, kwargs)
    whole, sharded = _check_masters(pmodel, precision)
    assert pmodel.grad_scaler.is_enabled() == (precision == "fp16")
    # The tied case shards every master over dp: what it tests is the tied head's shards.
    has_dp = any(name == "dp" and size > 1 for size, name in zip(case[0], case[1], strict=True))
    assert whole > 0 or has_dp, "no parameter without a data-parallel axis: the case tests nothing"
    assert sharded > 0 or not has_dp, "nothing sharded over dp"
    opt = torch.optim.SGD(pmodel.parameters(), lr=LR)
    checked = []
    diffs = {"loss diff": 0.0, "grad diff": 0.0, "param diff": 0.0}
    for step in range(NUM_STEPS):
        opt.zero_grad()
        loss, grads = _step(pmodel, args, kwargs, opt)
        assert_close_named(f"loss of step {step}", loss, want["losses"][step], rtol=TOL, atol=TOL)
        if step == 0:
            # Half precision moves the loss or some gradient off the fp32 run's. The loss
            # alone can land within 1e-6 of fp32's (the tiny LLaMA, fp16, in 2 microbatches,
            # on some CPUs), so every gradient of this rank counts too.
            moved = [abs(loss.item() - want["fp32 loss"].item())]
            moved += [_diff(g, want["fp32 grads"][name]) for name, g in grads.items()]
            assert max(moved) > 1e-6, "half was not used"
            for name, grad in grads.items():
                assert_close_named(
                    f"grad of {name}", grad, want["grads"][name], rtol=GRAD_RTOL, atol=GRAD_ATOL
                )
                checked.append(name)
                diffs["grad diff"] = max(diffs["grad diff"], _diff(grad, want["grads"][name]))
        diffs["loss diff"] = max(diffs["loss diff"], _diff(loss, want["losses"][step]))
    state_bytes = _check_priced_memory(pmodel)
    state = pmodel.state_dict()
    for name, value in state.items():
        assert_close_named(f"{name} after 3 steps", value, want["state"][name], rtol=0, atol=TOL)
        diffs["param diff"] = max(diffs["param diff"], _diff(value, want["state"][name]))
    if precision == "fp16":
        _check_overflow_skips(pmodel, args, kwargs, opt)
    if path:
        _check_reload(pmodel, case, path)
    return {
        "grads": sorted(checked),
        "state": sorted(state),
        "whole chunks": whole,
        "sharded chunks": sharded,
        "state bytes": state_bytes,
        **diffs,
    }


def _diff(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max()) if got.numel() else 0.0


def _check_overflow_skips(pmodel: Any, args: Any, kwargs: Any, opt: Any) -> None:
    """An inf in rank 0's gradients only: every rank skips the step (parameters unchanged bit
    for bit, on every stage) and halves the scale."""
    import torch.distributed as dist

    scaler = pmodel.grad_scaler
    before = {name: value.clone() for name, value in pmodel.state_dict().items()}
    scale = scaler.get_scale()
    opt.zero_grad()
    if hasattr(pmodel, "pmodules"):
        pmodel.step(*args, **kwargs)
    else:
        pmodel.scale_loss(model_loss(pmodel(*pmodel.shard_inputs(*args), **kwargs))).backward()
    if dist.get_rank() == 0:
        next(p for p in pmodel.parameters() if p.grad is not None).grad.view(-1)[0] = float("inf")
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == scale / 2 and scaler.skipped_steps == 1
    for name, value in pmodel.state_dict().items():
        assert torch.equal(value, before[name]), name


def _check_reload(saved: Any, case: tuple, path: str) -> None:
    """The masters into a fresh module of the same plan, through ``dcp.save`` / ``dcp.load``
    into directory ``path`` or (``path == "full"``) as a full state dict: equal masters, and
    the next loss equal bit for bit (the compute copies were refreshed from the masters)."""
    import torch.distributed.checkpoint as dcp

    model_name = case[2]
    if path != "full":
        dcp.save(saved.state_dict(sharded=True), checkpoint_id=path)
    model, args, kwargs = _build(model_name)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    loaded = _parallelize(case, model, args, kwargs)
    want = saved.state_dict()
    if path == "full":
        loaded.load_state_dict(want)
    else:
        template = loaded.state_dict(sharded=True)
        dcp.load(template, checkpoint_id=path)
        loaded.load_state_dict(template)
    for name, value in loaded.state_dict().items():
        torch.testing.assert_close(value, want[name], rtol=0, atol=0, msg=name)
    if hasattr(saved, "pmodules"):
        torch.testing.assert_close(loaded.step(*args), saved.step(*args), rtol=0, atol=0)
    else:
        local = saved.shard_inputs(*args)
        torch.testing.assert_close(loaded(*local), saved(*local), rtol=0, atol=0)


def _run(world_size: int, tmp_path: Any) -> None:
    cases = []
    for name, case in CASES[world_size].items():
        # Reloaded: the pp=2 masters through DCP, the one-rank ones as a full state dict.
        path = str(tmp_path / name.replace("/", "-")) if "pipeline" in case[4] else "full"
        cases.append((name, (case, path if world_size < 4 and "tp" not in case[1] else "")))
    results = run_cases(_check_one, world_size, cases, timeout_s=300)
    for name, case in CASES[world_size].items():
        values = results[name].check()
        # The measured distances and state bytes (pytest -s): the README's figures.
        worst = {k: max(v[k] for v in values) for k in ("loss diff", "grad diff", "param diff")}
        print(name, worst, "state held / priced per rank", [v["state bytes"] for v in values])
        model, _, _ = _build(case[2])
        every = {n for n, _ in model.named_parameters()}
        assert set().union(*(v["grads"] for v in values)) == every, name
        assert set().union(*(v["state"] for v in values)) >= every, name


def _check_one(rank: int, world_size: int, item: tuple) -> Any:
    case, path = item
    return check_case(rank, world_size, case, path)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_mixed_precision_without_data_parallel_axis(world_size: int, tmp_path: Any) -> None:
    _run(world_size, tmp_path)
