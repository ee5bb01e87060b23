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
the parameter that lies in this rank's O-shard (possibly empty). An empty piece gets no
``.grad``, so the optimizer's loop skips it on this rank: each rank steps only the parameters
its shard holds pieces of (:mod:`autopar.runtime.zero_step`, "Ownership"). Only elementwise
optimizers give the single-process result on such pieces (and ``autopar.optim``'s LAMB / LARS,
which take their norms over every piece); others are refused when they step.

Mechanism. :func:`autopar.runtime.zero_graph.rewrite_graph` copies the lowered graph and
inserts, before the first use of each chunk, one call of an autograd function that takes the
shard parameters and returns the full local parameters as views of the chunk's compute buffer
(P non-empty: all-gathered there, prefetching the next chunk; P empty: the kept buffer, whose
views are built once and handed out every step). Its backward runs once every gradient of the
chunk is complete: it flattens them (one ``_foreach_copy_`` or ``_chunk_cat`` per chunk) and
launches the chunk's reduce-scatters over G and the first all-reduce (asynchronous, overlapped
with the rest of backward); a callback queued on the autograd engine waits for them at the end
of backward, runs the remaining all-reduces and sets the shard parameters' ``.grad``. The
reduction lands in the chunk's kept G-level gradient buffer (made at the first backward) and
each ``.grad`` is a view of this rank's O-shard of it built once (DDP's gradient-as-bucket-view,
FSDP2's sharded gradients), so a step slices no parameter out of a chunk (README, "Session 12:
ZeRO views and collectives"). Where that buffer still holds a gradient to add to
(``.grad`` set and not zeroed), the reduction runs next to it and is added.

A gathered chunk (P non-empty) is freed when the graph's last view of it dies (fx drops dead
values); tensors that autograd saves for backward are packed by a ``saved_tensors_hooks`` pair as
(chunk, size, stride, offset) instead of the tensor, and unpacking in backward all-gathers the
chunk again (prefetching the previous one); it is freed when the chunk's backward ran. The
chunk the graph uses last (whose backward comes first) is the exception: its forward buffer is
kept into backward rather than freed and gathered again at once (one all-gather fewer per step,
no second full buffer next to the activations at backward's start; FSDP2 keeps its root's
parameters so), where autograd records the forward and a saved tensor views it.

Gradient accumulation: backward under :meth:`ZeroEngine.no_sync` adds the chunk's flat local
gradient to a pending buffer and communicates nothing; the next synchronised backward adds it in.

Mixed precision (``compute_dtype=torch.bfloat16`` or ``torch.float16``): the O-shards stay fp32
(the master weights the optimizer updates, with fp32 state); the kept buffer is held in the
compute dtype (refreshed after each step; when O = P there is none and the shard is cast before
gathering); the graph runs under ``torch.autocast``; gradients are flattened to fp32 before any
reduction. fp16 needs loss scaling: :class:`autopar.runtime.grad_scaler.ShardedGradScaler`.
A parameter with no data-parallel axis to shard over (R empty: a pipeline stage on a (1,)
submesh, one rank, a block tensor-parallel on every axis) is packed, under mixed precision only,
into chunks of no axes (P = G = O = {}): its fp32 master is the whole chunk, the kept buffer is
its half copy, the gradient is reduced in fp32 only over its partial axes (if any).

:class:`ZeroEngine` is a facade over objects with one job each, built in this order and handed
their dependencies explicitly: :class:`~autopar.runtime.zero_layout.ZeroMesh` (axis sizes,
coordinates, groups; the flat all-gather), :class:`~autopar.runtime.zero_store.ChunkStore` (the
chunk buffers, slots, shard parameters), :class:`~autopar.runtime.zero_gather.ChunkGatherer`
(forward gather, prefetch, release; pack / unpack for backward),
:class:`~autopar.runtime.zero_backward.GradientReducer` (reductions in backward, the in-flight
bound, ``no_sync``), :class:`~autopar.runtime.zero_step.OptimizerStepHook` (optimizer check,
after-step all-gather) and :class:`~autopar.runtime.zero_state.ChunkState` (full local blocks
for state dicts).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
import torch.nn as nn

from autopar.planner.chunks import (
    DEFAULT_MAX_CHUNK_BYTES,
    MIN_CHUNKS,
    choose_chunk_bytes,
    chunk_numels,
    pack_chunks,
)
from autopar.runtime.grad_scaler import ShardedGradScaler
from autopar.runtime.zero_backward import MAX_IN_FLIGHT, GradientReducer
from autopar.runtime.zero_gather import ChunkGatherer
from autopar.runtime.zero_graph import rewrite_graph
from autopar.runtime.zero_layout import Chunk, Slot, ZeroMesh, resolve_stages
from autopar.runtime.zero_state import ChunkState
from autopar.runtime.zero_step import ELEMENTWISE_OPTIMIZERS, OptimizerStepHook
from autopar.runtime.zero_store import ChunkStore

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


class ZeroEngine:
    """The chunks of one ParallelModule and what runs on them (module docstring).

    Args:
        params: ``(canonical fqn, local parameter, replicate axes R, grad-reduce axes)`` in
            order of first use; R lists the mesh axes of size > 1 with a ZeRO stage >= 1 on
            which the parameter is Replicate (non-empty, except under mixed precision: an
            empty R is a chunk of no axes, its fp32 master held whole on this rank).
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
        alone: FQNs each packed in a chunk of its own (a weight tied across pipeline stages,
            whose gradient shards the stages then sum element for element; :meth:`layout`).
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
        alone: Collection[str] = (),
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
        self.mesh = ZeroMesh(mesh_shape, coords, group_of, axis_names)
        self.mesh_shape = self.mesh.shape
        self.axis_names = self.mesh.axis_names
        for fqn, _, axes, _ in params:
            bad = [a for a in axes if self.stages[a] < 1 or self.mesh_shape[a] < 2]
            if bad or not (axes or compute_dtype is not None):
                raise ValueError(
                    f"{fqn}: ZeRO axes {axes} must be axes of stage >= 1, non-empty without "
                    f"mixed precision (with it, an empty R keeps the fp32 master whole)"
                )
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
        self.store = ChunkStore(
            params,
            stages=self.stages,
            mesh=self.mesh,
            chunk_bytes=self.chunk_bytes,
            compute_dtype=compute_dtype,
            read_flat=read_flat,
            device=torch.device(device) if device is not None else None,
            alone=frozenset(alone),
        )
        self.gatherer = ChunkGatherer(self.store, self.mesh)
        self.reducer = GradientReducer(self.store, self.mesh, self.gatherer.end_backward)
        self.step_hook = OptimizerStepHook(self.store, self.mesh, self.stage)
        self.state = ChunkState(self.store, self.mesh)
        self._graphs: dict[int, tuple[Any, nn.Module]] = {}

    # -- what the rest of the runtime reads -----------------------------------------------------

    @property
    def chunks(self) -> list[Chunk]:
        return self.store.chunks

    @property
    def shard_params(self) -> dict[str, nn.Parameter]:
        """Canonical fqn -> the shard parameter the optimizer sees."""
        return self.store.shard_params

    @property
    def _chunk_of_param(self) -> dict[int, tuple[int, int]]:
        return self.store.chunk_of_param

    @property
    def gathers(self) -> bool:
        """Whether some chunk is gathered for use (P non-empty): forward packs saved views."""
        return self.gatherer.gathers

    @property
    def gathered_bytes(self) -> int:
        """Bytes of gathered chunk buffers (P non-empty) still alive."""
        return self.gatherer.gathered_bytes

    @property
    def peak_gathered_bytes(self) -> int:
        """The most ``gathered_bytes`` has been (reset it to measure a step)."""
        return self.gatherer.peak_gathered_bytes

    @peak_gathered_bytes.setter
    def peak_gathered_bytes(self, value: int) -> None:
        self.gatherer.peak_gathered_bytes = value

    @property
    def padding_fraction(self) -> float:
        """Share of the chunk buffers that holds no parameter (padding to the shard count)."""
        return self.store.padding_fraction

    def manages(self, param: torch.Tensor) -> bool:
        return self.store.manages(param)

    def slot_of(self, param: torch.Tensor) -> tuple[Chunk, Slot]:
        """The chunk of a managed shard parameter and its slot there (layout for
        :mod:`autopar.runtime.state`)."""
        return self.store.slot_of(param)

    def zero_axes_of(self, param: torch.Tensor) -> tuple[int, ...]:
        """The mesh axes a managed parameter's optimizer shards are split over (O, in split
        order; empty if not managed)."""
        return self.store.zero_axes_of(param)

    def layout(self, param: torch.Tensor) -> tuple[Any, ...] | None:
        """Where this rank's shard parameter ``param`` lies: its chunk's size, axes and shard
        index and the slot's place in it (None if not managed). Two engines whose layouts of
        a parameter are equal hold the same elements of it in their shards."""
        if not self.store.manages(param):
            return None
        chunk, slot = self.store.slot_of(param)
        where = (slot.offset, slot.shard_lo, slot.shard_hi, slot.param_lo)
        return (chunk.numel, chunk.zero_axes, chunk.shard_index, chunk.shard_numel, *where)

    def piece_of(self, param: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
        """The part of a full local block that this rank's shard parameter ``param`` holds."""
        return self.store.piece_of(param, block)

    # -- state (collectives) --------------------------------------------------------------------

    def local_params(self) -> dict[int, torch.Tensor]:
        """id(shard parameter) -> this rank's full local block (see :class:`ChunkState`)."""
        return self.state.local_params()

    def local_grads(self) -> dict[int, torch.Tensor]:
        """id(shard parameter) -> the gradient of this rank's full local block."""
        return self.state.local_grads()

    def gather_pieces(self, pieces: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """id(shard parameter) -> full local block, from shard-shaped tensors (a collective)."""
        return self.state.gather_pieces(pieces)

    def load_local(self, param: torch.Tensor, block: torch.Tensor) -> None:
        """Set a managed parameter from this rank's full local block."""
        self.state.load_local(param, block)

    def sync_full(self, index: int) -> None:
        """All-gather chunk ``index``'s updated O-shards into its kept buffer (a collective)."""
        self.step_hook.sync_full(index)

    def complete_optim_state(self, optimizer: torch.optim.Optimizer) -> None:
        """Give the parameters this rank holds no piece of their owners' optimizer state form
        (a collective; see :meth:`OptimizerStepHook.complete_state`)."""
        self.step_hook.complete_state(optimizer)

    def holds_none_of(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is a managed shard parameter with no element on this rank (no
        ``.grad`` here, stepped by its owners; :mod:`autopar.runtime.zero_step`)."""
        entry = self.store.chunk_of_param.get(id(param))
        return entry is not None and self.store.chunks[entry[0]].slots[entry[1]].empty

    def remove(self) -> None:
        """Remove the engine's optimizer step hooks."""
        self.step_hook.remove()

    # -- running the graph ----------------------------------------------------------------------

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Backward calls inside accumulate local gradients without communicating."""
        return self.reducer.no_sync()

    def chunk_backward(self, index: int, grads: Sequence[torch.Tensor | None]) -> None:
        """Backward completed chunk ``index``'s gradients: release it and reduce them."""
        chunk = self.store.chunks[index]
        self.gatherer.release(chunk)
        self.reducer.chunk_backward(chunk, grads)

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
    alone: Collection[str] = (),
) -> ZeroEngine:
    """The engine for a ParallelModule's local parameters (canonical FQN -> local block).

    Args:
        stage: one stage for ``zero_axes``, or one stage per mesh axis (module docstring).
        zero_axes: with an int ``stage``: the mesh axes to shard over; None = every axis some
            parameter gradient is summed over (the data-parallel axes). A parameter is sharded
            over those of them on which it is Replicate.
        mixed_precision: None, "bf16" or "fp16" (see :class:`ZeroEngine`'s ``compute_dtype``;
            fp16 needs loss scaling: :class:`ShardedGradScaler`).
        read_flat, device, alone: see :class:`ZeroEngine`.
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
        # Under mixed precision a parameter with no axis to shard over (a pipeline stage's
        # (1,) submesh, one rank, tensor-parallel blocks) keeps its fp32 master whole in a chunk
        # of no axes: the same half copy, casts, optimizer hook and state paths as a shard.
        if own or mixed_precision is not None:
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
        alone=alone,
    )


_COMPUTE_DTYPES: dict[str | None, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}
