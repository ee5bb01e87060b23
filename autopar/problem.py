"""The bridge from the captured graph to the torch-free solver.

``build_space`` enumerates every node's strategies and prices everything that does not depend
on global knobs (compute, resharding on edges, gradient all-reduces, activation memory);
``build_problem`` adds what the ZeRO configuration and a recipe's restrictions change and emits
a ``solver.Problem``. ``evaluate`` prices a chosen assignment with the same tables, so the
figures a Plan reports are the ones the ILP optimised.

Cost model per node strategy (seconds, per device, one training step):
- compute: roofline on local work: FLOPs / (product of the sizes of the axes the op's work is
  split over: an axis where some input or output is sharded), bytes of the local inputs and
  outputs; backward priced only for nodes that need a gradient.
- gradient all-reduce: a Replicate input whose gradient is Partial on an axis (the gradient
  convention) is all-reduced over it; for parameters this is the data-parallel gradient sync.
- ZeRO (a stage per mesh axis, per parameter on the axes where it is Replicate; see
  ``ZeroConfig``): stages 1 and 2 turn the all-reduce into reduce-scatter + all-gather (same
  volume); each stage-3 axis adds one all-gather (parameters are gathered before forward and
  again before backward).
Edge cost: forward plus backward conversion steps from ``autopar.resharding``.
Memory per device: parameter, gradient and optimizer state (after ZeRO), activations saved for
backward (outputs of non-view ops that need a gradient), user inputs and buffers, plus the
largest transient (a node's output and its gradient).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.fx as fx

import solver
from autopar.capture import Captured
from autopar.flops import node_costs
from autopar.mesh import Mesh
from autopar.options import PlanOptions
from autopar.placement import REPLICATE, Placements, Shard, divides, local_shape
from autopar.resharding import placement_code, route_table
from autopar.saved_activations import SavedRule, saved_rules
from autopar.strategies import Strategy, input_nodes, strategies_for
from autopar.strategies.registry import TensorMeta, op_call, tensor_meta
from cost_models import LinkSpec, collective_time_s, compute_time_s, training_state_bytes

GRAD_BUCKET_BYTES = 25 * 2**20
"""Bucket size of the runtime's chunked gradient all-reduce (autopar.runtime.grad_sync)."""

COMM_KINDS = frozenset({"all_gather", "all_reduce", "reduce_scatter", "all_to_all"})
VIEW_FAMILIES = frozenset({"view"})


@dataclass(frozen=True, slots=True, init=False)
class ZeroConfig:
    """A ZeRO stage per mesh axis (semantics: ``autopar.runtime.zero``'s module docstring).

    ``ZeroConfig(stage=k, axes=S)`` is the uniform configuration (stage k on the axes S, 0
    elsewhere); ``ZeroConfig(stages=(2, 3))`` gives one stage per mesh axis. For a parameter
    Replicate on the axes R it shards the parameters over P = {a in R: stage 3}, the gradients
    over G = {a in R: stage >= 2} and the optimizer state over O = {a in R: stage >= 1}.
    """

    stages: tuple[int, ...]
    """Stage of each mesh axis, trailing zeros dropped (so both spellings compare equal)."""

    def __init__(
        self, *, stage: int = 0, axes: Sequence[int] = (), stages: Sequence[int] | None = None
    ) -> None:
        if stages is not None:
            if stage or axes:
                raise ValueError("give ZeroConfig either stages= or stage= with axes=, not both")
            values = [int(x) for x in stages]
        else:
            values = [0] * (max(axes) + 1 if axes else 0)
            for a in axes:
                values[a] = int(stage)
        if any(x not in (0, 1, 2, 3) for x in values) or stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stages must be 0, 1, 2 or 3, got {values or stage}")
        while values and values[-1] == 0:
            values.pop()
        object.__setattr__(self, "stages", tuple(values))

    @property
    def stage(self) -> int:
        """The largest stage of any axis."""
        return max(self.stages, default=0)

    @property
    def axes(self) -> tuple[int, ...]:
        """The axes with a stage >= 1."""
        return tuple(a for a, x in enumerate(self.stages) if x >= 1)

    @property
    def is_uniform(self) -> bool:
        """One stage on every axis that has one (the classic ZeRO stages)."""
        return len({x for x in self.stages if x}) <= 1

    def stage_of(self, axis: int) -> int:
        return self.stages[axis] if axis < len(self.stages) else 0

    def split(
        self, replicate_axes: Sequence[int]
    ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """(P, G, O) of a parameter Replicate on ``replicate_axes`` (mesh axes of size > 1)."""
        return (
            tuple(a for a in replicate_axes if self.stage_of(a) == 3),
            tuple(a for a in replicate_axes if self.stage_of(a) >= 2),
            tuple(a for a in replicate_axes if self.stage_of(a) >= 1),
        )

    def label(self, axis_names: Sequence[str]) -> str:
        """'stage 3 on dp', or 'stages dp=3,tp=2' when the axes differ."""
        if self.is_uniform:
            on = f" on {','.join(axis_names[a] for a in self.axes)}" if self.axes else ""
            return f"stage {self.stage}{on}"
        return "stages " + ",".join(
            f"{axis_names[a]}={self.stage_of(a)}" for a in range(len(axis_names))
        )

    def to_json(self, axis_names: Sequence[str]) -> dict[str, Any]:
        """``stage`` (the largest), ``axes`` (stage >= 1) and ``stages`` (per axis name)."""
        return {
            "stage": self.stage,
            "axes": [axis_names[a] for a in self.axes],
            "stages": {name: self.stage_of(a) for a, name in enumerate(axis_names)},
        }

    @classmethod
    def from_json(cls, entry: dict[str, Any], axis_names: Sequence[str]) -> ZeroConfig:
        """From a plan JSON's ``zero`` entry (``stages`` if present, else ``stage`` on ``axes``,
        as plans written before per-axis stages have it)."""
        index = {name: a for a, name in enumerate(axis_names)}
        stages = entry.get("stages")
        if stages:
            return cls(stages=[int(stages.get(name, 0)) for name in axis_names])
        return cls(stage=int(entry["stage"]), axes=tuple(index[a] for a in entry.get("axes", ())))


@dataclass(kw_only=True, slots=True)
class NodeSpace:
    """A decision node: one graph node, its strategies and their zero-independent costs."""

    name: str
    kind: str
    """'param', 'buffer', 'input' or 'op'."""
    strategies: list[Strategy]
    compute_s: np.ndarray
    grad_comm_s: np.ndarray
    """Gradient all-reduces of activations (Partial gradients of Replicate inputs)."""
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

    def node(self, name: str) -> NodeSpace:
        return self.nodes[self.index[name]]


# --------------------------------------------------------------------------------------------
# Strategy space


def _tensor_value(node: fx.Node) -> bool:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return True
    return isinstance(val, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in val)


def placeholder_strategies(meta: TensorMeta, mesh_shape: Sequence[int]) -> list[Strategy]:
    """Every layout of a graph input: Replicate or Shard(d) per axis, divisible ones only."""
    per_axis = [REPLICATE, *(Shard(d) for d in range(meta.ndim))]
    out: list[Strategy] = []
    for combo in itertools.product(*[per_axis if size > 1 else [REPLICATE] for size in mesh_shape]):
        if divides(meta.shape, combo, mesh_shape):
            out.append(Strategy(outputs=(tuple(combo),), inputs=(), input_grads=()))
    return out


def _local_bytes(meta: TensorMeta | None, placements: Placements | None, mesh_shape) -> float:
    if meta is None or placements is None or not isinstance(meta, TensorMeta):
        return 0.0
    return float(math.prod(local_shape(meta.shape, placements, mesh_shape))) * meta.dtype.itemsize


def _split_factor(strategy: Strategy, mesh_shape: Sequence[int]) -> int:
    factor = 1
    for axis, size in enumerate(mesh_shape):
        placements = [p[axis] for p in (*strategy.inputs, *strategy.outputs) if p is not None]
        if any(isinstance(p, Shard) for p in placements):
            factor *= size
    return factor


def _dtype_name(dtype: torch.dtype, mixed_precision: str | None) -> str:
    if mixed_precision == "bf16" and dtype.is_floating_point:
        return "bfloat16"
    if mixed_precision == "fp16" and dtype.is_floating_point:
        return "float16"
    return str(dtype).removeprefix("torch.")


def _without_latency(link: LinkSpec) -> LinkSpec:
    return dataclasses.replace(
        link,
        latency_s=0.0,
        collectives={kind: (0.0, beta) for kind, (_, beta) in link.collectives.items()},
    )


class CommPricer:
    """Prices resharding and all-reduces on a mesh, memoised (layers repeat)."""

    def __init__(self, mesh: Mesh, act_itemsize: int | None) -> None:
        self.mesh = mesh
        self.act_itemsize = act_itemsize
        self._reshard: dict[tuple, float] = {}
        self._num_devices = math.prod(mesh.shape)

    def itemsize(self, meta: TensorMeta) -> int:
        if self.act_itemsize is not None and meta.dtype.is_floating_point:
            return self.act_itemsize
        return meta.dtype.itemsize

    def reshard_s(self, src: Placements, dst: Placements, meta: TensorMeta) -> float:
        """Seconds of converting ``src`` to ``dst`` (forward and backward steps)."""
        if src == dst:
            return 0.0
        key = (src, dst, meta.shape, meta.dtype)
        cost = self._reshard.get(key)
        if cost is None:
            cost = self._reshard[key] = float(self.reshard_table([src], [dst], meta)[0, 0])
        return cost

    def reshard_table(
        self,
        srcs: Sequence[Placements],
        dsts: Sequence[Placements],
        meta: TensorMeta,
        *,
        forward_only: bool = False,
    ) -> np.ndarray:
        """[src, dst] seconds of converting each of ``srcs`` to each of ``dsts`` (inf where
        impossible): one route search per source serves the whole row
        (:func:`autopar.resharding.price_routes`). Routes depend on the shape only through
        gcd(dim size, devices); bytes scale with the tensor's size."""
        total_bytes = float(math.prod(meta.shape)) * self.itemsize(meta)
        pattern = tuple(math.gcd(size, self._num_devices) for size in meta.shape)
        mesh = self.mesh
        mesh_shape = tuple(mesh.shape)

        def step_s(kind: str, axis: int, fraction: float) -> float:
            nbytes = fraction * total_bytes
            return collective_time_s(kind, nbytes, mesh.shape[axis], mesh.links[axis])

        dst_codes = [placement_code(dst, pattern, mesh_shape) for dst in dsts]
        same = {dst: j for j, dst in enumerate(dsts)}
        table = np.full((len(srcs), len(dsts)), math.inf)
        for i, src in enumerate(srcs):
            index, fwd, bwd = route_table(
                placement_code(src, pattern, mesh_shape), pattern, mesh_shape, step_s
            )
            if index:
                rows = np.array([index.get(c, -1) for c in dst_codes], dtype=np.intp)
                found = rows >= 0
                cost = fwd if forward_only else fwd + bwd
                table[i, found] = cost[rows[found]]
            j = same.get(src)
            if j is not None:
                table[i, j] = 0.0
        return table

    def step_s(self, kind: str, axis: int, nbytes: float) -> float:
        return collective_time_s(kind, nbytes, self.mesh.shape[axis], self.mesh.links[axis])

    def grad_sync_s(self, nbytes: float, axis: int) -> float:
        """A parameter gradient's share of the bucketed all-reduce: its bytes at the link's
        bandwidth, plus the collective's latency once per ``GRAD_BUCKET_BYTES`` (the runtime
        reduces parameter gradients in flat buckets, not one collective per parameter)."""
        size, link = self.mesh.shape[axis], self.mesh.links[axis]
        bandwidth_only = _without_latency(link)
        transfer = collective_time_s("all_reduce", nbytes, size, bandwidth_only)
        latency = collective_time_s("all_reduce", GRAD_BUCKET_BYTES, size, link) - collective_time_s(
            "all_reduce", GRAD_BUCKET_BYTES, size, bandwidth_only
        )
        return transfer + latency * nbytes / GRAD_BUCKET_BYTES

    def all_reduce_s(self, nbytes: float, axis: int) -> float:
        return collective_time_s("all_reduce", nbytes, self.mesh.shape[axis], self.mesh.links[axis])

    def all_gather_s(self, nbytes: float, axis: int) -> float:
        return collective_time_s("all_gather", nbytes, self.mesh.shape[axis], self.mesh.links[axis])


def _needs_grad(gm: fx.GraphModule, param_nodes: dict[str, str]) -> set[str]:
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
    needs_grad = _needs_grad(gm, captured.param_nodes)
    # What each node adds to the activations kept for backward (depends on its consumers).
    saved = saved_rules(gm.graph, needs_grad)
    nodes: list[NodeSpace] = []
    index: dict[str, int] = {}
    warnings: list[str] = []
    output_users = _output_requirements(captured, mesh, options)
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
            key = ("placeholder", kind, meta)
            template = op_cache.get(key)
            if template is None:
                strategies = placeholder_strategies(meta, mesh_shape)
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
    )


def _output_requirements(
    captured: Captured, mesh: Mesh, options: PlanOptions
) -> dict[str, list[tuple[int, Placements]]]:
    """Producer name -> [(output index, required placement)] for the model's outputs."""
    from autopar.placement import parse_placements

    out_node = next(n for n in captured.gm.graph.nodes if n.op == "output")
    leaves = [leaf for leaf in torch.utils._pytree.tree_flatten(out_node.args)[0]]
    tensor_leaves = [leaf for leaf in leaves if isinstance(leaf, fx.Node) and _tensor_value(leaf)]
    user_outputs = tensor_leaves[len(tensor_leaves) - len(captured.output_names) :]
    requirements: dict[str, list[tuple[int, Placements]]] = {}
    for i, leaf in enumerate(user_outputs):
        if options.output_placements is not None and i < len(options.output_placements):
            required = parse_placements(options.output_placements[i])
            if len(required) != mesh.ndim:
                raise ValueError(
                    f"output_placements[{i}] = {options.output_placements[i]!r} has "
                    f"{len(required)} entries but the mesh has {mesh.ndim} axes"
                )
        else:
            required = (REPLICATE,) * mesh.ndim
        requirements.setdefault(leaf.name, []).append((0, required))
    return requirements


def _zeros(n: int) -> np.ndarray:
    return np.zeros(n, dtype=np.float64)


def _placeholder_space(node, kind, meta, strategies, mesh_shape, pricer) -> NodeSpace:
    n = len(strategies)
    local_bytes = np.array([_local_bytes(meta, s.outputs[0], mesh_shape) for s in strategies])
    local_numel = local_bytes / meta.dtype.itemsize
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
        fixed_bytes=_zeros(n) if kind == "param" else local_bytes,
        local_numel=local_numel if kind == "param" else None,
        itemsize=meta.dtype.itemsize,
    )


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
    is_view = work.family in VIEW_FAMILIES
    # Under mixed precision activations are half precision whatever the captured dtype.
    precision_scale = pricer.itemsize(TensorMeta((), dtype)) / dtype.itemsize
    for i, strategy in enumerate(strategies):
        factor = _split_factor(strategy, mesh_shape)
        out_bytes = sum(
            _local_bytes(m, p, mesh_shape) for m, p in zip(call.outputs, strategy.outputs)
        )
        in_bytes = sum(_local_bytes(m, p, mesh_shape) for m, p in zip(call.inputs, strategy.inputs))
        if not is_view:
            fwd_bytes = (in_bytes + out_bytes) * precision_scale
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
                    bytes_accessed=2 * fwd_bytes,
                    device=mesh.device,
                    dtype=dtype_name,
                    family=work.family,
                )
                if saved_rule is not None:
                    # autopar.saved_activations: the output when some backward saves it, plus
                    # internals (layer_norm statistics, sdpa logsumexp, log_softmax, masks).
                    first_in = (
                        _local_bytes(call.inputs[0], strategy.inputs[0], mesh_shape)
                        if call.inputs and strategy.inputs and strategy.inputs[0] is not None
                        else 0.0
                    )
                    # Saved inputs it owns: at ITS input layouts (a converted copy is kept).
                    owned = sum(
                        _local_bytes(call.inputs[j], strategy.inputs[j], mesh_shape)
                        for j in saved_rule.inputs
                    )
                    activation[i] = (
                        saved_rule.output * out_bytes + saved_rule.first_input * first_in + owned
                    ) * precision_scale
            transient[i] = out_bytes * (2 if grad else 1)
        # Partial gradients of Replicate inputs are all-reduced (gradient convention).
        for inp, meta, placements, grad_placements in zip(
            inputs, call.inputs, strategy.inputs, strategy.input_grads
        ):
            if grad_placements is None or inp.name not in needs_grad or placements is None:
                continue
            nbytes = _local_bytes(meta, placements, mesh_shape)
            if inp.op != "placeholder":
                nbytes *= pricer.itemsize(meta) / meta.dtype.itemsize
            for axis, p in enumerate(grad_placements):
                if p.is_partial() and mesh_shape[axis] > 1:
                    if inp.op == "placeholder":
                        param_grad_comm[i] += pricer.grad_sync_s(nbytes, axis)
                    else:
                        grad_comm[i] += pricer.all_reduce_s(nbytes, axis)
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


def _freeze(value):
    """A hashable stand-in for an OpCall's args (lists, dicts, TensorMeta, constants)."""
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_freeze(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((str(k), _freeze(v)) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))))
    if isinstance(value, float):
        return ("float", float.hex(value))
    if isinstance(value, (TensorMeta, bool, int, str, torch.dtype)) or value is None:
        return value
    return (type(value).__name__, str(value))


def _op_signature(node: fx.Node, needs_grad: set[str]) -> tuple:
    """Everything an op node's strategies and costs depend on: op, argument structure with
    tensors as (shape, dtype), outputs, and which inputs carry gradients (and are placeholders)."""
    call = op_call(node)
    inputs = input_nodes(node)
    return (
        node.target,
        _freeze(call.args),
        _freeze(call.kwargs),
        _freeze(call.outputs),
        node.name in needs_grad,
        tuple((inp.name in needs_grad, inp.op == "placeholder") for inp in inputs),
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
            src_pls = [s.outputs[out_index] if out_index < len(s.outputs) else None for s in src_strats]
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


def pair_table(
    pricer: CommPricer, srcs: list, dsts: list, meta: TensorMeta, *, forward_only: bool = False
) -> np.ndarray:
    """[src, dst] resharding seconds; a None placement (no such output / input) costs 0."""
    table = np.zeros((len(srcs), len(dsts)))
    rows = [i for i, p in enumerate(srcs) if p is not None]
    cols = [j for j, q in enumerate(dsts) if q is not None]
    if rows and cols:
        table[np.ix_(rows, cols)] = pricer.reshard_table(
            [srcs[i] for i in rows], [dsts[j] for j in cols], meta, forward_only=forward_only
        )
    return table


def _tie_edges(captured: Captured, nodes: list[NodeSpace], index: dict[str, int]) -> list[EdgeSpace]:
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


# --------------------------------------------------------------------------------------------
# Problem for one ZeRO configuration and one set of allowed strategies


@dataclass(frozen=True, kw_only=True, slots=True)
class BuiltProblem:
    problem: solver.Problem
    allowed: tuple[tuple[int, ...], ...]
    """Per space node: the strategy indices offered to the solver (solver choice -> index)."""
    zero: ZeroConfig


def param_state(
    space: StrategySpace, node: NodeSpace, s: int, zero: ZeroConfig
) -> tuple[float, float, dict[str, float]]:
    """(memory bytes, ZeRO comm seconds, memory breakdown) of parameter strategy ``s``."""
    options = space.options
    mesh = space.mesh
    if node.alias_of is not None:
        return 0.0, 0.0, {"params": 0.0, "grads": 0.0, "optimizer": 0.0, "master": 0.0, "total": 0.0}
    placements = node.strategies[s].outputs[0]
    replicate = [a for a in range(mesh.ndim) if placements[a].is_replicate() and mesh.shape[a] > 1]
    # Per-axis stages: parameters sharded over P, gradients over G, optimizer state over O.
    # Stages 1-2 cost no time (reduce-scatter + all-gather = the all-reduce already priced);
    # each P axis adds one all-gather of the parameter.
    param_axes, grad_axes, state_axes = zero.split(replicate)
    assert node.local_numel is not None
    numel = float(node.local_numel[s])
    breakdown = training_state_bytes(
        num_elements=numel,
        param_dtype_bytes=node.itemsize,
        optimizer=options.optimizer,
        mixed_precision=options.mixed_precision,
        param_shards=math.prod(mesh.shape[a] for a in param_axes),
        grad_shards=math.prod(mesh.shape[a] for a in grad_axes),
        state_shards=math.prod(mesh.shape[a] for a in state_axes),
    )
    comm = 0.0
    gather_itemsize = 2 if options.mixed_precision else node.itemsize
    for axis in param_axes:
        comm += collective_time_s(
            "all_gather", numel * gather_itemsize, mesh.shape[axis], mesh.links[axis]
        )
    return breakdown.total, comm, breakdown.to_dict()


def node_cost_vector(space: StrategySpace, node: NodeSpace, zero: ZeroConfig) -> tuple[np.ndarray, np.ndarray]:
    """(seconds, resident bytes) per strategy of ``node`` under ``zero``."""
    cost = node.compute_s + node.grad_comm_s + node.param_grad_comm_s + node.output_comm_s
    memory = node.activation_bytes + node.fixed_bytes
    if node.kind == "param":
        extra_mem = np.zeros(len(node.strategies))
        extra_cost = np.zeros(len(node.strategies))
        for s in range(len(node.strategies)):
            extra_mem[s], extra_cost[s], _ = param_state(space, node, s, zero)
        cost = cost + extra_cost
        memory = memory + extra_mem
    return cost, memory


_NO_BANS: frozenset[tuple[int, int]] = frozenset()


def build_problem(
    space: StrategySpace,
    zero: ZeroConfig,
    *,
    allowed: dict[str, Sequence[int]] | None = None,
    forbid: dict[int, set[tuple[int, int]]] | None = None,
    memory_budget_bytes: float | None,
    tied: Sequence[Sequence[int]] = (),
) -> BuiltProblem:
    """Emit the solver problem. ``allowed`` restricts nodes' strategies (recipes); ``forbid``
    maps an edge index to (src strategy, dst strategy) pairs that are not allowed; ``tied``
    lists classes of node indices that must choose alike (``autopar.coarsen.repeated_blocks``);
    a class whose members are offered different strategies is left untied."""
    allowed_idx: list[tuple[int, ...]] = []
    solver_nodes: list[solver.Node] = []
    for node in space.nodes:
        idx = tuple(allowed[node.name]) if allowed and node.name in allowed else tuple(
            range(len(node.strategies))
        )
        if not idx:
            raise ValueError(f"recipe leaves node {node.name} without a strategy")
        cost, memory = node_cost_vector(space, node, zero)
        solver_nodes.append(
            solver.Node(
                name=node.name,
                cost_s=tuple(float(cost[i]) for i in idx),
                memory_bytes=tuple(float(memory[i]) for i in idx),
                transient_bytes=tuple(float(node.transient_bytes[i]) for i in idx),
            )
        )
        allowed_idx.append(idx)
    solver_edges: list[solver.Edge] = []
    # Repeated layers share cost arrays: convert each (array, rows, cols, bans) once and share
    # the tuple, which also lets the solver merge a tied layer's edges by identity.
    converted: dict[tuple, tuple[tuple[float | None, ...], ...]] = {}
    for e, edge in enumerate(space.edges):
        rows = allowed_idx[edge.src]
        cols = allowed_idx[edge.dst]
        banned = forbid.get(e, _NO_BANS) if forbid else _NO_BANS
        # Recipes share one banned set per layer position (alive in ``forbid``: ids are stable).
        key = (id(edge.cost_s), rows, cols, id(banned))
        matrix = converted.get(key)
        if matrix is None:
            finite = np.isfinite(edge.cost_s)
            values = edge.cost_s.tolist()
            matrix = tuple(
                tuple(
                    None if (not finite[a, b] or (a, b) in banned) else values[a][b]
                    for b in cols
                )
                for a in rows
            )
            converted[key] = matrix
        solver_edges.append(solver.Edge(src=edge.src, dst=edge.dst, cost_s=matrix))
    classes = tuple(
        tuple(members)
        for members in tied
        if len(members) > 1 and len({allowed_idx[i] for i in members}) == 1
    )
    problem = solver.Problem(
        nodes=tuple(solver_nodes),
        edges=tuple(solver_edges),
        memory_budget_bytes=memory_budget_bytes,
        tied=classes,
    )
    return BuiltProblem(problem=problem, allowed=tuple(allowed_idx), zero=zero)


# --------------------------------------------------------------------------------------------
# Evaluating an assignment


@dataclass(frozen=True, kw_only=True, slots=True)
class Evaluation:
    """Predicted figures of one assignment (strategy index per space node)."""

    step_s: float
    compute_s: float
    resharding_s: float
    grad_sync_s: float
    activation_grad_comm_s: float
    zero_comm_s: float
    output_comm_s: float
    peak_memory_bytes: float
    memory: dict[str, float]
    node_s: tuple[float, ...]
    """Per node: its own seconds plus its incoming edges' resharding seconds."""
    recompute_s: float = 0.0
    """Forward seconds spent again in recomputed checkpoint segments (autopar.checkpointing)."""


def evaluate(space: StrategySpace, choice: Sequence[int], zero: ZeroConfig) -> Evaluation:
    compute = grad_sync = act_comm = zero_comm = out_comm = 0.0
    memory = {"params": 0.0, "grads": 0.0, "optimizer": 0.0, "master": 0.0, "activations": 0.0, "inputs_buffers": 0.0}
    node_s = [0.0] * len(space.nodes)
    transient = 0.0
    for i, node in enumerate(space.nodes):
        s = choice[i]
        compute += node.compute_s[s]
        grad_sync += node.param_grad_comm_s[s]
        act_comm += node.grad_comm_s[s]
        out_comm += node.output_comm_s[s]
        node_s[i] = float(
            node.compute_s[s] + node.param_grad_comm_s[s] + node.grad_comm_s[s] + node.output_comm_s[s]
        )
        memory["activations"] += node.activation_bytes[s]
        memory["inputs_buffers"] += node.fixed_bytes[s]
        transient = max(transient, float(node.transient_bytes[s]))
        if node.kind == "param":
            _, comm, breakdown = param_state(space, node, s, zero)
            zero_comm += comm
            node_s[i] += comm
            for key in ("params", "grads", "optimizer", "master"):
                memory[key] += breakdown[key]
    resharding = 0.0
    for edge in space.edges:
        c = float(edge.cost_s[choice[edge.src], choice[edge.dst]])
        resharding += c
        node_s[edge.dst] += c
    memory["transient"] = transient
    peak = sum(memory.values())
    step = compute + resharding + grad_sync + act_comm + zero_comm + out_comm
    return Evaluation(
        step_s=float(step),
        compute_s=float(compute),
        resharding_s=float(resharding),
        grad_sync_s=float(grad_sync),
        activation_grad_comm_s=float(act_comm),
        zero_comm_s=float(zero_comm),
        output_comm_s=float(out_comm),
        peak_memory_bytes=float(peak),
        memory={k: float(v) for k, v in memory.items()},
        node_s=tuple(node_s),
    )
