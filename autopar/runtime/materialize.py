"""This rank's blocks of a model's tensors: where :class:`~autopar.runtime.module.ParallelModule`
takes its parameters and buffers from (the original model, a full state dict, or a
:class:`~autopar.runtime.state.StateSource` for a model built on the meta device), and the two
conversions between a full tensor and this rank's block (:func:`local_block`, :func:`gather_full`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from autopar.lowering.rewrite import LoweredGraph
from autopar.placement import (
    Partial,
    Placements,
    SectionShard,
    Shard,
    format_placements,
    replicated,
)
from autopar.resharding.sections import (
    from_rank_major,
    sections_of,
    select_sections,
    without_sections,
)
from autopar.runtime.state_source import StateSource, block_index

__all__ = ["SourceState", "container", "gather_full", "local_block", "read_source"]


def local_block(
    full: torch.Tensor, placements: Placements, mesh_shape: Sequence[int], coords: Sequence[int]
) -> torch.Tensor:
    """This rank's block of ``full`` (a view; a copy under a SectionShard): axis 0 outermost when
    a dim is split over several axes."""
    block = full
    for axis, p in enumerate(placements):
        if isinstance(p, SectionShard):
            if any(size % mesh_shape[axis] for size in p.sections):
                raise ValueError(
                    f"sections {p.sections} do not split {mesh_shape[axis]} ways "
                    f"(placements {format_placements(placements)})"
                )
            block = select_sections(block, p.dim, p.sections, mesh_shape[axis], coords[axis])
        elif isinstance(p, Shard):
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
        if isinstance(p, (Shard, SectionShard)):
            group = group_of(axis)
            parts = [torch.empty_like(value) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, value, group=group)
            value = torch.cat(parts, dim=p.dim)
            if isinstance(p, SectionShard):
                value = from_rank_major(value, p.dim, p.sections, len(parts))
        elif isinstance(p, Partial):
            group = group_of(axis)
            value = value.clone()
            dist.all_reduce(value, group=group)
    return value


@dataclass(kw_only=True, slots=True)
class SourceState:
    """The source's tensors under the original names, checked against the lowered graph."""

    full: dict[str, torch.Tensor]
    """Name -> full tensor (every name of a tied parameter)."""
    persistent: set[str]
    """Names a state dict holds (parameters and persistent buffers)."""
    requires_grad: dict[str, bool]
    """Parameter name -> requires_grad (empty for a state-dict source)."""
    canonical: dict[str, str]
    """Name -> canonical name (tied parameters share one); absent: itself."""
    is_param: dict[str, bool]
    read_as: dict[str, str]
    """Canonical parameter name -> the name a state source holds it under."""

    def key(self, name: str) -> str:
        """The canonical name of ``name``."""
        return self.canonical.get(name, name)


def read_source(
    lowered: LoweredGraph,
    source: nn.Module | Mapping[str, torch.Tensor],
    state_source: StateSource | None,
) -> SourceState:
    """The source's tensors and names (ValueError on a tensor the graph needs and the source
    lacks, or a state source that does not match)."""
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
    read_as = _check_state_source(state_source, full, persistent, canonical, is_param)
    return SourceState(
        full=full,
        persistent=persistent,
        requires_grad=requires_grad,
        canonical=canonical,
        is_param=is_param,
        read_as=read_as,
    )


def read_block(
    state_source: StateSource,
    name: str,
    shape: Sequence[int],
    placements: Placements,
    mesh_shape: Sequence[int],
    coords: Sequence[int],
) -> torch.Tensor:
    """This rank's block of ``name`` read from ``state_source``; a section-sharded one is read
    whole along its sections' dim (one block without that axis) and its pieces selected."""
    found = sections_of(placements)
    if found is None:
        return state_source.read(name, block_index(shape, placements, mesh_shape, coords))
    axis, p = found
    index = block_index(shape, without_sections(placements), mesh_shape, coords)
    whole = state_source.read(name, index)
    return select_sections(whole, p.dim, p.sections, mesh_shape[axis], coords[axis])


def param_block_index(
    lowered: LoweredGraph, src: SourceState, key: str, coords: Sequence[int]
) -> tuple[slice, ...]:
    """The region of canonical parameter ``key``'s full tensor that is this rank's block."""
    placements = lowered.param_placements.get(key, replicated(len(lowered.mesh_shape)))
    shape = src.full[src.read_as[key]].shape
    return block_index(shape, placements, lowered.mesh_shape, coords)


def flat_reader(
    lowered: LoweredGraph, src: SourceState, state_source: StateSource, coords: Sequence[int]
) -> Callable[[str, int, int], torch.Tensor]:
    """``read_flat(key, lo, hi)``: flat elements [lo, hi) of parameter ``key``'s local block,
    read from ``state_source`` as fp32 (what ZeRO fills its chunks from)."""

    def read_flat(key: str, lo: int, hi: int) -> torch.Tensor:
        placements = lowered.param_placements.get(key, replicated(len(lowered.mesh_shape)))
        if sections_of(placements) is not None:
            shape = src.full[src.read_as[key]].shape
            block = read_block(
                state_source, src.read_as[key], shape, placements, lowered.mesh_shape, coords
            )
            return block.reshape(-1)[lo:hi].to(torch.float32)
        index = param_block_index(lowered, src, key, coords)
        value = state_source.read_flat(src.read_as[key], index, lo, hi)
        return value.to(torch.float32)

    return read_flat


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


def container(root: nn.Module, fqn: str) -> nn.Module:
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
