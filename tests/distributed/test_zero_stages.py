"""Per-axis ZeRO stages on real gloo ranks equal single-process training.

One spawn of 4 ranks. The tiny GPT data parallel on a 2x2 mesh (the batch split over both
axes, every parameter Replicate on both), with a stage per axis (``(dp, tp)`` stages below;
both axes are data parallel here, the names are the test mesh's):

* ``sgd/<stages>`` for (3, 2), (3, 1), (2, 3), (3, 0), (1, 2): the chunks' split order is P, then
  G \\ P, then O \\ G; losses of 3 SGD steps, the first gradients (gathered to full) and the
  parameters after 3 steps equal one process (rtol 1e-5, atol 1e-6, as in test_zero.py).
* ``adamw/<stages>`` for (2, 3) and (3, 1): 3 AdamW steps at test_zero.py's AdamW tolerance
  (rtol 1e-4, atol 2e-5); then the measured bytes of live parameter, gradient and
  optimizer-state storages per rank equal what the planner prices for these stages
  (``cost_models.training_state_bytes`` with the P / G / O shard counts, as
  ``autopar.planner.problem.param_state`` calls it) within 10%; the sharded state dict and sharded
  optimizer state (split order (1, 0) for (2, 3)) gather back to the full ones bit for bit.
* ``accumulate/(3, 1)``: backward twice under ``no_sync`` then once synchronised equals one
  large-batch backward.
* ``lamb/(2, 3)``: clip_grad_norm_ (the norm over the O-shards on every axis) + LAMB for 3 steps
  equal one process.
* ``bf16/(3, 1)``: bf16 compute with a bf16 kept buffer (P != O) and fp32 master O-shards,
  within bf16 tolerance of one process under autocast.
* ``dcp/(3, 2)``: 2 AdamW steps, ``dcp.save`` of the sharded model and optimizer state; loaded
  with ``dcp.load`` on the 4 ranks as a 1-D mesh at stage 3, parameters and optimizer state bit
  for bit; then (the parent, one process, no process group) into a plain module and AdamW bit
  for bit.
* ``keep-grads/<stages>`` for (1, 1) and (2, 3): SGD with ``zero_grad(set_to_none=False)``:
  every chunk's backward reduces into the buffer the ``.grad`` views hold (from the first
  backward where G is empty and the buffer is kept, from the second where G is not; no second
  gradient buffer during backward; the same storage every step)
  and 3 steps equal one process; two backward calls without zeroing in between reuse nothing
  and still add up (twice the first gradients).
* ``autoparallelize/dp=2,tp=3``: ``autoparallelize(..., zero_stage={"dp": 2, "tp": 3})`` (the
  planner picks the layouts, the plan JSON carries the stages to the engine): 3 SGD steps equal
  one process.
* ``autoparallelize-bf16/ddp``: a bf16 plan at ZeRO stage 0 runs with its fp32 masters in ZeRO-1
  chunks, within bf16 tolerance of one process under autocast.
"""

from __future__ import annotations

import math
import os
from typing import Any

import pytest
import torch

from tests.distributed.reference import full_grads
from tests.distributed.test_zero import (
    ADAM_ATOL,
    ADAM_RTOL,
    ATOL,
    NUM_STEPS,
    RTOL,
    _build,
    _check_bf16,
    _compare,
    _reference,
    _state_bytes,
    _train,
    bf16_against_autocast,
    check_accumulation,
)

MESH = (2, 2)
SGD_STAGES = ((3, 2), (3, 1), (2, 3), (3, 0), (1, 2))
SPLIT_ORDER = {
    (3, 2): (0, 1),
    (3, 1): (0, 1),
    (2, 3): (1, 0),
    (3, 0): (0,),
    (1, 2): (1, 0),
    (1, 1): (0, 1),
}


def _check_split(pmodel: Any, stages: tuple[int, int]) -> None:
    for chunk in pmodel.zero.chunks:
        assert chunk.zero_axes == SPLIT_ORDER[stages], (stages, chunk.zero_axes)
        assert chunk.param_axes == tuple(a for a in chunk.zero_axes if stages[a] == 3)
        assert chunk.grad_axes == tuple(a for a in chunk.zero_axes if stages[a] >= 2)


def _predicted_bytes(pmodel: Any, stages: tuple[int, int]) -> dict[str, float]:
    """What the planner prices: training_state_bytes per parameter with the P / G / O shard
    counts of ``ZeroConfig.split`` (every parameter is Replicate on both axes here)."""
    from autopar.planner.problem import ZeroConfig
    from cost_models import training_state_bytes

    shape = pmodel.lowered.mesh_shape
    param_axes, grad_axes, state_axes = ZeroConfig(stages=stages).split((0, 1))
    out = {"params": 0.0, "grads": 0.0, "optimizer": 0.0}
    engine = pmodel.zero
    for param in pmodel.parameters():
        chunk, slot = engine.slot_of(param)
        breakdown = training_state_bytes(
            num_elements=slot.numel,
            param_dtype_bytes=4,
            optimizer="adamw",
            param_shards=math.prod(shape[a] for a in param_axes),
            grad_shards=math.prod(shape[a] for a in grad_axes),
            state_shards=math.prod(shape[a] for a in state_axes),
        ).to_dict()
        for key in out:
            out[key] += breakdown[key]
    return out


def _check_sharded_state(pmodel: Any, opt: torch.optim.Optimizer) -> None:
    from autopar.optim import full_optim_state_dict, sharded_optim_state_dict

    full = pmodel.state_dict()
    for name, value in pmodel.state_dict(sharded=True).items():
        assert torch.equal(value.full_tensor(), full[name]), name
    full_optim = full_optim_state_dict(pmodel, opt)
    sharded = sharded_optim_state_dict(pmodel, opt)
    for name, entries in full_optim["state"].items():
        for key, value in entries.items():
            got = sharded["state"][name][key]
            got = got.full_tensor() if hasattr(got, "full_tensor") else got
            assert torch.equal(torch.as_tensor(got), torch.as_tensor(value)), (name, key)


def _dcp(stages: tuple[int, int], path: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    from autopar.optim import full_optim_state_dict
    from tests.distributed.test_state_dict import (
        _dcp_load,
        _dcp_template,
        _equal_optim,
        _equal_state,
    )

    _, args, pmodel = _build(None, MESH, stages)
    got = _train(pmodel, args, "adamw", 2)
    opt = got["opt"]
    dcp.save(_dcp_template(pmodel, opt), checkpoint_id=path)
    full = pmodel.state_dict()
    full_optim = full_optim_state_dict(pmodel, opt)
    # The same 4 ranks as a 1-D mesh at stage 3 (another mesh shape, split and stage).
    _, _, other = _build(None, (4,), 3)
    assert all(c.zero_axes == (0,) for c in other.zero.chunks)
    other_opt = torch.optim.AdamW(other.parameters(), lr=0.5)
    _dcp_load(other, other_opt, path)
    _equal_state(other.state_dict(), full, "(4,) stage 3 from the (3, 2) checkpoint")
    _equal_optim(full_optim_state_dict(other, other_opt), full_optim, "(4,) stage 3 optimizer")
    return {"model": full, "optim": full_optim}


def _autoparallelized(stages: dict[str, int]) -> dict[str, Any]:
    """``autoparallelize(..., zero_stage={axis: stage})``: the plan carries the per-axis stages
    to the engine, and 3 SGD steps equal one process."""
    import autopar
    from tests.models import tiny_gpt

    model, args, _ = tiny_gpt()
    mesh = autopar.Mesh.from_world(MESH, ("dp", "tp"))
    pmodel = autopar.autoparallelize(
        model, mesh, args, zero_stage=stages, optimizer="sgd", price_baselines=False
    )
    assert pmodel.plan.zero["stages"] == stages, pmodel.plan.zero
    assert pmodel.zero is not None and pmodel.zero.stages == tuple(stages.values())
    assert any(c.param_axes for c in pmodel.zero.chunks)
    got = _train(pmodel, args, "sgd", 3)
    _compare(f"autoparallelize {stages}", got, _reference("sgd", 3), RTOL, ATOL)
    return {"layouts": sorted(set(pmodel.plan.param_placements().values()))}


def _keep_grads(pmodel: Any, args: Any, stages: tuple[int, int]) -> None:
    import torch.distributed as dist

    from tests.distributed.test_zero import _optimizer

    engine = pmodel.zero
    reused: list[bool] = []
    find = engine.reducer.zeroed_grad_buffer

    def spy(chunk: Any) -> Any:
        buffer = find(chunk)
        reused.append(buffer is not None)
        return buffer

    engine.reducer.zeroed_grad_buffer = spy
    # Where the gradient reductions write (stage 1: the all-reduced flat chunk; stage >= 2: the
    # reduce-scatter output).
    written: set[int] = set()
    originals = {name: getattr(dist, name) for name in ("all_reduce", "reduce_scatter_single")}

    def recording(name: str) -> Any:
        def call(out: torch.Tensor, *rest: Any, **kwargs: Any) -> Any:
            written.add(out.untyped_storage().data_ptr())
            return originals[name](out, *rest, **kwargs)

        return call

    opt = _optimizer("sgd", pmodel.parameters(), pmodel.split_groups)
    local = pmodel.shard_inputs(*args)
    losses, grads, storages, per_step = [], {}, [], []
    for step in range(3):
        opt.zero_grad(set_to_none=False)
        reused.clear()
        written.clear()
        loss = pmodel(*local)
        for name in originals:
            setattr(dist, name, recording(name))
        try:
            loss.backward()
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)
        per_step.append(list(reused))
        # From the second step on, reduced in place into the buffers .grad views (chunks whose
        # gradient some collective reduces).
        # (Parameters with no element in this rank's shard have no .grad here.)
        held = {
            p.grad.untyped_storage().data_ptr()
            for p in pmodel.parameters()
            if p.grad is not None
            and (engine.slot_of(p)[0].scatter_axes or engine.slot_of(p)[0].allreduce_axes)
        }
        assert held and (step == 0 or held <= written), (stages, step, "reduced next to .grad")
        if step == 0:
            grads = full_grads(pmodel)
        storages.append(
            {p.grad.untyped_storage().data_ptr() for p in pmodel.parameters() if p.grad is not None}
        )
        opt.step()
        losses.append(loss.detach())
    chunks = len(engine.chunks)
    # A chunk with G empty keeps its gradient buffer, written from the first step on (made
    # then, .grad None); with G non-empty the reduction writes the buffer .grad views from the
    # second step on.
    first = [not chunk.grad_axes for chunk in engine.chunks]
    assert per_step == [first, [True] * chunks, [True] * chunks], (stages, per_step)
    assert storages[1] == storages[2] == storages[0], (stages, "gradient storage changed")
    got = {"losses": losses, "grads": grads, "state": pmodel.state_dict()}
    _compare(f"keep-grads {stages}", got, _reference("sgd", 3), RTOL, ATOL)
    # Not zeroed: the .grad views hold a gradient, so backward must add to it.
    opt.zero_grad(set_to_none=False)
    pmodel(*local).backward()
    once = full_grads(pmodel)
    reused.clear()
    pmodel(*local).backward()
    assert not any(reused), (stages, "a gradient buffer holding a gradient was reused")
    for name, value in full_grads(pmodel).items():
        torch.testing.assert_close(
            value, 2 * once[name], rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}"
        )


def _autoparallelized_bf16() -> None:
    """A bf16 plan at ZeRO stage 0 (the ``ddp`` recipe) runs: its fp32 master weights live in
    ZeRO-1 chunks over the data-parallel axes (the planner prices stage 1 as stage 0; until
    session 22 the runtime refused the plan), within bf16 tolerance of one process under
    autocast (``test_zero.bf16_against_autocast``)."""
    import autopar
    from tests.models import tiny_gpt

    model, args, _ = tiny_gpt()
    mesh = autopar.Mesh.from_world(MESH, ("dp", "tp"))
    pmodel = autopar.autoparallelize(
        model, mesh, args, recipe="ddp", mixed_precision="bf16", optimizer="sgd"
    )
    assert not any(pmodel.plan.zero["stages"].values()), pmodel.plan.zero
    assert pmodel.zero is not None and pmodel.zero.stages == (1, 1)
    bf16_against_autocast(pmodel, args)


def run_case(rank: int, world_size: int, case: tuple[str, Any], path: str) -> Any:
    kind, stages = case
    if kind == "dcp":
        return _dcp(stages, path)
    if kind == "autoparallelize":
        return _autoparallelized(stages)
    if kind == "autoparallelize-bf16":
        return _autoparallelized_bf16()
    if kind == "bf16":
        return _check_bf16(None, MESH, stages)  # type: ignore[arg-type]
    _, args, pmodel = _build(None, MESH, stages)
    _check_split(pmodel, stages)
    if kind == "sgd":
        got = _train(pmodel, args, "sgd", NUM_STEPS)
        _compare(f"sgd {stages}", got, _reference("sgd", NUM_STEPS), RTOL, ATOL)
        return None
    if kind == "adamw":
        got = _train(pmodel, args, "adamw", NUM_STEPS)
        _compare(f"adamw {stages}", got, _reference("adamw", NUM_STEPS), ADAM_RTOL, ADAM_ATOL)
        measured = _state_bytes(pmodel, got["opt"])
        predicted = _predicted_bytes(pmodel, stages)
        for key, value in predicted.items():
            assert abs(measured[key] - value) <= 0.1 * value, (stages, key, measured, predicted)
        _check_sharded_state(pmodel, got["opt"])
        return {"measured": measured, "predicted": predicted}
    if kind == "accumulate":
        check_accumulation(pmodel, args)
        return None
    if kind == "keep-grads":
        _keep_grads(pmodel, args, stages)
        return None
    if kind == "lamb":
        got = _train(pmodel, args, "lamb", 3)
        _compare(f"clip + lamb {stages}", got, _reference("lamb", 3), RTOL, ATOL)
        return None
    raise AssertionError(case)


CASES = (
    [(f"sgd/{s}", ("sgd", s)) for s in SGD_STAGES]
    + [(f"adamw/{s}", ("adamw", s)) for s in ((2, 3), (3, 1))]
    + [
        ("accumulate/(3, 1)", ("accumulate", (3, 1))),
        ("lamb/(2, 3)", ("lamb", (2, 3))),
        ("keep-grads/(1, 1)", ("keep-grads", (1, 1))),
        ("keep-grads/(2, 3)", ("keep-grads", (2, 3))),
        ("bf16/(3, 1)", ("bf16", (3, 1))),
        ("dcp/(3, 2)", ("dcp", (3, 2))),
        ("autoparallelize/dp=2,tp=3", ("autoparallelize", {"dp": 2, "tp": 3})),
        ("autoparallelize-bf16/ddp", ("autoparallelize-bf16", None)),
    ]
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return os.path.join(str(tmp_path_factory.mktemp("zero_stages")), "ckpt")


@pytest.fixture(scope="module")
def results(checkpoint: str) -> dict[str, Any]:
    from tests.distributed.launcher import run_cases

    return run_cases(run_case, 4, CASES, checkpoint, timeout_s=240)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("case", [name for name, _ in CASES])
def test_per_axis_stages_on_2x2(results: dict[str, Any], case: str) -> None:
    results[case].check()


@pytest.mark.distributed
@pytest.mark.slow
def test_mixed_stage_checkpoint_loads_into_one_process(
    results: dict[str, Any], checkpoint: str
) -> None:
    """One process, no process group: the (3, 2) checkpoint through torch's own API."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    from tests.distributed.test_state_dict import _equal_optim, _equal_state
    from tests.models import tiny_gpt

    saved = results["dcp/(3, 2)"].check()[0]
    model, _, _ = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    template = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(template, checkpoint_id=checkpoint)
    model.load_state_dict(template["model"])
    set_optimizer_state_dict(model, opt, template["optim"])
    _equal_state(model.state_dict(), saved["model"], "one process")
    _equal_optim(get_optimizer_state_dict(model, opt), saved["optim"], "one-process optimizer")


def test_bad_engine_stages_are_refused() -> None:
    from autopar.runtime.zero import resolve_stages

    assert resolve_stages(3, 2, [1]) == (0, 3)
    assert resolve_stages((3, 2), 2) == (3, 2)
    with pytest.raises(ValueError, match="one stage per mesh axis"):
        resolve_stages((3, 2, 1), 2)
    with pytest.raises(ValueError, match="0, 1, 2 or 3"):
        resolve_stages((3, 4), 2)
    with pytest.raises(ValueError, match="not both"):
        resolve_stages((3, 2), 2, [0])
