"""Chunk-managed ZeRO (stages 1, 2, 3) over the data-parallel mesh axes.

Parameters (this rank's tensor-parallel blocks, as ``ParallelModule`` holds them) are packed in
order of first use in forward into flat fp32 chunks. Every chunk is sharded evenly over its ZeRO
axes (the chosen axes on which its parameters are Replicate; padded to a multiple of the shard
count). Sharding is hierarchical over several axes: the first ZeRO axis is outermost, so this
rank's shard is the contiguous piece at its row-major index over those axes.

What the optimizer sees: one ``nn.Parameter`` per original parameter, a 1-D view of the part of
the parameter that lies in this rank's chunk shard (possibly empty). Only elementwise optimizers
give the single-process result on such pieces (and ``autopar.optim``'s LAMB / LARS, which take
their norms over every piece); others are refused when they step.

Per stage, on one rank (``N`` = shards of a chunk):

======  ===================================  ======================  ======================
stage   compute parameters                   gradients               optimizer state
======  ===================================  ======================  ======================
1       full chunk buffers, kept             full chunk, all-reduce  1/N (on the shard)
2       full chunk buffers, kept             1/N, reduce-scatter     1/N
3       1/N; a chunk is all-gathered before  1/N, reduce-scatter     1/N
        its first use and freed after its
        last use in forward, gathered again
        for backward
======  ===================================  ======================  ======================

Mechanism. :meth:`ZeroEngine.rewrite` copies the lowered graph and inserts, before the first use
of each chunk, one call of a :class:`_UseChunk` autograd function that takes the shard parameters
and returns the full local parameters as views of the chunk buffer (stage 3: all-gathered there,
prefetching the next chunk; stages 1-2: the kept buffer). Its backward runs once every gradient of
the chunk is complete: it flattens them and launches the chunk's asynchronous reduce-scatter
(stage 1: all-reduce), overlapped with the rest of backward; a callback queued on the autograd
engine waits for them at the end of backward and sets the shard parameters' ``.grad``.

Stage 3 frees a gathered chunk when the graph's last view of it dies (fx drops dead values);
tensors that autograd saves for backward are packed by a ``saved_tensors_hooks`` pair as
(chunk, size, stride, offset) instead of the tensor, and unpacking in backward all-gathers the
chunk again (prefetching the previous one); it is freed when the chunk's backward ran.

Stages 1-2 copy the updated shards back into the full buffers after every optimizer step that
touches them (a global ``torch.optim`` step post-hook, filtered by parameter identity).

Gradient accumulation: backward under :meth:`ZeroEngine.no_sync` adds the chunk's flat local
gradient to a pending buffer and communicates nothing; the next synchronised backward adds it in.

Mixed precision (``compute_dtype=torch.bfloat16`` or ``torch.float16``): the shards stay fp32 (the master weights the
optimizer updates, with fp32 state); stage 3 gathers bf16 copies, stages 1-2 keep bf16 full
buffers refreshed after each step; the graph runs under ``torch.autocast``; gradients are
flattened to fp32 before any reduction. fp16 needs loss scaling (its range is small):
:class:`ShardedGradScaler` scales the loss, unscales the shard gradients and skips a step on
every rank when any rank's shard overflowed.

State: ``ParallelModule.state_dict`` reads :meth:`ZeroEngine.local_params` (fp32, gathered);
:meth:`ZeroEngine.gather_pieces` / :meth:`ZeroEngine.piece_of` turn shard-shaped tensors
(gradients, elementwise optimizer state) into full local blocks and back, which is what
``autopar.optim.full_optim_state_dict`` / ``load_full_optim_state_dict`` use.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch.autograd import Variable

__all__ = [
    "DEFAULT_MAX_CHUNK_BYTES",
    "ELEMENTWISE_OPTIMIZERS",
    "MIN_CHUNKS",
    "ShardedGradScaler",
    "ZeroEngine",
    "build_zero_engine",
    "chunk_numels",
    "choose_chunk_bytes",
    "pack_chunks",
]

DEFAULT_MAX_CHUNK_BYTES = 32 * 2**20
"""Upper end of the chunk-size search (the largest parameter raises it)."""

MIN_CHUNKS = 8
"""The chunk-size search stops at 1/8 of the parameters (or the largest parameter): stage 3
gathers about two chunks at a time (the one in use and the prefetched one), not the model, and
in every stage a chunk's gradients are reduced while backward goes on, with one chunk of
flattened gradients in flight rather than the whole model's."""

ELEMENTWISE_OPTIMIZERS: frozenset[str] = frozenset(
    {
        "SGD",
        "Adam",
        "AdamW",
        "Adamax",
        "Adagrad",
        "Adadelta",
        "ASGD",
        "NAdam",
        "RAdam",
        "RMSprop",
        "Rprop",
        "LAMB",
        "LARS",
    }
)
"""Optimizer class names whose update of an element depends only on that element (LAMB / LARS:
autopar.optim's, which reduce their norms over every shard)."""


# ---------------------------------------------------------------------------------------------
# Chunk-size search (torch-free: the planner calls it)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pack_chunks(numels: Sequence[int], chunk_numel: int) -> list[list[int]]:
    """Indices of ``numels`` per chunk: in order, a new chunk when the next one does not fit.

    A parameter larger than ``chunk_numel`` gets a chunk of its own (of its size).
    """
    chunks: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, n in enumerate(numels):
        if current and used + n > chunk_numel:
            chunks.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        chunks.append(current)
    return chunks


def chunk_numels(
    numels: Sequence[int], chunks: Sequence[Sequence[int]], chunk_numel: int, shards: int
) -> list[int]:
    """Buffer size of each chunk: ``chunk_numel`` (fixed-size chunks) or its content if larger,
    the last one trimmed to its content; all rounded up to a multiple of ``shards``."""
    sizes = []
    for k, members in enumerate(chunks):
        used = sum(numels[i] for i in members)
        size = used if k == len(chunks) - 1 else max(chunk_numel, used)
        sizes.append(_round_up(max(size, 1), shards))
    return sizes


def choose_chunk_bytes(
    param_local_numels: Sequence[int],
    zero_shards: int,
    *,
    itemsize: int = 4,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    num_candidates: int = 512,
    min_chunks: int = 1,
) -> tuple[int, float]:
    """The chunk size (bytes) that minimises padding waste, and that waste as a fraction.

    Candidates run from the largest parameter (a parameter never spans chunks) to
    ``max_chunk_bytes``, in about ``num_candidates`` steps that are multiples of the shard count.
    Waste is measured for fixed-size buffers of the chosen size (a pool of equal buffers, as in
    ColossalAI's Gemini): the unused tail of every chunk plus the padding of the last one to a
    multiple of ``zero_shards``, over the total buffer size. Ties go to the larger chunk (fewer
    collectives). The size is the capacity the runtime packs parameters up to; it allocates each
    chunk at its content rounded up to the shard count (balanced shards, under ``zero_shards``
    elements of padding per chunk), so the returned fraction bounds its padding from above.

    Args:
        param_local_numels: elements of each parameter's local (tensor-parallel) block, in order
            of first use.
        zero_shards: number of shards of a chunk (product of the ZeRO axes' sizes).
        min_chunks: cap the size at ``1/min_chunks`` of the total (never below the largest
            parameter); the runtime and the planner pass :data:`MIN_CHUNKS`.
    """
    if zero_shards < 1:
        raise ValueError(f"zero_shards must be >= 1, got {zero_shards}")
    numels = [int(n) for n in param_local_numels if n > 0]
    if not numels:
        return _round_up(max_chunk_bytes // itemsize, zero_shards) * itemsize, 0.0
    total = sum(numels)
    lo = _round_up(max(numels), zero_shards)
    cap = min(max_chunk_bytes // itemsize, total, -(-total // max(1, min_chunks)))
    hi = max(lo, _round_up(cap, zero_shards))
    step = max(zero_shards, _round_up(max(1, (hi - lo) // num_candidates), zero_shards))
    candidates = list(range(lo, hi + 1, step))
    if candidates[-1] != hi:
        candidates.append(hi)
    best_numel, best_waste = lo, math.inf
    for chunk_numel in candidates:
        capacity = sum(
            chunk_numels(numels, pack_chunks(numels, chunk_numel), chunk_numel, zero_shards)
        )
        waste = (capacity - total) / capacity
        if waste <= best_waste:
            best_numel, best_waste = chunk_numel, waste
    return best_numel * itemsize, float(best_waste)


# ---------------------------------------------------------------------------------------------
# Runtime


@dataclass(slots=True)
class _Slot:
    fqn: str
    shape: torch.Size
    offset: int
    numel: int
    shard_lo: int
    """Range of this parameter's elements inside this rank's shard (shard-relative)."""
    shard_hi: int
    param_lo: int
    """Range of the parameter's flat elements that this rank's shard holds."""


@dataclass(slots=True)
class _Chunk:
    index: int
    zero_axes: tuple[int, ...]
    scatter_axes: tuple[int, ...]
    """ZeRO axes on which the gradient is Partial (reduce-scatter); on the others, slice."""
    other_axes: tuple[int, ...]
    """Non-ZeRO axes on which the gradient is Partial (all-reduce of the shard)."""
    numel: int
    shard_numel: int
    shard_index: int
    slots: list[_Slot] = field(default_factory=list)
    shard: torch.Tensor | None = None
    full: torch.Tensor | None = None
    """Stages 1-2: the kept compute buffer. Stage 3: the gathered buffer while backward needs it."""
    full_ref: Any = None
    """Stage 3: weak reference to the buffer gathered for forward."""
    prefetch: tuple[Any, torch.Tensor] | None = None
    grad_full: torch.Tensor | None = None
    pending: torch.Tensor | None = None
    work: Any = None
    reduced: torch.Tensor | None = None
    params: list[nn.Parameter] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class _Packed:
    """A saved tensor that is a view of a gathered stage-3 chunk, kept as its geometry."""

    chunk: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


class _UseChunk(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, engine: ZeroEngine, index: int, *shards: torch.Tensor) -> Any:
        ctx.engine = engine
        ctx.index = index
        ctx.num_shards = len(shards)
        ctx.set_materialize_grads(False)
        return engine._forward_views(index)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        ctx.engine._chunk_backward(ctx.index, grads)
        return (None, None) + (None,) * ctx.num_shards


class _UseChunkModule(nn.Module):
    """The graph's handle on the engine (a call_module node: fx cannot print the engine)."""

    def __init__(self, engine: ZeroEngine) -> None:
        super().__init__()
        self.engine = engine

    def forward(self, index: int, *shards: torch.Tensor) -> Any:
        return _UseChunk.apply(self.engine, index, *shards)


class _ZeroGraph(nn.Module):
    def __init__(self, gm: fx.GraphModule, engine: ZeroEngine) -> None:
        super().__init__()
        self.gm = gm
        self.engine = engine

    def forward(self, *args: Any) -> Any:
        engine = self.engine
        with contextlib.ExitStack() as stack:
            if engine.compute_dtype is not None:
                device_type = engine.chunks[0].shard.device.type if engine.chunks else "cpu"  # type: ignore[union-attr]
                stack.enter_context(torch.autocast(device_type, dtype=engine.compute_dtype))
            if engine.stage < 3:
                return self.gm(*args)
            stack.enter_context(
                torch.autograd.graph.saved_tensors_hooks(engine._pack, engine._unpack)
            )
            try:
                return self.gm(*args)
            finally:
                engine._end_forward()


class ZeroEngine:
    """Owns the chunks of one ParallelModule (module docstring).

    Args:
        stage: 1, 2 or 3.
        params: ``(canonical fqn, local parameter, zero axes, grad-reduce axes)`` in order of first
            use; only parameters with at least one ZeRO axis (of size > 1).
        mesh_shape: size of each mesh axis.
        coords: this rank's mesh coordinate.
        group_of: mesh axis -> this rank's process group along it.
        chunk_bytes: chunk size; None = :func:`choose_chunk_bytes`.
        compute_dtype: None (fp32), ``torch.bfloat16`` or ``torch.float16`` (mixed precision:
            half compute, fp32 master shards, optimizer state and gradient reduction).
        read_flat: for parameters on the meta device, ``read_flat(fqn, lo, hi)`` returns flat
            elements [lo, hi) of the parameter's local block (see
            :class:`autopar.runtime.state.StateSource`); chunks are then allocated on ``device``
            and filled from it, stage 3 reading only this rank's pieces.
        device: where ``read_flat``'s chunks live.
    """

    def __init__(
        self,
        *,
        stage: int,
        params: Sequence[tuple[str, torch.Tensor, tuple[int, ...], tuple[int, ...]]],
        mesh_shape: Sequence[int],
        coords: Sequence[int],
        group_of: Callable[[int], Any],
        chunk_bytes: int | None = None,
        compute_dtype: torch.dtype | None = None,
        read_flat: Callable[[str, int, int], torch.Tensor] | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        if stage not in (1, 2, 3):
            raise ValueError(
                f"ZeRO stage must be 1, 2 or 3 here (0 is the all-reduce path), got {stage}"
            )
        self.stage = stage
        self.compute_dtype = compute_dtype
        """None: compute in fp32 on the chunks; else forward runs under autocast to this dtype
        with parameters gathered (stage 3) or kept (stages 1-2) in it, from fp32 master shards."""
        self.mesh_shape = tuple(mesh_shape)
        self._coords = tuple(coords)
        self._group_of = group_of
        self._read_flat = read_flat
        self._device = torch.device(device) if device is not None else None
        self.chunks: list[_Chunk] = []
        self.shard_params: dict[str, nn.Parameter] = {}
        self._chunk_of_param: dict[int, tuple[int, int]] = {}
        self._sync = True
        self._callback_queued = False
        self._graphs: dict[int, tuple[fx.GraphModule, nn.Module]] = {}
        self.gathered_bytes = 0
        """Bytes of stage-3 chunk buffers gathered and still alive."""
        self.peak_gathered_bytes = 0
        """The most ``gathered_bytes`` has been (reset it to measure a step)."""
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

        # One stream of chunks per (zero axes, partial axes, dtype), each in first-use order.
        streams: dict[tuple[Any, ...], list[tuple[str, torch.Tensor]]] = {}
        for fqn, param, zero_axes, reduce_axes in params:
            if param.dtype != torch.float32:
                raise ValueError(
                    f"ZeRO keeps fp32 chunks but {fqn} is {param.dtype}; build the model in fp32 "
                    f"(mixed precision is a runtime option)"
                )
            streams.setdefault((tuple(zero_axes), tuple(sorted(reduce_axes))), []).append(
                (fqn, param)
            )
        first_use = {fqn: i for i, (fqn, _, _, _) in enumerate(params)}
        pending: list[
            tuple[int, int, tuple[int, ...], tuple[int, ...], list[tuple[str, torch.Tensor]]]
        ] = []
        for (zero_axes, reduce_axes), members in streams.items():
            shards = math.prod(self.mesh_shape[a] for a in zero_axes)
            chunk_numel = max(1, self.chunk_bytes // 4)
            numels = [p.numel() for _, p in members]
            groups = pack_chunks(numels, chunk_numel)
            for group in groups:
                # Content-sized buffers: shards stay balanced (a fixed-size chunk's empty tail
                # would all land on the last ranks' shards).
                numel = _round_up(max(1, sum(numels[i] for i in group)), shards)
                first = first_use[members[group[0]][0]]
                pending.append((first, numel, zero_axes, reduce_axes, [members[i] for i in group]))
        pending.sort(key=lambda item: item[0])
        for _, numel, zero_axes, reduce_axes, members in pending:
            self._build_chunk(numel, zero_axes, reduce_axes, members)
        self._handles = _register_optimizer_hooks(self)

    # -- construction ---------------------------------------------------------------------------

    def _build_chunk(
        self,
        numel: int,
        zero_axes: tuple[int, ...],
        reduce_axes: tuple[int, ...],
        members: list[tuple[str, torch.Tensor]],
    ) -> None:
        shards = math.prod(self.mesh_shape[a] for a in zero_axes)
        shard_numel = numel // shards
        shard_index = 0
        for a in zero_axes:
            shard_index = shard_index * self.mesh_shape[a] + self._coords[a]
        chunk = _Chunk(
            index=len(self.chunks),
            zero_axes=zero_axes,
            scatter_axes=tuple(a for a in zero_axes if a in reduce_axes),
            other_axes=tuple(a for a in reduce_axes if a not in zero_axes),
            numel=numel,
            shard_numel=shard_numel,
            shard_index=shard_index,
        )
        read = self._read_flat
        device = members[0][1].device if read is None else self._device
        # Materializing from a state source at stage 3: only this rank's pieces are read.
        pieces_only = read is not None and self.stage == 3
        full = None if pieces_only else torch.zeros(numel, dtype=torch.float32, device=device)
        lo, hi = shard_index * shard_numel, (shard_index + 1) * shard_numel
        offset = 0
        for fqn, param in members:
            n = param.numel()
            if full is not None:
                value = param.detach() if read is None else read(fqn, 0, n)
                full[offset : offset + n].copy_(value.reshape(-1))
            a, b = max(offset, lo), min(offset + n, hi)
            if a >= b:
                a = b = lo
            chunk.slots.append(
                _Slot(
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
        # Stages 1-2 keep the full buffer and the shard is a view of it; stage 3 keeps the shard.
        if full is None:
            assert read is not None
            chunk.shard = torch.zeros(shard_numel, dtype=torch.float32, device=device)
            for slot in chunk.slots:
                width = slot.shard_hi - slot.shard_lo
                if width:
                    piece = read(slot.fqn, slot.param_lo, slot.param_lo + width)
                    chunk.shard[slot.shard_lo : slot.shard_hi].copy_(piece)
        elif self.stage < 3 and self.compute_dtype is None:
            chunk.full = full
            chunk.shard = full[lo:hi]
        else:
            chunk.shard = full[lo:hi].clone()
            if self.stage < 3:
                chunk.full = full.to(self.compute_dtype)
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
            cached = (lowered.gm, self.rewrite(lowered.gm, names))
            self._graphs[key] = cached
        return cached[1]

    def rewrite(self, gm: fx.GraphModule, param_placeholders: dict[str, str]) -> nn.Module:
        """A copy of ``gm`` whose chunk parameters come from the engine (module docstring).

        Args:
            gm: the lowered graph; its parameter placeholders will receive the shard parameters.
            param_placeholders: placeholder node name -> canonical parameter FQN.
        """
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for node in gm.graph.nodes:
            env[node] = graph.node_copy(node, lambda n: env[n])
        new_gm = fx.GraphModule(gm, graph)
        new_gm.add_submodule("autopar_zero_use_chunk", _UseChunkModule(self))
        holders_of: dict[str, list[fx.Node]] = {}
        for node in graph.nodes:
            fqn = param_placeholders.get(node.name) if node.op == "placeholder" else None
            if fqn is not None:
                holders_of.setdefault(fqn, []).append(node)
        order = {n: i for i, n in enumerate(graph.nodes)}
        for chunk in self.chunks:
            # Tied parameters have one placeholder per name; the first stands for the chunk input.
            holders = [holders_of.get(slot.fqn, []) for slot in chunk.slots]
            if any(not h for h in holders):
                raise AssertionError(f"chunk {chunk.index}: a parameter has no placeholder")
            users = [u for hs in holders for h in hs for u in h.users]
            if not users:
                continue
            first = min(users, key=order.__getitem__)
            with graph.inserting_before(first):
                call = graph.call_module(
                    "autopar_zero_use_chunk", (chunk.index, *(hs[0] for hs in holders))
                )
                views = [graph.call_function(_getitem, (call, k)) for k in range(len(holders))]
            for hs, view in zip(holders, views):
                for holder in hs:
                    for user in list(holder.users):
                        if user is not call:
                            user.replace_input_with(holder, view)
        graph.lint()
        new_gm.recompile()
        return _ZeroGraph(new_gm, self)

    # -- forward --------------------------------------------------------------------------------

    def _forward_views(self, index: int) -> tuple[torch.Tensor, ...]:
        chunk = self.chunks[index]
        if self.stage < 3:
            full = chunk.full
            assert full is not None
        else:
            full = self._gathered(chunk)
            chunk.full_ref = weakref.ref(full)
            if index + 1 < len(self.chunks):
                self._start_prefetch(self.chunks[index + 1])
        return tuple(full[s.offset : s.offset + s.numel].view(s.shape) for s in chunk.slots)

    def _start_prefetch(self, chunk: _Chunk) -> None:
        if chunk.prefetch is not None or chunk.full is not None or len(chunk.zero_axes) != 1:
            return
        assert chunk.shard is not None
        shard = self._compute_shard(chunk)
        out = torch.empty(chunk.numel, dtype=shard.dtype, device=shard.device)
        work = dist.all_gather_single(
            out, shard, group=self._group_of(chunk.zero_axes[0]), async_op=True
        )
        chunk.prefetch = (work, self._track(out))

    def _track(self, buffer: torch.Tensor) -> torch.Tensor:
        nbytes = buffer.untyped_storage().nbytes()
        self.gathered_bytes += nbytes
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)
        weakref.finalize(buffer.untyped_storage(), self._untrack, nbytes)
        return buffer

    def _untrack(self, nbytes: int) -> None:
        self.gathered_bytes -= nbytes

    def _gathered(self, chunk: _Chunk) -> torch.Tensor:
        """The chunk's full buffer (all-gathered now unless prefetched)."""
        if chunk.prefetch is not None:
            work, out = chunk.prefetch
            chunk.prefetch = None
            work.wait()
            return out
        return self._track(self._gather_flat(self._compute_shard(chunk), chunk.zero_axes))

    def _compute_shard(self, chunk: _Chunk) -> torch.Tensor:
        assert chunk.shard is not None
        shard = chunk.shard.detach()
        return shard if self.compute_dtype is None else shard.to(self.compute_dtype)

    def _gather_flat(self, shard: torch.Tensor, zero_axes: tuple[int, ...]) -> torch.Tensor:
        """All-gather a flat shard over ``zero_axes`` (row-major shard index) into the chunk."""
        value = shard
        # Innermost ZeRO axis first: its pieces are adjacent in the chunk.
        for axis in reversed(zero_axes):
            size = self.mesh_shape[axis]
            out = torch.empty(value.numel() * size, dtype=value.dtype, device=value.device)
            dist.all_gather_single(out, value.contiguous(), group=self._group_of(axis))
            value = out
        return value

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
                return _Packed(chunk.index, tuple(t.size()), tuple(t.stride()), t.storage_offset())
        return t

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Packed):
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

    # -- backward -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward calls inside accumulate local gradients without communicating."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def _chunk_backward(self, index: int, grads: Sequence[torch.Tensor | None]) -> None:
        chunk = self.chunks[index]
        if self.stage == 3:
            chunk.full = None  # every use of the chunk in backward is done
        flat = torch.zeros(chunk.numel, dtype=torch.float32, device=chunk.shard.device)  # type: ignore[union-attr]
        for slot, grad in zip(chunk.slots, grads):
            if grad is not None:
                flat[slot.offset : slot.offset + slot.numel].copy_(grad.reshape(-1))
        if chunk.pending is not None:
            flat += chunk.pending
            chunk.pending = None
        if not self._sync:
            chunk.pending = flat
            return
        if not self._callback_queued:
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self._finish_backward)
        if self.stage == 1:
            axes = chunk.scatter_axes + chunk.other_axes
            if axes:
                chunk.work = dist.all_reduce(flat, group=self._group_of(axes[0]), async_op=True)
            chunk.reduced = flat
            return
        # Reduce-scatter (or slice, where the gradient is already whole) over the ZeRO axes.
        value = flat
        for axis in chunk.zero_axes:
            size = self.mesh_shape[axis]
            part = value.numel() // size
            if axis in chunk.scatter_axes:
                out = torch.empty(part, dtype=value.dtype, device=value.device)
                if axis == chunk.zero_axes[-1] and not chunk.other_axes:
                    chunk.work = dist.reduce_scatter_single(
                        out, value, group=self._group_of(axis), async_op=True
                    )
                else:
                    dist.reduce_scatter_single(out, value, group=self._group_of(axis))
                value = out
            else:
                value = value[self._coords[axis] * part : (self._coords[axis] + 1) * part].clone()
        chunk.reduced = value

    def _finish_backward(self) -> None:
        self._callback_queued = False
        for chunk in self.chunks:
            if chunk.reduced is None:
                continue
            if chunk.work is not None:
                chunk.work.wait()
                chunk.work = None
            if self.stage == 1:
                axes = chunk.scatter_axes + chunk.other_axes
                for axis in axes[1:]:
                    dist.all_reduce(chunk.reduced, group=self._group_of(axis))
                chunk.grad_full = chunk.reduced
                lo = chunk.shard_index * chunk.shard_numel
                grad_shard = chunk.reduced[lo : lo + chunk.shard_numel]
            else:
                for axis in chunk.other_axes:
                    dist.all_reduce(chunk.reduced, group=self._group_of(axis))
                grad_shard = chunk.reduced
            chunk.reduced = None
            for slot, param in zip(chunk.slots, chunk.params):
                grad = grad_shard[slot.shard_lo : slot.shard_hi]
                if param.grad is None:
                    param.grad = grad
                else:
                    param.grad.add_(grad)
        for chunk in self.chunks:
            if self.stage == 3:
                chunk.full = None
            if chunk.prefetch is not None:
                chunk.prefetch[0].wait()
                chunk.prefetch = None

    # -- optimizer step -------------------------------------------------------------------------

    def _check_optimizer(self, optimizer: torch.optim.Optimizer) -> bool:
        if not any(
            id(p) in self._chunk_of_param for g in optimizer.param_groups for p in g["params"]
        ):
            return False
        name = type(optimizer).__name__
        if name not in ELEMENTWISE_OPTIMIZERS and not getattr(
            type(optimizer), "autopar_elementwise", False
        ):
            raise ValueError(
                f"ZeRO stage {self.stage} gives the optimizer 1-D shards of each parameter, and "
                f"{name} needs whole parameters; use an elementwise optimizer (SGD, Adam, AdamW, ...) "
                f"or autopar.optim.LAMB / LARS, train with zero_stage=0, or set "
                f"{name}.autopar_elementwise = True if its update really is elementwise"
            )
        return True

    def _after_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.stage == 3:
            return
        touched = sorted(
            {
                self._chunk_of_param[id(p)][0]
                for g in optimizer.param_groups
                for p in g["params"]
                if id(p) in self._chunk_of_param
            }
        )
        with torch.no_grad():
            for index in touched:
                self.sync_full(index)

    def sync_full(self, index: int) -> None:
        """Stages 1-2: all-gather the chunk's shards into its kept full buffer."""
        chunk = self.chunks[index]
        assert chunk.full is not None and chunk.shard is not None
        # From a copy: the shard is a view into the buffer being written.
        chunk.full.copy_(self._gather_flat(self._compute_shard(chunk).clone(), chunk.zero_axes))

    # -- state ------------------------------------------------------------------------------------

    def local_params(self) -> dict[int, torch.Tensor]:
        """id(shard parameter) -> this rank's full local block (a collective in stage 3)."""
        out: dict[int, torch.Tensor] = {}
        for chunk in self.chunks:
            if self.stage < 3 and self.compute_dtype is None:
                full = chunk.full
            else:
                full = self._gather_flat(chunk.shard.detach(), chunk.zero_axes)  # type: ignore[union-attr]
            assert full is not None
            for slot, param in zip(chunk.slots, chunk.params):
                # A copy: a view would keep the whole gathered chunk alive (and alias the buffer).
                out[id(param)] = (
                    full[slot.offset : slot.offset + slot.numel].view(slot.shape).clone()
                )
        return out

    def local_grads(self) -> dict[int, torch.Tensor]:
        """id(shard parameter) -> the gradient of this rank's full local block (a collective;
        zeros where no gradient was produced)."""
        return self.gather_pieces(
            {id(p): p.grad for c in self.chunks for p in c.params if p.grad is not None}
        )

    def gather_pieces(self, pieces: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """id(shard parameter) -> full local block, from tensors shaped like the shard
        parameters (gradients, elementwise optimizer state); a collective over every chunk.
        Parameters without a piece read as zeros; every rank must pass the same ids."""
        out: dict[int, torch.Tensor] = {}
        for chunk in self.chunks:
            if not any(id(p) in pieces for p in chunk.params):
                continue
            flat = torch.zeros(chunk.shard_numel, dtype=torch.float32, device=chunk.shard.device)  # type: ignore[union-attr]
            for slot, param in zip(chunk.slots, chunk.params):
                piece = pieces.get(id(param))
                if piece is not None:
                    flat[slot.shard_lo : slot.shard_hi].copy_(piece)
            full = self._gather_flat(flat, chunk.zero_axes)
            for slot, param in zip(chunk.slots, chunk.params):
                if id(param) in pieces:
                    out[id(param)] = (
                        full[slot.offset : slot.offset + slot.numel].view(slot.shape).clone()
                    )
        return out

    def piece_of(self, param: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
        """The part of a full local block that this rank's shard parameter ``param`` holds."""
        index, k = self._chunk_of_param[id(param)]
        slot = self.chunks[index].slots[k]
        n = slot.shard_hi - slot.shard_lo
        return block.detach().reshape(-1)[slot.param_lo : slot.param_lo + n]

    @property
    def padding_fraction(self) -> float:
        """Share of the chunk buffers that holds no parameter (padding to the shard count)."""
        total = sum(c.numel for c in self.chunks)
        used = sum(s.numel for c in self.chunks for s in c.slots)
        return (total - used) / total if total else 0.0

    def manages(self, param: torch.Tensor) -> bool:
        return id(param) in self._chunk_of_param

    def slot_of(self, param: torch.Tensor) -> tuple[_Chunk, _Slot]:
        """The chunk of a managed shard parameter and its slot there (layout for
        :mod:`autopar.runtime.state`)."""
        index, k = self._chunk_of_param[id(param)]
        return self.chunks[index], self.chunks[index].slots[k]

    def load_local(self, param: torch.Tensor, block: torch.Tensor) -> None:
        """Set a managed parameter from this rank's full local block."""
        index, k = self._chunk_of_param[id(param)]
        chunk = self.chunks[index]
        slot = chunk.slots[k]
        flat = block.detach().reshape(-1)
        with torch.no_grad():
            param.copy_(self.piece_of(param, block))
            if chunk.full is not None and self.stage < 3:
                chunk.full[slot.offset : slot.offset + slot.numel].copy_(flat)

    def zero_axes_of(self, param: torch.Tensor) -> tuple[int, ...]:
        """The mesh axes a managed parameter's shards are split over (empty if not managed)."""
        entry = self._chunk_of_param.get(id(param))
        return self.chunks[entry[0]].zero_axes if entry is not None else ()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _getitem(values: Any, index: int) -> Any:
    return values[index]


def _register_optimizer_hooks(engine: ZeroEngine) -> list[Any]:
    """Global torch.optim step hooks that act only on optimizers holding this engine's shards
    (weakly referenced: a dropped module leaves inert hooks)."""
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    ref = weakref.ref(engine)

    def pre(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        live = ref()
        if live is not None:
            live._check_optimizer(optimizer)

    def post(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        live = ref()
        if live is not None and live._check_optimizer(optimizer):
            live._after_step(optimizer)

    handles = [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]
    weakref.finalize(engine, _remove_handles, list(handles))
    return handles


def _remove_handles(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()


class ShardedGradScaler:
    """Dynamic loss scaling for fp16 mixed precision on a mesh, with ``torch.amp.GradScaler``'s
    API: ``scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()``.

    ``unscale_(optimizer)`` divides the optimizer's gradients (this rank's shards) by the scale
    in place and looks for inf/NaN; the verdict is all-reduced (max) over every mesh axis, so
    every rank and every shard agree to skip or take the step. ``step`` unscales if
    ``unscale_`` was not called (call it yourself before ``pmodel.clip_grad_norm_``) and runs
    ``optimizer.step()`` only when no rank overflowed. ``update`` multiplies the scale by
    ``backoff_factor`` after a skipped step and by ``growth_factor`` after ``growth_interval``
    clean steps in a row. Disabled (``enabled=False``, fp32 / bf16), it passes through.

    Args:
        groups: the process groups whose ranks must agree (one per mesh axis of size > 1).
    """

    def __init__(
        self,
        groups: Sequence[Any],
        *,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        if not 0.0 < backoff_factor < 1.0 or growth_factor <= 1.0 or growth_interval < 1:
            raise ValueError(
                f"need 0 < backoff_factor < 1 < growth_factor and growth_interval >= 1, got "
                f"{backoff_factor}, {growth_factor}, {growth_interval}"
            )
        self._groups = tuple(groups)
        self._scale = float(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.enabled = bool(enabled)
        self._growth_tracker = 0
        self._found_inf: dict[int, bool] = {}
        """id(optimizer) -> overflow verdict, for optimizers unscaled since the last update."""
        self.skipped_steps = 0
        """Optimizer steps skipped for overflow so far."""

    def get_scale(self) -> float:
        return self._scale if self.enabled else 1.0

    def is_enabled(self) -> bool:
        return self.enabled

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the current scale (unchanged when disabled)."""
        return loss * self._scale if self.enabled else loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> bool:
        """Divide ``optimizer``'s gradients by the scale; returns whether ANY rank found an
        inf/NaN (a collective over the mesh: every rank must call it)."""
        if not self.enabled:
            return False
        if id(optimizer) in self._found_inf:
            raise RuntimeError(
                "unscale_() was already called on this optimizer since the last update(); call "
                "it once per step, before step()"
            )
        inverse = 1.0 / self._scale
        grads = [
            p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None
        ]
        device = grads[0].device if grads else torch.device("cpu")
        if dist.is_initialized() and dist.get_backend() == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        found = torch.zeros(1, dtype=torch.float32, device=device)
        with torch.no_grad():
            for grad in grads:
                grad.mul_(inverse)
                if grad.numel() and not bool(torch.isfinite(grad).all()):
                    found.fill_(1.0)
            for group in self._groups:
                dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
        self._found_inf[id(optimizer)] = bool(found.item() > 0)
        return self._found_inf[id(optimizer)]

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """``optimizer.step()`` unless some rank's gradients overflowed (then None)."""
        if not self.enabled:
            return optimizer.step(*args, **kwargs)
        if id(optimizer) not in self._found_inf:
            self.unscale_(optimizer)
        if self._found_inf[id(optimizer)]:
            self.skipped_steps += 1
            return None
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale: float | None = None) -> None:
        """Adjust the scale after the step(s) of this iteration (same on every rank)."""
        if not self.enabled:
            return
        if new_scale is not None:
            self._scale = float(new_scale)
            self._growth_tracker = 0
        elif any(self._found_inf.values()):
            self._scale *= self.backoff_factor
            self._growth_tracker = 0
        elif self._found_inf:
            self._growth_tracker += 1
            if self._growth_tracker >= self.growth_interval:
                self._scale *= self.growth_factor
                self._growth_tracker = 0
        self._found_inf = {}

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self._scale,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "_growth_tracker": self._growth_tracker,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._scale = float(state["scale"])
        self.growth_factor = float(state["growth_factor"])
        self.backoff_factor = float(state["backoff_factor"])
        self.growth_interval = int(state["growth_interval"])
        self._growth_tracker = int(state["_growth_tracker"])


def build_zero_engine(
    lowered: Any,
    params: dict[str, nn.Parameter],
    coords: Sequence[int],
    group_of: Callable[[int], Any],
    *,
    stage: int,
    zero_axes: Sequence[int] | None = None,
    chunk_bytes: int | None = None,
    mixed_precision: str | None = None,
    read_flat: Callable[[str, int, int], torch.Tensor] | None = None,
    device: torch.device | str | None = None,
) -> ZeroEngine:
    """The engine for a ParallelModule's local parameters (canonical FQN -> local block).

    Args:
        zero_axes: mesh axes to shard over; None = every axis some parameter gradient is summed
            over (the data-parallel axes). A parameter is sharded over those of them on which
            it is Replicate.
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
    if zero_axes is None:
        axes = sorted({a for reduce in lowered.param_grad_reduce_axes.values() for a in reduce})
    else:
        axes = sorted(int(a) for a in zero_axes)
        bad = [a for a in axes if not 0 <= a < len(mesh_shape)]
        if bad:
            raise ValueError(f"zero_axes {bad} are not axes of the mesh {mesh_shape}")
    entries = []
    for fqn in lowered.param_use_order:
        param = params.get(fqn)
        if param is None or not param.requires_grad:
            continue
        placements = lowered.param_placements[fqn]
        own = tuple(a for a in axes if isinstance(placements[a], Replicate) and mesh_shape[a] > 1)
        if own:
            entries.append((fqn, param, own, tuple(lowered.param_grad_reduce_axes.get(fqn, ()))))
    return ZeroEngine(
        stage=stage,
        params=entries,
        mesh_shape=mesh_shape,
        coords=coords,
        group_of=group_of,
        chunk_bytes=chunk_bytes,
        compute_dtype=_COMPUTE_DTYPES.get(mixed_precision),
        read_flat=read_flat,
        device=device,
    )


_COMPUTE_DTYPES: dict[str | None, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}
