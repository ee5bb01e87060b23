"""Capture: a model and example inputs -> a static ATen graph with shapes, module paths and FQNs.

``capture`` runs ``torch.export.export`` (training IR, non-strict). Non-strict export already
traces on FakeTensors made from the real parameters and inputs, so no real kernel runs and a
model on the meta device captures without allocating. Afterwards:

* a stack of 8 or more identical layers is exported as 3 layers and the others are spliced in
  (``autopar.capture.layer_replication``: checked, the same graph as a full export, or a full export);
* assert-only nodes (``aten._assert_tensor_metadata`` and friends) are erased: they pin the
  device of the capture and would fail when a meta capture runs on real tensors;
* ops without a sharding rule that have a decomposition are decomposed (repeatedly, until no
  such op is left); ops still without a rule stay and the planner replicates them;
* every node gets ``meta["autopar_module_path"]`` (innermost module FQN) and parameter/buffer
  placeholders get ``meta["autopar_fqn"]``;
* ``graph_hash`` fingerprints the graph without devices or node names, so a plan made on meta
  tensors is accepted for the same model on real devices.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map

from autopar.capture.exact_means import exact_means
from autopar.capture.layer_replication import export_replicated
from autopar.errors import UnsupportedModelError

# Nodes that only check metadata at run time; they carry the capture device and do no work.
_ASSERT_PACKETS = (
    "_assert_tensor_metadata",
    "_assert_scalar",
    "_assert_async",
    "sym_constrain_range_for_size",
)
ASSERT_OPS: frozenset[Any] = frozenset(
    getattr(getattr(torch.ops.aten, packet), overload)
    for packet in _ASSERT_PACKETS
    if hasattr(torch.ops.aten, packet)
    for overload in getattr(torch.ops.aten, packet).overloads()
)

_TORCH_DIR = os.path.dirname(torch.__file__)
_THIS_FILE = os.path.abspath(__file__)


@dataclass(frozen=True, kw_only=True, slots=True)
class Captured:
    """A captured model: the exported program and what later stages need to know about it."""

    exported: torch.export.ExportedProgram
    """The ExportedProgram (after assert erasure and decompositions)."""
    gm: fx.GraphModule
    """``exported.graph_module``: parameters and buffers are lifted placeholder nodes."""
    param_nodes: dict[str, str]
    """Placeholder node name -> parameter FQN."""
    buffer_nodes: dict[str, str]
    """Placeholder node name -> buffer FQN."""
    input_nodes: list[str]
    """User input placeholder names, in the order of the flattened (args, kwargs); non-tensor
    leaves (e.g. ``use_cache=False``) have a placeholder too but are baked in as constants."""
    output_node: str
    """Name of the graph's output node."""
    output_names: tuple[str, ...]
    """Names of the nodes the model returns, in output order (None-free)."""
    graph_hash: str
    """``graph_hash(gm)``: the key a Plan is checked against."""
    decomposed_ops: tuple[str, ...]
    """Ops (as strings) that were decomposed because no sharding rule covers them."""
    num_params: int
    """Total parameter elements (a tied parameter counted once)."""
    tied_params: dict[str, list[str]]
    """Parameter FQN -> the other FQNs sharing its storage (only for tied parameters)."""
    replicated_layers: str = ""
    """How the graph was captured: ``"layers: 3 of 80 traced"`` when the layers were
    replicated from a sample (the same graph as a full export), "" for a full export."""


# --------------------------------------------------------------------------------------------
# capture


def capture(
    model: nn.Module,
    example_args: tuple[Any, ...],
    example_kwargs: dict[str, Any] | None = None,
    *,
    decompose: bool = True,
    replicate_layers: bool = True,
    check_splice: bool = True,
) -> Captured:
    """Export ``model`` at ATen level on its example inputs (global batch).

    Args:
        model: the single-device model, on any device (meta included), in the train/eval mode
            the graph should have (dropout and batch norm are fixed at capture time).
        example_args, example_kwargs: inputs of one forward call.
        decompose: decompose ops that have no sharding rule (see the module docstring).
        replicate_layers: export 3 layers of a stack of identical layers and replicate the
            rest (``autopar.capture.layer_replication``); False exports every layer.
        check_splice: check that splice against an export of 4 layers (the whole model is
            exported when it fails); False only where a test proves it (``splice_proven``).

    Raises:
        UnsupportedModelError: the model cannot be captured as one static graph; the message
            names the user source line and what to change.
    """
    example_kwargs = dict(example_kwargs or {})
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        # A meta model with real example inputs: trace everything on meta, nothing is allocated.
        example_args, example_kwargs = tree_map(
            lambda x: x.to("meta") if isinstance(x, torch.Tensor) else x,
            (tuple(example_args), example_kwargs),
        )
    # torch logs a whole graph dump for data-dependent guards; our error says it in one line.
    shapes_logger = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = shapes_logger.level
    shapes_logger.setLevel(logging.ERROR)
    replicated = None
    try:
        if replicate_layers:
            try:
                args = tuple(example_args)
                replicated = export_replicated(model, args, example_kwargs, check=check_splice)
            except Exception:  # the cut model did not export: the whole model says why
                replicated = None
        if replicated is not None:
            exported = replicated[0]
        else:
            exported = torch.export.export(model, tuple(example_args), example_kwargs, strict=False)
    except Exception as error:  # torch raises many types here; all mean "not capturable"
        raise UnsupportedModelError(_explain_export_failure(error)) from error
    finally:
        shapes_logger.setLevel(level)

    _erase_asserts_and_layout_copies(exported.graph_module)
    decomposed: tuple[str, ...] = ()
    if decompose:
        exported, decomposed = _decompose_unruled_ops(exported)
        _erase_asserts_and_layout_copies(exported.graph_module)
    gm = exported.graph_module
    _check_no_data_dependent_values(gm)
    exact_means(gm, recompile=False)  # recompiled once below

    param_nodes: dict[str, str] = {}
    buffer_nodes: dict[str, str] = {}
    input_nodes: list[str] = []
    kinds = torch.export.graph_signature.InputKind
    for spec in exported.graph_signature.input_specs:
        name = spec.arg.name
        if spec.kind == kinds.PARAMETER:
            param_nodes[name] = str(spec.target)
        elif spec.kind == kinds.BUFFER:
            buffer_nodes[name] = str(spec.target)
        elif spec.kind == kinds.USER_INPUT:
            input_nodes.append(name)
    _annotate(gm, {**param_nodes, **buffer_nodes})

    output = next(n for n in gm.graph.nodes if n.op == "output")
    leaves, _ = tree_flatten(output.args[0])
    output_names = tuple(leaf.name for leaf in leaves if isinstance(leaf, fx.Node))
    if "val" not in output.meta:
        output.meta["val"] = tuple(
            leaf.meta.get("val") if isinstance(leaf, fx.Node) else leaf for leaf in leaves
        )

    gm.graph.lint()
    gm.recompile()
    return Captured(
        exported=exported,
        gm=gm,
        param_nodes=param_nodes,
        buffer_nodes=buffer_nodes,
        input_nodes=input_nodes,
        output_node=output.name,
        output_names=output_names,
        graph_hash=graph_hash(gm),
        decomposed_ops=decomposed,
        num_params=sum(p.numel() for p in model.parameters()),
        tied_params=_tied_params(model),
        replicated_layers=replicated[1] if replicated is not None else "",
    )


def _erase_asserts_and_layout_copies(gm: fx.GraphModule) -> None:
    """Erase assert-only nodes and layout-only ``contiguous`` copies, then dead code.

    ``x.contiguous()`` is recorded only when x is not contiguous, and that depends on the
    device's kernels (CPU flash attention returns a transposed layout, meta does not), so the
    same model would give different graphs on meta and on CPU. A ``contiguous`` whose users are
    not ``view`` (the one op that needs the layout) changes no value and goes (unless it is a
    model output, whose name the export signature holds).
    """
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in ASSERT_OPS and not node.users:
            gm.graph.erase_node(node)
        elif node.target in _LAYOUT_ONLY_OPS and not any(
            user.target in _NEEDS_LAYOUT or user.op == "output" for user in node.users
        ):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
    # No recompile (0.5 s at 80 layers): capture() does it at the end, _decompose_unruled_ops first.
    gm.graph.eliminate_dead_code(is_impure_node=_is_impure_but_not_assert)


_LAYOUT_ONLY_OPS = frozenset((torch.ops.aten.contiguous.default,))
_NEEDS_LAYOUT = frozenset((torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default))


def _is_impure_but_not_assert(node: fx.Node) -> bool:
    # Keep placeholders, outputs and ops with side effects (in-place buffer updates, RNG);
    # dead pure ops left behind by erased asserts go.
    if node.op in ("placeholder", "output"):
        return True
    if node.op == "call_function" and node.target in ASSERT_OPS:
        return False
    return node.is_impure()


def _tied_params(model: nn.Module) -> dict[str, list[str]]:
    by_storage: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_storage.setdefault(id(param), []).append(name)
    tied: dict[str, list[str]] = {}
    for names in by_storage.values():
        if len(names) > 1:
            for name in names:
                tied[name] = [other for other in names if other != name]
    return tied


def _annotate(gm: fx.GraphModule, state_fqns: dict[str, str]) -> None:
    """Write autopar_module_path on every node and autopar_fqn on parameter/buffer placeholders."""
    for node in gm.graph.nodes:
        fqn = state_fqns.get(node.name)
        if fqn is not None:
            node.meta["autopar_fqn"] = fqn
            node.meta["autopar_module_path"] = fqn.rpartition(".")[0]
            continue
        stack = node.meta.get("nn_module_stack")
        path = ""
        if stack:
            path = str(list(stack.values())[-1][0])
        node.meta["autopar_module_path"] = path


# --------------------------------------------------------------------------------------------
# Decomposition of ops without a sharding rule


def _decompose_unruled_ops(
    exported: torch.export.ExportedProgram,
) -> tuple[torch.export.ExportedProgram, tuple[str, ...]]:
    # Only export's own table (core ATen decompositions plus the composite-implicit ops): the
    # wider torch._decomp table has reference implementations that emit prims, which
    # re-export cannot functionalize.
    import autopar.strategies  # noqa: F401  (registers every rule)
    from autopar.strategies.registry import get_rule

    export_table = torch.export.default_decompositions()
    decomposed: set[str] = set()
    tried: set[Any] = set()
    for _ in range(6):  # a decomposition may produce ops that need one in turn
        present = {n.target for n in exported.graph.nodes if n.op == "call_function"}
        candidates = [
            op
            for op in present - tried
            if isinstance(op, torch._ops.OpOverload)
            and op not in ASSERT_OPS
            and get_rule(op) is None
            and op in export_table
        ]
        if not candidates:
            break
        tried |= set(candidates)
        exported.graph_module.recompile()  # re-export runs the module's code
        try:
            exported = exported.run_decompositions({op: export_table[op] for op in candidates})
        except Exception:
            # One bad decomposition must not cost the others: apply them one by one.
            for op in candidates:
                try:
                    exported = exported.run_decompositions({op: export_table[op]})
                except Exception:
                    continue
        after = {n.target for n in exported.graph.nodes if n.op == "call_function"}
        decomposed |= {str(op) for op in candidates if op not in after}
    return exported, tuple(sorted(decomposed))


# --------------------------------------------------------------------------------------------
# Errors a user can act on


_ADVICE = (
    (
        (
            "data-dependent",
            "GuardOnDataDependent",
            "data dependent",
            "symbolic boolean",
            "guard on",
        ),
        "Python control flow on a tensor value is not capturable: replace `if tensor...:` by "
        "torch.where(cond, a, b) or torch.cond(pred, true_fn, false_fn, operands), and "
        ".item()/.tolist()/int(tensor) by tensor arithmetic.",
    ),
    (
        ("item", "_local_scalar_dense", "tolist"),
        "Do not turn tensors into Python numbers (.item(), .tolist(), float(t)): keep them as tensors.",
    ),
    (
        ("print", "side effect", "mutation", "global"),
        "Remove prints and other Python side effects from forward.",
    ),
)


def _explain_export_failure(error: BaseException) -> str:
    location = _user_location(error)
    text = f"{type(error).__name__}: {error}"
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    advice = next(
        (fix for keys, fix in _ADVICE if any(key.lower() in text.lower() for key in keys)),
        "Make forward a static graph: no Python control flow on tensor values, no .item(), "
        "no side effects; see the torch.export documentation for the construct named above.",
    )
    where = f"at {location}" if location else "(no user source line found in the traceback)"
    return f"cannot capture the model {where}: {first_line}\nFix: {advice}"


def _is_user_file(filename: str) -> bool:
    path = os.path.abspath(filename) if not filename.startswith("<") else filename
    return not path.startswith(_TORCH_DIR) and path != _THIS_FILE and "/importlib/" not in path


def _user_location(error: BaseException) -> str | None:
    """file:line of the user code that triggered the export failure (innermost user frame)."""
    text = str(error)
    match = re.search(r'raised this error:\s*File "([^"]+)", line (\d+)', text)
    if match and _is_user_file(match.group(1)):
        return f"{match.group(1)}:{match.group(2)}"
    chained: BaseException | None = error
    while chained is not None:
        frames = [
            f for f in traceback.extract_tb(chained.__traceback__) if _is_user_file(f.filename)
        ]
        if frames:
            return f"{frames[-1].filename}:{frames[-1].lineno}"
        chained = chained.__cause__ or chained.__context__
    for filename, line in re.findall(r'File "([^"]+)", line (\d+)', text):
        if _is_user_file(filename):
            return f"{filename}:{line}"
    return None


_SCALAR_OPS = frozenset((torch.ops.aten.item.default, torch.ops.aten._local_scalar_dense.default))


def _check_no_data_dependent_values(gm: fx.GraphModule) -> None:
    # .item() whose value only feeds arithmetic, or boolean-mask indexing, exports fine but
    # leaves unbacked symbols in the graph: such a node cannot be sharded or priced, so refuse
    # it and name its line.
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        val = node.meta.get("val")
        problem = None
        if node.target in _SCALAR_OPS or isinstance(
            val, (torch.SymInt, torch.SymFloat, torch.SymBool)
        ):
            problem = (
                f"{node.target} turns a tensor into a Python number.\n"
                "Fix: keep values as tensors (no .item(), .tolist(), float(t), int(t)) in forward."
            )
        elif any(
            isinstance(leaf, torch.Tensor) and not all(isinstance(size, int) for size in leaf.shape)
            for leaf in tree_flatten(val)[0]
        ):
            problem = (
                f"{node.target} produces a tensor whose shape depends on tensor values.\n"
                "Fix: avoid boolean-mask indexing, nonzero() and unique() in forward; use "
                "torch.where or masked arithmetic with static shapes."
            )
        if problem is not None:
            frame = _stack_trace_location(node.meta.get("stack_trace", ""))
            where = f"at {frame}" if frame else f"(node {node.name})"
            raise UnsupportedModelError(f"cannot capture the model {where}: {problem}")


def _stack_trace_location(stack_trace: str) -> str | None:
    frames = re.findall(r'File "([^"]+)", line (\d+)', stack_trace or "")
    user = [(f, line) for f, line in frames if _is_user_file(f)]
    if not user:
        return None
    filename, line = user[-1]
    return f"{filename}:{line}"


# --------------------------------------------------------------------------------------------
# Canonical graph hash


def _canonical(value: Any, index: dict[fx.Node, int]) -> Any:
    if isinstance(value, fx.Node):
        return ("node", index[value])
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_canonical(v, index) for v in value))
    if isinstance(value, dict):
        return (
            "dict",
            tuple(
                (str(k), _canonical(v, index))
                for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))
            ),
        )
    if isinstance(value, torch.device):
        return "device"
    if isinstance(value, (torch.dtype, torch.memory_format, torch.layout)):
        return str(value)
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype))
    if isinstance(value, float):
        return ("float", float.hex(value))
    if isinstance(value, (bool, int, str)) or value is None:
        return (type(value).__name__, value)
    return (type(value).__name__, str(value))


def _value_signature(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (tuple(str(s) for s in value.shape), str(value.dtype))
    if isinstance(value, (list, tuple)):
        return tuple(_value_signature(v) for v in value)
    if value is None:
        return None
    return type(value).__name__


def _target_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload) or not callable(target):
        return str(target)
    return f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', repr(target))}"


def graph_hash(gm: fx.GraphModule) -> str:
    """sha256 over op targets, argument structure, output shapes and dtypes, in graph order.

    Node references become topological indices and constants their values; devices, node names,
    assert-only nodes and layout-only copies are left out (view and reshape count as one op), so the same model on meta or on real tensors hashes
    the same and any change of shape, dtype or structure changes the hash.
    """
    digest = hashlib.sha256()
    index: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in ASSERT_OPS:
            continue
        if (
            node.op == "call_function"
            and node.target in _LAYOUT_ONLY_OPS
            and isinstance(node.args[0], fx.Node)
        ):
            index[node] = index[node.args[0]]  # same value, see _erase_asserts_and_layout_copies
            continue
        index[node] = len(index)
        if node.op == "placeholder":
            target = "placeholder"
        elif node.op == "get_attr":
            attr = getattr(gm, str(node.target), None)
            target = f"get_attr:{_canonical(attr, index)}"
        else:
            # view and reshape compute the same value; which one appears depends on layouts.
            target = (
                "aten.reshape.default"
                if node.target in _NEEDS_LAYOUT
                else _target_name(node.target)
            )
        record = (
            node.op,
            target,
            _canonical(node.args, index),
            _canonical(node.kwargs, index),
            _value_signature(node.meta.get("val")),
        )
        digest.update(repr(record).encode("ascii", "backslashreplace"))
        digest.update(b"\n")
    return digest.hexdigest()
