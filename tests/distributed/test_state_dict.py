"""Sharded state dicts, torch.distributed.checkpoint across meshes, meta-device loading.

Three spawns of gloo ranks plus one plain process, on the tiny GPT (tied embedding) and LLaMA:

* ``(2, 2)`` (the ``fsdp+tp`` plan: Megatron TP on ``tp``, ZeRO on ``dp``; small chunks so that
  parameters straddle chunk and shard boundaries):

  - ``layout/<stage>`` for stages 0-3, after 2 AdamW steps: ``state_dict(sharded=True)`` holds
    DTensors whose local tensors are real shards (a ZeRO-managed parameter's is its row shard,
    smaller than its tensor-parallel block) and whose ``full_tensor()`` equals the full state
    dict bit for bit; the sharded optimizer state equals ``full_optim_state_dict`` bit for bit;
    both load into a fresh module of the same stage bit for bit, and the next step agrees
    exactly; a sharded dict of another layout is refused with the DCP recipe in the message.
    ``layout-2d/3``: the same with the batch split over both axes and ZeRO-3 over both (each
    row shard nested over two mesh axes, exchanged within groups of 4).
  - ``dcp-save``: stage 3 + TP saves model and optimizer with ``dcp.save``, loads them back with
    ``dcp.load`` into a stage-1 module (bit for bit), and records the full state and the loss of
    the next step.

* ``(4,)`` (the ``fsdp`` plan, ZeRO stage 2 over 4 ranks: another plan, stage and mesh):
  ``dcp-load`` loads that checkpoint: parameters and optimizer state bit for bit, the next loss
  within fp32 tolerance (the reduction order differs). ``meta-dict``: a GPT built under
  ``torch.device("meta")`` and ``autoparallelize(..., state_dict=full_sd)`` (stage 3 over 4)
  equals the model built normally (state, loss, gradients after a step), and its parameter
  storages are its 1/4 shard. ``meta-safetensors``: a LLaMA on meta from a safetensors file;
  the file lacks the non-persistent rotary tables, so it is refused naming them; with them
  given, it equals the model built normally, and no read took a whole parameter.
  ``meta-errors``: missing and unexpected keys, shape mismatches and a meta model without
  weights are refused with the names in the message.

* One process: the 2x2 checkpoint loads into a plain ``nn.Module`` and a plain AdamW through
  ``dcp.load`` and torch's ``get/set_optimizer_state_dict`` (bit for bit; next loss within fp32
  tolerance), and through ``dcp_to_torch_save``.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any

import pytest
import torch

LR = 1e-2
CHUNK_BYTES = 8192  # several chunks in the tiny GPT: parameters straddle chunks and shards
NEXT_RTOL, NEXT_ATOL = 1e-5, 1e-6


@functools.cache
def _groups(mesh_shape: tuple[int, ...]) -> Any:
    from autopar.comm.process_groups import axis_groups

    names = ("dp",) if len(mesh_shape) == 1 else ("dp", "tp")
    return axis_groups(mesh_shape, names, key="state-test")


def _build(plan_json: str, stage: int) -> tuple[Any, Any]:
    """(global args, ParallelModule) of the tiny GPT under a plan's layouts at a ZeRO stage;
    ``plan_json="fsdp-2d"``: the batch split over both axes of (2, 2), ZeRO over both."""
    from autopar.capture.export import capture
    from autopar.lowering import lower
    from autopar.plan.document import Plan
    from autopar.runtime.module import ParallelModule
    from tests.distributed.test_lowering import dp_layout, greedy_choices
    from tests.models import tiny_gpt

    model, args, kwargs = tiny_gpt()
    captured = capture(model, args, kwargs)
    zero_axes: list[int] | None
    if plan_json == "fsdp-2d":
        mesh_shape: tuple[int, ...] = (2, 2)
        choices = greedy_choices(captured, mesh_shape, dp_layout(captured, mesh_shape))
        zero_axes = [0, 1]
    else:
        plan = Plan.from_json(plan_json)
        mesh_shape = tuple(plan.data["mesh"]["shape"])
        choices = plan.choices()
        zero_axes = [_groups(mesh_shape).axis_names.index(a) for a in plan.zero["axes"]] or None
    groups = _groups(mesh_shape)
    lowered = lower(captured, choices, mesh_shape, groups.key)
    pmodel = ParallelModule(
        lowered, model, groups, zero_stage=stage, zero_axes=zero_axes, chunk_bytes=CHUNK_BYTES
    )
    return args, pmodel


def _step(pmodel: Any, opt: torch.optim.Optimizer, args: Any) -> float:
    opt.zero_grad()
    loss = pmodel(*pmodel.shard_inputs(*args))
    loss.backward()
    opt.step()
    return float(loss.detach())


def _trained(plan_json: str, stage: int, steps: int = 2) -> tuple[Any, Any, Any]:
    args, pmodel = _build(plan_json, stage)
    opt = torch.optim.AdamW(pmodel.parameters(), lr=LR, weight_decay=0.1)
    for _ in range(steps):
        _step(pmodel, opt, args)
    return args, pmodel, opt


def _equal_state(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    assert set(got) == set(want), (what, sorted(set(got) ^ set(want)))
    for name, value in want.items():
        assert torch.equal(torch.as_tensor(got[name]), torch.as_tensor(value)), f"{what}: {name}"


def _equal_optim(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    assert set(got["state"]) == set(want["state"]), what
    for name, entries in want["state"].items():
        _equal_state(got["state"][name], entries, f"{what} {name}")
    for g, w in zip(got["param_groups"], want["param_groups"], strict=True):
        assert g["params"] == w["params"], what
        assert g["lr"] == w["lr"] and g["weight_decay"] == w["weight_decay"], what


def _full_of(sharded: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Gather a sharded dict's DTensors (a check only: the collective runs in key order)."""
    return {name: value.full_tensor() for name, value in sharded.items()}


def _dcp_template(pmodel: Any, opt: torch.optim.Optimizer) -> dict[str, Any]:
    from autopar.optim import sharded_optim_state_dict

    return {
        "model": pmodel.state_dict(sharded=True),
        "optim": sharded_optim_state_dict(pmodel, opt),
    }


def _dcp_load(pmodel: Any, opt: torch.optim.Optimizer, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    from autopar.optim import load_sharded_optim_state_dict

    template = _dcp_template(pmodel, opt)
    dcp.load(template, checkpoint_id=path)
    pmodel.load_state_dict(template["model"])
    load_sharded_optim_state_dict(pmodel, opt, template["optim"])


# ---------------------------------------------------------------------------------------------
# Cases on (2, 2)


def _check_layout(plan: str, stage: int) -> None:
    from torch.distributed.tensor import DTensor

    from autopar.optim import (
        full_optim_state_dict,
        load_sharded_optim_state_dict,
        sharded_optim_state_dict,
    )

    args, pmodel, opt = _trained(plan, stage)
    full = pmodel.state_dict()
    sharded = pmodel.state_dict(sharded=True)
    assert list(sharded) == list(full)
    own = dict(pmodel._named_state())
    for name, value in sharded.items():
        assert isinstance(value, DTensor), name
        local = value.to_local()
        if pmodel.zero is not None and pmodel.zero.manages(own[name]) and local.dim():
            # A ZeRO row shard: the tensor-parallel block split over the 2 dp ranks.
            chunk, slot = pmodel.zero.slot_of(own[name])
            shards = math.prod(pmodel.lowered.mesh_shape[a] for a in chunk.zero_axes)
            row_numel = slot.numel // slot.shape[0]
            assert local.numel() <= math.ceil(slot.shape[0] / shards) * row_numel, name
            assert local.numel() < slot.numel, f"{name}: gathered whole"
        elif name in pmodel._param_placements:
            assert local.shape == own[name].shape, name
    _equal_state(_full_of(sharded), full, f"stage {stage} sharded vs full")
    want_optim = full_optim_state_dict(pmodel, opt)
    got_optim = sharded_optim_state_dict(pmodel, opt)
    for name, entries in got_optim["state"].items():
        for key, value in entries.items():
            if isinstance(value, DTensor):
                value = value.full_tensor()
            assert torch.equal(
                torch.as_tensor(value), torch.as_tensor(want_optim["state"][name][key])
            )
    assert got_optim["param_groups"][0]["params"] == want_optim["param_groups"][0]["params"]

    _, fresh = _build(plan, stage)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    fresh.load_state_dict(sharded)
    load_sharded_optim_state_dict(fresh, fresh_opt, got_optim)
    _equal_state(fresh.state_dict(), full, f"stage {stage} reloaded")
    _equal_optim(full_optim_state_dict(fresh, fresh_opt), want_optim, f"stage {stage} optim")
    assert _step(fresh, fresh_opt, args) == _step(pmodel, opt, args)
    _equal_state(fresh.state_dict(), pmodel.state_dict(), f"stage {stage} after a step")

    if stage == 3:
        # Another layout (stage 0: no ZeRO row shards) is refused, with the DCP recipe.
        _, other = _build(plan, 0)
        with pytest.raises(ValueError, match="dcp.load"):
            other.load_state_dict(sharded)


def _dcp_save(plans: dict[str, str], path: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    from autopar.optim import full_optim_state_dict

    plan = plans["fsdp+tp"]
    args, pmodel, opt = _trained(plan, 3)
    dcp.save(_dcp_template(pmodel, opt), checkpoint_id=path)
    full = pmodel.state_dict()
    full_optim = full_optim_state_dict(pmodel, opt)
    next_loss = _step(pmodel, opt, args)
    # The same mesh, another ZeRO stage, through DCP.
    _, other = _build(plan, 1)
    other_opt = torch.optim.AdamW(other.parameters(), lr=0.5)
    _dcp_load(other, other_opt, path)
    _equal_state(other.state_dict(), full, "2x2 stage 1 from DCP")
    _equal_optim(full_optim_state_dict(other, other_opt), full_optim, "2x2 stage 1 optim")
    assert _step(other, other_opt, args) == pytest.approx(next_loss, rel=NEXT_RTOL)
    return {"model": full, "optim": full_optim, "next_loss": next_loss}


def case_2x2(rank: int, world_size: int, case: tuple[str, Any], inputs: dict[str, Any]) -> Any:
    kind, arg = case
    if kind == "layout":
        return _check_layout(inputs["plans"]["fsdp+tp"], arg)
    if kind == "layout-2d":
        return _check_layout("fsdp-2d", arg)
    if kind == "dcp-save":
        return _dcp_save(inputs["plans"], inputs["checkpoint"])
    raise AssertionError(case)


# ---------------------------------------------------------------------------------------------
# Cases on (4,)


def _dcp_load_on_4(inputs: dict[str, Any]) -> None:
    from autopar.optim import full_optim_state_dict

    saved = inputs["saved"]
    args, pmodel = _build(inputs["plans"]["fsdp4"], 2)
    assert pmodel.zero is not None and pmodel.zero.stage == 2
    opt = torch.optim.AdamW(pmodel.parameters(), lr=0.5)
    _dcp_load(pmodel, opt, inputs["checkpoint"])
    _equal_state(pmodel.state_dict(), saved["model"], "(4,) from the 2x2 checkpoint")
    _equal_optim(full_optim_state_dict(pmodel, opt), saved["optim"], "(4,) optimizer")
    loss = _step(pmodel, opt, args)
    assert loss == pytest.approx(saved["next_loss"], rel=NEXT_RTOL, abs=NEXT_ATOL)


def _param_storage_bytes(pmodel: Any) -> int:
    """Bytes of the distinct storages behind the module's parameters."""
    seen: dict[int, int] = {}
    for param in pmodel.parameters():
        storage = param.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _train_compare(pmodel: Any, normal: Any, args: Any) -> None:
    """Both modules give the same loss, state and state after one SGD step."""
    _equal_state(pmodel.state_dict(), normal.state_dict(), "materialized vs built normally")
    losses = []
    for module in (pmodel, normal):
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
        losses.append(_step(module, opt, args))
    assert losses[0] == losses[1]
    _equal_state(pmodel.state_dict(), normal.state_dict(), "after a step")


def _meta_dict(inputs: dict[str, Any]) -> dict[str, int]:
    import autopar
    from autopar.models import GPT
    from autopar.plan.document import Plan
    from tests.models import tiny_gpt

    ref, args, _ = tiny_gpt()
    with torch.device("meta"):
        model = GPT(ref.config)
    mesh = autopar.Mesh.from_world((4,), ("dp",))
    plan = Plan.from_json(inputs["plans"]["fsdp4"])
    pmodel = autopar.autoparallelize(model, mesh, args, plan=plan, state_dict=ref.state_dict())
    normal = autopar.autoparallelize(tiny_gpt()[0], mesh, args, plan=plan)
    assert pmodel.zero is not None and pmodel.zero.stage == 3
    assert not any(p.is_meta for p in pmodel.parameters())
    got, want = _param_storage_bytes(pmodel), _param_storage_bytes(normal)
    total = sum(p.numel() * 4 for p in ref.parameters())
    assert got == want, (got, want)
    assert got <= 1.05 * total / 4, (got, total)
    _train_compare(pmodel, normal, args)
    return {"param_bytes": got, "total_bytes": total}


def _meta_safetensors(inputs: dict[str, Any]) -> dict[str, int]:
    import autopar
    from autopar.models import Llama
    from autopar.plan.document import Plan
    from autopar.runtime.state import StateSource
    from tests.models import tiny_llama

    ref, args, _ = tiny_llama()
    with torch.device("meta"):
        model = Llama(ref.config)
    mesh = autopar.Mesh.from_world((4,), ("dp",))
    plan = Plan.from_json(inputs["plans"]["llama-fsdp4"])
    path = inputs["safetensors"]
    with pytest.raises(ValueError, match=r"rope_cos.*rope_sin|non-persistent"):
        autopar.autoparallelize(model, mesh, args, plan=plan, state_dict=path)
    source = StateSource([path, {"rope_cos": ref.rope_cos, "rope_sin": ref.rope_sin}])
    pmodel = autopar.autoparallelize(model, mesh, args, plan=plan, state_dict=source)
    normal = autopar.autoparallelize(tiny_llama()[0], mesh, args, plan=plan)
    assert torch.equal(pmodel.get_buffer("rope_cos"), ref.rope_cos)
    total = sum(p.numel() * 4 for p in ref.parameters())
    # This rank read its quarter of the parameters (plus the partial rows at the ends of its
    # pieces and the small rotary tables), never the whole file.
    assert source.read_bytes < 0.3 * total, (source.read_bytes, total)
    shard_bytes = _param_storage_bytes(pmodel)
    assert shard_bytes == _param_storage_bytes(normal)
    assert shard_bytes <= 1.05 * total / 4, (shard_bytes, total)
    _train_compare(pmodel, normal, args)
    return {"read_bytes": source.read_bytes, "param_bytes": shard_bytes, "total_bytes": total}


def _meta_errors(inputs: dict[str, Any]) -> None:
    from autopar.capture.export import capture
    from autopar.lowering import lower
    from autopar.models import GPT
    from autopar.plan.document import Plan
    from autopar.runtime.module import ParallelModule
    from autopar.runtime.state import StateSource
    from tests.models import tiny_gpt

    ref, args, _ = tiny_gpt()
    with torch.device("meta"):
        model = GPT(ref.config)
    plan = Plan.from_json(inputs["plans"]["fsdp4"])
    groups = _groups((4,))
    lowered = lower(capture(model, args, {}), plan.choices(), (4,), groups.key)
    full = ref.state_dict()
    name = "blocks.0.attn.qkv.weight"
    assert name in full, sorted(full)

    def build(source: Any) -> Any:
        return ParallelModule(
            lowered,
            model,
            groups,
            zero_stage=3,
            state_source=None if source is None else StateSource(source),
        )

    with pytest.raises(ValueError, match=r"meta device.*state_dict="):
        build(None)
    with pytest.raises(ValueError, match=rf"missing keys \['{name}'\]"):
        build({k: v for k, v in full.items() if k != name})
    with pytest.raises(ValueError, match=r"unexpected keys \['bogus'\]"):
        build({**full, "bogus": torch.zeros(1)})
    with pytest.raises(ValueError, match=rf"{name}: \(64, 64\) in the state dict"):
        build({**full, name: torch.zeros(64, 64)})
    # A tied parameter under one of its names is enough (Hugging Face files store it once).
    tied = build({k: v for k, v in full.items() if k != "lm_head.weight"})
    assert tied.get_parameter("lm_head.weight") is tied.get_parameter("wte.weight")


def case_4(rank: int, world_size: int, case: tuple[str, Any], inputs: dict[str, Any]) -> Any:
    kind, _ = case
    if kind == "dcp-load":
        return _dcp_load_on_4(inputs)
    if kind == "meta-dict":
        return _meta_dict(inputs)
    if kind == "meta-safetensors":
        return _meta_safetensors(inputs)
    if kind == "meta-errors":
        return _meta_errors(inputs)
    raise AssertionError(case)


# ---------------------------------------------------------------------------------------------
# Parent


CASES_2X2 = [(f"layout/{s}", ("layout", s)) for s in (0, 1, 2, 3)] + [
    ("layout-2d/3", ("layout-2d", 3)),
    ("dcp-save", ("dcp-save", None)),
]
CASES_4 = [
    ("dcp-load", ("dcp-load", None)),
    ("meta-dict", ("meta-dict", None)),
    ("meta-safetensors", ("meta-safetensors", None)),
    ("meta-errors", ("meta-errors", None)),
]


@functools.cache
def _plans() -> dict[str, str]:
    import autopar
    from tests.models import tiny_gpt, tiny_llama

    gpt, args, _ = tiny_gpt()
    llama, llama_args, _ = tiny_llama()
    mesh2x2 = autopar.Mesh.spec((2, 2), ("dp", "tp"))
    mesh4 = autopar.Mesh.spec((4,), ("dp",))
    return {
        "fsdp+tp": autopar.plan(gpt, mesh2x2, args, recipe="fsdp+tp").to_json(),
        "fsdp4": autopar.plan(gpt, mesh4, args, recipe="fsdp").to_json(),
        "llama-fsdp4": autopar.plan(llama, mesh4, llama_args, recipe="fsdp").to_json(),
    }


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("state_dict"))


@pytest.fixture(scope="module")
def results_2x2(workdir: str) -> dict[str, Any]:
    from tests.distributed.launcher import run_cases

    inputs = {"plans": _plans(), "checkpoint": os.path.join(workdir, "ckpt")}
    return run_cases(case_2x2, 4, CASES_2X2, inputs, timeout_s=240)


@pytest.fixture(scope="module")
def results_4(workdir: str, results_2x2: dict[str, Any]) -> dict[str, Any]:
    from safetensors.torch import save_file

    from tests.distributed.launcher import run_cases
    from tests.models import tiny_llama

    path = os.path.join(workdir, "llama.safetensors")
    save_file(tiny_llama()[0].state_dict(), path)
    inputs = {
        "plans": _plans(),
        "checkpoint": os.path.join(workdir, "ckpt"),
        "saved": results_2x2["dcp-save"].check()[0],
        "safetensors": path,
    }
    return run_cases(case_4, 4, CASES_4, inputs, timeout_s=240)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("case", [name for name, _ in CASES_2X2])
def test_sharded_state_on_2x2(results_2x2: dict[str, Any], case: str) -> None:
    results_2x2[case].check()


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("case", [name for name, _ in CASES_4])
def test_checkpoint_and_meta_loading_on_4(results_4: dict[str, Any], case: str) -> None:
    results_4[case].check()


@pytest.mark.distributed
@pytest.mark.slow
def test_2x2_checkpoint_loads_into_a_plain_module(
    results_2x2: dict[str, Any], workdir: str
) -> None:
    """One process, no process group: torch's own state-dict API loads the DCP checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    from tests.models import tiny_gpt

    saved = results_2x2["dcp-save"].check()[0]
    path = os.path.join(workdir, "ckpt")
    model, args, _ = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    template = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(template, checkpoint_id=path)
    model.load_state_dict(template["model"])
    set_optimizer_state_dict(model, opt, template["optim"])
    _equal_state(model.state_dict(), saved["model"], "one process")
    _equal_optim(get_optimizer_state_dict(model, opt), saved["optim"], "one-process optimizer")
    opt.zero_grad()
    loss = model(*args)
    loss.backward()
    opt.step()
    assert float(loss.detach()) == pytest.approx(saved["next_loss"], rel=NEXT_RTOL, abs=NEXT_ATOL)

    torch_file = os.path.join(workdir, "ckpt.pt")
    dcp_to_torch_save(path, torch_file)
    whole = torch.load(torch_file, weights_only=False)
    _equal_state(whole["model"], saved["model"], "dcp_to_torch_save")


# ---------------------------------------------------------------------------------------------
# One process: geometry and the lazy reader


def test_row_split_is_nested_torch_chunk() -> None:
    """The ZeRO row shards are DTensor's uneven Shard(0) nested over the ZeRO axes."""
    from autopar.runtime.state import _nested_rows

    for rows in range(0, 13):
        for sizes in ((2,), (3,), (2, 2), (4, 2)):
            for flat in range(math.prod(sizes)):
                coords, rest = [], flat
                for size in reversed(sizes):
                    coords.insert(0, rest % size)
                    rest //= size
                piece = torch.arange(rows)
                for size, coord in zip(sizes, coords):
                    parts = torch.chunk(piece, size)
                    piece = parts[coord] if coord < len(parts) else piece[:0]
                start, stop = _nested_rows(rows, zip(sizes, coords))
                assert piece.tolist() == list(range(start, stop)), (rows, sizes, coords)


def test_state_source_reads_only_the_requested_block(tmp_path: Any) -> None:
    """A safetensors file and a dict give the same blocks and flat ranges; the file reads only
    the rows that cover them; blocks are the regions local_block cuts."""
    from safetensors.torch import save_file
    from torch.distributed.tensor import Replicate, Shard

    from autopar.runtime.module import local_block
    from autopar.runtime.state import StateSource, block_index

    full = {"w": torch.randn(8, 6), "b": torch.randn(6), "s": torch.tensor(3.0)}
    path = str(tmp_path / "t.safetensors")
    save_file(full, path)
    mesh_shape = (2, 3)
    for placements in ((Shard(0), Shard(1)), (Replicate(), Shard(1)), (Shard(1), Shard(0))):
        if any(
            isinstance(p, Shard) and full["w"].shape[p.dim] % mesh_shape[a]
            for a, p in enumerate(placements)
        ):
            continue
        for coords in ((0, 0), (1, 2)):
            index = block_index(full["w"].shape, placements, mesh_shape, coords)
            want = local_block(full["w"], placements, mesh_shape, coords)
            for sources in (path, full):
                source = StateSource(sources)
                assert torch.equal(source.read("w", index), want)
                flat = want.reshape(-1)
                for lo, hi in ((0, flat.numel()), (1, 4), (3, 3), (flat.numel() - 1, flat.numel())):
                    assert torch.equal(source.read_flat("w", index, lo, hi), flat[lo:hi])
    source = StateSource([path, {"extra": torch.ones(2)}])
    assert torch.equal(source.read_flat("s", (), 0, 1), full["s"].reshape(1))
    assert set(source.keys()) == {"w", "b", "s", "extra"} and source.shape("w") == (8, 6)
    before = source.read_bytes
    source.read_flat("w", (slice(0, 8), slice(0, 6)), 13, 14)  # one element: its row only
    assert source.read_bytes - before == 6 * 4
