"""Lowering + ParallelModule on real gloo ranks match the single-process model.

Until the planner exists the choices come from a small deterministic chooser (below): given the
placements of the placeholders, each op takes the strategy whose required inputs best match its
producers' layouts (parameters weigh more than activations, exact matches win, ties go to the
first strategy), else the all-Replicate one. Layouts:

* ``dp``: every user input Shard(0) on every axis, parameters Replicate;
* ``tp`` (Megatron-ish): inputs Shard(0) on all but the last axis; on the last axis the first
  projection of each MLP / attention (column-parallel) has its weight (and bias) Shard(0), the
  second (row-parallel) its weight Shard(1);
* ``mixed`` (MLP): forces re-layouts so that every step kind runs (all_gather, all_reduce,
  reduce_scatter, all_to_all, slice, zero_out) and a weight is split over two axes.

For each case, on meshes (2,) and (2, 2), one spawn per mesh: the loss and every parameter
gradient (gathered to full) equal the single-process ones (fp32, rtol 1e-5, atol 1e-6), and so
do the parameters after 3 SGD steps; the full state dict round-trips; a global batch passed as
local input is refused. Hugging Face GPT-2 and LLaMA (keyword inputs) run data parallel on (2,).
Dropout masks agree between replicas and differ between batch shards.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.fx as fx

from autopar.placement import Placements, Replicate, SectionShard, Shard, replicated, section_axis
from autopar.strategies.registry import (
    Strategy,
    input_nodes,
    op_call,
    replicate_all,
    strategies_for,
)
from autopar.strategies.sections import section_strategies
from tests.distributed.reference import assert_close_named, model_loss, sgd_reference, sgd_steps

RTOL, ATOL = 1e-5, 1e-6
NUM_STEPS = 3
LR = 0.1

# Megatron roles by parameter FQN suffix (column-parallel first, row-parallel second).
_COLUMN = (
    "qkv.weight",
    "qkv.bias",
    "fc.weight",
    "fc.bias",
    "wq.weight",
    "wk.weight",
    "wv.weight",
    "w1.weight",
    "w3.weight",
    "layers.0.weight",
    "layers.0.bias",
    # Vocab-parallel embeddings and output layers (rows = vocabulary).
    "wte.weight",
    "lm_head.weight",
    "tok_embeddings.weight",
    "output.weight",
)
_ROW = ("attn.proj.weight", "mlp.proj.weight", "wo.weight", "w2.weight", "layers.1.weight")


# --------------------------------------------------------------------------------------------
# Choosers


def greedy_choices(
    captured: Any,
    mesh_shape: tuple[int, ...],
    fixed: dict[str, Placements],
    forced: dict[Any, Placements] | None = None,
    *,
    sections: bool = False,
) -> dict[str, Strategy]:
    """Placeholders as in ``fixed`` (else Replicate); each op the best-matching strategy, except
    ops in ``forced`` (op -> placements), which take the first strategy requiring those
    placements of their first input. With ``sections``, the section-sharded strategies
    (``autopar.strategies.sections``) are candidates too."""
    num_axes = len(mesh_shape)
    params = set(captured.param_nodes) | set(captured.buffer_nodes)
    choices: dict[str, Strategy] = {}
    for node in captured.gm.graph.nodes:
        if node.op == "placeholder":
            choices[node.name] = Strategy(
                outputs=(fixed.get(node.name, replicated(num_axes)),), inputs=()
            )
        elif node.op == "call_function" and forced and node.target in forced:
            strategies, _ = strategies_for(node, mesh_shape)
            choices[node.name] = next(s for s in strategies if s.inputs[0] == forced[node.target])
        elif node.op == "call_function":
            choices[node.name] = _best_strategy(node, mesh_shape, choices, params, sections)
    return choices


def _best_strategy(
    node: fx.Node,
    mesh_shape: tuple[int, ...],
    choices: dict[str, Strategy],
    params: set[str],
    sections: bool = False,
) -> Strategy:
    strategies, _ = strategies_for(node, mesh_shape)
    if sections:
        strategies = section_strategies(node, mesh_shape) + strategies
    have: list[Placements | None] = []
    for producer in input_nodes(node):
        outputs = choices[producer.name].outputs
        have.append(outputs[int(node.args[1])] if node.target is operator.getitem else outputs[0])
    weights = [10 if producer.name in params else 1 for producer in input_nodes(node)]
    best, best_score = None, 0
    for strategy in strategies:
        score = sum(
            w for w, need, got in zip(weights, strategy.inputs, have) if need is None or need == got
        )
        if score > best_score:
            best, best_score = strategy, score
    if best is not None:
        return best
    plain = [
        s
        for s in strategies
        if all(
            p is None or all(isinstance(x, Replicate) for x in p) for p in (*s.inputs, *s.outputs)
        )
    ]
    return plain[0] if plain else replicate_all(op_call(node), len(mesh_shape))


def dp_layout(captured: Any, mesh_shape: tuple[int, ...]) -> dict[str, Placements]:
    return {
        name: (Shard(0),) * len(mesh_shape)
        for name in captured.input_nodes
        if _is_tensor(captured, name)
    }


def tp_layout(captured: Any, mesh_shape: tuple[int, ...]) -> dict[str, Placements]:
    outer: Placements = (Shard(0),) * (len(mesh_shape) - 1)
    fixed = {
        name: outer + (Replicate(),) for name in captured.input_nodes if _is_tensor(captured, name)
    }
    for name, fqn in captured.param_nodes.items():
        if fqn.endswith(_COLUMN):
            fixed[name] = (Replicate(),) * (len(mesh_shape) - 1) + (Shard(0),)
        elif fqn.endswith(_ROW):
            fixed[name] = (Replicate(),) * (len(mesh_shape) - 1) + (Shard(1),)
    return fixed


def tp_sections_layout(captured: Any, mesh_shape: tuple[int, ...]) -> dict[str, Placements]:
    """``tp_layout`` with the fused qkv weight and bias section-sharded on the last axis (q, k
    and v each split over it: Megatron's per-rank order), so attention runs on local heads."""
    fixed = tp_layout(captured, mesh_shape)
    for name, fqn in captured.param_nodes.items():
        if fqn.endswith(("qkv.weight", "qkv.bias")):
            rows = captured.gm.graph.find_nodes(op="placeholder", target=name)[0].meta["val"]
            width = rows.shape[0] // 3
            sections = SectionShard(0, (width, width, width))
            fixed[name] = (Replicate(),) * (len(mesh_shape) - 1) + (sections,)
    return fixed


def mixed_layout(
    captured: Any, mesh_shape: tuple[int, ...]
) -> tuple[dict[str, Placements], dict[Any, Placements]]:
    """MLP only: batch-sharded input, hidden layer re-split on its feature dim (all_to_all,
    slice), second weight split on dim 1 over every axis (Partial output, zero_out bias) and the
    loss inputs re-split on the batch (reduce_scatter)."""
    num_axes = len(mesh_shape)
    fixed = dp_layout(captured, mesh_shape)
    second = next(name for name, fqn in captured.param_nodes.items() if fqn == "layers.1.weight")
    fixed[second] = (Shard(1),) * num_axes
    forced = {
        torch.ops.aten.gelu.default: (Shard(1),) * num_axes,
        torch.ops.aten.broadcast_tensors.default: (Shard(0),) * num_axes,
    }
    return fixed, forced


def _is_tensor(captured: Any, name: str) -> bool:
    node = next(n for n in captured.gm.graph.nodes if n.name == name)
    return isinstance(node.meta.get("val"), torch.Tensor)


# --------------------------------------------------------------------------------------------
# One case on one rank


def _reference(build: Callable[[], Any]) -> dict[str, Any]:
    model, args, kwargs = build()
    return sgd_reference(model, args, kwargs, lr=LR, steps=NUM_STEPS)


_loss = model_loss


def _close(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert_close_named(what, got, want, rtol=RTOL, atol=ATOL)


def check_case(
    build: Callable[[], Any],
    choose: Callable[[Any, tuple[int, ...]], dict[str, Strategy]],
    mesh_shape: tuple[int, ...],
    groups: Any,
    *,
    grad_bucket_bytes: int,
) -> None:
    """Loss, gradients, 3 SGD steps and state dict round trip vs the single-process model."""
    from autopar.capture.export import capture
    from autopar.lowering import lower
    from autopar.runtime.module import ParallelModule, gather_full

    want = _reference(build)
    model, args, kwargs = build()
    captured = capture(model, args, kwargs)
    lowered = lower(captured, choose(captured, mesh_shape), mesh_shape, groups.key)
    pmodel = ParallelModule(lowered, model, groups, grad_bucket_bytes=grad_bucket_bytes)
    if lowered.param_grad_reduce_axes and grad_bucket_bytes < 2**20:
        assert pmodel.grad_reducer.num_buckets > 1
    assert [n for n, _ in pmodel.named_parameters()] == [n for n, _ in model.named_parameters()]

    local = pmodel.shard_inputs(*args, **kwargs)
    local_args, local_kwargs = local if kwargs else (local, {})
    if any(a.shape != b.shape for a, b in zip(args, local_args)):
        with pytest.raises(ValueError, match="local shape"):
            pmodel(*args, **kwargs)
    loss = _loss(pmodel(*local_args, **local_kwargs))
    _close("loss", loss.detach(), want["loss"])
    loss.backward()
    for name, param in pmodel.named_parameters():
        grad = gather_full(param.grad, lowered.param_placements[name], groups.groups.__getitem__)
        _close(f"grad of {name}", grad, want["grads"][name])

    # Gradient accumulation: two half-weighted micro-batches, the first under no_sync().
    grads = {name: param.grad.clone() for name, param in pmodel.named_parameters()}
    pmodel.zero_grad()
    with pmodel.no_sync():
        (0.5 * _loss(pmodel(*local_args, **local_kwargs))).backward()
    (0.5 * _loss(pmodel(*local_args, **local_kwargs))).backward()
    for name, param in pmodel.named_parameters():
        _close(f"accumulated grad of {name}", param.grad, grads[name])

    sgd_steps(pmodel, local_args, local_kwargs, lr=LR, steps=NUM_STEPS)
    state = pmodel.state_dict()
    assert list(state) == list(want["state"]), (list(state), list(want["state"]))
    for name, value in want["state"].items():
        _close(f"{name} after {NUM_STEPS} SGD steps", state[name], value)

    # Round trip: a fresh ParallelModule from a full state dict, then load the trained one.
    fresh = ParallelModule(lowered, build()[0].state_dict() | _non_persistent(model), groups)
    fresh.load_state_dict(want["state"])
    for name, value in fresh.state_dict().items():
        _close(f"{name} after load_state_dict", value, want["state"][name])
    if any(section_axis(p) is not None for p in lowered.param_placements.values()):
        check_from_state_source(lowered, build, groups, want["state"] | _non_persistent(model))
        check_sharded_checkpoint(pmodel, fresh, local_args, local_kwargs)


def check_from_state_source(
    lowered: Any, build: Any, groups: Any, state: dict, **zero: Any
) -> None:
    """A module built on the meta device reads its blocks (section-sharded ones included) from
    a StateSource of the full tensors."""
    from autopar.runtime.module import ParallelModule
    from autopar.runtime.state import StateSource

    with torch.device("meta"):
        meta_model = build()[0]
    source = StateSource(state)
    pmodel = ParallelModule(lowered, meta_model, groups, state_source=source, **zero)
    for name, value in pmodel.state_dict().items():
        _close(f"{name} read from a StateSource", value, state[name])


def check_sections_under_zero3(mesh_shape: tuple[int, ...], groups: Any) -> None:
    """The section-sharded GPT with ZeRO-3 on axis 0 (fsdp+tp's shape on 2x2): 3 SGD steps
    match one process, and the sharded checkpoint round trip holds."""
    from autopar.capture.export import capture
    from autopar.lowering import lower
    from autopar.runtime.module import ParallelModule
    from tests.models import tiny_gpt

    want = _reference(tiny_gpt)
    model, args, kwargs = tiny_gpt()
    captured = capture(model, args, kwargs)
    lowered = lower(captured, _chooser("tp_sections")(captured, mesh_shape), mesh_shape, groups.key)

    def build(source: Any) -> Any:
        return ParallelModule(
            lowered, source, groups, zero_stage=3, zero_axes=(0,), chunk_bytes=8192
        )

    pmodel = build(model)
    qkv = dict(pmodel.named_parameters())["blocks.0.attn.qkv.weight"]
    assert pmodel.zero.manages(qkv) and pmodel.zero.zero_axes_of(qkv) == (0,)
    local = pmodel.shard_inputs(*args)
    _loss(pmodel(*local)).backward()
    sgd_steps(pmodel, local, {}, lr=LR, steps=NUM_STEPS)
    for name, value in pmodel.state_dict().items():
        _close(f"{name} after {NUM_STEPS} SGD steps (ZeRO-3)", value, want["state"][name])
    check_sharded_checkpoint(pmodel, build(tiny_gpt()[0]), local, {})
    state = pmodel.state_dict() | _non_persistent(model)
    check_from_state_source(
        lowered, tiny_gpt, groups, state, zero_stage=3, zero_axes=(0,), chunk_bytes=8192
    )


def check_sharded_checkpoint(pmodel: Any, fresh: Any, args: Any, kwargs: dict) -> None:
    """``state_dict(sharded=True)`` and the sharded AdamW state through ``dcp.save`` /
    ``dcp.load`` into another module give back every tensor (section-sharded ones included)."""
    import tempfile

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from autopar.optim import load_sharded_optim_state_dict, sharded_optim_state_dict

    opt = torch.optim.AdamW(pmodel.parameters(), lr=LR)
    _loss(pmodel(*args, **kwargs)).backward()
    opt.step()
    path = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    saved = {
        "model": pmodel.state_dict(sharded=True),
        "optim": sharded_optim_state_dict(pmodel, opt),
    }
    dcp.save(saved, checkpoint_id=path[0])
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=LR)
    loaded = {
        "model": fresh.state_dict(sharded=True),
        "optim": sharded_optim_state_dict(fresh, fresh_opt),
    }
    dcp.load(loaded, checkpoint_id=path[0])
    fresh.load_state_dict(loaded["model"])
    load_sharded_optim_state_dict(fresh, fresh_opt, loaded["optim"])
    want = pmodel.state_dict()
    for name, value in fresh.state_dict().items():
        _close(f"{name} after dcp.load", value, want[name])
    # Into plain full tensors: the checkpoint holds each tensor in its original order.
    plain = {"model": {name: torch.zeros_like(value) for name, value in want.items()}}
    dcp.load(plain, checkpoint_id=path[0])
    for name, value in plain["model"].items():
        _close(f"{name} loaded whole", value, want[name])
    fresh_params = dict(fresh.named_parameters())
    for name, param in pmodel.named_parameters():
        for key, value in opt.state[param].items():
            if torch.is_tensor(value) and value.shape == param.shape:
                _close(
                    f"AdamW {key} of {name} after dcp.load",
                    fresh_opt.state[fresh_params[name]][key],
                    value,
                )


def _dp_buckets(mesh_shape: tuple[int, ...], groups: Any) -> tuple[dict, Any, Any, Any]:
    """The tiny MLP's single-process reference and its data-parallel module with 256-byte
    gradient buckets (several), its local inputs and an SGD optimizer."""
    from autopar.capture.export import capture
    from autopar.lowering import lower
    from autopar.runtime.module import ParallelModule
    from tests.models import tiny_mlp

    want = _reference(tiny_mlp)
    model, args, kwargs = tiny_mlp()
    captured = capture(model, args, kwargs)
    lowered = lower(captured, _chooser("dp")(captured, mesh_shape), mesh_shape, groups.key)
    pmodel = ParallelModule(lowered, model, groups, grad_bucket_bytes=256)
    assert pmodel.grad_reducer.num_buckets > 1
    return want, pmodel, pmodel.shard_inputs(*args), torch.optim.SGD(pmodel.parameters(), lr=LR)


def check_grad_buffers(mesh_shape: tuple[int, ...], groups: Any) -> None:
    """Data-parallel gradients are views of their bucket's flat buffer after backward (nothing
    is copied back after the all-reduce); under ``zero_grad(set_to_none=False)`` the next
    backward accumulates into those views and reduces the same buffers in place; SGD steps
    that way match the single-process model."""
    want, pmodel, local, opt = _dp_buckets(mesh_shape, groups)
    buffers = None
    for _ in range(NUM_STEPS):
        opt.zero_grad(set_to_none=False)
        _loss(pmodel(*local)).backward()
        bases = {name: p.grad._base for name, p in pmodel.named_parameters()}
        assert all(b is not None and b.dim() == 1 for b in bases.values()), bases
        now = sorted({b.data_ptr() for b in bases.values()})
        assert len(now) == pmodel.grad_reducer.num_buckets, now
        assert buffers is None or now == buffers, (now, buffers)
        buffers = now
        opt.step()
    for name, value in pmodel.state_dict().items():
        _close(f"{name} after {NUM_STEPS} SGD steps, grads kept", value, want["state"][name])


def check_grad_kept(mesh_shape: tuple[int, ...], groups: Any) -> None:
    """Under ``zero_grad()`` (set to None) each bucket's flat buffer is kept between steps and
    the next backward's gradients are copied into it; a ``.grad`` (or a view of one) that the
    caller keeps across ``zero_grad()`` is never overwritten: its bucket gets a new buffer and
    the other buckets keep theirs. SGD steps that way match the single-process model."""
    want, pmodel, local, opt = _dp_buckets(mesh_shape, groups)
    names = [name for name, _ in pmodel.named_parameters()]
    before: dict[str, int] = {}
    held: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for step in range(NUM_STEPS):
        opt.zero_grad()
        _loss(pmodel(*local)).backward()
        params = dict(pmodel.named_parameters())
        now = {name: params[name].grad._base.data_ptr() for name in names}
        assert len(set(now.values())) == pmodel.grad_reducer.num_buckets, now
        held_buffers = {before[name] for name in held}
        for name in names:
            if step > 0:
                moved = before[name] in held_buffers
                assert (now[name] != before[name]) == moved, (step, name, moved)
        for name, (tensor, value) in held.items():
            _close(f"{name}'s .grad kept from step {step - 1}", tensor, value)
        # Step 1: keep the first parameter's .grad and a view of the last one's (another
        # bucket) across zero_grad(); the next backward must leave both alone.
        held = {}
        if step == 1:
            first, last = params[names[0]].grad, params[names[-1]].grad
            assert now[names[0]] != now[names[-1]]
            held = {names[0]: (first, first.clone()), names[-1]: (last[:1], last[:1].clone())}
        before = now
        opt.step()
    for name, value in pmodel.state_dict().items():
        _close(f"{name} after {NUM_STEPS} SGD steps, buffers kept", value, want["state"][name])


def check_local_loss(mesh_shape: tuple[int, ...], groups: Any) -> None:
    """Batch-sharded outputs and a loss on the local block: DDP's convention gives the gradients
    of the global mean loss."""
    import torch.nn.functional as F

    from autopar.capture.export import capture
    from autopar.lowering import lower
    from autopar.runtime.module import ParallelModule, gather_full
    from tests.models import tiny_mlp

    model, (x, y), _ = tiny_mlp()
    F.mse_loss(model(x), y).backward()
    want = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    captured = capture(model, (x,))
    sharded = (Shard(0),) * len(mesh_shape)
    choices = greedy_choices(captured, mesh_shape, dp_layout(captured, mesh_shape))
    lowered = lower(captured, choices, mesh_shape, groups.key, output_placements=[sharded])
    pmodel = ParallelModule(lowered, model, groups)
    (local_x,) = pmodel.shard_inputs(x)
    out = pmodel(local_x)
    local_y = y.chunk(math.prod(mesh_shape))[groups.rank]
    assert out.shape == local_y.shape
    F.mse_loss(out, local_y).backward()
    for name, param in pmodel.named_parameters():
        grad = gather_full(param.grad, lowered.param_placements[name], groups.groups.__getitem__)
        _close(f"grad of {name} (local loss)", grad, want[name])


def _non_persistent(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for module_name, module in model.named_modules():
        for name in module._non_persistent_buffers_set:
            out[f"{module_name}.{name}" if module_name else name] = module._buffers[name]
    return out


def check_dropout_masks(groups: Any) -> None:
    """Replicas along an axis draw one mask; shards along a sharded axis draw different ones."""
    import torch.distributed as dist

    from autopar.lowering import autopar_dropout

    torch.manual_seed(123)
    x = torch.ones(256)
    masks = {}
    for sharded in ((), (0,)):
        y = autopar_dropout(x, 0.5, True, groups.key, sharded)
        assert set(y.unique().tolist()) <= {0.0, 2.0}
        everyone = [torch.empty_like(y) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, y)
        coords = [None] * dist.get_world_size()
        dist.all_gather_object(coords, tuple(groups.coordinate))
        masks[sharded] = dict(zip(coords, everyone))
    for mask_a in masks[()].values():
        for mask_b in masks[()].values():
            assert torch.equal(mask_a, mask_b), "replicated dropout masks differ between ranks"
    for a, mask_a in masks[(0,)].items():
        for b, mask_b in masks[(0,)].items():
            assert torch.equal(mask_a, mask_b) == (a[0] == b[0]), (a, b)


def _chooser(layout: str) -> Callable[[Any, tuple[int, ...]], dict[str, Strategy]]:
    def choose(captured: Any, mesh_shape: tuple[int, ...]) -> dict[str, Strategy]:
        if layout == "mixed":
            fixed, forced = mixed_layout(captured, mesh_shape)
            return greedy_choices(captured, mesh_shape, fixed, forced)
        if layout == "tp_sections":
            choices = greedy_choices(
                captured, mesh_shape, tp_sections_layout(captured, mesh_shape), sections=True
            )
            # Attention runs on local heads: no conversion of the section-sharded qkv output.
            assert any(
                s.outputs[0] is not None and section_axis(s.outputs[0]) is not None
                for s in choices.values()
                if s.inputs
            )
            return choices
        fixed = (dp_layout if layout == "dp" else tp_layout)(captured, mesh_shape)
        return greedy_choices(captured, mesh_shape, fixed)

    return choose


CASES = [
    "dropout",
    "mlp/grad_buffers",
    "mlp/grad_kept",
    "mlp/local_loss",
    "mlp/dp",
    "mlp/tp",
    "mlp/mixed",
    "gpt/dp",
    "gpt/tp",
    "gpt/tp_sections",
    "llama/dp",
    "llama/tp",
]
HF_CASES = ["hf_gpt2/dp", "hf_llama/dp"]
TWO_D_CASES = ["gpt/tp_sections_zero3"]
"""Cases that need a data-parallel axis next to the tensor-parallel one (2x2 only)."""
"""Hugging Face models (keyword inputs, ModelOutput results) run on the 1-D mesh only, for time."""
MESHES = {"mesh2": (2,), "mesh2x2": (2, 2)}


@functools.cache
def _groups(mesh_shape: tuple[int, ...]) -> Any:
    from autopar.comm.process_groups import axis_groups

    return axis_groups(mesh_shape, tuple(f"a{i}" for i in range(len(mesh_shape))), key="lowering")


def run_case(rank: int, world_size: int, case: str, mesh_shape: tuple[int, ...]) -> None:
    """Body of one case on one rank (raises on the first mismatch)."""
    from tests import models

    groups = _groups(mesh_shape)
    if case == "dropout":
        check_dropout_masks(groups)
        return
    if case == "mlp/grad_buffers":
        check_grad_buffers(mesh_shape, groups)
        return
    if case == "mlp/grad_kept":
        check_grad_kept(mesh_shape, groups)
        return
    if case == "mlp/local_loss":
        check_local_loss(mesh_shape, groups)
        return
    if case == "gpt/tp_sections_zero3":
        check_sections_under_zero3(mesh_shape, groups)
        return
    model_name, layout = case.split("/")
    build = {"mlp": models.tiny_mlp, "gpt": models.tiny_gpt, "llama": models.tiny_llama}.get(
        model_name
    ) or getattr(models, model_name)
    # Small buckets under data parallelism exercise several overlapped all-reduces.
    bucket_bytes = 16 * 1024 if layout == "dp" else 25 * 2**20
    check_case(build, _chooser(layout), mesh_shape, groups, grad_bucket_bytes=bucket_bytes)


@pytest.fixture(scope="module", params=list(MESHES))
def mesh_results(request: pytest.FixtureRequest) -> dict[str, Any]:
    """Every case on one mesh, in one spawn of gloo ranks."""
    from tests.distributed.launcher import run_cases

    mesh_shape = MESHES[request.param]
    world_size = math.prod(mesh_shape)
    cases = CASES + HF_CASES if len(mesh_shape) == 1 else CASES + TWO_D_CASES
    return run_cases(
        run_case,
        world_size,
        [(case, case) for case in cases],
        mesh_shape,
        timeout_s=300,
        env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"},
    )


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("case", CASES + HF_CASES + TWO_D_CASES)
def test_lowered_model_matches_single_process(mesh_results: dict[str, Any], case: str) -> None:
    if case not in mesh_results:
        pytest.skip("Hugging Face models run on the 1-D mesh only; ZeRO next to TP on 2x2")
    mesh_results[case].check()


def test_lowering_rewrites_a_copy_with_local_sizes_and_collectives() -> None:
    """One process, no process group: the structure of a data-parallel GPT on mesh (2,)."""
    from autopar.capture.export import capture
    from autopar.lowering import lower
    from tests.models import tiny_gpt

    model, args, kwargs = tiny_gpt()
    captured = capture(model, args, kwargs)
    before = captured.gm.code
    choices = greedy_choices(captured, (2,), dp_layout(captured, (2,)))
    lowered = lower(captured, choices, (2,), "mesh_test")
    assert captured.gm.code == before, "lower() must not modify the captured graph"
    code = lowered.gm.code
    assert "_assert_tensor_metadata" not in code
    assert "collectives_autopar_" in code
    assert "'mesh_test'" in code
    views = [n for n in lowered.gm.graph.nodes if n.target is torch.ops.aten.view.default]
    batch = args[0].shape[0]
    assert any(list(n.args[1])[0] == batch // 2 for n in views), "view sizes must become local"
    assert lowered.local_input_shapes[0] == (batch // 2, args[0].shape[1])
    # Data parallel: every parameter's gradient is summed over the batch axis after backward
    # (wpe's lookup of the replicated positions is added to the sharded batch: its Partial
    # gradient is carried back to it, lowering.param_chains).
    assert set(lowered.param_grad_reduce_axes) == set(lowered.param_placements)
    assert all(axes == (0,) for axes in lowered.param_grad_reduce_axes.values())


def test_lowering_refuses_absolute_split_of_a_sharded_dim() -> None:
    from autopar.capture.export import capture
    from autopar.lowering import lower
    from tests.models import tiny_gpt

    model, args, kwargs = tiny_gpt()
    captured = capture(model, args, kwargs)
    choices = greedy_choices(captured, (2,), dp_layout(captured, (2,)))
    split = next(n for n in captured.gm.graph.nodes if n.target is torch.ops.aten.split.Tensor)
    sharded = (Shard(2),)
    choices[split.name] = Strategy(
        outputs=(sharded,) * 3, inputs=(sharded,), input_grads=(sharded,)
    )
    with pytest.raises(AssertionError, match="absolute sizes along dim 2"):
        lower(captured, choices, (2,), "mesh_test")


class _SqueezeAll(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.unsqueeze(1).squeeze() * 2.0).sum()


def test_lowering_squeezes_only_globally_size_one_dims() -> None:
    """A batch of 2 split 2 ways has local size 1: squeeze() must not drop the batch dim."""
    from autopar.capture.export import capture
    from autopar.lowering import lower

    captured = capture(_SqueezeAll(), (torch.randn(2, 8),))
    choices = greedy_choices(captured, (2,), dp_layout(captured, (2,)))
    lowered = lower(captured, choices, (2,), "mesh_test")
    squeezes = [n for n in lowered.gm.graph.nodes if str(n.target).startswith("aten.squeeze")]
    assert [(n.target, n.args[1]) for n in squeezes] == [(torch.ops.aten.squeeze.dims, [1])]
