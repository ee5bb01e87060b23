"""Lowering + ParallelModule on real gloo ranks match the single-process model.

Until the planner exists the choices come from a small deterministic chooser (below): given the
placements of the placeholders, each op takes the strategy whose required inputs best match its
producers' layouts (parameters weigh more than activations, exact matches win, ties go to the
first strategy), else the all-Replicate one. Two layouts per model:

* ``dp``: every user input Shard(0) on every axis, parameters Replicate;
* ``tp`` (Megatron-ish): inputs Shard(0) on all but the last axis; on the last axis the first
  projection of each MLP / attention (column-parallel) has its weight (and bias) Shard(0), the
  second (row-parallel) its weight Shard(1).

For each case, on meshes (2,) and (2, 2): the loss and every parameter gradient (gathered to
full) equal the single-process ones (fp32, rtol 1e-5, atol 1e-6), and so do the parameters after
3 SGD steps; the full state dict round-trips.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.fx as fx

from autopar.placement import Placements, Replicate, Shard, replicated
from autopar.strategies.registry import (
    Strategy,
    input_nodes,
    op_call,
    replicate_all,
    strategies_for,
)


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
)
_ROW = ("attn.proj.weight", "mlp.proj.weight", "wo.weight", "w2.weight", "layers.1.weight")


# --------------------------------------------------------------------------------------------
# Choosers


def greedy_choices(
    captured: Any, mesh_shape: tuple[int, ...], fixed: dict[str, Placements]
) -> dict[str, Strategy]:
    """Placeholders as in ``fixed`` (else Replicate); each op the best-matching strategy."""
    num_axes = len(mesh_shape)
    params = set(captured.param_nodes) | set(captured.buffer_nodes)
    choices: dict[str, Strategy] = {}
    for node in captured.gm.graph.nodes:
        if node.op == "placeholder":
            choices[node.name] = Strategy(
                outputs=(fixed.get(node.name, replicated(num_axes)),), inputs=()
            )
        elif node.op == "call_function":
            choices[node.name] = _best_strategy(node, mesh_shape, choices, params)
    return choices


def _best_strategy(
    node: fx.Node, mesh_shape: tuple[int, ...], choices: dict[str, Strategy], params: set[str]
) -> Strategy:
    strategies, _ = strategies_for(node, mesh_shape)
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


def _is_tensor(captured: Any, name: str) -> bool:
    node = next(n for n in captured.gm.graph.nodes if n.name == name)
    return isinstance(node.meta.get("val"), torch.Tensor)


# --------------------------------------------------------------------------------------------
# One case on one rank


def _reference(build: Callable[[], Any]) -> dict[str, Any]:
    model, args, kwargs = build()
    loss = model(*args, **kwargs)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    opt.step()
    for _ in range(NUM_STEPS - 1):
        opt.zero_grad()
        model(*args, **kwargs).backward()
        opt.step()
    return {"loss": loss.detach(), "grads": grads, "state": model.state_dict()}


def _close(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def check_case(
    build: Callable[[], Any],
    layout: Callable[..., dict[str, Placements]],
    mesh_shape: tuple[int, ...],
    groups: Any,
    group_key: str,
    *,
    grad_bucket_bytes: int,
) -> None:
    from autopar.capture import capture
    from autopar.lowering import lower
    from autopar.runtime.module import ParallelModule, gather_full

    want = _reference(build)
    model, args, kwargs = build()
    captured = capture(model, args, kwargs)
    choices = greedy_choices(captured, mesh_shape, layout(captured, mesh_shape))
    lowered = lower(captured, choices, mesh_shape, group_key)
    pmodel = ParallelModule(lowered, model, groups, grad_bucket_bytes=grad_bucket_bytes)
    assert [n for n, _ in pmodel.named_parameters()] == [n for n, _ in model.named_parameters()]

    local = pmodel.shard_inputs(*args, **kwargs)
    local_args, local_kwargs = local if kwargs else (local, {})
    if any(a.shape != b.shape for a, b in zip(args, local_args)):
        with pytest.raises(ValueError, match="local shape"):
            pmodel(*args, **kwargs)
    loss = pmodel(*local_args, **local_kwargs)
    _close("loss", loss.detach(), want["loss"])
    loss.backward()
    for name, param in pmodel.named_parameters():
        grad = gather_full(param.grad, lowered.param_placements[name], groups.groups.__getitem__)
        _close(f"grad of {name}", grad, want["grads"][name])

    opt = torch.optim.SGD(pmodel.parameters(), lr=LR)
    opt.step()
    for _ in range(NUM_STEPS - 1):
        opt.zero_grad()
        pmodel(*local_args, **local_kwargs).backward()
        opt.step()
    state = pmodel.state_dict()
    assert list(state) == list(want["state"]), (list(state), list(want["state"]))
    for name, value in want["state"].items():
        _close(f"{name} after {NUM_STEPS} SGD steps", state[name], value)

    # Round trip: load the reference's full state into a fresh ParallelModule.
    fresh = ParallelModule(lowered, build()[0].state_dict() | _non_persistent(model), groups)
    fresh.load_state_dict(want["state"])
    for name, value in fresh.state_dict().items():
        _close(f"{name} after load_state_dict", value, want["state"][name])


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
    for a, mask_a in masks[()].items():
        for b, mask_b in masks[()].items():
            assert torch.equal(mask_a, mask_b), "replicated dropout masks differ between ranks"
    for a, mask_a in masks[(0,)].items():
        for b, mask_b in masks[(0,)].items():
            assert torch.equal(mask_a, mask_b) == (a[0] == b[0]), (a, b)


def _cases() -> list[tuple[str, Callable[[], Any], Callable[..., dict[str, Placements]]]]:
    from tests.models import tiny_gpt, tiny_llama, tiny_mlp

    return [
        (f"{model_name}/{layout_name}", build, layout)
        for model_name, build in (("mlp", tiny_mlp), ("gpt", tiny_gpt), ("llama", tiny_llama))
        for layout_name, layout in (("dp", dp_layout), ("tp", tp_layout))
    ]


def run_all_cases(mesh_shape: tuple[int, ...]) -> None:
    """Body of one rank: every case on this mesh (raises on the first mismatch)."""
    from autopar.runtime.process_groups import axis_groups

    torch.set_num_threads(1)
    names = tuple(f"a{i}" for i in range(len(mesh_shape)))
    groups = axis_groups(mesh_shape, names)
    check_dropout_masks(groups)
    for case_name, build, layout in _cases():
        # Small buckets for data parallelism exercise several overlapped all-reduces.
        bucket_bytes = 16 * 1024 if case_name.endswith("dp") else 25 * 2**20
        try:
            check_case(build, layout, mesh_shape, groups, groups.key, grad_bucket_bytes=bucket_bytes)
        except Exception as error:
            raise AssertionError(f"case {case_name} on mesh {mesh_shape}: {error}") from error


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=["mesh2", "mesh2x2"])
def test_lowered_models_match_single_process(mesh_shape: tuple[int, ...]) -> None:
    from tests.distributed.launcher import run_distributed

    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    world_size = 1
    for size in mesh_shape:
        world_size *= size
    run_distributed(run_all_cases, world_size, mesh_shape, timeout_s=240)


def test_lowering_rewrites_a_copy_with_local_sizes_and_collectives() -> None:
    """One process, no process group: the structure of a data-parallel GPT on mesh (2,)."""
    from autopar.capture import capture
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
    assert "collectives_all_gather(" in code and "collectives_grad_all_reduce(" not in code
    assert "'mesh_test'" in code
    views = [n for n in lowered.gm.graph.nodes if n.target is torch.ops.aten.view.default]
    batch = args[0].shape[0]
    assert any(list(n.args[1])[0] == batch // 2 for n in views), "view sizes must become local"
    assert lowered.local_input_shapes[0] == (batch // 2, args[0].shape[1])
    # Data parallel: the gradients of parameters applied to the sharded batch are summed over the
    # batch axis after backward (wpe is applied to the replicated positions: its gradient is whole).
    assert set(lowered.param_grad_reduce_axes) == set(lowered.param_placements) - {"wpe.weight"}
    assert all(axes == (0,) for axes in lowered.param_grad_reduce_axes.values())


def test_lowering_refuses_absolute_split_of_a_sharded_dim() -> None:
    from autopar.capture import capture
    from autopar.lowering import lower
    from tests.models import tiny_gpt

    model, args, kwargs = tiny_gpt()
    captured = capture(model, args, kwargs)
    choices = greedy_choices(captured, (2,), dp_layout(captured, (2,)))
    split = next(n for n in captured.gm.graph.nodes if n.target is torch.ops.aten.split.Tensor)
    sharded = (Shard(2),)
    choices[split.name] = Strategy(outputs=(sharded,) * 3, inputs=(sharded,), input_grads=(sharded,))
    with pytest.raises(AssertionError, match="absolute sizes along dim 2"):
        lower(captured, choices, (2,), "mesh_test")
