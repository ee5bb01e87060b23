"""Chunk-managed ZeRO over the data-parallel mesh axes, with a stage per mesh axis.

Parameters (this rank's tensor-parallel blocks, as ``ParallelModule`` holds them) are packed in
order of first use in forward into flat fp32 chunks (sizes: :mod:`autopar.planner.chunks`).

Stages per mesh axis. Each mesh axis ``a`` has a stage ``s[a]`` in {0, 1, 2, 3}. For a
parameter whose placement is Replicate on the set ``R`` of mesh axes of size > 1:

* ``P = {a in R: s[a] == 3}``: the parameters are sharded over P (all-gathered before use,
  freed after, gathered again for backward);
* ``G = {a in R: s[a] >= 2}``: the gradients are reduce-scattered over G (this rank keeps the
  piece of the chunk at its G coordinate) and all-reduced over the axes of ``R \\ G`` on which
  the gradient is a partial sum;
* ``O = {a in R: s[a] >= 1}``: the optimizer state (and the shard parameters the optimizer
  sees) is sharded over O.

``P <= G <= O``. A chunk (its parameters share R) is split hierarchically with P's axes
outermost, then ``G \\ P``, then ``O \\ G`` (each group in mesh-axis order; ``Chunk.zero_axes``
is that order), so this rank's O-shard is a contiguous sub-range of its G-shard, which is a
contiguous sub-range of its P-shard (the "kept" buffer). Per rank, ``N`` = chunk elements:

================  =================================  =====================================
state             kept                               collectives per step
================  =================================  =====================================
parameters        N / |P| (the kept buffer)          all-gather over P before forward and
                                                     again before backward (none if P = {})
gradients         N / |G|                            reduce-scatter over G, all-reduce over
                                                     the partial axes outside G
optimizer state   N / |O| (views into the O-shard)   all-gather of the updated O-shards over
                                                     ``O \\ P`` into the kept buffer after
                                                     each optimizer step
================  =================================  =====================================

The uniform configurations are the classic stages: stage k on axes S is ``s[a] = k`` for a in S
and 0 elsewhere (stage 1: P = G = {}; stage 2: P = {}; stage 3: P = G = O), and run exactly as
they did before per-axis stages existed. HSDP / ZeRO++ style is stage 3 on the intra-node axis and
2 (or 1, or 0) on the inter-node one: parameters are gathered only inside a node.

What the optimizer sees: one ``nn.Parameter`` per original parameter, a 1-D view of the part of
the parameter that lies in this rank's O-shard (possibly empty). Only elementwise optimizers
give the single-process result on such pieces (and ``autopar.optim``'s LAMB / LARS, which take
their norms over every piece); others are refused when they step.

Mechanism. :func:`autopar.runtime.zero_graph.rewrite_graph` copies the lowered graph and
inserts, before the first use of each chunk, one call of an autograd function that takes the
shard parameters and returns the full local parameters as views of the chunk's compute buffer
(P non-empty: all-gathered there, prefetching the next chunk; P empty: the kept buffer). Its
backward runs once every gradient of the chunk is complete: it flattens them and launches the
chunk's reduce-scatters over G and the first all-reduce (asynchronous, overlapped with the rest
of backward); a callback queued on the autograd engine waits for them at the end of backward,
runs the remaining all-reduces and sets the shard parameters' ``.grad`` (views of this rank's
O-shard of the reduced G-shard).

A gathered chunk (P non-empty) is freed when the graph's last view of it dies (fx drops dead
values); tensors that autograd saves for backward are packed by a ``saved_tensors_hooks`` pair as
(chunk, size, stride, offset) instead of the tensor, and unpacking in backward all-gathers the
chunk again (prefetching the previous one); it is freed when the chunk's backward ran.

Gradient accumulation: backward under :meth:`ZeroEngine.no_sync` adds the chunk's flat local
gradient to a pending buffer and communicates nothing; the next synchronised backward adds it in.

Mixed precision (``compute_dtype=torch.bfloat16`` or ``torch.float16``): the O-shards stay fp32
(the master weights the optimizer updates, with fp32 state); the kept buffer is held in the
compute dtype (refreshed after each step; when O = P there is none and the shard is cast before
gathering); the graph runs under ``torch.autocast``; gradients are flattened to fp32 before any
reduction. fp16 needs loss scaling: :class:`autopar.runtime.grad_scaler.ShardedGradScaler`.

The engine's backward, optimizer-step and state methods live in :mod:`.zero_backward`,
:mod:`.zero_step` and :mod:`.zero_state` (mixins of :class:`ZeroEngine`).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from autopar.comm.collective_check import run_collective, wait_collective
from autopar.planner.chunks import (
    DEFAULT_MAX_CHUNK_BYTES,
    MIN_CHUNKS,
    choose_chunk_bytes,
    chunk_numels,
    pack_chunks,
    round_up,
)
from autopar.runtime.grad_scaler import ShardedGradScaler
from autopar.runtime.zero_backward import MAX_IN_FLIGHT, ZeroBackwardMixin
from autopar.runtime.zero_graph import Packed, rewrite_graph
from autopar.runtime.zero_layout import Chunk, Slot, resolve_stages
from autopar.runtime.zero_state import ZeroStateMixin
from autopar.runtime.zero_step import (
    ELEMENTWISE_OPTIMIZERS,
    ZeroStepMixin,
    register_optimizer_hooks,
)

__all__ = [
    "DEFAULT_MAX_CHUNK_BYTES",
    "ELEMENTWISE_OPTIMIZERS",
    "MAX_IN_FLIGHT",
    "MIN_CHUNKS",
    "ShardedGradScaler",
    "ZeroEngine",
    "build_zero_engine",
    "chunk_numels",
    "choose_chunk_bytes",
    "pack_chunks",
    "resolve_stages",
]


class ZeroEngine(ZeroBackwardMixin, ZeroStepMixin, ZeroStateMixin):
    """Owns the chunks of one ParallelModule (module docstring).

    Args:
        params: ``(canonical fqn, local parameter, replicate axes R, grad-reduce axes)`` in
            order of first use; R lists the mesh axes of size > 1 with a ZeRO stage >= 1 on
            which the parameter is Replicate (non-empty).
        mesh_shape: size of each mesh axis.
        coords: this rank's mesh coordinate.
        group_of: mesh axis -> this rank's process group along it.
        stages: the ZeRO stage of each mesh axis (0-3; module docstring).
        stage: shorthand for the same stage on every axis; with ``stages``, only the label
            :attr:`stage` (the largest stage by default).
        chunk_bytes: chunk size; None = :func:`choose_chunk_bytes`.
        compute_dtype: None (fp32), ``torch.bfloat16`` or ``torch.float16`` (mixed precision:
            half compute, fp32 master shards, optimizer state and gradient reduction).
        read_flat: for parameters on the meta device, ``read_flat(fqn, lo, hi)`` returns flat
            elements [lo, hi) of the parameter's local block (see
            :class:`autopar.runtime.state.StateSource`); chunks are then allocated on ``device``
            and filled from it, reading only the range of this rank's kept buffer.
        device: where ``read_flat``'s chunks live.
        axis_names: the mesh axes' names (collective failures and check mode name the axis).
    """

    def __init__(
        self,
        *,
        params: Sequence[tuple[str, torch.Tensor, tuple[int, ...], tuple[int, ...]]],
        mesh_shape: Sequence[int],
        coords: Sequence[int],
        group_of: Callable[[int], Any],
        stages: Sequence[int] | None = None,
        stage: int | None = None,
        chunk_bytes: int | None = None,
        compute_dtype: torch.dtype | None = None,
        read_flat: Callable[[str, int, int], torch.Tensor] | None = None,
        device: torch.device | str | None = None,
        axis_names: Sequence[str] | None = None,
    ) -> None:
        if stages is None and stage is None:
            raise ValueError("give ZeroEngine stages= (one per mesh axis) or stage=")
        self.stages = resolve_stages(stage if stages is None else stages, len(mesh_shape))  # type: ignore[arg-type]
        self.stage = int(stage) if stage is not None else max(self.stages, default=0)
        """The largest per-axis stage (or the ``stage=`` given)."""
        if self.stage not in (1, 2, 3):
            raise ValueError(
                f"ZeRO stages {list(self.stages)} put no axis at stage 1-3 (stage 0 everywhere "
                f"is the all-reduce path: build no engine)"
            )
        self.compute_dtype = compute_dtype
        """None: compute in fp32 on the chunks; else forward runs under autocast to this dtype
        with parameters gathered or kept in it, from fp32 master shards."""
        self.mesh_shape = tuple(mesh_shape)
        self.axis_names = tuple(axis_names or (f"a{i}" for i in range(len(mesh_shape))))
        self._coords = tuple(coords)
        self._group_of = group_of
        self._read_flat = read_flat
        self._device = torch.device(device) if device is not None else None
        self.chunks: list[Chunk] = []
        self.shard_params: dict[str, nn.Parameter] = {}
        self._chunk_of_param: dict[int, tuple[int, int]] = {}
        self._sync = True
        self._callback_queued = False
        self._in_flight: list[Chunk] = []
        """Chunks whose asynchronous gradient reduction is launched and not yet waited for."""
        self._graphs: dict[int, tuple[Any, nn.Module]] = {}
        self.gathered_bytes = 0
        """Bytes of gathered chunk buffers (P non-empty) still alive."""
        self.peak_gathered_bytes = 0
        """The most ``gathered_bytes`` has been (reset it to measure a step)."""
        for fqn, _, axes, _ in params:
            bad = [a for a in axes if self.stages[a] < 1 or self.mesh_shape[a] < 2]
            if not axes or bad:
                raise ValueError(f"{fqn}: ZeRO axes {axes} must be non-empty axes of stage >= 1")
        if chunk_bytes is None:
            shards = max(
                (math.prod(self.mesh_shape[a] for a in axes) for _, _, axes, _ in params), default=1
            )
            chunk_bytes, _ = choose_chunk_bytes(
                [p.numel() for _, p, _, _ in params],
                shards,
                min_chunks=MIN_CHUNKS,
            )
        self.chunk_bytes = int(chunk_bytes)

        # One stream of chunks per (replicate axes, partial axes), each in first-use order.
        streams: dict[tuple[Any, ...], list[tuple[str, torch.Tensor]]] = {}
        for fqn, param, axes, reduce_axes in params:
            if param.dtype != torch.float32:
                raise ValueError(
                    f"ZeRO keeps fp32 chunks but {fqn} is {param.dtype}; build the model in fp32 "
                    f"(mixed precision is a runtime option)"
                )
            streams.setdefault((tuple(axes), tuple(sorted(reduce_axes))), []).append((fqn, param))
        first_use = {fqn: i for i, (fqn, _, _, _) in enumerate(params)}
        pending: list[
            tuple[int, int, tuple[int, ...], tuple[int, ...], list[tuple[str, torch.Tensor]]]
        ] = []
        for (axes, reduce_axes), members in streams.items():
            shards = math.prod(self.mesh_shape[a] for a in axes)
            chunk_numel = max(1, self.chunk_bytes // 4)
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
        self.gathers = any(c.num_param_axes for c in self.chunks)
        """Whether some chunk is gathered for use (P non-empty): forward packs saved views."""
        self._handles = register_optimizer_hooks(self)

    # -- construction ---------------------------------------------------------------------------

    def _index(self, axes: Sequence[int]) -> int:
        """This rank's row-major index over ``axes``."""
        index = 0
        for a in axes:
            index = index * self.mesh_shape[a] + self._coords[a]
        return index

    def _build_chunk(
        self,
        numel: int,
        axes: tuple[int, ...],
        reduce_axes: tuple[int, ...],
        members: list[tuple[str, torch.Tensor]],
    ) -> None:
        stages = self.stages
        by_stage = [tuple(a for a in axes if stages[a] == s) for s in (3, 2, 1)]
        zero_axes = by_stage[0] + by_stage[1] + by_stage[2]
        num_p, num_g = len(by_stage[0]), len(by_stage[0]) + len(by_stage[1])
        grad_axes = zero_axes[:num_g]
        shards = math.prod(self.mesh_shape[a] for a in zero_axes)
        shard_numel = numel // shards
        kept_numel = numel // math.prod(self.mesh_shape[a] for a in zero_axes[:num_p])
        chunk = Chunk(
            index=len(self.chunks),
            zero_axes=zero_axes,
            num_param_axes=num_p,
            num_grad_axes=num_g,
            scatter_axes=tuple(a for a in grad_axes if a in reduce_axes),
            allreduce_axes=tuple(a for a in zero_axes[num_g:] if a in reduce_axes)
            + tuple(a for a in reduce_axes if a not in zero_axes),
            numel=numel,
            shard_numel=shard_numel,
            shard_index=self._index(zero_axes),
            kept_numel=kept_numel,
            kept_index=self._index(zero_axes[:num_p]),
            shard_in_kept=self._index(zero_axes[num_p:]) * shard_numel,
            shard_in_grad=self._index(zero_axes[num_g:]) * shard_numel,
        )
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
            chunk.kept = kept.to(self.compute_dtype) if len(zero_axes) > num_p else None
        if num_p == 0:
            chunk.full = chunk.kept
        for k, slot in enumerate(chunk.slots):
            shard_param = nn.Parameter(
                chunk.shard[slot.shard_lo : slot.shard_hi],
                requires_grad=bool(members[k][1].requires_grad),
            )
            chunk.params.append(shard_param)
            self.shard_params[slot.fqn] = shard_param
            self._chunk_of_param[id(shard_param)] = (chunk.index, k)
        self.chunks.append(chunk)

    def graph_for(self, lowered: Any) -> nn.Module:
        """The rewritten graph of a ``LoweredGraph`` (built once per graph; train and eval
        graphs share the chunks)."""
        key = id(lowered.gm)
        cached = self._graphs.get(key)
        if cached is None or cached[0] is not lowered.gm:
            holders = [n for n in lowered.gm.graph.nodes if n.op == "placeholder"]
            names = {
                node.name: source.fqn
                for node, source in zip(holders, lowered.placeholders, strict=True)
                if source.kind == "param"
            }
            cached = (lowered.gm, rewrite_graph(self, lowered.gm, names))
            self._graphs[key] = cached
        return cached[1]

    # -- forward --------------------------------------------------------------------------------

    def _forward_views(self, index: int) -> tuple[torch.Tensor, ...]:
        chunk = self.chunks[index]
        if not chunk.num_param_axes:
            full = chunk.full
            assert full is not None
        else:
            full = self._gathered(chunk)
            chunk.full_ref = weakref.ref(full)
            if index + 1 < len(self.chunks):
                self._start_prefetch(self.chunks[index + 1])
        return tuple(full[s.offset : s.offset + s.numel].view(s.shape) for s in chunk.slots)

    def _start_prefetch(self, chunk: Chunk) -> None:
        if chunk.prefetch is not None or chunk.full is not None or chunk.num_param_axes != 1:
            return
        kept = self._compute_kept(chunk)
        out = torch.empty(chunk.numel, dtype=kept.dtype, device=kept.device)
        axis = chunk.zero_axes[0]
        group, label = self._group_of(axis), self.axis_names[axis]
        work = run_collective(
            "all_gather", f"zero chunk {chunk.index}", kept, group, label,
            lambda: dist.all_gather_single(out, kept, group=group, async_op=True),
        )  # fmt: skip
        chunk.prefetch = (work, self._track(out))

    def _track(self, buffer: torch.Tensor) -> torch.Tensor:
        nbytes = buffer.untyped_storage().nbytes()
        self.gathered_bytes += nbytes
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)
        weakref.finalize(buffer.untyped_storage(), self._untrack, nbytes)
        return buffer

    def _untrack(self, nbytes: int) -> None:
        self.gathered_bytes -= nbytes

    def _gathered(self, chunk: Chunk) -> torch.Tensor:
        """The chunk's full buffer (all-gathered over P now unless prefetched)."""
        if chunk.prefetch is not None:
            work, out = chunk.prefetch
            chunk.prefetch = None
            axis = chunk.zero_axes[0]
            group, label = self._group_of(axis), self.axis_names[axis]
            wait_collective(work, "all_gather", f"zero chunk {chunk.index}", out, group, label)
            return out
        return self._track(self._gather_flat(self._compute_kept(chunk), chunk.param_axes))

    def _compute_shard(self, chunk: Chunk) -> torch.Tensor:
        """The O-shard in the compute dtype."""
        assert chunk.shard is not None
        shard = chunk.shard.detach()
        return shard if self.compute_dtype is None else shard.to(self.compute_dtype)

    def _compute_kept(self, chunk: Chunk) -> torch.Tensor:
        """The P-level buffer in the compute dtype (cast from the master shard when O = P)."""
        if chunk.kept is not None:
            return chunk.kept.detach()
        return self._compute_shard(chunk)

    def _end_forward(self) -> None:
        # A prefetch nobody consumed (the graph ended) must still complete on every rank.
        for chunk in self.chunks:
            if chunk.prefetch is not None:
                chunk.prefetch[0].wait()
                chunk.prefetch = None

    def _pack(self, t: torch.Tensor) -> Any:
        base = t._base
        if base is None:
            return t
        for chunk in self.chunks:
            ref = chunk.full_ref
            if ref is not None and ref() is base:
                return Packed(chunk.index, tuple(t.size()), tuple(t.stride()), t.storage_offset())
        return t

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, Packed):
            return packed
        chunk = self.chunks[packed.chunk]
        if chunk.full is None:
            # Always gathered again, even if forward's buffer is still alive: whether it is can
            # depend on when Python's cycle collector ran, which differs between ranks, and
            # every rank must issue the same collectives.
            chunk.full = self._gathered(chunk)
            if packed.chunk > 0:
                self._start_prefetch(self.chunks[packed.chunk - 1])
        return chunk.full.as_strided(packed.size, packed.stride, packed.offset)


def build_zero_engine(
    lowered: Any,
    params: dict[str, nn.Parameter],
    coords: Sequence[int],
    group_of: Callable[[int], Any],
    *,
    stage: int | Sequence[int],
    zero_axes: Sequence[int] | None = None,
    chunk_bytes: int | None = None,
    mixed_precision: str | None = None,
    read_flat: Callable[[str, int, int], torch.Tensor] | None = None,
    device: torch.device | str | None = None,
    axis_names: Sequence[str] | None = None,
) -> ZeroEngine:
    """The engine for a ParallelModule's local parameters (canonical FQN -> local block).

    Args:
        stage: one stage for ``zero_axes``, or one stage per mesh axis (module docstring).
        zero_axes: with an int ``stage``: the mesh axes to shard over; None = every axis some
            parameter gradient is summed over (the data-parallel axes). A parameter is sharded
            over those of them on which it is Replicate.
        mixed_precision: None, "bf16" or "fp16" (see :class:`ZeroEngine`'s ``compute_dtype``;
            fp16 needs loss scaling: :class:`ShardedGradScaler`).
        read_flat, device: materialize meta-device parameters (see :class:`ZeroEngine`).
    """
    if mixed_precision not in (None, "bf16", "fp16"):
        raise ValueError(
            f"mixed_precision={mixed_precision!r} is not supported by the ZeRO runtime; use None, "
            f"'bf16' or 'fp16' (fp16: scale the loss with pmodel.grad_scaler)"
        )
    from autopar.placement import Replicate

    mesh_shape = tuple(lowered.mesh_shape)
    if isinstance(stage, int) and zero_axes is None:
        zero_axes = sorted(
            {a for reduce in lowered.param_grad_reduce_axes.values() for a in reduce}
        )
    stages = resolve_stages(stage, len(mesh_shape), zero_axes)
    entries = []
    for fqn in lowered.param_use_order:
        param = params.get(fqn)
        if param is None or not param.requires_grad:
            continue
        placements = lowered.param_placements[fqn]
        own = tuple(
            a
            for a in range(len(mesh_shape))
            if stages[a] >= 1 and isinstance(placements[a], Replicate) and mesh_shape[a] > 1
        )
        if own:
            entries.append((fqn, param, own, tuple(lowered.param_grad_reduce_axes.get(fqn, ()))))
    return ZeroEngine(
        stages=stages,
        stage=stage if isinstance(stage, int) else None,
        params=entries,
        mesh_shape=mesh_shape,
        coords=coords,
        group_of=group_of,
        chunk_bytes=chunk_bytes,
        compute_dtype=_COMPUTE_DTYPES.get(mixed_precision),
        read_flat=read_flat,
        device=device,
        axis_names=axis_names,
    )


_COMPUTE_DTYPES: dict[str | None, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}
