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
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import _IncompatibleKeys
from torch.utils._pytree import tree_flatten, tree_unflatten

from autopar.lowering.rewrite import LoweredGraph
from autopar.placement import Partial, Placements, Shard, format_placements, replicated
from autopar.runtime.grad_sync import DEFAULT_BUCKET_BYTES, GradReducer
from autopar.runtime.norms import clip_grad_norm_
from autopar.runtime.state import (
    StateSource,
    block_index,
    load_sharded_state_dict,
    sharded_state_dict,
)
from autopar.runtime.zero import ShardedGradScaler, ZeroEngine, build_zero_engine

__all__ = ["ParallelModule", "gather_full", "local_block"]


def local_block(
    full: torch.Tensor, placements: Placements, mesh_shape: Sequence[int], coords: Sequence[int]
) -> torch.Tensor:
    """This rank's block of ``full`` (a view): axis 0 outermost when a dim is split over several axes."""
    block = full
    for axis, p in enumerate(placements):
        if isinstance(p, Shard):
            size = mesh_shape[axis]
            if block.shape[p.dim] % size:
                raise ValueError(
                    f"dim {p.dim} of size {block.shape[p.dim]} does not split {size} ways "
                    f"(placements {format_placements(placements)})"
                )
            block = block.chunk(size, dim=p.dim)[coords[axis]]
        elif isinstance(p, Partial):
            raise ValueError(
                f"cannot cut a full tensor into Partial placements {format_placements(placements)}; "
                f"plan parameters and inputs as Shard or Replicate"
            )
    return block


def gather_full(
    local: torch.Tensor, placements: Placements, group_of: Callable[[int], Any]
) -> torch.Tensor:
    """All-gather ``local`` over its sharded axes (innermost axis first) into the full tensor."""
    value = local.detach().contiguous()
    for axis in reversed(range(len(placements))):
        p = placements[axis]
        if isinstance(p, Shard):
            group = group_of(axis)
            parts = [torch.empty_like(value) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, value, group=group)
            value = torch.cat(parts, dim=p.dim)
        elif isinstance(p, Partial):
            group = group_of(axis)
            value = value.clone()
            dist.all_reduce(value, group=group)
    return value


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
            reduction; needs ``zero_stage >= 1``; fp16 also needs loss scaling with
            ``grad_scaler`` / ``scale_loss``).
        state_source: where the values come from when ``source`` is a model built on the
            meta device (:class:`~autopar.runtime.state.StateSource`: a full state dict or a
            safetensors file): each rank reads only its blocks (under ZeRO stage 3 only the
            rows covering its chunk pieces) onto ``device`` (default: this rank's CUDA device
            under NCCL, else CPU). Non-persistent buffers it lacks are taken from ``source``
            if they are not on meta, else refused by name.

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
        num_axes = len(lowered.mesh_shape)
        full, persistent, requires_grad = _full_tensors(source, lowered.non_persistent_buffers)
        if device is None:
            on_cuda = groups.device_mesh.device_type == "cuda"
            device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else "cpu"

        # Canonical name of every parameter name (tied parameters share one canonical name).
        canonical: dict[str, str] = {}
        for fqn, others in lowered.tied_params.items():
            for other in others:
                canonical[other] = fqn
        if isinstance(source, nn.Module):
            by_identity: dict[int, list[str]] = {}
            for name, param in source.named_parameters(remove_duplicate=False):
                by_identity.setdefault(id(param), []).append(name)
            for names in by_identity.values():
                first = next((n for n in names if n in lowered.param_placements), names[0])
                for name in names:
                    canonical[name] = first
        is_param = {
            name: name in requires_grad or canonical.get(name, name) in lowered.param_placements
            for name in full
        }
        present = {canonical.get(name, name) for name in full}
        missing = sorted((set(lowered.param_placements) | set(lowered.buffer_placements)) - present)
        if missing:
            raise ValueError(
                f"ParallelModule: the source lacks {', '.join(missing[:8])}; pass the original model "
                f"(non-persistent buffers are not in its state_dict) or a complete state dict"
            )

        read_as = _check_state_source(state_source, full, persistent, canonical, is_param)
        self._params: dict[str, nn.Parameter] = {}
        self._buffer_placements: dict[str, Placements] = {}
        self._param_placements: dict[str, Placements] = {}
        self._persistent: set[str] = {name for name in full if name in persistent}
        for name, tensor in full.items():
            leaf_name = name.rpartition(".")[2]
            if not is_param[name]:
                placements = lowered.buffer_placements.get(name, replicated(num_axes))
                if state_source is not None and name in state_source:
                    index = block_index(tensor.shape, placements, lowered.mesh_shape, self.coords)
                    block = state_source.read(name, index).to(device=device, dtype=tensor.dtype)
                else:
                    block = local_block(
                        tensor.detach(), placements, lowered.mesh_shape, self.coords
                    ).clone()
                _container(self, name).register_buffer(
                    leaf_name, block, persistent=name in persistent
                )
                self._buffer_placements[name] = placements
                continue
            key = canonical.get(name, name)
            placements = lowered.param_placements.get(key, replicated(num_axes))
            param = self._params.get(key)
            if param is None:
                block = local_block(tensor.detach(), placements, lowered.mesh_shape, self.coords)
                # From a state source: a meta placeholder now, read below (or by ZeRO).
                block = block.clone() if state_source is None else block.to("meta")
                param = nn.Parameter(block, requires_grad=requires_grad.get(name, True))
                self._params[key] = param
            _container(self, name).register_parameter(leaf_name, param)
            self._param_placements[name] = placements

        # ZeRO (autopar.runtime.zero): chunk parameters are replaced by their shard views.
        self.zero: ZeroEngine | None = None
        self._split_axes: dict[int, tuple[int, ...]] | None = None
        zero_on = bool(zero_stage) if isinstance(zero_stage, int) else any(zero_stage)
        if mixed_precision is not None and not zero_on:
            raise ValueError(
                "mixed_precision needs zero_stage >= 1 (fp32 master shards live in ZeRO chunks)"
            )

        def index_of(key: str) -> tuple[slice, ...]:
            placements = lowered.param_placements.get(key, replicated(num_axes))
            shape = full[read_as[key]].shape
            return block_index(shape, placements, lowered.mesh_shape, self.coords)

        def read_flat(key: str, lo: int, hi: int) -> torch.Tensor:
            assert state_source is not None
            value = state_source.read_flat(read_as[key], index_of(key), lo, hi)
            return value.to(torch.float32)

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
                read_flat=None if state_source is None else read_flat,
                device=device,
                axis_names=groups.axis_names,
            )
            for name in self._param_placements:
                shard = self.zero.shard_params.get(canonical.get(name, name))
                if shard is not None:
                    _container(self, name).register_parameter(name.rpartition(".")[2], shard)
                    self._params[canonical.get(name, name)] = shard
        if state_source is not None:
            # Parameters ZeRO does not hold are read as their whole tensor-parallel block.
            for key, param in list(self._params.items()):
                if param.is_meta:
                    value = state_source.read(read_as[key], index_of(key))
                    self._params[key] = nn.Parameter(
                        value.to(device=device, dtype=param.dtype),
                        requires_grad=param.requires_grad,
                    )
            for name in self._param_placements:
                param = self._params[canonical.get(name, name)]
                _container(self, name).register_parameter(name.rpartition(".")[2], param)
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
                    a for a, x in enumerate(self._param_placements[name]) if isinstance(x, Shard)
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
    keys = list(in_spec.children_specs[1].context) if in_spec is not None else list(kwargs)
    if set(keys) != set(kwargs):
        raise ValueError(
            f"keyword inputs {sorted(kwargs)} differ from the captured ones {sorted(keys)}"
        )
    return {key: kwargs[key] for key in keys}


def _full_tensors(
    source: nn.Module | Mapping[str, torch.Tensor], non_persistent: frozenset[str]
) -> tuple[dict[str, torch.Tensor], set[str], dict[str, bool]]:
    """(name -> full tensor, persistent names, parameter name -> requires_grad)."""
    if isinstance(source, nn.Module):
        full: dict[str, torch.Tensor] = {}
        requires_grad: dict[str, bool] = {}
        persistent: set[str] = set()
        for name, param in source.named_parameters(remove_duplicate=False):
            full[name] = param
            requires_grad[name] = param.requires_grad
            persistent.add(name)
        for module_name, module in source.named_modules(remove_duplicate=False):
            for buffer_name, buffer in module._buffers.items():
                if buffer is None:
                    continue
                name = f"{module_name}.{buffer_name}" if module_name else buffer_name
                full[name] = buffer
                if buffer_name not in module._non_persistent_buffers_set:
                    persistent.add(name)
        return full, persistent, requires_grad
    full = dict(source)
    return full, set(full) - non_persistent, {}


def _check_state_source(
    source: StateSource | None,
    full: Mapping[str, torch.Tensor],
    persistent: set[str],
    canonical: Mapping[str, str],
    is_param: Mapping[str, bool],
) -> dict[str, str]:
    """Canonical parameter name -> the name the source holds it under (any of its tied
    names); ValueError on a meta model without a source, missing or unexpected keys, or
    shapes that differ."""
    if source is None:
        meta = [name for name, tensor in full.items() if tensor.is_meta]
        if meta:
            raise ValueError(
                f"the model is on the meta device ({', '.join(meta[:4])}, ...): pass its weights "
                f"with state_dict= (a full state dict or a .safetensors path) so that each rank "
                f"materializes its own shards"
            )
        return {}
    read_as: dict[str, str] = {}
    for name in full:
        if is_param[name] and name in source:
            read_as.setdefault(canonical.get(name, name), name)
    missing = [
        name
        for name, tensor in full.items()
        if (canonical.get(name, name) not in read_as if is_param[name] else name not in source)
        and (is_param[name] or name in persistent or tensor.is_meta)
    ]
    unexpected = [name for name in source.keys() if name not in full]
    if missing or unexpected:
        buffers = [name for name in missing if name not in persistent and not is_param[name]]
        hint = (
            f"; {buffers} are non-persistent buffers (not in a saved state dict) and the model "
            f"holds them on meta: add them to the state dict, pass state_dict=[path, "
            f"{{name: tensor}}], or build the model so that those buffers are real"
            if buffers
            else ""
        )
        raise ValueError(
            f"state_dict= does not match the model: missing keys {missing}, unexpected keys "
            f"{unexpected}{hint}"
        )
    mismatched = [
        f"{name}: {tuple(source.shape(name))} in the state dict, {tuple(full[name].shape)} in "
        f"the model"
        for name in full
        if name in source and tuple(source.shape(name)) != tuple(full[name].shape)
    ]
    if mismatched:
        raise ValueError(f"state_dict= has other shapes than the model: {'; '.join(mismatched)}")
    return read_as


def _container(root: nn.Module, fqn: str) -> nn.Module:
    """The (created on demand) plain module that owns ``fqn``'s last component."""
    module = root
    path = fqn.split(".")[:-1]
    for part in path:
        child = module._modules.get(part)
        if child is None:
            child = nn.Module()
            module.add_module(part, child)
        module = child
    return module
