"""Which activations autograd keeps for backward, per node of a captured graph (static).

The planner prices saved-activation memory per node strategy as multiples of the node's local
output bytes and of its first tensor input's local bytes (:class:`SavedRule`); this module says
which multiples, from what each op's backward saves in eager PyTorch (checked against
``torch.autograd.graph.saved_tensors_hooks`` on the tiny GPT and LLaMA, one storage counted
once):

* A node's output is kept iff some backward saves it: the node's own (``softmax``,
  ``log_softmax``, ``rsqrt``, ``tanh``, ``sdpa``, ...) or a consumer's (``linear`` / matmuls save
  their activation inputs, ``layer_norm`` / ``gelu`` / ``silu`` / ``pow`` theirs, ``mul`` an
  input when the other one needs a gradient, ...), seen through alias ops (views, same-dtype
  ``to`` / ``type_as``, ``dropout`` with ``p=0``, a ``reshape`` of a contiguous tensor): a saved
  alias keeps its root's storage. ``add`` / ``sub`` / ``cat`` / reductions save nothing.
* Tensors created inside an op and kept: ``layer_norm`` mean and rstd (2 floats per row),
  ``sdpa`` logsumexp (one float per query row and head), ``cross_entropy_loss`` the log-softmax of
  its logits (the input's size), ``dropout`` with ``p > 0`` its mask (the output's size: autopar's
  dropout multiplies by a mask of the input's dtype); ``sdpa`` with ``dropout_p > 0`` runs its
  math path (eager CPU), which keeps copies of q and k (and of v unless it is contiguous) and
  three (batch, heads, Tq, Tk) tensors instead of its output and logsumexp.
* Ops without a rule here are assumed to save their tensor inputs (conservative).

``autopar.planner.problem`` prices every op strategy's saved-activation bytes with :func:`saved_rules`;
:func:`predicted_saved_bytes` and :func:`predicted_saved_bytes_with_segments` give global
per-node figures (without / with recomputed segments) that tests compare with measurements.
Where a saved storage is priced: each saved root (a node's output storage) is charged once, to
its OWNER: the node itself when its own backward saves it, else its first saving consumer in
graph order, which prices the inputs it reads from that root under its own strategy's input
layouts (:attr:`SavedRule.inputs`): a tensor converted by the lowering (all-gathered, sliced)
before the consumer saves it is priced at the consumer's layout, which is the copy kept; when
the layouts match the conversion is a no-op and this is the producer's storage. Later savers add
nothing (they share the owner's storage when their layout matches). Not modelled: a second saver
reading the root under a different layout than the owner (a second converted copy), and an
owner whose inputs cover only part of the root (then the producer's layout is used).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.fx as fx

if TYPE_CHECKING:
    from autopar.planner.checkpointing import CheckpointSegment

__all__ = [
    "SavedRule",
    "predicted_saved_bytes",
    "predicted_saved_bytes_with_segments",
    "saved_owners",
    "saved_parameters",
    "saved_rules",
]

aten = torch.ops.aten


@dataclass(frozen=True, kw_only=True, slots=True)
class SavedRule:
    """Bytes one node adds to the activations kept for backward, as multiples of local sizes."""

    output: float = 0.0
    """Multiple of the node's local output bytes (1 when its output is kept, plus internals
    sized like the output)."""
    first_input: float = 0.0
    """Multiple of the node's first tensor input's local bytes (internals sized like it)."""
    inputs: tuple[int, ...] = ()
    """Positions (in ``autopar.strategies.input_nodes`` order) of inputs this node owns as
    saved tensors, priced under the node strategy's INPUT layouts: when the lowering converts
    a tensor (e.g. all-gathers it) before a consumer that saves it, the converted copy is what
    stays alive, so the consumer's layout gives its size."""


# Ops whose output aliases their first input (or is a view of it).
_ALIAS = {
    "view",
    "_unsafe_view",
    "transpose",
    "permute",
    "t",
    "unsqueeze",
    "squeeze",
    "expand",
    "slice",
    "select",
    "split",
    "split_with_sizes",
    "chunk",
    "unbind",
    "alias",
    "detach",
    "unflatten",
    "flatten",
    "as_strided",
    "narrow",
    "view_as",
}
# Ops whose backward saves nothing of their inputs or output.
_SAVES_NOTHING = {
    "add",
    "sub",
    "neg",
    "cat",
    "stack",
    "sum",
    "mean",
    "clone",
    "copy",
    "_to_copy",
    "to",
    "type_as",
    "contiguous",
    "reshape",
    "embedding",
    "zeros_like",
    "ones_like",
    "full_like",
    "arange",
    "ne",
    "eq",
    "lt",
    "gt",
    "le",
    "ge",
    "where",
    "masked_fill",
    "_assert_tensor_metadata",
    "repeat",
    "index_select",
    "scatter",
    "tril",
    "triu",
    "repeat_interleave",
}
# Ops whose backward saves their own output.
_SAVES_OUTPUT = {
    "softmax",
    "_softmax",
    "log_softmax",
    "_log_softmax",
    "rsqrt",
    "sqrt",
    "tanh",
    "sigmoid",
    "exp",
    "relu",
}
# Ops whose backward saves every tensor input (that is an activation).
_SAVES_INPUTS = {
    "layer_norm",
    "native_layer_norm",
    "gelu",
    "silu",
    "pow",
    "log",
    "sin",
    "cos",
    "abs",
    "mse_loss",
    "rms_norm",
    "group_norm",
    "batch_norm",
    "softplus",
    "erf",
}
_MATMULS = {"linear", "mm", "bmm", "matmul", "addmm", "baddbmm", "einsum"}


def _name(node: fx.Node) -> str:
    if node.target is operator.getitem:
        return "getitem"
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    return str(getattr(packet, "__name__", getattr(target, "__name__", str(target))))


def _tensor_inputs(node: fx.Node) -> list[fx.Node]:
    return [n for n in node.all_input_nodes if isinstance(n.meta.get("val"), torch.Tensor)]


def _val(node: fx.Node) -> torch.Tensor | None:
    val = node.meta.get("val")
    return val if isinstance(val, torch.Tensor) else None


def _is_alias(node: fx.Node) -> bool:
    """Whether ``node``'s output shares its first input's storage."""
    if node.op != "call_function":
        return False
    name = _name(node)
    if name == "getitem":
        return _name(node.args[0]) in _ALIAS if isinstance(node.args[0], fx.Node) else False
    if name in _ALIAS:
        return True
    inputs = _tensor_inputs(node)
    if not inputs:
        return False
    src, out = _val(inputs[0]), _val(node)
    if name in ("to", "type_as", "_to_copy") and src is not None and out is not None:
        return src.dtype == out.dtype and name != "_to_copy"
    if name in ("reshape", "contiguous") and src is not None:
        return bool(src.is_contiguous())
    if name == "dropout":
        p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.0)
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
        return p == 0.0 or not train
    return False


def _sdpa_dropout(node: fx.Node) -> float:
    p = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
    return float(p) if isinstance(p, (int, float)) else 0.0


def _root(node: fx.Node) -> fx.Node:
    while _is_alias(node):
        node = node.args[0]
    return node


def _saves(node: fx.Node, needs_grad: Collection[str]) -> tuple[list[fx.Node], float, float]:
    """What ``node``'s backward keeps: (roots of the saved tensors, internals as a multiple of
    the output bytes, internals as a multiple of the first input's bytes)."""
    if node.op != "call_function" or node.name not in needs_grad or _is_alias(node):
        return [], 0.0, 0.0
    name = _name(node)
    inputs = _tensor_inputs(node)
    out = _val(node)
    if name in _SAVES_NOTHING or name == "getitem":
        return [], 0.0, 0.0
    if name == "dropout":
        return [], 1.0, 0.0  # the mask
    if name in _SAVES_OUTPUT:
        return [_root(node)], 0.0, 0.0
    if name == "scaled_dot_product_attention" and _sdpa_dropout(node) > 0.0 and out is not None:
        # Math path with dropout (eager CPU): copies of q and k, v (a copy unless it is
        # contiguous, then its root), and three (batch, heads, Tq, Tk) tensors: the
        # probabilities, the mask and the dropped probabilities.
        q, k, v = (_val(n) for n in inputs[:3])
        if q is None or k is None or v is None:
            return [_root(n) for n in inputs[:3]], 0.0, 0.0
        scores = q.numel() // int(q.shape[-1]) * int(k.shape[-2])
        copied = q.numel() + k.numel() + (0 if v.is_contiguous() else v.numel())
        roots = [_root(inputs[2])] if v.is_contiguous() else []
        return roots, (copied + 3 * scores) / out.numel(), 0.0
    if name == "scaled_dot_product_attention":
        extra = 1.0 / int(out.shape[-1]) if out is not None and out.dim() and out.shape[-1] else 0.0
        return [*(_root(n) for n in inputs[:3]), node], extra, 0.0  # + logsumexp
    if name == "cross_entropy_loss":
        return [], 0.0, 1.0  # log_softmax of the logits
    if name == "nll_loss":
        return [_root(n) for n in inputs[:1]], 0.0, 0.0
    if name in ("mul", "div"):
        if len(inputs) != 2:
            return [], 0.0, 0.0
        a, b = inputs
        roots = []
        if name == "mul":
            if b.name in needs_grad:
                roots.append(_root(a))
            if a.name in needs_grad:
                roots.append(_root(b))
        else:
            roots.append(_root(b))
            if b.name in needs_grad:
                roots.append(_root(a))
        return roots, 0.0, 0.0
    if name in _MATMULS:
        grad_inputs = [n for n in inputs if n.name in needs_grad]
        roots = [_root(n) for n in inputs[:2] if any(o is not n for o in grad_inputs)]
        return roots, 0.0, 0.0
    if name in ("layer_norm", "native_layer_norm") and inputs:
        src = _val(inputs[0])
        shape = node.args[1] if len(node.args) > 1 else ()
        width = math.prod(int(d) for d in shape) if shape else 1
        # mean and rstd: two fp32 numbers per normalized row
        extra = 8.0 / (width * src.element_size()) if src is not None and width else 0.0
        return [_root(inputs[0])], 0.0, extra
    # _SAVES_INPUTS and unknown ops: every tensor input.
    return [_root(n) for n in inputs], 0.0, 0.0


def saved_rules(graph: fx.Graph, needs_grad: Collection[str]) -> dict[str, SavedRule]:
    """Rule per call_function node name (nodes absent from the result add nothing).

    Args:
        graph: a captured graph (ATen training IR with ``meta["val"]``).
        needs_grad: names of the nodes whose value needs a gradient (parameters included).
    """

    owner: dict[fx.Node, fx.Node] = {}
    first_input: dict[str, float] = {}
    extra_output: dict[str, float] = {}
    for node in graph.nodes:
        roots, extra_out, extra_in = _saves(node, needs_grad)
        for root in roots:
            owner.setdefault(root, node)  # graph order: a self-saving root owns itself
        if extra_out:
            extra_output[node.name] = extra_out
        if extra_in:
            first_input[node.name] = extra_in
    own_output: set[fx.Node] = set()
    owned_inputs: dict[str, list[int]] = {}
    for root, positions in _owners(owner).items():
        if positions:
            owned_inputs.setdefault(owner[root].name, []).extend(positions)
        else:
            own_output.add(root)
    rules: dict[str, SavedRule] = {}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        output = (1.0 if node in own_output else 0.0) + extra_output.get(node.name, 0.0)
        rule = SavedRule(
            output=output,
            first_input=first_input.get(node.name, 0.0),
            inputs=tuple(sorted(owned_inputs.get(node.name, ()))),
        )
        if rule.output or rule.first_input or rule.inputs:
            rules[node.name] = rule
    return rules


def saved_parameters(graph: fx.Graph, needs_grad: Collection[str]) -> frozenset[str]:
    """Names of the placeholders (parameters, buffers, inputs) some backward saves, seen
    through alias ops: what ZeRO-3's unpack hook gathers again in backward
    (``runtime.zero_gather``: a saved view of a gathered chunk re-gathers the chunk). A norm
    saves its weight and bias too (``native_layer_norm_backward`` takes them), which
    :func:`_saves` leaves out as they are not activations."""
    out: set[str] = set()
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        roots = _saves(node, needs_grad)[0]
        if roots and _name(node) in _NORMS:
            roots = [_root(n) for n in _tensor_inputs(node)]
        out.update(root.name for root in roots if root.op == "placeholder")
    return frozenset(out)


_NORMS = {"layer_norm", "native_layer_norm", "group_norm", "batch_norm", "native_batch_norm"}


def _owners(owner: Mapping[fx.Node, fx.Node]) -> dict[fx.Node, list[int]]:
    """Saved activation root -> positions of its owner's inputs that price it ([] = priced
    at the root's own output layout)."""
    from autopar.strategies import input_nodes

    out: dict[fx.Node, list[int]] = {}
    for root, saver in owner.items():
        if root.op != "call_function":
            continue  # parameters, buffers and inputs are not activations
        out[root] = _owned_positions(saver, root, input_nodes(saver)) if saver is not root else []
    return out


def saved_owners(
    graph: fx.Graph,
    needs_grad: Collection[str],
    saves: Sequence[tuple[fx.Node, list[fx.Node]]] | None = None,
) -> dict[str, str]:
    """Saved activation root name -> name of the node whose activation bytes price its
    storage (itself, or the consumer owning it; see the module docstring). ``saves``: each
    node of the graph, in order, with ``_saves(node, needs_grad)[0]`` (computed here if None)."""
    if saves is None:
        saves = [(node, _saves(node, needs_grad)[0]) for node in graph.nodes]
    owner: dict[fx.Node, fx.Node] = {}
    for node, roots in saves:
        for root in roots:
            owner.setdefault(root, node)
    return {
        root.name: (owner[root].name if positions else root.name)
        for root, positions in _owners(owner).items()
    }


def _owned_positions(saver: fx.Node, root: fx.Node, inputs: Sequence[fx.Node]) -> list[int]:
    """Positions of ``saver``'s distinct inputs that alias ``root`` when together they cover
    it (same element count), else [] (the root is then priced at its producer's layout)."""
    positions: list[int] = []
    seen: set[fx.Node] = set()
    for position, inp in enumerate(inputs):
        if inp in seen or _val(inp) is None or _root(inp) is not root:
            continue
        seen.add(inp)
        positions.append(position)
    root_val = _val(root)
    if root_val is None or not positions:
        return []
    covered = sum(_val(inputs[p]).numel() for p in positions)
    return positions if covered == root_val.numel() else []


def predicted_saved_bytes(graph: fx.Graph, needs_grad: Collection[str]) -> dict[str, float]:
    """Global (unsharded) saved bytes per node under :func:`saved_rules` (for tests and
    diagnostics; the planner applies the rules to local sizes)."""
    out: dict[str, float] = {}
    rules = saved_rules(graph, needs_grad)
    for node in graph.nodes:
        rule = rules.get(node.name)
        if rule is None:
            continue
        val = _val(node)
        inputs = _tensor_inputs(node)
        out_bytes = val.numel() * val.element_size() if val is not None else 0
        src = _val(inputs[0]) if inputs else None
        in_bytes = src.numel() * src.element_size() if src is not None else 0
        out[node.name] = out.get(node.name, 0.0) + rule.output * out_bytes
        out[node.name] += rule.first_input * in_bytes
        if rule.inputs:
            from autopar.strategies import input_nodes

            owned = input_nodes(node)
            for position in rule.inputs:
                inp = owned[position]
                val_in = _val(inp)
                root = _root(inp).name
                if val_in is not None:
                    out[root] = out.get(root, 0.0) + val_in.numel() * val_in.element_size()
    return out


def predicted_saved_bytes_with_segments(
    graph: fx.Graph, needs_grad: Collection[str], segments: Sequence[CheckpointSegment]
) -> dict[str, float]:
    """Global saved bytes per node when ``segments`` recompute (non-reentrant checkpoint).

    Inside a segment nothing is kept except: outputs some backward OUTSIDE the segment saves,
    the segment's inputs (checkpoint saves them; their root's storage), and under the selective
    policy the outputs of ``keep`` nodes (and their internals).
    """
    nodes = {n.name: n for n in graph.nodes}
    plain = predicted_saved_bytes(graph, needs_grad)
    member: dict[str, int] = {}
    for k, segment in enumerate(segments):
        for name in segment.nodes:
            member[name] = k
    outside = _saved_roots_outside(graph, needs_grad, member)
    out = dict(plain)
    for segment in segments:
        keep = set(segment.keep) if segment.policy == "selective" else set()
        inside = {name for name in segment.nodes if name in nodes}
        for name in inside:
            if name in keep or nodes[name] in outside:
                # kept node, or an output saved by a consumer outside the segment
                val = _val(nodes[name])
                if name in keep and val is not None:
                    out[name] = max(out.get(name, 0.0), float(val.numel() * val.element_size()))
                continue
            out.pop(name, None)
        for name in inside:
            for inp in nodes[name].all_input_nodes:
                root = _root(inp)
                if root.name in inside or root.op != "call_function":
                    continue
                val = _val(root)
                if val is not None and not out.get(root.name):
                    out[root.name] = float(val.numel() * val.element_size())
    return out


def _saved_roots_outside(
    graph: fx.Graph, needs_grad: Collection[str], member: Mapping[str, int]
) -> set[fx.Node]:
    """Roots saved by a backward of a node outside the segment that produces them."""
    saved: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        for root in _saves(node, needs_grad)[0]:
            if member.get(root.name) is None or member.get(root.name) != member.get(node.name):
                saved.add(root)
    return saved
