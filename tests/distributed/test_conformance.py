"""Strategy conformance on real gloo ranks: every strategy of every op the zoo uses.

For each sample call of ``tests/op_samples.py`` and each strategy ``strategies_for`` returns for
it on a (2,) and a (2, 2) mesh (one spawn per mesh, one test case per sample), every rank:

1. builds the full inputs from the same seed and cuts its local inputs per the strategy's input
   placements (``resharding.simulator.shard_full``: Shard -> its chunk in mesh-axis order,
   Replicate -> the full tensor, Partial -> small-integer summands that add up to the full
   tensor);
2. runs the op on them as the lowered graph would: a one-op fx graph rewritten by the
   lowering's own ``rewrite_local_ops`` (local view sizes, vocab-parallel embedding, squeeze,
   sliced arange, rank-aware dropout);
3. gathers each output to Replicate with the runtime's collectives (the forward steps of
   ``reshard_steps``) and compares it with the op on the full inputs;
4. runs backward from a replicated upstream gradient, cut per the gradient placement of each
   output (a Partial output's gradient is Replicate), gathers each input's local gradient to
   Replicate per ``strategy.input_grads`` (Partial -> all-reduce) and compares it with the
   full gradient.

A rank whose local op raises tells the others through one all-reduced flag before any
collective, so a failing strategy is reported (with its layout) and the run stays in step.
float64 throughout; tolerances rtol 1e-7, atol 1e-9.
"""

from __future__ import annotations

import functools
import math
import traceback
from typing import Any

import pytest
import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_unflatten

from tests.op_samples import OpSample, build_samples, sample_ops

RTOL, ATOL = 1e-7, 1e-9
MESHES = {"mesh2": (2,), "mesh2x2": (2, 2)}
GROUP_KEY = "conformance"
SAMPLE_NAMES = [sample.name for sample in build_samples()]


def one_op_graph(sample: OpSample) -> tuple[fx.Graph, fx.Node, list[torch.Tensor]]:
    """A graph ``placeholders -> op -> output`` with the full values as ``meta["val"]``.

    Placeholders follow the flatten order of ``(args, kwargs)``, the order ``Strategy.inputs``
    uses; returns the graph, the op node and the full input tensors in that order.
    """
    graph = fx.Graph()
    leaves, spec = tree_flatten((sample.args, sample.kwargs))
    tensors: list[torch.Tensor] = []
    new_leaves: list[Any] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            placeholder = graph.placeholder(f"in{len(tensors)}")
            placeholder.meta["val"] = leaf
            tensors.append(leaf)
            new_leaves.append(placeholder)
        else:
            new_leaves.append(leaf)
    args, kwargs = tree_unflatten(new_leaves, spec)
    node = graph.call_function(sample.op, tuple(args), dict(kwargs))
    node.meta["val"] = sample.op(*sample.args, **sample.kwargs)
    graph.output(node)
    return graph, node, tensors


def _as_tuple(value: Any) -> tuple[Any, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _is_float(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype.is_floating_point


def _run_graph(graph: fx.Graph, inputs: list[torch.Tensor]) -> tuple[Any, ...]:
    """Evaluate a (rewritten) graph node by node, as its generated code would."""
    env: dict[fx.Node, Any] = {}
    placeholders = iter(inputs)
    for node in graph.nodes:
        if node.op == "placeholder":
            env[node] = next(placeholders)
        elif node.op == "call_function":
            args = fx.node.map_arg(node.args, env.__getitem__)
            kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
            env[node] = node.target(*args, **kwargs)
        elif node.op == "output":
            return _as_tuple(fx.node.map_arg(node.args[0], env.__getitem__))
    raise AssertionError("graph without output")


def _local_op(
    graph: fx.Graph, strategy: Any, mesh_shape: tuple[int, ...], inputs: list[torch.Tensor]
) -> tuple[Any, ...]:
    """The op on local inputs after the lowering's local rewrite (on a copy of the graph)."""
    from autopar.lowering.local_ops import rewrite_local_ops, shape_of
    from autopar.strategies.registry import input_nodes

    copy = fx.Graph()
    val_map: dict[fx.Node, fx.Node] = {}
    copy.output(copy.graph_copy(graph, val_map))
    node = next(n for n in copy.nodes if n.op == "call_function")
    first = input_nodes(node)
    first_shape = {node: shape_of(first[0])} if first else {}
    rewrite_local_ops(copy, {node: strategy}, first_shape, mesh_shape, GROUP_KEY)
    return _run_graph(copy, inputs)


def _to_replicate(local: torch.Tensor, placements: Any, shape: tuple[int, ...], groups: Any) -> Any:
    from autopar.comm.collectives import run_steps
    from autopar.placement import replicated
    from autopar.resharding.steps import reshard_steps

    fwd, _ = reshard_steps(
        placements, replicated(len(placements)), shape, local.dtype.itemsize, groups.mesh_shape
    )
    return run_steps(local.detach().contiguous(), fwd, groups)


def _full_reference(
    sample: OpSample, tensors: list[torch.Tensor], seed: int
) -> tuple[tuple[Any, ...], tuple[Any, ...], list[torch.Tensor | None]]:
    """(full outputs, upstream gradients, full input gradients) of the unsharded op."""
    leaves, spec = tree_flatten((sample.args, sample.kwargs))
    full_inputs = [t.detach().clone().requires_grad_(_is_float(t)) for t in tensors]
    it = iter(full_inputs)
    fed = [next(it) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
    args, kwargs = tree_unflatten(fed, spec)
    outputs = _as_tuple(sample.op(*args, **kwargs))
    gen = torch.Generator().manual_seed(seed)
    upstream = tuple(
        torch.randn(o.shape, generator=gen, dtype=o.dtype)
        if _is_float(o) and o.requires_grad
        else None
        for o in outputs
    )
    pairs = [(o, g) for o, g in zip(outputs, upstream) if g is not None]
    wanted = [t for t in full_inputs if t.requires_grad]
    grads: list[torch.Tensor | None] = [None] * len(full_inputs)
    if pairs and wanted:
        got = torch.autograd.grad(
            [o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True
        )
        it_grads = iter(got)
        for j, t in enumerate(full_inputs):
            if t.requires_grad:
                grad = next(it_grads)
                grads[j] = torch.zeros_like(t) if grad is None else grad
    return tuple(o.detach() for o in outputs), upstream, grads


def _check_strategy(
    graph: fx.Graph,
    strategy: Any,
    tensors: list[torch.Tensor],
    reference: tuple[tuple[Any, ...], tuple[Any, ...], list[torch.Tensor | None]],
    groups: Any,
    seed: int,
) -> list[str]:
    """Mismatches of one strategy on this rank (empty when it conforms)."""
    import torch.distributed as dist

    from autopar.placement import format_placements, replicated
    from autopar.resharding.simulator import shard_full
    from autopar.resharding.steps import gradient_placements

    mesh_shape = groups.mesh_shape
    coord = tuple(groups.coordinate)
    full_out, upstream, full_grads = reference
    failure = None
    try:
        local_inputs = []
        for j, (t, placements) in enumerate(zip(tensors, strategy.inputs)):
            placements = placements or replicated(len(mesh_shape))
            local = shard_full(t, placements, mesh_shape, seed=seed + j)[coord]
            local_inputs.append(local.detach().clone().requires_grad_(_is_float(t)))
        local_out = _local_op(graph, strategy, mesh_shape, local_inputs)
        pairs = []
        for o, g, placements in zip(local_out, upstream, strategy.outputs):
            if g is not None and o.requires_grad:
                pairs.append((o, shard_full(g, gradient_placements(placements), mesh_shape)[coord]))
        wanted = [t for t in local_inputs if t.requires_grad]
        local_grads: list[torch.Tensor | None] = [None] * len(local_inputs)
        if pairs and wanted:
            got = torch.autograd.grad(
                [o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True
            )
            it_grads = iter(got)
            for j, t in enumerate(local_inputs):
                if t.requires_grad:
                    grad = next(it_grads)
                    local_grads[j] = torch.zeros_like(t) if grad is None else grad
    except Exception:
        failure = traceback.format_exc(limit=-3)
    flag = torch.tensor([0 if failure is None else 1])
    dist.all_reduce(flag)
    if int(flag.item()):
        return [f"local op failed on {int(flag.item())} rank(s): {failure or '(other ranks)'}"]

    problems: list[str] = []
    for k, (o, want, placements) in enumerate(zip(local_out, full_out, strategy.outputs)):
        if placements is None:
            continue
        got = _to_replicate(o, placements, tuple(want.shape), groups)
        try:
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
        except AssertionError as exc:
            problems.append(f"output {k} ({format_placements(placements)}): {exc}")
    for j, want in enumerate(full_grads):
        grad_placements = strategy.input_grads[j] if j < len(strategy.input_grads) else None
        if want is None or grad_placements is None:
            continue
        local = local_grads[j]
        if local is None:
            local = torch.zeros(local_inputs[j].shape, dtype=want.dtype)
        got = _to_replicate(local, grad_placements, tuple(want.shape), groups)
        try:
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
        except AssertionError as exc:
            problems.append(f"grad of input {j} ({format_placements(grad_placements)}): {exc}")
    return problems


@functools.cache
def _groups(mesh_shape: tuple[int, ...]) -> Any:
    from autopar.comm.process_groups import axis_groups

    names = tuple(f"a{i}" for i in range(len(mesh_shape)))
    return axis_groups(mesh_shape, names, key=GROUP_KEY)


def run_sample(rank: int, world_size: int, name: str, mesh_shape: tuple[int, ...]) -> list[str]:
    """Every strategy of one sample on this rank; one line per non-conforming strategy."""
    import autopar.strategies  # noqa: F401  (registers every rule)
    from autopar.strategies.registry import strategies_for

    groups = _groups(mesh_shape)
    index = SAMPLE_NAMES.index(name)
    sample = build_samples()[index]
    graph, node, tensors = one_op_graph(sample)
    strategies, warning = strategies_for(node, mesh_shape)
    if warning:
        return [f"{name}: {warning}"]
    reference = _full_reference(sample, tensors, seed=1000 + index)
    failures = []
    for strategy in strategies:
        problems = _check_strategy(graph, strategy, tensors, reference, groups, seed=index)
        failures.extend(f"{strategy.describe()}: {p}" for p in problems)
    return failures


@pytest.fixture(scope="module", params=list(MESHES))
def conformance(request: pytest.FixtureRequest) -> dict[str, Any]:
    """Every sample on one mesh, in one spawn of gloo ranks."""
    from tests.distributed.launcher import run_cases

    mesh_shape = MESHES[request.param]
    return run_cases(
        run_sample,
        math.prod(mesh_shape),
        [(name, name) for name in SAMPLE_NAMES],
        mesh_shape,
        timeout_s=300,
        # Every collective of a strategy is autopar's (run_steps), and the launcher's check mode
        # (AUTOPAR_CHECK_COLLECTIVES=1) checks op, shape, dtype and order of each across ranks;
        # the only other one is the one-int failure flag, the same on every rank. gloo's
        # DETAIL wrapper would check the same a second time (each costs one latency-bound
        # round trip per collective): off here, it quartered this file's wall time (mesh (2,):
        # 3.9 s vs 23.0 s with both checks, load 11; README "Tests").
        env={"TORCH_DISTRIBUTED_DEBUG": "OFF"},
    )


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("name", SAMPLE_NAMES)
def test_every_strategy_matches_the_unsharded_op(conformance: dict[str, Any], name: str) -> None:
    failures = sorted({line for rank_lines in conformance[name].check() for line in rank_lines})
    assert not failures, f"{len(failures)} non-conforming strategies:\n" + "\n".join(failures[:10])


@pytest.mark.slow
def test_samples_cover_every_op_the_zoo_uses() -> None:
    """Each ATen op in the captured zoo models has a sample (``getitem`` only indexes tuples:
    its element keeps its producer's layout, exercised end to end by the lowering tests)."""
    import operator

    from autopar.capture.export import ASSERT_OPS, capture
    from tests.models import ALL_MODELS

    used = set()
    for build in ALL_MODELS.values():
        model, args, kwargs = build()
        for node in capture(model, args, kwargs).gm.graph.nodes:
            if node.op == "call_function" and node.target not in ASSERT_OPS:
                used.add(node.target)
    missing = used - sample_ops() - {operator.getitem}
    assert not missing, f"add samples to tests/op_samples.py for {sorted(map(str, missing))}"


def test_readme_lists_the_supported_ops() -> None:
    """README.md's "Supported ops" section is the registry's list (regenerate it with
    ``python -m tests.op_samples``)."""
    from pathlib import Path

    from tests.op_samples import supported_ops_markdown

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert supported_ops_markdown() in readme, (
        "README.md's '## Supported ops' section is out of date with the strategy registry: "
        "replace it with the output of `python -m tests.op_samples`"
    )
