"""Split a captured model into pipeline stage graphs at a PipelinePlan's cuts.

Each stage gets a :class:`Captured` of its own (``build_space``, ``plan_captured`` and ``lower``
work on it as on a whole model), whose placeholders are, in this order:

1. the parameters its ops use (a parameter used in two stages, e.g. an embedding tied to the
   output layer, is a placeholder of both: :attr:`StageGraph.shared_params` names them);
2. the buffers it needs;
3. the activations it receives from the previous stage (positional inputs, in the order the
   previous stage returns them);
4. the model inputs it consumes (keyword inputs, under the placeholder names of the capture,
   e.g. ``idx`` in the first stage and ``targets`` in the last).

Which stage a node runs in:

* a node inside block ``k`` of ``pipeline.stack`` (its module path starts with
  ``<stack>.<k>``) runs in the stage owning block ``k``;
* a node that needs no parameter (transitively: it depends only on buffers, model inputs and
  constants, e.g. rotary tables sliced to the sequence, a causal mask) is copied into every
  stage that uses it, so nothing without a gradient crosses a stage boundary;
* any other node runs in the latest stage of its inputs (stage 0 when it has none): the
  embedding before the first block lands in stage 0, the final norm, head and loss in the last.

A value produced in stage ``p`` and used in stage ``q > p + 1`` is relayed through the stages in
between (torch.distributed.pipelining sends only from one stage to the next). The last stage
returns the model's outputs (the loss).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import torch.fx as fx
from torch.utils._pytree import tree_flatten

from autopar.capture.blocks import index_in_stack, node_path
from autopar.capture.export import Captured, graph_hash
from autopar.errors import UnsupportedModelError

if TYPE_CHECKING:  # planner/stages.py is the shared data; capture sits below the planner
    from autopar.planner.stages import PipelinePlan

__all__ = ["StageGraph", "block_indices", "split_stages"]


class StageCallSpec(NamedTuple):
    """What ``lower`` reads of an ExportedProgram's ``call_spec``."""

    in_spec: Any
    out_spec: Any


@dataclass(frozen=True, slots=True)
class StageSignature:
    """What ``lower`` reads of an ExportedProgram's ``graph_signature`` (the buffer specs)."""

    input_specs: tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class StageProgram:
    """Stands in for ``Captured.exported`` of a stage: a stage graph is no ExportedProgram, but
    the lowering needs its (args, kwargs) and output specs and which buffers are persistent."""

    call_spec: StageCallSpec
    graph_signature: StageSignature


@dataclass(frozen=True, kw_only=True, slots=True)
class StageGraph:
    """One pipeline stage's graph and how it connects to its neighbours."""

    index: int
    captured: Captured
    """The stage as a captured model: ``captured.gm`` is called as
    ``(*activations, **model_inputs)`` through ``captured.exported.call_spec.in_spec``."""
    activation_inputs: tuple[str, ...]
    """Names (in the whole graph) of the values received from the previous stage, in order."""
    model_inputs: tuple[str, ...]
    """Placeholder names of the model inputs this stage consumes (passed as keyword inputs)."""
    outputs: tuple[str, ...]
    """Names of the values sent to the next stage (the last stage: the model's outputs)."""
    blocks: tuple[int, int]
    shared_params: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Parameter FQN -> every stage using it, for parameters used in more than one stage."""


def block_indices(gm: fx.GraphModule, stack: str) -> dict[str, int]:
    """Node name -> index of the block of ``stack`` it belongs to (nodes outside are absent)."""
    out: dict[str, int] = {}
    for node in gm.graph.nodes:
        index = index_in_stack(node_path(node), stack)
        if index is not None:
            out[node.name] = index
    return out


def _check_pipeline(pipeline: PipelinePlan, blocks: dict[str, int]) -> None:
    found = sorted(set(blocks.values()))
    stack = pipeline.stack
    if not found:
        raise UnsupportedModelError(
            f"cannot pipeline: the model has no stack of blocks named {stack!r} (no module "
            f"path {stack}.0, {stack}.1, ...); name the stack of repeated layers as pipeline stack"
        )
    if len(found) == 1:
        raise UnsupportedModelError(
            f"cannot pipeline: the stack {stack!r} has one block; pipeline stages are cut "
            f"between blocks, so a model needs at least 2 blocks"
        )
    if found != list(range(len(found))) or len(found) != pipeline.num_blocks:
        raise UnsupportedModelError(
            f"the pipeline plan has {pipeline.num_blocks} blocks in {stack!r} but the model has "
            f"blocks {found[0]}..{found[-1]} ({len(found)}); plan the pipeline for this model"
        )
    if pipeline.num_stages > pipeline.num_blocks:
        raise UnsupportedModelError(
            f"more pipeline stages than blocks: {pipeline.num_stages} stages for "
            f"{pipeline.num_blocks} blocks of {stack!r}; use at most {pipeline.num_blocks} stages"
        )
    for stage in pipeline.stages:
        if stage.first_fqn != f"{stack}.{stage.blocks[0]}":
            raise UnsupportedModelError(
                f"pipeline stage {stage.index} is cut at {stage.first_fqn!r}, which is not block "
                f"{stage.blocks[0]} of {stack!r} ({stack}.{stage.blocks[0]}); cut only between blocks"
            )


def _grad_free(gm: fx.GraphModule, param_nodes: dict[str, str]) -> set[str]:
    """Nodes that depend on no parameter: placeholders other than parameters, constants, and
    ops over those only (copied into every stage that uses them)."""
    free: set[str] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if node.name not in param_nodes:
                free.add(node.name)
        elif node.op == "get_attr":
            free.add(node.name)
        elif node.op == "call_function":
            if all(inp.name in free for inp in node.all_input_nodes):
                free.add(node.name)
    return free


def _assign(
    captured: Captured, pipeline: PipelinePlan, blocks: dict[str, int], free: set[str]
) -> tuple[dict[str, int], dict[str, set[int]]]:
    """(stage of every node that runs once, stages needing every grad-free node or parameter)."""
    stage_of_block = {b: s.index for s in pipeline.stages for b in range(*s.blocks)}
    last = pipeline.num_stages - 1
    stage: dict[str, int] = {}
    gm = captured.gm
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.name in free:
            continue
        producers = [stage[inp.name] for inp in node.all_input_nodes if inp.name in stage]
        earliest = max(producers, default=0)
        if node.name in blocks:
            stage[node.name] = stage_of_block[blocks[node.name]]
            if stage[node.name] < earliest:
                raise UnsupportedModelError(
                    f"cannot pipeline: {node.name} in block {blocks[node.name]} uses a value "
                    f"computed after that block; stages must run in block order"
                )
        else:
            stage[node.name] = earliest
    needed: dict[str, set[int]] = {}
    output = next(n for n in gm.graph.nodes if n.op == "output")
    for node in reversed(list(gm.graph.nodes)):
        if node.name in stage or node.op == "output":
            continue
        users: set[int] = set()
        for user in node.users:
            if user is output:
                users.add(last)
            elif user.name in stage:
                users.add(stage[user.name])
            else:
                users |= needed.get(user.name, set())
        if not users and node.name in captured.param_nodes:
            # An unused parameter still belongs to some stage's state.
            users = {stage_of_block[blocks[node.name]] if node.name in blocks else 0}
        needed[node.name] = users
    return stage, needed


def split_stages(captured: Captured, pipeline: PipelinePlan) -> tuple[StageGraph, ...]:
    """One :class:`StageGraph` per stage of ``pipeline`` (module docstring), in stage order.

    ``captured`` is usually captured at the microbatch's shapes (what each stage runs).

    Raises:
        UnsupportedModelError: no stack named ``pipeline.stack``, a stack of one block, block
            counts that differ, more stages than blocks, or a cut that is not a block boundary.
    """
    gm = captured.gm
    blocks = block_indices(gm, pipeline.stack)
    _check_pipeline(pipeline, blocks)
    free = _grad_free(gm, captured.param_nodes)
    stage, needed = _assign(captured, pipeline, blocks, free)
    num_stages = pipeline.num_stages
    output = next(n for n in gm.graph.nodes if n.op == "output")
    out_leaves = [v for v in tree_flatten(output.args[0])[0] if isinstance(v, fx.Node)]
    if any(v.name in free for v in out_leaves):
        raise UnsupportedModelError(
            "cannot pipeline: a model output does not depend on any parameter; return only "
            "values computed by the model (e.g. the loss)"
        )
    # Last stage using each once-run value (model outputs: the last stage).
    last_use = dict(stage)
    for node in gm.graph.nodes:
        for inp in node.all_input_nodes:
            if inp.name in stage:
                use = num_stages - 1 if node is output else stage.get(node.name)
                if use is None:  # a grad-free node cannot use a once-run value
                    continue
                last_use[inp.name] = max(last_use[inp.name], use)
    order = [n.name for n in gm.graph.nodes if n.name in stage]
    crossing = [[v for v in order if stage[v] <= b < last_use[v]] for b in range(num_stages - 1)]
    shared = {
        captured.param_nodes[name]: tuple(sorted(users))
        for name, users in needed.items()
        if name in captured.param_nodes and len(users) > 1
    }
    return tuple(
        _stage_graph(
            captured,
            pipeline.stages[s].index,
            pipeline.stages[s].blocks,
            stage,
            needed,
            received=crossing[s - 1] if s > 0 else [],
            sent=crossing[s] if s < num_stages - 1 else None,
            shared=shared,
        )
        for s in range(num_stages)
    )


def _stage_graph(
    captured: Captured,
    index: int,
    blocks: tuple[int, int],
    stage: dict[str, int],
    needed: dict[str, set[int]],
    *,
    received: list[str],
    sent: list[str] | None,
    shared: dict[str, tuple[int, ...]],
) -> StageGraph:
    """Stage ``index``'s graph; ``sent`` None for the last stage (it returns the model outputs)."""
    gm = captured.gm
    nodes = {n.name: n for n in gm.graph.nodes}
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}

    def placeholder(name: str) -> None:
        env[name] = graph.placeholder(name)
        env[name].meta = dict(nodes[name].meta)

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node in placeholders:
        if node.name not in captured.input_nodes and index in needed.get(node.name, ()):
            placeholder(node.name)  # parameters, then buffers, in the capture's order
    for name in received:
        placeholder(name)
    model_inputs = [
        n.name
        for n in placeholders
        if n.name in captured.input_nodes and index in needed.get(n.name, ())
    ]
    for name in model_inputs:
        placeholder(name)
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if stage.get(node.name) == index or (
            node.name not in stage and index in needed.get(node.name, ())
        ):
            env[node.name] = graph.node_copy(node, lambda n: env[n.name])
    output = next(n for n in gm.graph.nodes if n.op == "output")
    if sent is None:
        out = graph.output(fx.map_arg(output.args[0], lambda n: env[n.name]))
        out_spec = captured.exported.call_spec.out_spec
        leaves = [v for v in tree_flatten(output.args[0])[0] if isinstance(v, fx.Node)]
    else:
        leaves = [nodes[name] for name in sent]
        out = graph.output(tuple(env[name] for name in sent))
        out_spec = tree_flatten(tuple(range(len(sent))))[1]
    out.meta["val"] = tuple(leaf.meta.get("val") for leaf in leaves)
    stage_gm = fx.GraphModule(gm, graph)
    stage_gm.graph.lint()
    stage_gm.recompile()

    in_spec = tree_flatten((tuple(received), {name: name for name in model_inputs}))[1]
    param_nodes = {k: v for k, v in captured.param_nodes.items() if k in env}
    buffer_nodes = {k: v for k, v in captured.buffer_nodes.items() if k in env}
    fqns = set(param_nodes.values())
    specs = tuple(
        spec
        for spec in captured.exported.graph_signature.input_specs
        if spec.arg.name in env and spec.arg.name not in received
    )
    stage_captured = Captured(
        exported=StageProgram(StageCallSpec(in_spec, out_spec), StageSignature(specs)),  # type: ignore[arg-type]
        gm=stage_gm,
        param_nodes=param_nodes,
        buffer_nodes=buffer_nodes,
        input_nodes=[*received, *model_inputs],
        output_node=out.name,
        output_names=tuple(env[leaf.name].name for leaf in leaves),
        graph_hash=graph_hash(stage_gm),
        decomposed_ops=captured.decomposed_ops,
        num_params=sum(v.meta["val"].numel() for k, v in env.items() if k in param_nodes),
        tied_params={k: v for k, v in captured.tied_params.items() if k in fqns},
        replicated_layers=captured.replicated_layers,
    )
    return StageGraph(
        index=index,
        captured=stage_captured,
        activation_inputs=tuple(received),
        model_inputs=tuple(model_inputs),
        outputs=tuple(sent) if sent is not None else stage_captured.output_names,
        blocks=blocks,
        shared_params={k: v for k, v in shared.items() if k in fqns},
    )
