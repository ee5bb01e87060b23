"""The chunks of the ZeRO runtime: packing parameters into flat fp32 chunks, the shard
parameters the optimizer sees, and where each parameter lives (see :mod:`autopar.runtime.zero`
for the layout: P, G and O and how a chunk is split over them).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn

from autopar.planner.chunks import pack_chunks, round_up
from autopar.runtime.zero_layout import Chunk, Slot, ZeroMesh

__all__ = ["ChunkStore"]

_Member = tuple[str, torch.Tensor]


class ChunkStore:
    """Owns the chunk buffers and the shard parameters viewing them.

    Args:
        params: ``(canonical fqn, local parameter, replicate axes R, grad-reduce axes)`` in
            order of first use (see :class:`autopar.runtime.zero.ZeroEngine`).
        stages: the ZeRO stage of each mesh axis.
        mesh: this rank's place on the mesh.
        chunk_bytes: the chunk size (buffers are content-sized up to it).
        compute_dtype: None (fp32) or the half dtype the kept buffers are held in.
        read_flat, device: fill meta-device parameters' chunks from a state source (see
            :class:`autopar.runtime.zero.ZeroEngine`).
        alone: FQNs packed each in a chunk of its own (a weight tied across pipeline stages:
            its shards then cover the same elements in every stage's engine).
    """

    def __init__(
        self,
        params: Sequence[tuple[str, torch.Tensor, tuple[int, ...], tuple[int, ...]]],
        *,
        stages: tuple[int, ...],
        mesh: ZeroMesh,
        chunk_bytes: int,
        compute_dtype: torch.dtype | None,
        read_flat: Callable[[str, int, int], torch.Tensor] | None,
        device: torch.device | None,
        alone: frozenset[str] = frozenset(),
    ) -> None:
        self.stages = stages
        self.mesh = mesh
        self.compute_dtype = compute_dtype
        self._read_flat = read_flat
        self._device = device
        self.chunks: list[Chunk] = []
        self.shard_params: dict[str, nn.Parameter] = {}
        self.chunk_of_param: dict[int, tuple[int, int]] = {}
        """id(shard parameter) -> (chunk index, slot index)."""
        # One stream of chunks per (replicate axes, partial axes), each in first-use order.
        streams: dict[tuple[Any, ...], list[_Member]] = {}
        for fqn, param, axes, reduce_axes in params:
            if param.dtype != torch.float32:
                raise ValueError(
                    f"ZeRO keeps fp32 chunks but {fqn} is {param.dtype}; build the model in fp32 "
                    f"(mixed precision is a runtime option)"
                )
            key = (tuple(axes), tuple(sorted(reduce_axes)), fqn if fqn in alone else "")
            streams.setdefault(key, []).append((fqn, param))
        first_use = {fqn: i for i, (fqn, _, _, _) in enumerate(params)}
        pending: list[tuple[int, int, tuple[int, ...], tuple[int, ...], list[_Member]]] = []
        for (axes, reduce_axes, _), members in streams.items():
            shards = math.prod(mesh.shape[a] for a in axes)
            chunk_numel = max(1, chunk_bytes // 4)
            numels = [p.numel() for _, p in members]
            for group in pack_chunks(numels, chunk_numel):
                # Content-sized buffers: shards stay balanced (a fixed-size chunk's empty tail
                # would all land on the last ranks' shards).
                numel = round_up(max(1, sum(numels[i] for i in group)), shards)
                first = first_use[members[group[0]][0]]
                pending.append((first, numel, axes, reduce_axes, [members[i] for i in group]))
        pending.sort(key=lambda item: item[0])
        for _, numel, axes, reduce_axes, members in pending:
            self._build_chunk(numel, axes, reduce_axes, members)

    def _layout(self, numel: int, axes: tuple[int, ...], reduce_axes: tuple[int, ...]) -> Chunk:
        """An empty chunk of ``numel`` elements split over ``axes`` by their stages."""
        mesh = self.mesh
        by_stage = [tuple(a for a in axes if self.stages[a] == s) for s in (3, 2, 1)]
        zero_axes = by_stage[0] + by_stage[1] + by_stage[2]
        num_p, num_g = len(by_stage[0]), len(by_stage[0]) + len(by_stage[1])
        grad_axes = zero_axes[:num_g]
        shard_numel = numel // math.prod(mesh.shape[a] for a in zero_axes)
        return Chunk(
            index=len(self.chunks),
            zero_axes=zero_axes,
            num_param_axes=num_p,
            num_grad_axes=num_g,
            scatter_axes=tuple(a for a in grad_axes if a in reduce_axes),
            allreduce_axes=tuple(a for a in zero_axes[num_g:] if a in reduce_axes)
            + tuple(a for a in reduce_axes if a not in zero_axes),
            numel=numel,
            shard_numel=shard_numel,
            shard_index=mesh.index(zero_axes),
            kept_numel=numel // math.prod(mesh.shape[a] for a in zero_axes[:num_p]),
            kept_index=mesh.index(zero_axes[:num_p]),
            shard_in_kept=mesh.index(zero_axes[num_p:]) * shard_numel,
            shard_in_grad=mesh.index(zero_axes[num_g:]) * shard_numel,
        )

    def _build_chunk(
        self,
        numel: int,
        axes: tuple[int, ...],
        reduce_axes: tuple[int, ...],
        members: list[_Member],
    ) -> None:
        chunk = self._layout(numel, axes, reduce_axes)
        kept_numel, shard_numel = chunk.kept_numel, chunk.shard_numel
        read = self._read_flat
        device = members[0][1].device if read is None else self._device
        kept = torch.zeros(kept_numel, dtype=torch.float32, device=device)
        kept_lo = chunk.kept_index * kept_numel
        lo = chunk.shard_index * shard_numel
        hi = lo + shard_numel
        offset = 0
        for fqn, param in members:
            n = param.numel()
            # Only the kept range is filled (from a state source, only it is read).
            a, b = max(offset, kept_lo), min(offset + n, kept_lo + kept_numel)
            if a < b:
                if read is None:
                    value = param.detach().reshape(-1)[a - offset : b - offset]
                else:
                    value = read(fqn, a - offset, b - offset)
                kept[a - kept_lo : b - kept_lo].copy_(value.reshape(-1))
            a, b = max(offset, lo), min(offset + n, hi)
            if a >= b:
                a = b = lo
            chunk.slots.append(
                Slot(
                    fqn=fqn,
                    shape=param.shape,
                    offset=offset,
                    numel=n,
                    shard_lo=a - lo,
                    shard_hi=b - lo,
                    param_lo=max(a - offset, 0),
                )
            )
            offset += n
        s0 = chunk.shard_in_kept
        if self.compute_dtype is None:
            chunk.kept = kept
            chunk.shard = kept[s0 : s0 + shard_numel]
        else:
            chunk.shard = kept[s0 : s0 + shard_numel].clone()
            # No kept buffer only when O = P is non-empty (the shard is cast at each gather);
            # a chunk of no axes keeps its half copy like any chunk with P empty.
            gathered = chunk.zero_axes and len(chunk.zero_axes) == chunk.num_param_axes
            chunk.kept = None if gathered else kept.to(self.compute_dtype)
        if chunk.num_param_axes == 0:
            chunk.full = chunk.kept
        for k, slot in enumerate(chunk.slots):
            shard_param = nn.Parameter(
                chunk.shard[slot.shard_lo : slot.shard_hi],
                requires_grad=bool(members[k][1].requires_grad),
            )
            chunk.params.append(shard_param)
            self.shard_params[slot.fqn] = shard_param
            self.chunk_of_param[id(shard_param)] = (chunk.index, k)
        self.chunks.append(chunk)

    def compute_shard(self, chunk: Chunk) -> torch.Tensor:
        """The O-shard in the compute dtype."""
        assert chunk.shard is not None
        shard = chunk.shard.detach()
        return shard if self.compute_dtype is None else shard.to(self.compute_dtype)

    def compute_kept(self, chunk: Chunk) -> torch.Tensor:
        """The P-level buffer in the compute dtype (cast from the master shard when O = P)."""
        if chunk.kept is not None:
            return chunk.kept.detach()
        return self.compute_shard(chunk)

    def manages(self, param: torch.Tensor) -> bool:
        return id(param) in self.chunk_of_param

    def slot_of(self, param: torch.Tensor) -> tuple[Chunk, Slot]:
        """The chunk of a managed shard parameter and its slot there."""
        index, k = self.chunk_of_param[id(param)]
        return self.chunks[index], self.chunks[index].slots[k]

    def zero_axes_of(self, param: torch.Tensor) -> tuple[int, ...]:
        """The mesh axes a managed parameter's optimizer shards are split over (O, in split
        order; empty if not managed)."""
        entry = self.chunk_of_param.get(id(param))
        return self.chunks[entry[0]].zero_axes if entry is not None else ()

    def piece_of(self, param: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
        """The part of a full local block that this rank's shard parameter ``param`` holds."""
        _, slot = self.slot_of(param)
        n = slot.shard_hi - slot.shard_lo
        return block.detach().reshape(-1)[slot.param_lo : slot.param_lo + n]

    @property
    def padding_fraction(self) -> float:
        """Share of the chunk buffers that holds no parameter (padding to the shard count)."""
        total = sum(c.numel for c in self.chunks)
        used = sum(s.numel for c in self.chunks for s in c.slots)
        return (total - used) / total if total else 0.0
