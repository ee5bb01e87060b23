"""The strategy space: every node's strategies and the costs that depend on nothing global.

``build_space`` enumerates each graph node's strategies (``autopar.strategies``) and prices what
does not depend on the ZeRO configuration or a recipe: compute (roofline on local work), the
resharding of every edge, gradient all-reduces, activation and transient memory. Repeated
layers share strategy lists and cost arrays (one pricing per signature). The cost model itself
is described in :mod:`autopar.planner.problem`, which turns a space into a ``solver.Problem``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.fx as fx

from autopar.capture.export import Captured
from autopar.capture.flops import node_costs
from autopar.mesh import Mesh
from autopar.options import PlanOptions
from autopar.placement import REPLICATE, Placements, SectionShard, Shard, divides, local_shape
from autopar.planner.chain_grads import chain_roots, price_chain_grads
from autopar.planner.fused_pricing import price_fused_reductions
from autopar.planner.outputs import output_requirements as _output_requirements
from autopar.planner.outputs import tensor_value as _tensor_value
from autopar.planner.pricing import CommPricer, bucket_rounding, pair_table
from autopar.planner.saved_activations import SavedRule, saved_rules
from autopar.planner.shared_grads import price_shared_param_grads
from autopar.planner.sibling_grads import SiblingUse, sibling_uses
from autopar.planner.signatures import op_signature as _op_signature
from autopar.strategies import Strategy, input_nodes, strategies_for
from autopar.strategies.registry import TensorMeta, in_op_collectives, op_call, tensor_meta
from autopar.strategies.sections import fused_param_sections, section_strategies
from cost_models import compute_time_s, op_bytes

VIEW_FAMILIES = frozenset({"view"})


@dataclass(kw_only=True, slots=True)
class NodeSpace:
    """A decision node: one graph node, its strategies and their zero-independent costs."""

    name: str
    kind: str
    """'param', 'buffer', 'input' or 'op'."""
    strategies: list[Strategy]
    compute_s: np.ndarray
    grad_comm_s: np.ndarray
    """Activation collectives: gradient all-reduces of activations (Partial gradients of
    Replicate inputs) and collectives inside the op (a vocab-parallel cross entropy)."""
    param_grad_comm_s: np.ndarray
    """Gradient all-reduces of parameters (the data-parallel sync)."""
    output_comm_s: np.ndarray
    """Converting a model output to its required placement (forward + backward)."""
    activation_bytes: np.ndarray
    transient_bytes: np.ndarray
    fixed_bytes: np.ndarray
    """Inputs and buffers (zero-independent resident bytes)."""
    fqn: str | None = None
    local_numel: np.ndarray | None = None
    """Parameters: local element count per strategy (before ZeRO)."""
    itemsize: int = 4
    warning: str | None = None
    alias_of: str | None = None
    """For a tied parameter lifted twice: the placeholder that owns its state."""
    forward_s: np.ndarray | None = None
    """Ops: the forward part of ``compute_s`` (what recomputing the node costs again)."""


@dataclass(kw_only=True, slots=True)
class EdgeSpace:
    src: int
    dst: int
    input_index: int
    cost_s: np.ndarray
    """[src strategy, dst strategy] seconds; inf where the pair is impossible."""


@dataclass(kw_only=True, slots=True)
class StrategySpace:
    """Every node's strategies and costs on one mesh (independent of ZeRO and recipe)."""

    captured: Captured
    mesh: Mesh
    options: PlanOptions
    nodes: list[NodeSpace]
    edges: list[EdgeSpace]
    index: dict[str, int]
    warnings: list[str] = field(default_factory=list)
    build_s: float = 0.0
    signatures: dict[str, tuple] = field(default_factory=dict)
    """Node name -> what its strategies and costs depend on (op, shapes, arguments): nodes
    with equal signatures have the same strategies and cost arrays (shared objects)."""
    bucket_share_s: tuple[float, ...] = ()
    """Per mesh axis: the last gradient bucket's all-reduce latency per byte of a Partial
    parameter block (``pricing.bucket_rounding``)."""
    # grad_nodes and saved_rules of the graph, as built (the checkpoint candidates reuse them).
    shared_grad_uses: frozenset[tuple[int, int]] = frozenset()
    """(consumer, input) uses of a parameter that another op reads first: their reduction is
    priced on a pair edge (``planner.shared_grads``), their bucket share by the first use."""
    sibling_grads: tuple[tuple[SiblingUse, ...], ...] = field(default=(), repr=False)
    """Per activation read by several ops, its uses: the plan's figures charge one all-reduce
    per conversion the lowering issues (``planner.sibling_grads``)."""
    needs_grad: frozenset[str] | None = field(default=None, repr=False)
    saved: dict | None = field(default=None, repr=False)
    evaluation_cache: dict[tuple[int, ...], dict] = field(default_factory=dict, repr=False)
    """autopar.planner.problem.evaluate's ZeRO-independent sums per choice (a few, recent)."""

    def node(self, name: str) -> NodeSpace:
        return self.nodes[self.index[name]]


# --------------------------------------------------------------------------------------------
# Strategy space


def placeholder_strategies(
    meta: TensorMeta, mesh_shape: Sequence[int], sections: Sequence[tuple[int, ...]] = ()
) -> list[Strategy]:
    """Every layout of a graph input: Replicate or Shard(d) per axis, divisible ones only; and
    ``SectionShard(0, s)`` on one axis for each of ``sections`` (``fused_param_sections``)."""
    per_axis = [REPLICATE, *(Shard(d) for d in range(meta.ndim))]
    per_axis += [SectionShard(0, s) for s in sections]
    out: list[Strategy] = []
    for combo in itertools.product(*[per_axis if size > 1 else [REPLICATE] for size in mesh_shape]):
        if divides(meta.shape, combo, mesh_shape):
            out.append(Strategy(outputs=(tuple(combo),), inputs=(), input_grads=()))
    return out


def local_bytes(meta: TensorMeta | None, placements: Placements | None, mesh_shape) -> float:
    if meta is None or placements is None or not isinstance(meta, TensorMeta):
        return 0.0
    return float(math.prod(local_shape(meta.shape, placements, mesh_shape))) * meta.dtype.itemsize


def _split_factor(strategy: Strategy, mesh_shape: Sequence[int]) -> int:
    factor = 1
    for axis, size in enumerate(mesh_shape):
        placements = [p[axis] for p in (*strategy.inputs, *strategy.outputs) if p is not None]
        if any(isinstance(p, (Shard, SectionShard)) for p in placements):
            factor *= size
    return factor


def _local_input_bytes(metas, placements, mesh_shape) -> tuple[float, float]:
    """Local bytes of a node's floating inputs and of its other inputs (indices, masks)."""
    float_bytes = other_bytes = 0.0
    for meta, placement in zip(metas, placements):
        if isinstance(meta, TensorMeta) and not meta.dtype.is_floating_point:
            other_bytes += local_bytes(meta, placement, mesh_shape)
        else:
            float_bytes += local_bytes(meta, placement, mesh_shape)
    return float_bytes, other_bytes


def _dtype_name(dtype: torch.dtype, mixed_precision: str | None) -> str:
    if mixed_precision == "bf16" and dtype.is_floating_point:
        return "bfloat16"
    if mixed_precision == "fp16" and dtype.is_floating_point:
        return "float16"
    return str(dtype).removeprefix("torch.")


def grad_nodes(gm: fx.GraphModule, param_nodes: dict[str, str]) -> set[str]:
    """Names of the parameters and the ops computed from them that need a gradient."""
    needs: set[str] = set()
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder":
            if node.name in param_nodes and isinstance(val, torch.Tensor) and val.is_floating_point():
                needs.add(node.name)
        elif node.op == "call_function" and any(inp.name in needs for inp in input_nodes(node)):
            floats = [val] if isinstance(val, torch.Tensor) else list(val or ())
            if any(isinstance(v, torch.Tensor) and v.is_floating_point() for v in floats):
                needs.add(node.name)
    return needs


def build_space(captured: Captured, mesh: Mesh, options: PlanOptions) -> StrategySpace:
    """Enumerate strategies of every node and price what does not depend on ZeRO or recipe."""
    import time

    start = time.perf_counter()
    gm = captured.gm
    mesh_shape = mesh.shape
    act_itemsize = 2 if options.mixed_precision else None
    pricer = CommPricer(mesh, act_itemsize)
    needs_grad = grad_nodes(gm, captured.param_nodes)
    # What each node adds to the activations kept for backward (depends on its consumers).
    saved = saved_rules(gm.graph, needs_grad)
    nodes: list[NodeSpace] = []
    index: dict[str, int] = {}
    warnings: list[str] = []
    output_users = _output_requirements(captured, mesh, options)
    param_sections = fused_param_sections(gm)
    op_cache: dict[tuple, NodeSpace] = {}
    signatures: dict[str, tuple] = {}

    for node in gm.graph.nodes:
        if node.op not in ("placeholder", "call_function") or not _tensor_value(node):
            continue
        if node.op == "placeholder":
            meta = tensor_meta(node.meta["val"])
            kind = (
                "param"
                if node.name in captured.param_nodes
                else "buffer" if node.name in captured.buffer_nodes else "input"
            )
            # Each layer's parameters repeat (kind, shape, dtype): priced once, shared.
            sections = param_sections.get(node.name, ())
            key = ("placeholder", kind, meta, sections)
            template = op_cache.get(key)
            if template is None:
                strategies = placeholder_strategies(meta, mesh_shape, sections)
                space = _placeholder_space(node, kind, meta, strategies, mesh_shape, pricer)
                op_cache[key] = dataclasses.replace(space)
            else:
                space = dataclasses.replace(template, name=node.name)
            signatures[node.name] = key
            space.fqn = captured.param_nodes.get(node.name) or captured.buffer_nodes.get(node.name)
        else:
            # Repeated layers repeat (op, shapes, arguments): strategies and costs are priced
            # once per signature and shared (the arrays are never written in place).
            key = (*_op_signature(node, needs_grad), saved.get(node.name))
            template = op_cache.get(key)
            if template is None:
                strategies, warning = strategies_for(node, mesh_shape)
                strategies = strategies + section_strategies(node, mesh_shape)
                space = _op_space(
                    node, strategies, mesh, options, pricer, needs_grad, saved.get(node.name)
                )
                if warning is None:
                    op_cache[key] = dataclasses.replace(space)
            else:
                warning = None
                space = dataclasses.replace(template, name=node.name)
            if warning:
                warnings.append(warning)
            space.warning = warning
            signatures[node.name] = key
        for out_index, required in output_users.get(node.name, []):
            meta = tensor_meta(node.meta["val"])
            meta = meta[out_index] if isinstance(meta, list) else meta
            space.output_comm_s = space.output_comm_s + np.array(
                [pricer.reshard_s(s.outputs[out_index], required, meta) for s in space.strategies]
            )
        index[node.name] = len(nodes)
        nodes.append(space)

    edges = _edges(gm, nodes, index, pricer, signatures)
    edges.extend(_tie_edges(captured, nodes, index))
    shared_uses = price_shared_param_grads(gm, nodes, index, edges, pricer, needs_grad)
    price_chain_grads(gm, nodes, index, edges, pricer, needs_grad, captured, signatures)
    chains = chain_roots(gm, captured.param_nodes, captured.buffer_nodes)
    siblings = sibling_uses(gm, nodes, index, pricer, needs_grad, frozenset(n.name for n in chains))
    price_fused_reductions(gm, nodes, edges, pricer)
    bucket_share_s = bucket_rounding(nodes, edges, pricer, shared_uses)
    if options.accumulation > 1:  # the gradient sync, once per step, shared by its microbatches
        for ns in nodes:
            ns.param_grad_comm_s = ns.param_grad_comm_s / options.accumulation
        bucket_share_s = tuple(s / options.accumulation for s in bucket_share_s)
    return StrategySpace(
        captured=captured,
        mesh=mesh,
        options=options,
        nodes=nodes,
        edges=edges,
        index=index,
        warnings=warnings,
        build_s=time.perf_counter() - start,
        signatures=signatures,
        bucket_share_s=bucket_share_s,
        shared_grad_uses=shared_uses,
        sibling_grads=siblings,
        needs_grad=frozenset(needs_grad),
        saved=saved,
    )


def _zeros(n: int) -> np.ndarray:
    return np.zeros(n, dtype=np.float64)


def _placeholder_space(node, kind, meta, strategies, mesh_shape, pricer) -> NodeSpace:
    n = len(strategies)
    nbytes = np.array([local_bytes(meta, s.outputs[0], mesh_shape) for s in strategies])
    local_numel = nbytes / meta.dtype.itemsize
    return NodeSpace(
        name=node.name,
        kind=kind,
        strategies=strategies,
        compute_s=_zeros(n),
        grad_comm_s=_zeros(n),
        param_grad_comm_s=_zeros(n),
        output_comm_s=_zeros(n),
        activation_bytes=_zeros(n),
        transient_bytes=_zeros(n),
        fixed_bytes=_zeros(n) if kind == "param" else nbytes,
        local_numel=local_numel if kind == "param" else None,
        itemsize=meta.dtype.itemsize,
    )


def partial_axes(grad_placements: Placements, mesh_shape: Sequence[int]) -> tuple[int, ...]:
    """The mesh axes (of more than one device) on which a gradient is Partial."""
    return tuple(a for a, p in enumerate(grad_placements) if p.is_partial() and mesh_shape[a] > 1)


def activation_grad_s(
    meta: TensorMeta, placements: Placements, grad_placements: Placements, pricer: CommPricer
) -> float:
    """The whole all-reduces of an activation input's Partial gradient, one per Partial axis,
    at the activations' itemsize (what ``_op_space`` prices per consumer strategy)."""
    shape = pricer.mesh.shape
    nbytes = local_bytes(meta, placements, shape) * pricer.itemsize(meta) / meta.dtype.itemsize
    return sum(pricer.all_reduce_s(nbytes, a) for a in partial_axes(grad_placements, shape))


def _op_space(
    node, strategies, mesh, options, pricer, needs_grad, saved_rule: SavedRule | None = None
) -> NodeSpace:
    mesh_shape = mesh.shape
    work = node_costs(node)
    call = op_call(node)
    dtype = next((m.dtype for m in call.outputs if m is not None), torch.float32)
    dtype_name = _dtype_name(dtype, options.mixed_precision)
    grad = node.name in needs_grad
    inputs = input_nodes(node)
    n = len(strategies)
    compute = _zeros(n)
    grad_comm = _zeros(n)
    param_grad_comm = _zeros(n)
    activation = _zeros(n)
    transient = _zeros(n)
    forward = _zeros(n)
    is_view = work.family in VIEW_FAMILIES or work.cast_is_free(options.mixed_precision)
    # Under mixed precision activations are half precision whatever the captured dtype.
    precision_scale = pricer.itemsize(TensorMeta((), dtype)) / dtype.itemsize
    for i, strategy in enumerate(strategies):
        factor = _split_factor(strategy, mesh_shape)
        out_bytes = sum(
            local_bytes(m, p, mesh_shape) for m, p in zip(call.outputs, strategy.outputs)
        )
        float_in, other_in = _local_input_bytes(call.inputs, strategy.inputs, mesh_shape)
        if not is_view:
            fwd_bytes, bwd_bytes = op_bytes(
                work.family,
                float_input_bytes=float_in * precision_scale,
                other_input_bytes=other_in,  # indices and masks keep their dtype
                output_bytes=out_bytes * precision_scale,
            )
            compute[i] = compute_time_s(
                flops=work.fwd_flops / factor,
                bytes_accessed=fwd_bytes,
                device=mesh.device,
                dtype=dtype_name,
                family=work.family,
            )
            forward[i] = compute[i]
            if grad:
                compute[i] += compute_time_s(
                    flops=work.bwd_flops / factor,
                    bytes_accessed=bwd_bytes,
                    device=mesh.device,
                    dtype=dtype_name,
                    family=work.family,
                )
                if saved_rule is not None:
                    # autopar.planner.saved_activations: the output when some backward saves it, plus
                    # internals (layer_norm statistics, sdpa logsumexp, log_softmax, masks).
                    first_in = (
                        local_bytes(call.inputs[0], strategy.inputs[0], mesh_shape)
                        if call.inputs and strategy.inputs and strategy.inputs[0] is not None
                        else 0.0
                    )
                    # Saved inputs it owns: at ITS input layouts (a converted copy is kept).
                    owned = sum(
                        local_bytes(call.inputs[j], strategy.inputs[j], mesh_shape)
                        for j in saved_rule.inputs
                    )
                    activation[i] = (
                        (saved_rule.output * out_bytes + saved_rule.first_input * first_in + owned)
                        * precision_scale
                        * options.in_flight
                    )
            transient[i] = out_bytes * (2 if grad else 1)
        # Collectives inside the op (autopar.strategies.registry.in_op_collectives).
        for kind, axis, nbytes in in_op_collectives(call, strategy, mesh_shape):
            if mesh_shape[axis] > 1:
                grad_comm[i] += pricer.step_s(kind, axis, nbytes * precision_scale)
        # Partial gradients of Replicate inputs are all-reduced (gradient convention).
        for inp, meta, placements, grad_placements in zip(
            inputs, call.inputs, strategy.inputs, strategy.input_grads
        ):
            if grad_placements is None or inp.name not in needs_grad or placements is None:
                continue
            if inp.op != "placeholder":
                grad_comm[i] += activation_grad_s(meta, placements, grad_placements, pricer)
                continue
            nbytes = local_bytes(meta, placements, mesh_shape)
            for axis in partial_axes(grad_placements, mesh_shape):
                param_grad_comm[i] += pricer.grad_sync_s(nbytes, axis)
    return NodeSpace(
        name=node.name,
        kind="op",
        strategies=strategies,
        compute_s=compute,
        grad_comm_s=grad_comm,
        param_grad_comm_s=param_grad_comm,
        output_comm_s=_zeros(n),
        activation_bytes=activation,
        transient_bytes=transient,
        fixed_bytes=_zeros(n),
        forward_s=forward,
    )


def _edges(gm, nodes, index, pricer, signatures) -> list[EdgeSpace]:
    edges: list[EdgeSpace] = []
    cache: dict[tuple, np.ndarray] = {}
    for node in gm.graph.nodes:
        if node.name not in index:
            continue
        dst = index[node.name]
        for j, inp in enumerate(input_nodes(node)):
            if inp.name not in index:
                continue
            src = index[inp.name]
            out_index = node.args[1] if node.target is operator.getitem else 0
            meta = tensor_meta(inp.meta["val"])
            if isinstance(meta, list):
                meta = meta[out_index]
            key = (signatures[inp.name], signatures[node.name], j, out_index)
            cost = cache.get(key)
            if cost is not None:
                edges.append(EdgeSpace(src=src, dst=dst, input_index=j, cost_s=cost))
                continue
            src_strats = nodes[src].strategies
            dst_strats = nodes[dst].strategies
            # Price each distinct (source placement, required placement) pair once: strategies
            # share placements, so the matrix is a gather from a much smaller table.
            src_pls = [
                s.outputs[out_index] if out_index < len(s.outputs) else None for s in src_strats
            ]
            dst_pls = [t.inputs[j] for t in dst_strats]
            src_ids = {p: k for k, p in enumerate(dict.fromkeys(src_pls))}
            dst_ids = {p: k for k, p in enumerate(dict.fromkeys(dst_pls))}
            table = pair_table(pricer, list(src_ids), list(dst_ids), meta)
            rows = np.array([src_ids[p] for p in src_pls], dtype=np.intp)
            cols = np.array([dst_ids[p] for p in dst_pls], dtype=np.intp)
            cost = table[np.ix_(rows, cols)]
            cache[key] = cost
            edges.append(EdgeSpace(src=src, dst=dst, input_index=j, cost_s=cost))
    return edges


def _tie_edges(
    captured: Captured, nodes: list[NodeSpace], index: dict[str, int]
) -> list[EdgeSpace]:
    """Tied parameters lifted as separate placeholders (HF GPT-2's wte / lm_head) are one
    parameter: the same layout is forced by an edge allowing equal placements only, and the
    later placeholder's state is not counted again (``NodeSpace.alias_of``)."""
    by_fqn = {node.fqn: i for i, node in enumerate(nodes) if node.kind == "param"}
    edges: list[EdgeSpace] = []
    for fqn, others in captured.tied_params.items():
        if fqn not in by_fqn:
            continue
        first = by_fqn[fqn]
        for other in others:
            j = by_fqn.get(other)
            if j is None or j <= first or nodes[j].alias_of is not None:
                continue
            nodes[j].alias_of = nodes[first].name
            a, b = nodes[first].strategies, nodes[j].strategies
            cost = np.array(
                [[0.0 if sa.outputs == sb.outputs else math.inf for sb in b] for sa in a]
            )
            edges.append(EdgeSpace(src=first, dst=j, input_index=-1, cost_s=cost))
    return edges
