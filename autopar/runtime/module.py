"""ParallelModule: a lowered graph with this rank's parameter shards, under the original names.

Each rank materializes only its own block of every parameter and buffer (the full tensor sliced
per its planned placement and this rank's mesh coordinate) and registers it under the ORIGINAL
FQN: plain ``nn.Module`` containers mirror the original module paths, so ``named_parameters()``
yields exactly the original names (a tied parameter is one Parameter registered under each of
its names, and deduplicated like in the original model). Any torch optimizer works on the local
shards.

Parameter gradients that are Partial over some mesh axes are summed after each backward by a
:class:`~autopar.runtime.grad_sync.GradReducer` (chunked, overlapped with backward), so a
training step is ``loss.backward(); opt.step()``.

``state_dict()`` returns the FULL unsharded tensors (all-gathered over the sharded axes, a
collective every rank must call); ``load_state_dict(full)`` takes full tensors and keeps this
rank's slice. ``state_dict(sharded=True)`` returns per-FQN DTensors of this rank's real shards
for ``torch.distributed.checkpoint``, and ``load_state_dict`` takes that form back
(:mod:`autopar.runtime.state`). A model built on the meta device is materialized shard by shard
from a ``state_source`` (a full state dict or a safetensors file).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import _IncompatibleKeys
from torch.utils._pytree import tree_flatten, tree_unflatten

from autopar.lowering.rewrite import LoweredGraph
from autopar.placement import Placements, SectionShard, Shard, format_placements, replicated
from autopar.runtime.grad_sync import DEFAULT_BUCKET_BYTES, GradReducer
from autopar.runtime.materialize import (
    SourceState,
    container,
    flat_reader,
    gather_full,
    local_block,
    read_block,
    read_source,
)
from autopar.runtime.norms import clip_grad_norm_
from autopar.runtime.state import (
    StateSource,
    block_index,
    load_sharded_state_dict,
    sharded_state_dict,
)
from autopar.runtime.zero import ShardedGradScaler, ZeroEngine, build_zero_engine

__all__ = ["ParallelModule", "gather_full", "local_block"]


class ParallelModule(nn.Module):
    """Runs a :class:`LoweredGraph` on this rank's shards (module docstring).

    Args:
        lowered: the result of ``autopar.lowering.lower``.
        source: the original model (preferred: it also provides non-persistent buffers and tied
            names) or a full state dict under the original FQNs.
        groups: this rank's ``AxisGroups`` (coordinate and process group per mesh axis), the
            one registered under ``lowered.group_key``.
        grad_bucket_bytes: size of the flat buckets of the gradient all-reduce.
        zero_stage: 0 (gradients all-reduced, as above) or 1-3: ZeRO on ``zero_axes`` with
            parameters in flat chunks of ``chunk_bytes`` (None: searched), see
            :mod:`autopar.runtime.zero`; ``parameters()`` then yields 1-D shard views. Or one
            stage per mesh axis (a sequence; ``zero_axes`` must then be None).
        zero_axes: mesh axes to shard over (None: the axes parameter gradients are summed over).
        mixed_precision: None, "bf16" or "fp16" (half compute, fp32 master shards and
            reduction; at ``zero_stage=0`` the masters live in ZeRO-1 chunks over the
            data-parallel axes, whole where a parameter has none; fp16 also needs loss
            scaling with ``grad_scaler`` / ``scale_loss``).
        state_source: where the values come from when ``source`` is a model built on the
            meta device (:class:`~autopar.runtime.state.StateSource`: a full state dict or a
            safetensors file): each rank reads only its blocks (under ZeRO stage 3 only the
            rows covering its chunk pieces) onto ``device`` (default: this rank's CUDA device
            under NCCL, else CPU). Non-persistent buffers it lacks are taken from ``source``
            if they are not on meta, else refused by name.
        zero_alone: FQNs given a ZeRO chunk each (weights tied across pipeline stages).

    Attributes (besides the parameters and buffers under their original names): ``lowered``,
    ``groups``, ``coords`` (this rank's mesh coordinate) and ``grad_reducer`` (the
    :class:`~autopar.runtime.grad_sync.GradReducer` that sums Partial parameter gradients after
    each backward). The train/eval mode is the one the graph was captured in.
    """

    def __init__(
        self,
        lowered: LoweredGraph,
        source: nn.Module | Mapping[str, torch.Tensor],
        groups: Any,
        *,
        grad_bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        zero_stage: int | Sequence[int] = 0,
        zero_axes: Sequence[int] | None = None,
        chunk_bytes: int | None = None,
        mixed_precision: str | None = None,
        state_source: StateSource | None = None,
        device: torch.device | str | None = None,
        zero_alone: Collection[str] = (),
    ) -> None:
        super().__init__()
        self.lowered = lowered
        self.groups = groups
        self.coords = tuple(int(c) for c in groups.coordinate)
        # The graph's train/eval mode is fixed at capture (dropout, batch norm): one lowered
        # graph per mode, the other one built on first use by ``attach_mode_lowering``'s hook.
        self.training = source.training if isinstance(source, nn.Module) else True
        self._captured_mode = self.training
        self._mode_graphs: dict[bool, LoweredGraph] = {self.training: lowered}
        self._lower_mode: Callable[[bool], LoweredGraph] | None = None
        self.plan: Any = None
        """The Plan this module was lowered from (set by ``autopar.autoparallelize``)."""
        src = read_source(lowered, source, state_source)
        if device is None:
            on_cuda = groups.device_mesh.device_type == "cuda"
            device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else "cpu"
        self._params: dict[str, nn.Parameter] = {}
        self._buffer_placements: dict[str, Placements] = {}
        self._param_placements: dict[str, Placements] = {}
        self._persistent: set[str] = {name for name in src.full if name in src.persistent}
        self._register_blocks(src, state_source, device)

        # ZeRO (autopar.runtime.zero): chunk parameters are replaced by their shard views.
        self.zero: ZeroEngine | None = None
        self._split_axes: dict[int, tuple[int, ...]] | None = None
        zero_on = bool(zero_stage) if isinstance(zero_stage, int) else any(zero_stage)
        if mixed_precision is not None and not zero_on:
            # The fp32 master weights live in ZeRO chunks: stage 1 over the data-parallel axes
            # (the planner prices stage 0 and 1 alike in time; stage 1 holds less), chunks of
            # no axes where a parameter has none to shard over (autopar.runtime.zero).
            zero_stage, zero_axes, zero_on = 1, None, True
        if zero_on:
            self.zero = build_zero_engine(
                lowered,
                self._params,
                self.coords,
                self._axis_group,
                stage=zero_stage if isinstance(zero_stage, int) else tuple(zero_stage),
                zero_axes=zero_axes,
                chunk_bytes=chunk_bytes,
                mixed_precision=mixed_precision,
                read_flat=(
                    None
                    if state_source is None
                    else flat_reader(lowered, src, state_source, self.coords)
                ),
                device=device,
                axis_names=groups.axis_names,
                alone=zero_alone,
            )
            for name in self._param_placements:
                shard = self.zero.shard_params.get(src.key(name))
                if shard is not None:
                    container(self, name).register_parameter(name.rpartition(".")[2], shard)
                    self._params[src.key(name)] = shard
        if state_source is not None:
            self._read_unheld(src, state_source, device)
        self.grad_scaler = ShardedGradScaler(
            [self._axis_group(a) for a, n in enumerate(lowered.mesh_shape) if n > 1],
            enabled=mixed_precision == "fp16",
        )
        """Loss scaling (:class:`~autopar.runtime.zero.ShardedGradScaler`): enabled under fp16
        mixed precision, a pass-through otherwise."""
        self.grad_reducer = GradReducer(
            [
                (self._params[fqn], lowered.param_grad_reduce_axes.get(fqn, ()))
                for fqn in lowered.param_use_order
                if fqn in self._params and (self.zero is None or fqn not in self.zero.shard_params)
            ],
            self._axis_group,
            bucket_bytes=grad_bucket_bytes,
            axis_names=groups.axis_names,
        )

    def _register_blocks(
        self, src: SourceState, state_source: StateSource | None, device: torch.device | str
    ) -> None:
        """Register this rank's block of every source tensor under its original name (a
        parameter from a state source: a meta placeholder, read later)."""
        lowered = self.lowered
        num_axes = len(lowered.mesh_shape)
        for name, tensor in src.full.items():
            leaf_name = name.rpartition(".")[2]
            if not src.is_param[name]:
                placements = lowered.buffer_placements.get(name, replicated(num_axes))
                if state_source is not None and name in state_source:
                    index = block_index(tensor.shape, placements, lowered.mesh_shape, self.coords)
                    block = state_source.read(name, index).to(device=device, dtype=tensor.dtype)
                else:
                    block = local_block(
                        tensor.detach(), placements, lowered.mesh_shape, self.coords
                    ).clone()
                container(self, name).register_buffer(
                    leaf_name, block, persistent=name in src.persistent
                )
                self._buffer_placements[name] = placements
                continue
            key = src.key(name)
            placements = lowered.param_placements.get(key, replicated(num_axes))
            param = self._params.get(key)
            if param is None:
                block = local_block(tensor.detach(), placements, lowered.mesh_shape, self.coords)
                # From a state source: a meta placeholder now, read below (or by ZeRO).
                block = block.clone() if state_source is None else block.to("meta")
                param = nn.Parameter(block, requires_grad=src.requires_grad.get(name, True))
                self._params[key] = param
            container(self, name).register_parameter(leaf_name, param)
            self._param_placements[name] = placements

    def _read_unheld(
        self, src: SourceState, state_source: StateSource, device: torch.device | str
    ) -> None:
        """Read the parameters ZeRO does not hold from the state source, each as its whole
        tensor-parallel block."""
        for key, param in list(self._params.items()):
            if param.is_meta:
                shape = src.full[src.read_as[key]].shape
                placements = self.lowered.param_placements.get(key, replicated(len(self.coords)))
                mesh_shape = self.lowered.mesh_shape
                value = read_block(
                    state_source, src.read_as[key], shape, placements, mesh_shape, self.coords
                )
                self._params[key] = nn.Parameter(
                    value.to(device=device, dtype=param.dtype),
                    requires_grad=param.requires_grad,
                )
        for name in self._param_placements:
            param = self._params[src.key(name)]
            container(self, name).register_parameter(name.rpartition(".")[2], param)

    def attach_mode_lowering(self, lower_mode: Callable[[bool], LoweredGraph]) -> None:
        """Let the module switch train/eval: ``lower_mode(training)`` must return the graph of
        that mode lowered with the SAME parameter, buffer and input placements (collective: it is
        called on every rank at the first forward in the new mode)."""
        self._lower_mode = lower_mode

    def _use_mode_graph(self) -> None:
        """Point ``self.lowered`` at the graph of the current ``self.training`` mode."""
        mode = self.training
        lowered = self._mode_graphs.get(mode)
        if lowered is None:
            if self._lower_mode is None:
                captured = "train" if not mode else "eval"
                raise RuntimeError(
                    f"this ParallelModule was lowered from a graph captured in {captured} mode "
                    f"and cannot build the other one; build it with autopar.autoparallelize "
                    f"(which captures the other mode on first use) or call .train({not mode})"
                )
            lowered = self._lower_mode(mode)
            first = next(iter(self._mode_graphs.values()))
            if (
                lowered.param_placements != first.param_placements
                or lowered.input_placements != first.input_placements
            ):
                raise AssertionError("the other mode's graph must keep the parameter layouts")
            self._mode_graphs[mode] = lowered
        # The gradient reducer follows the captured mode's graph.
        reduced_by = self._mode_graphs[self._captured_mode].param_grad_reduce_axes
        if torch.is_grad_enabled() and lowered.param_grad_reduce_axes != reduced_by:
            raise RuntimeError(
                f"in {'train' if mode else 'eval'} mode this plan reduces parameter gradients "
                f"over other mesh axes than the gradient reducer does; evaluate under "
                f"torch.no_grad(), or train in the mode the model was captured in"
            )
        self.lowered = lowered

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Context for all but the last micro-batch of gradient accumulation (as in DDP): the
        backward calls inside skip the gradient reduction; the next one outside reduces the sum."""
        if self.zero is None:
            return self.grad_reducer.no_sync()
        stack = contextlib.ExitStack()
        stack.enter_context(self.grad_reducer.no_sync())
        stack.enter_context(self.zero.no_sync())
        return stack

    def reduce_accumulated_grads(self) -> None:
        """Reduce now, outside any backward, the gradients that backward passes under
        :meth:`no_sync` accumulated (what the next synchronised backward would have reduced):
        for pipeline schedules whose weight passes run no gradient hooks. A collective."""
        self.grad_reducer.reduce_now()
        if self.zero is not None:
            self.zero.reducer.reduce_pending()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the fp16 loss scale (``self.grad_scaler.scale``; identity unless
        ``mixed_precision="fp16"``); then ``self.grad_scaler.step(opt)`` and ``.update()``."""
        return self.grad_scaler.scale(loss)

    def split_groups(self, param: torch.Tensor) -> tuple[Any, ...]:
        """Process groups over which ``param``'s full value is split (its tensor-parallel Shard
        axes and, under ZeRO, its chunk's axes): reduce a partial norm over each, once."""
        if self._split_axes is None:
            self._split_axes = {}
            for name, p in self.named_parameters():
                axes = {
                    a
                    for a, x in enumerate(self._param_placements[name])
                    if isinstance(x, (Shard, SectionShard))
                }
                if self.zero is not None:
                    axes |= set(self.zero.zero_axes_of(p))
                self._split_axes[id(p)] = tuple(sorted(axes))
        return tuple(
            self._axis_group(a)
            for a in self._split_axes[id(param)]
            if self.lowered.mesh_shape[a] > 1
        )

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip gradients by the global norm over every shard on every axis (replicated parts
        counted once); returns the total norm (the same on every rank)."""
        return clip_grad_norm_(
            list(self.parameters()), max_norm, norm_type, split_groups=self.split_groups
        )

    def _axis_group(self, axis: int) -> Any:
        return self.groups.groups[axis]

    # ----------------------------------------------------------------------------------------
    # Inputs

    def _flatten_inputs(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[list[Any], Any]:
        kwargs = _reorder_kwargs(kwargs, self.lowered.in_spec)
        leaves, spec = tree_flatten((args, kwargs))
        expected = len(self.lowered.input_placements)
        if len(leaves) != expected:
            raise ValueError(
                f"the model was captured with {expected} input leaves (args and kwargs flattened) "
                f"but got {len(leaves)}; call it with the same arguments as the example inputs"
            )
        return leaves, spec

    def shard_inputs(self, *args: Any, **kwargs: Any) -> Any:
        """Cut the GLOBAL batch into this rank's local inputs, per the planned input placements.

        Returns a tuple of args, or ``(args, kwargs)`` when keyword inputs were given.
        """
        leaves, spec = self._flatten_inputs(args, kwargs)
        local: list[Any] = []
        for i, leaf in enumerate(leaves):
            placements = self.lowered.input_placements[i]
            if isinstance(leaf, torch.Tensor) and placements is not None:
                expected = self.lowered.global_input_shapes[i]
                if tuple(leaf.shape) != expected:
                    raise ValueError(
                        f"global input {self.lowered.input_names[i]!r} has shape {tuple(leaf.shape)} but the "
                        f"plan was made for {expected}; plan again for other shapes"
                    )
                leaf = local_block(leaf, placements, self.lowered.mesh_shape, self.coords)
            local.append(leaf)
        local_args, local_kwargs = tree_unflatten(local, spec)
        return (tuple(local_args), dict(local_kwargs)) if kwargs else tuple(local_args)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run on this rank's LOCAL inputs (see :meth:`shard_inputs`)."""
        self._use_mode_graph()
        leaves, _ = self._flatten_inputs(args, kwargs)
        for i, leaf in enumerate(leaves):
            expected = self.lowered.local_input_shapes[i]
            if (
                expected is not None
                and isinstance(leaf, torch.Tensor)
                and tuple(leaf.shape) != expected
            ):
                raise ValueError(
                    f"input {self.lowered.input_names[i]!r} has shape {tuple(leaf.shape)} but this rank expects "
                    f"its local shape {expected} (global {self.lowered.global_input_shapes[i]} laid out as "
                    f"{format_placements(self.lowered.input_placements[i])}); cut the global batch with "
                    f"shard_inputs()"
                )
        values: list[Any] = []
        for source in self.lowered.placeholders:
            if source.kind == "param":
                values.append(self._params[source.fqn])
            elif source.kind == "buffer":
                # Looked up per call: Module.to() / cuda() replace buffer tensors.
                values.append(self.get_buffer(source.fqn))
            else:
                values.append(leaves[source.index])
        run = self.lowered.gm if self.zero is None else self.zero.graph_for(self.lowered)
        outputs = run(*values)
        return tree_unflatten(list(outputs), self.lowered.out_spec)

    # ----------------------------------------------------------------------------------------
    # Full state dict <-> local shards

    def state_dict(
        self,
        *args: Any,
        destination: Any = None,
        prefix: str = "",
        keep_vars: bool = False,
        sharded: bool = False,
    ) -> Any:
        """The FULL (unsharded) state dict under the original names; every rank must call it.

        With ``sharded=True``: per FQN a DTensor of this rank's shard, nothing gathered (what
        ``torch.distributed.checkpoint`` saves and loads across meshes; see
        :func:`autopar.runtime.state.sharded_state_dict`).
        """
        if args:
            raise TypeError("ParallelModule.state_dict takes keyword arguments only")
        out: Any = OrderedDict() if destination is None else destination
        if sharded:
            shards = sharded_state_dict(self)
            out.update((prefix + name, value) for name, value in shards.items())
            return out
        gathered: dict[int, torch.Tensor] = {}
        zero_local = self.zero.local_params() if self.zero is not None else {}
        for name, tensor in self._named_state():
            if name not in self._persistent:
                continue
            tensor = zero_local.get(id(tensor), tensor)
            placements = self._param_placements.get(name) or self._buffer_placements[name]
            key = id(tensor)
            if key not in gathered:
                gathered[key] = gather_full(tensor, placements, self._axis_group)
            out[prefix + name] = gathered[key]
        return out

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load FULL tensors (each rank keeps its block), or the sharded form of
        ``state_dict(sharded=True)`` (DTensors, e.g. filled by ``dcp.load``; a collective)."""
        if any(isinstance(v, DTensor) for v in state_dict.values()):
            return load_sharded_state_dict(self, state_dict, strict=strict)
        own = dict(self._named_state())
        missing = [name for name in own if name in self._persistent and name not in state_dict]
        unexpected = [name for name in state_dict if name not in own]
        if strict and (missing or unexpected):
            raise RuntimeError(
                f"ParallelModule.load_state_dict: missing keys {missing}, unexpected keys {unexpected}"
            )
        with torch.no_grad():
            for name, value in state_dict.items():
                if name not in own:
                    continue
                placements = self._param_placements.get(name) or self._buffer_placements[name]
                block = local_block(value, placements, self.lowered.mesh_shape, self.coords)
                if self.zero is not None and self.zero.manages(own[name]):
                    self.zero.load_local(own[name], block)
                else:
                    own[name].copy_(block)
        return _IncompatibleKeys(missing, unexpected)

    def _named_state(self) -> list[tuple[str, torch.Tensor]]:
        """(name, local tensor) in ``nn.Module.state_dict`` order: per module in pre-order, its
        parameters then its buffers; a tied parameter under each of its names."""
        named: list[tuple[str, torch.Tensor]] = []
        for module_name, module in self.named_modules(remove_duplicate=False):
            prefix = f"{module_name}." if module_name else ""
            for name, tensor in (*module._parameters.items(), *module._buffers.items()):
                if tensor is not None:
                    named.append((prefix + name, tensor))
        return named


def _reorder_kwargs(kwargs: dict[str, Any], in_spec: Any) -> dict[str, Any]:
    if not kwargs:
        return {}
    if in_spec is None:
        keys = list(kwargs)
    else:  # newer torch has TreeSpec.child and warns on children_specs; older has only that
        child = in_spec.child(1) if hasattr(in_spec, "child") else in_spec.children_specs[1]
        keys = list(child.context)
    if set(keys) != set(kwargs):
        raise ValueError(
            f"keyword inputs {sorted(kwargs)} differ from the captured ones {sorted(keys)}"
        )
    return {key: kwargs[key] for key in keys}
