"""The auto plan optimizes over a superset of every recipe: never predicted slower than one that fits."""

from __future__ import annotations

import functools
import re

import pytest
import torch

import autopar
from autopar.api import plan_captured
from autopar.options import PlanOptions
from autopar.placement import Replicate, SectionShard, Shard
from autopar.planner.recipes import BASELINE_RECIPES, tp_axis
from autopar.presets import build_preset
from autopar.strategies import input_nodes

CASES = [
    ("mlp", "4", 64, 16),
    ("mlp", "2x2", 64, 16),
    ("gpt2-small-2l", "2x2", 8, 128),
    ("llama3-8b-2l", "4", 8, 128),
    ("mlp", "2x2x2", 64, 16),
    ("hf:gpt2?n_layer=2&n_embd=256&n_head=8&vocab_size=4096&n_positions=256", "2x2", 8, 128),
    (
        "hf:llama?num_hidden_layers=2&hidden_size=256&num_attention_heads=8&num_key_value_heads=4"
        "&intermediate_size=512&vocab_size=4096",
        "2x2",
        8,
        128,
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "mesh", "batch", "seq"), CASES, ids=[f"{c[0][:20]}-{c[1]}" for c in CASES]
)
def test_auto_plan_is_never_slower_than_a_recipe_that_fits(name, mesh, batch, seq):
    model, args, kwargs = build_preset(name, batch=batch, seq=seq)
    captured = autopar.capture(model, args, kwargs)
    plan = plan_captured(
        captured, autopar.Mesh.parse(mesh, device="h100"), PlanOptions(), model_name=name
    )
    assert plan.data["solver"]["status"] == "optimal"
    fitting = {k: v for k, v in plan.baselines.items() if v["fits"]}
    assert fitting, "with the default budget at least one recipe should fit these small models"
    for recipe, figures in fitting.items():
        assert plan.predicted_step_s <= figures["step_s"] * (1 + 1e-6), (
            f"auto {plan.predicted_step_s} slower than {recipe} {figures['step_s']}"
        )
    assert plan.predicted_peak_memory_bytes <= plan.data["memory_budget_bytes"]


@pytest.mark.parametrize("recipe", ["ddp", "fsdp", "megatron"])
def test_data_parallel_recipes_never_gather_the_batch(recipe):
    """Under ddp/fsdp (every axis) and megatron (the non-tp axes) every non-scalar activation
    computed from the inputs stays split on the data-parallel axes: no rank recomputes the
    samples of another (on this tiny GPT, replicating the whole batch on every rank is cheaper
    under the cost model, which is not what the recipe means)."""
    from tests.models import tiny_gpt

    model, args, kwargs = tiny_gpt()
    captured = autopar.capture(model, args, kwargs)
    mesh = autopar.Mesh.parse("2x2", device="cpu")
    plan = plan_captured(captured, mesh, PlanOptions(recipe=recipe), model_name="tiny_gpt")
    data_axes = [0, 1] if recipe != "megatron" else [0]
    from_inputs = {n.name for n in captured.gm.graph.nodes if n.name in captured.input_nodes}
    checked = 0
    for node in captured.gm.graph.nodes:
        if node.op != "call_function" or not any(
            i.name in from_inputs for i in node.all_input_nodes
        ):
            continue
        from_inputs.add(node.name)
        val = node.meta.get("val")
        strategy = plan.choices().get(node.name)
        if strategy is None or not hasattr(val, "dim") or val.dim() == 0:
            continue
        checked += 1
        assert all(not strategy.outputs[0][a].is_replicate() for a in data_axes), (
            f"{recipe}: {node.name} is replicated on a data-parallel axis"
        )
    assert checked > 20


@pytest.mark.parametrize(
    ("pair", "mesh"), [(("ddp", "fsdp"), "2x2"), (("megatron", "fsdp+tp"), "2x2")]
)
def test_recipes_that_differ_only_in_zero_share_one_solve_and_it_is_their_optimum(pair, mesh):
    """fsdp's ZeRO-3 terms are constants when every parameter's layout is fixed: its layouts
    are ddp's, and solving its own ILP finds no faster plan (the shared solve is exact)."""
    from autopar.planner.driver import Driver
    from autopar.planner.problem import build_space
    from autopar.planner.recipes import recipe_spec

    model, args, kwargs = build_preset("gpt2-small-2l", batch=8, seq=128)
    captured = autopar.capture(model, args, kwargs)
    space = build_space(captured, autopar.Mesh.parse(mesh, device="h100"), PlanOptions())
    specs = [recipe_spec(space, recipe) for recipe in pair]
    driver = Driver(space, tied=(), candidates=())
    first, second = driver.configurations.solve_many(
        [(r, s.zero, s, None) for r, s in zip(pair, specs)]
    )
    assert first.choice == second.choice
    assert first.zero != second.zero and second.evaluation.step_s != first.evaluation.step_s
    alone = driver.configurations.solve(specs[1].zero, name=pair[1], budget=None, spec=specs[1])
    assert second.evaluation.step_s == pytest.approx(alone.evaluation.step_s, rel=1e-9)
    assert second.solution.objective_s == pytest.approx(alone.solution.objective_s, rel=1e-9)


# --------------------------------------------------------------------------------------------
# Each recipe's solved plan is exactly the recipe, on every model and mesh shape the tests use.

RECIPE_MODELS = ("mlp", "tiny_gpt", "tiny_llama", "gpt2-small-2l", "llama3-8b-2l")
RECIPE_MESHES = ("2", "4", "8", "2x2", "2x4", "2x2x2")

# Megatron roles by module path (an independent statement of the recipe, not baselines.py's
# data-flow inference): column-parallel (output features, bias with them), row-parallel (input
# features, bias replicated), vocab-parallel (the vocab dim of the token embedding / LM head).
COLUMN = ("attn.qkv", "mlp.fc", "wq", "wk", "wv", "w1", "w3")
ROW = ("attn.proj", "mlp.proj", "wo", "w2")
VOCAB = ("wte", "tok_embeddings", "lm_head", "output")


@functools.cache
def _captured(name: str):
    if name in ("tiny_gpt", "tiny_llama"):
        from tests import models

        model, args, kwargs = getattr(models, name)()
    else:
        model, args, kwargs = build_preset(name, batch=8, seq=128)
    return autopar.capture(model, args, kwargs)


def _megatron_role(fqn: str) -> str | None:
    module, _, leaf = fqn.rpartition(".")
    layers = re.fullmatch(r"layers\.(\d+)", module)
    if layers:  # the MLP: layers alternate column, row
        role = "col" if int(layers.group(1)) % 2 == 0 else "row"
    else:
        role = next(
            (
                r
                for r, names in (("col", COLUMN), ("row", ROW), ("vocab", VOCAB))
                for n in names
                if module == n or module.endswith("." + n)
            ),
            None,
        )
    if role == "vocab" or (role is not None and leaf == "weight"):
        return role
    return "col" if role == "col" else None  # a column-parallel bias is split with the outputs


def _expected_param(fqn: str, shape, mesh, tp: int | None) -> tuple:
    wanted = [Replicate()] * mesh.ndim
    role = _megatron_role(fqn) if tp is not None else None
    if role is not None:
        dim = 1 if role == "row" else 0
        sections = (shape[0] // 3,) * 3
        if fqn.rpartition(".")[0].endswith("attn.qkv") and sections[0] % mesh.shape[tp] == 0:
            # The fused qkv (split into q, k, v): each section split, Megatron's per-rank order.
            wanted[tp] = SectionShard(0, sections)
        elif shape[dim] % mesh.shape[tp] == 0:  # otherwise the recipe keeps it replicated
            wanted[tp] = Shard(dim)
    return tuple(wanted)


def _check_recipe(recipe: str, solved, space, captured) -> None:
    mesh = space.mesh
    tp = tp_axis(mesh.axis_names) if recipe in ("megatron", "fsdp+tp") else None
    data_axes = [a for a in range(mesh.ndim) if a != tp and mesh.shape[a] > 1]
    chosen = {node.name: node.strategies[solved.choice[i]] for i, node in enumerate(space.nodes)}
    # Inputs: the batch split over the data axes, whole on the tensor-parallel axis.
    for name in captured.input_nodes:
        if name in chosen:
            want = tuple(Replicate() if a == tp else Shard(0) for a in range(mesh.ndim))
            assert chosen[name].outputs[0] == want, (
                f"{recipe}: input {name} {chosen[name].outputs[0]}"
            )
    # Parameters: placed as the recipe says and used where they live (a replicated bias may be
    # added once as Partial on the tensor-parallel axis only).
    values = {n.name: n.meta.get("val") for n in captured.gm.graph.nodes}
    for name, fqn in captured.param_nodes.items():
        have = chosen[name].outputs[0]
        assert have == _expected_param(fqn, values[name].shape, mesh, tp), (
            f"{recipe}: {fqn} is {have}"
        )
    state = set(captured.param_nodes) | set(captured.buffer_nodes)
    derived = set(captured.input_nodes)
    for node in captured.gm.graph.nodes:
        if node.op != "call_function" or node.name not in chosen:
            continue
        strategy = chosen[node.name]
        ins = input_nodes(node)
        for j, inp in enumerate(ins):
            if inp.name in state:
                have, need = chosen[inp.name].outputs[0], strategy.inputs[j]
                assert all(
                    h == n
                    or (
                        a == tp
                        and h.is_replicate()
                        and (n.is_partial() or inp.name in captured.buffer_nodes)
                    )
                    for a, (h, n) in enumerate(zip(have, need))
                ), f"{recipe}: {node.name} uses {inp.name} ({have}) as {need}"
        # Activations computed from the inputs keep the batch split on the data axes (the same
        # dim on each) until the loss sums it, and never split it on the tensor-parallel axis.
        if not any(inp.name in derived for inp in ins):
            continue
        derived.add(node.name)
        vals = (
            values[node.name]
            if isinstance(values[node.name], (list, tuple))
            else [values[node.name]]
        )
        for val, out in zip(vals, strategy.outputs):
            if out is None or not isinstance(val, torch.Tensor) or val.dim() == 0 or not data_axes:
                continue
            first = out[data_axes[0]]
            assert first.is_shard() and all(out[a] == first for a in data_axes), (
                f"{recipe}: {node.name} is {out} on the data axes {data_axes}"
            )
            assert tp is None or out[tp] != first, f"{recipe}: {node.name} splits the batch on tp"
    if data_axes:
        assert solved.evaluation.grad_sync_s > 0, f"{recipe}: no gradient all-reduce"
    for axis in data_axes + ([tp] if tp is not None and mesh.shape[tp] > 1 else []):
        sharded = recipe == "fsdp" or (recipe == "fsdp+tp" and axis != tp)
        assert solved.zero.stage_of(axis) == (3 if sharded else 0), f"{recipe}: ZeRO on axis {axis}"


@pytest.mark.slow
@pytest.mark.parametrize("mesh_text", RECIPE_MESHES)
@pytest.mark.parametrize("name", RECIPE_MODELS)
def test_every_recipe_solves_to_exactly_the_recipe(name, mesh_text):
    """ddp / fsdp: every parameter Replicate and used as Replicate, the batch split on every
    axis, a real gradient all-reduce; megatron / fsdp+tp: column- then row-parallel matmuls and
    vocab-parallel embedding and LM head on the tp axis, the batch split on the others; the
    fsdp variants add ZeRO-3 on their data axes."""
    from autopar.planner.driver import Driver
    from autopar.planner.problem import build_space

    captured = _captured(name)
    space = build_space(captured, autopar.Mesh.parse(mesh_text, device="h100"), PlanOptions())
    driver = Driver(space, tied=(), candidates=())
    solved = driver.recipes(BASELINE_RECIPES)
    assert not driver.notes, driver.notes  # every dim divides in these cases: no fallback
    for recipe in BASELINE_RECIPES:
        _check_recipe(recipe, solved[recipe], space, captured)


def test_ddp_on_the_mlp_prices_a_real_all_reduce():
    """Regression: ddp on ``mlp --mesh 8`` used the weights as Partial with the batch gathered
    (no gradient sync). The public entry now plans DDP: batch-split linears, replicated
    weights, and every weight's gradient all-reduced."""
    model, args, kwargs = build_preset("mlp", batch=64, seq=16)
    plan = autopar.plan(model, autopar.Mesh.parse("8", device="h100"), args, kwargs, recipe="ddp")
    assert plan.data["predicted"]["breakdown"]["grad_sync_s"] > 0
    for name, strategy in plan.choices().items():
        if name.startswith("linear"):
            assert strategy.outputs[0] == (Shard(0),) and strategy.inputs[1:] == (
                (Replicate(),),
                (Replicate(),),
            )


def test_recipe_falls_back_when_the_batch_does_not_divide_and_says_so():
    """A batch of 4 on an 8-way ddp: the axis replicates the computation, and the notes say so."""
    from autopar.planner.problem import build_space
    from autopar.planner.recipes import recipe_spec

    model, args, kwargs = build_preset("mlp", batch=4, seq=16)
    space = build_space(
        autopar.capture(model, args, kwargs), autopar.Mesh.parse("8", device="h100"), PlanOptions()
    )
    spec = recipe_spec(space, "ddp")
    assert any("does not split 8 ways" in note for note in spec.notes), spec.notes
    x = space.node("x")
    assert [x.strategies[i].outputs[0] for i in spec.allowed["x"]] == [(Replicate(),)]
