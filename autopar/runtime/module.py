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
rank's slice.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.modules.module import _IncompatibleKeys
from torch.utils._pytree import tree_flatten, tree_unflatten

from autopar.lowering.rewrite import LoweredGraph
from autopar.placement import Partial, Placements, Shard, format_placements, replicated
from autopar.runtime.grad_sync import DEFAULT_BUCKET_BYTES, GradReducer

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
    ) -> None:
        super().__init__()
        self.lowered = lowered
        self.groups = groups
        self.coords = tuple(int(c) for c in groups.coordinate)
        num_axes = len(lowered.mesh_shape)
        full, persistent, requires_grad = _full_tensors(source, lowered.non_persistent_buffers)

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

        self._params: dict[str, nn.Parameter] = {}
        self._buffer_placements: dict[str, Placements] = {}
        self._param_placements: dict[str, Placements] = {}
        self._persistent: set[str] = {name for name in full if name in persistent}
        for name, tensor in full.items():
            leaf_name = name.rpartition(".")[2]
            if not is_param[name]:
                placements = lowered.buffer_placements.get(name, replicated(num_axes))
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
                block = local_block(
                    tensor.detach(), placements, lowered.mesh_shape, self.coords
                ).clone()
                param = nn.Parameter(block, requires_grad=requires_grad.get(name, True))
                self._params[key] = param
            _container(self, name).register_parameter(leaf_name, param)
            self._param_placements[name] = placements

        self.grad_reducer = GradReducer(
            [
                (self._params[fqn], lowered.param_grad_reduce_axes.get(fqn, ()))
                for fqn in lowered.param_use_order
                if fqn in self._params
            ],
            self._axis_group,
            bucket_bytes=grad_bucket_bytes,
        )

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Context for all but the last micro-batch of gradient accumulation (as in DDP): the
        backward calls inside skip the gradient reduction; the next one outside reduces the sum."""
        return self.grad_reducer.no_sync()

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
        outputs = self.lowered.gm(*values)
        return tree_unflatten(list(outputs), self.lowered.out_spec)

    # ----------------------------------------------------------------------------------------
    # Full state dict <-> local shards

    def state_dict(
        self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False
    ) -> Any:
        """The FULL (unsharded) state dict under the original names; every rank must call it."""
        if args:
            raise TypeError("ParallelModule.state_dict takes keyword arguments only")
        out: Any = OrderedDict() if destination is None else destination
        gathered: dict[int, torch.Tensor] = {}
        for name, tensor in self._named_state():
            if name not in self._persistent:
                continue
            placements = self._param_placements.get(name) or self._buffer_placements[name]
            key = id(tensor)
            if key not in gathered:
                gathered[key] = gather_full(tensor, placements, self._axis_group)
            out[prefix + name] = gathered[key]
        return out

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load FULL tensors; each rank keeps its block."""
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
                own[name].copy_(
                    local_block(value, placements, self.lowered.mesh_shape, self.coords)
                )
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
