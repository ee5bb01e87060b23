"""Capture time that does not grow with depth: export a few layers, replicate the rest.

torch.export traces every op of every layer (about 0.14 s per LLaMA layer on these machines,
11 of the 13 s that capturing llama3-70b took). The layers of a transformer are one block
repeated, so ``export_replicated`` exports the model with its stack of identical layers cut to
``SAMPLE_LAYERS`` (3: a first layer, a middle one and a last one), then splices copies of the
middle layer's subgraph in, with node names, parameter placeholders, FQNs, ``nn_module_stack``
paths and the signature rewritten per layer, so the ExportedProgram is the one a full export
gives (names included).

The splice is checked, not assumed: the model is also exported with one more layer and the
3-layer program spliced to 4 layers must equal that export node for node (names, targets,
arguments, module paths, shapes, strides, signature, module call graph). This catches layers
that differ, data flowing between layers other than through one hidden state, code that
depends on the number of layers (``len(self.layers)``) and anything else the splice does not
model. When a check fails, or the model has no such stack, the caller exports the whole model.
For the built-in presets (``autopar.presets.SPLICE_PROVEN``: code this project owns) the same
property is proven in CI instead, at several depths (tests/planner/test_layer_replication.py),
and ``autopar plan`` skips the second export (``check=False``); user models keep the check.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.export.graph_signature import (
    ExportGraphSignature,
    InputKind,
    InputSpec,
    OutputKind,
    TensorArgument,
)

from autopar.capture.export_compare import program_difference
from autopar.capture.repeated_layers import MIN_LAYERS, find_repeated_layers

SAMPLE_LAYERS = 3
"""Layers traced: the splice copies layer 1, whose input and output are both other layers."""

_NAME_NUMBER = re.compile(r"^(.*)_(\d+)$")


def export_replicated(
    model: nn.Module,
    example_args: tuple[Any, ...],
    example_kwargs: dict[str, Any],
    *,
    min_layers: int = MIN_LAYERS,
    check: bool = True,
) -> tuple[torch.export.ExportedProgram, str] | None:
    """The model's full ExportedProgram, built from an export of 3 of its layers and checked
    against an export of 4 (``check=False`` skips that check: only for models whose splice a
    test proves, the built-in presets of ``autopar.presets.SPLICE_PROVEN``).

    Returns:
        (program, note) with note like ``"layers: 3 of 80 traced"``, or None when the model has
        no stack of at least ``min_layers`` identical layers or the splice check fails (the
        caller then exports the whole model). Export errors propagate as torch raises them.
    """
    found = find_repeated_layers(model, min_layers=min_layers)
    if found is None:
        return None
    path = found[2]
    num_layers = len(getattr(found[0], found[1]))
    sample = export_cut(model, found, SAMPLE_LAYERS, example_args, example_kwargs)
    if check:
        spliced = splice_layers(sample, model, path, SAMPLE_LAYERS, SAMPLE_LAYERS + 1)
        real = export_cut(model, found, SAMPLE_LAYERS + 1, example_args, example_kwargs)
        if spliced is None or program_difference(spliced, real) is not None:
            return None
    full = splice_layers(sample, model, path, SAMPLE_LAYERS, num_layers)
    if full is None:
        return None
    return full, f"{path}: {SAMPLE_LAYERS} of {num_layers} traced"


def export_cut(
    model: nn.Module,
    found: tuple[nn.Module, str, str],
    count: int,
    example_args: tuple[Any, ...],
    example_kwargs: dict[str, Any],
) -> torch.export.ExportedProgram:
    """``model`` exported with the layer list ``found`` (see :func:`find_repeated_layers`) cut
    to its first ``count`` layers (the model is left as it was)."""
    parent, attr, _ = found
    layers = getattr(parent, attr)
    cut = nn.ModuleList(list(layers)[:count])
    cut.training = layers.training
    parent._modules[attr] = cut
    try:
        return torch.export.export(model, tuple(example_args), example_kwargs, strict=False)
    finally:
        parent._modules[attr] = layers


# --------------------------------------------------------------------------------------------
# The splice


@dataclasses.dataclass(kw_only=True, slots=True)
class _Layout:
    """Where the sampled program's nodes sit: a prefix, one run per layer, a suffix."""

    prefix: list[fx.Node]
    layers: list[list[fx.Node]]
    suffix: list[fx.Node]
    hidden_out: list[fx.Node]
    """Per sampled layer, its one node used outside the layer."""
    state_layer: dict[fx.Node, int]
    """Parameter/buffer placeholder -> the sampled layer it belongs to."""


def splice_layers(
    sample: torch.export.ExportedProgram,
    model: nn.Module,
    path: str,
    num_sampled: int,
    num_layers: int,
) -> torch.export.ExportedProgram | None:
    """``sample`` (an export of ``model`` with layer list ``path`` cut to its first
    ``num_sampled`` layers) grown to ``num_layers`` layers by copying layer 1; None when the
    program does not have the shape the splice needs."""
    layout = _layout(sample, path, num_sampled)
    if layout is None:
        return None
    strides = _name_strides(layout.layers[1], layout.layers[2])
    if strides is None:
        return None
    extra = num_layers - num_sampled
    last = num_sampled - 1
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    specs = {spec.arg.name: spec for spec in sample.graph_signature.input_specs}
    new_specs: list[InputSpec] = []
    fake_mode = _fake_mode(sample)
    layer_states: dict[int, dict[str, fx.Node]] = {}  # new layer -> relative FQN -> placeholder
    copied_kinds: set[InputKind] = set()

    def add_placeholder(node: fx.Node, layer: int | None, new_layer: int, own: bool) -> None:
        spec = specs[node.name]
        name, target = node.name, spec.target
        if layer is not None:
            name = _rename_state(name, path, layer, new_layer)
            target = f"{path}.{new_layer}.{spec.target[len(path) + len(str(layer)) + 2 :]}"
        new = graph.placeholder(name)
        new.meta = copy.copy(node.meta)
        if layer is not None and new_layer != layer:
            new.meta["val"] = _fresh_fake(fake_mode, node.meta["val"])
            layer_states.setdefault(new_layer, {})[target[len(f"{path}.{new_layer}.") :]] = new
        if new.name != name:
            raise _SpliceError("placeholder name taken")
        new_specs.append(dataclasses.replace(spec, arg=TensorArgument(name=name), target=target))
        if own:
            env[node] = new  # a copy of layer 1's state is found through layer_states instead

    try:
        for node in sample.graph.nodes:
            if node.op != "placeholder":
                continue
            layer = layout.state_layer.get(node)
            if layer == last and specs[node.name].kind not in copied_kinds:
                copied_kinds.add(specs[node.name].kind)
                template = [
                    n
                    for n, i in layout.state_layer.items()
                    if i == 1 and specs[n.name].kind == specs[node.name].kind
                ]
                for new_layer in range(last, last + extra):
                    for state in template:
                        add_placeholder(state, 1, new_layer, False)
            add_placeholder(node, layer, layer + extra if layer == last else (layer or 0), True)
        for node in layout.prefix + [n for run in layout.layers[:last] for n in run]:
            env[node] = _copy_node(graph, node, env.__getitem__, node.name, path, None)
        hidden = env[layout.hidden_out[last - 1]]
        template_states = {
            n: specs[n.name].target[len(f"{path}.1.") :]
            for n, i in layout.state_layer.items()
            if i == 1
        }
        for new_layer in range(last, last + extra):
            local = {layout.hidden_out[0]: hidden}
            local.update({n: layer_states[new_layer][rel] for n, rel in template_states.items()})

            def lookup(node: fx.Node, local: dict[fx.Node, fx.Node] = local) -> fx.Node:
                return local[node] if node in local else env[node]

            for node in layout.layers[1]:
                name = _shift_name(node.name, strides, new_layer - 1)
                local[node] = _copy_node(graph, node, lookup, name, path, (1, new_layer))
            hidden = local[layout.hidden_out[1]]
        env[layout.hidden_out[last - 1]] = hidden
        last_nodes = set(layout.layers[last])
        for node in layout.layers[last] + layout.suffix:
            moved = (last, last + extra) if node in last_nodes else None
            name = _shift_name(node.name, strides, extra)
            env[node] = _copy_node(graph, node, env.__getitem__, name, path, moved)
        output = next(n for n in sample.graph.nodes if n.op == "output")
        env[output] = _copy_node(graph, output, env.__getitem__, output.name, path, None)
        return _assemble(sample, model, graph, new_specs, env, path, last, extra)
    except _SpliceError:
        return None


class _SpliceError(Exception):
    pass


def _layout(sample: torch.export.ExportedProgram, path: str, num_sampled: int) -> _Layout | None:
    layer_path = re.compile(rf"^{re.escape(path)}\.(\d+)$")
    state_layer: dict[fx.Node, int] = {}
    by_name = {n.name: n for n in sample.graph.nodes}
    for spec in sample.graph_signature.input_specs:
        if spec.target and spec.target.startswith(f"{path}."):
            if spec.kind not in (InputKind.PARAMETER, InputKind.BUFFER):
                return None
            index = spec.target[len(path) + 1 :].split(".")[0]
            state_layer[by_name[spec.arg.name]] = int(index)
    runs: list[list[fx.Node]] = [[] for _ in range(num_sampled)]
    prefix: list[fx.Node] = []
    suffix: list[fx.Node] = []
    previous = -1
    for node in sample.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op != "call_function":
            return None  # get_attr / higher-order submodules: not replicated
        stack = node.meta.get("nn_module_stack") or {}
        indices = {int(m.group(1)) for p, _ in stack.values() if (m := layer_path.match(str(p)))}
        if len(indices) > 1:
            return None
        index = indices.pop() if indices else None
        if index is None:
            (prefix if previous < 0 else suffix).append(node)
            if previous >= 0:
                previous = num_sampled  # nothing of a layer may come after the suffix starts
            continue
        if index < previous or index > previous + 1 or (index == previous + 1 and suffix):
            return None
        previous = index
        runs[index].append(node)
    if previous != num_sampled - 1 and previous != num_sampled or any(not run for run in runs):
        return None
    owner = {n: i for i, run in enumerate(runs) for n in run}
    hidden_out = []
    for i, run in enumerate(runs):
        outside = [n for n in run if any(owner.get(u) != i for u in n.users)]
        if len(outside) != 1:
            return None
        allowed = {i + 1} if i + 1 < num_sampled else {None}
        if any(owner.get(u) not in allowed and owner.get(u) != i for u in outside[0].users):
            return None
        hidden_out.append(outside[0])
        for node in run:
            for arg in node.all_input_nodes:
                source = owner.get(arg, state_layer.get(arg))
                if source not in (None, i, i - 1) or (
                    source == i - 1 and arg in owner and arg is not hidden_out[i - 1]
                ):
                    return None
                if arg in state_layer and state_layer[arg] != i:
                    return None
    if any(
        owner.get(arg, num_sampled - 1) != num_sampled - 1
        for n in suffix
        for arg in n.all_input_nodes
    ):
        return None
    return _Layout(
        prefix=prefix, layers=runs, suffix=suffix, hidden_out=hidden_out, state_layer=state_layer
    )


def _name_strides(template: list[fx.Node], following: list[fx.Node]) -> dict[str, int] | None:
    """Per name base (``linear`` of ``linear_7``), how far its counter moves per layer."""
    if len(template) != len(following):
        return None
    strides: dict[str, int] = {}
    for a, b in zip(template, following):
        base_a, num_a = _split_name(a.name)
        base_b, num_b = _split_name(b.name)
        if base_a != base_b or strides.setdefault(base_a, num_b - num_a) != num_b - num_a:
            return None
    return strides


def _split_name(name: str) -> tuple[str, int]:
    match = _NAME_NUMBER.match(name)
    return (match.group(1), int(match.group(2))) if match else (name, 0)


def _shift_name(name: str, strides: dict[str, int], layers: int) -> str:
    base, num = _split_name(name)
    step = strides.get(base, 0)
    if step == 0 or layers == 0:
        return name
    num += step * layers
    return f"{base}_{num}" if num else base


def _rename_state(name: str, path: str, old: int, new: int) -> str:
    if old == new:
        return name
    old_token = re.sub(r"\W", "_", f"{path}.{old}.")
    if old_token not in name:
        raise _SpliceError(f"placeholder {name} does not name {path}.{old}")
    return name.replace(old_token, re.sub(r"\W", "_", f"{path}.{new}."), 1)


@functools.lru_cache(maxsize=65536)
def _rename_path(text: str, path: str, old: int, new: int) -> str:
    return re.sub(rf"(?<![A-Za-z0-9]){re.escape(path)}\.{old}(?=\.|$)", f"{path}.{new}", text)


def _copy_node(
    graph: fx.Graph,
    node: fx.Node,
    lookup: Callable[[fx.Node], fx.Node],
    name: str,
    path: str,
    moved: tuple[int, int] | None,
) -> fx.Node:
    args = fx.map_arg(node.args, lookup)
    kwargs = fx.map_arg(node.kwargs, lookup)
    new = graph.create_node(node.op, node.target, args, kwargs, name=name, type_expr=node.type)
    if new.name != name:
        raise _SpliceError(f"node name {name} taken")
    new.meta = copy.copy(node.meta)
    if moved is not None and moved[0] != moved[1] and "nn_module_stack" in node.meta:
        old, to = moved
        new.meta["nn_module_stack"] = {
            _rename_path(key, path, old, to): (_rename_path(str(p), path, old, to), cls)
            for key, (p, cls) in node.meta["nn_module_stack"].items()
        }
    return new


def _fake_mode(sample: torch.export.ExportedProgram) -> Any:
    for node in sample.graph.nodes:
        fake_mode = getattr(node.meta.get("val"), "fake_mode", None)
        if fake_mode is not None:
            return fake_mode
    raise _SpliceError("no fake values in the exported graph")


def _fresh_fake(fake_mode: Any, like: torch.Tensor) -> torch.Tensor:
    # Each placeholder needs its own fake tensor (one object for two inputs reads as aliasing);
    # this is 100x cheaper than fake_mode.from_tensor on a meta parameter.
    with fake_mode:
        fresh = torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device=like.device)
    return fresh.requires_grad_(like.requires_grad)


def _assemble(
    sample: torch.export.ExportedProgram,
    model: nn.Module,
    graph: fx.Graph,
    input_specs: list[InputSpec],
    env: dict[fx.Node, fx.Node],
    path: str,
    last: int,
    extra: int,
) -> torch.export.ExportedProgram | None:
    by_name = {n.name: n for n in sample.graph.nodes}
    output_specs = []
    for spec in sample.graph_signature.output_specs:
        if spec.kind != OutputKind.USER_OUTPUT:
            return None  # buffer mutations and the like: not replicated
        if isinstance(spec.arg, TensorArgument):
            spec = dataclasses.replace(
                spec, arg=TensorArgument(name=env[by_name[spec.arg.name]].name)
            )
        output_specs.append(spec)
    state_dict: dict[str, Any] = {}
    constants = dict(sample.constants)
    for spec in input_specs:
        if spec.kind == InputKind.PARAMETER:
            state_dict[spec.target] = model.get_parameter(spec.target)
        elif spec.kind == InputKind.BUFFER and spec.persistent:
            state_dict[spec.target] = model.get_buffer(spec.target)
        elif spec.kind == InputKind.BUFFER and spec.target not in constants:
            constants[spec.target] = model.get_buffer(spec.target)
    module_call_graph = _grow_call_graph(sample.module_call_graph, path, last, extra)
    if module_call_graph is None:
        return None
    try:
        return torch.export.ExportedProgram(
            root=sample.graph_module,
            graph=graph,
            graph_signature=ExportGraphSignature(
                input_specs=input_specs, output_specs=output_specs
            ),
            state_dict=state_dict,
            range_constraints=sample.range_constraints,
            module_call_graph=module_call_graph,
            example_inputs=sample.example_inputs,
            constants=constants,
            verifiers=list(sample.verifiers),
        )
    except Exception:  # the verifier refused the spliced program: export the whole model
        return None


def _grow_call_graph(entries: list[Any], path: str, last: int, extra: int) -> list[Any] | None:
    def in_layer(fqn: str, index: int) -> bool:
        return fqn == f"{path}.{index}" or fqn.startswith(f"{path}.{index}.")

    template = [e for e in entries if in_layer(e.fqn, 1)]
    if any(e.signature is not None for e in template):
        return None
    out: list[Any] = []
    inserted = False
    for entry in entries:
        if in_layer(entry.fqn, last):
            if entry.signature is not None:
                return None
            if not inserted:
                inserted = True
                for layer in range(last, last + extra):
                    out.extend(
                        dataclasses.replace(e, fqn=_rename_path(e.fqn, path, 1, layer))
                        for e in template
                    )
            entry = dataclasses.replace(
                entry, fqn=_rename_path(entry.fqn, path, last, last + extra)
            )
        out.append(entry)
    return out
