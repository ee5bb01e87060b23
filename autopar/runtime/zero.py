"""Chunk-managed ZeRO over the data-parallel mesh axes, with a stage per mesh axis.

Parameters (this rank's tensor-parallel blocks, as ``ParallelModule`` holds them) are packed in
order of first use in forward into flat fp32 chunks (sizes: :mod:`autopar.runtime.chunks`).

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

After every optimizer step that touches a chunk (a global ``torch.optim`` step post-hook,
filtered by parameter identity) the updated O-shards are all-gathered over ``O \\ P`` into the
kept buffer (nothing to do when O = P).

Gradient accumulation: backward under :meth:`ZeroEngine.no_sync` adds the chunk's flat local
gradient to a pending buffer and communicates nothing; the next synchronised backward adds it in.

Mixed precision (``compute_dtype=torch.bfloat16`` or ``torch.float16``): the O-shards stay fp32
(the master weights the optimizer updates, with fp32 state); the kept buffer is held in the
compute dtype (refreshed after each step; when O = P there is none and the shard is cast before
gathering); the graph runs under ``torch.autocast``; gradients are flattened to fp32 before any
reduction. fp16 needs loss scaling: :class:`autopar.runtime.grad_scaler.ShardedGradScaler`.

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
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd import Variable

from autopar.runtime.chunks import (
    DEFAULT_MAX_CHUNK_BYTES,
    MIN_CHUNKS,
    choose_chunk_bytes,
    chunk_numels,
    pack_chunks,
    round_up,
)
from autopar.runtime.grad_scaler import ShardedGradScaler
from autopar.runtime.zero_graph import Packed, rewrite_graph
from autopar.runtime.zero_layout import Chunk, Slot, resolve_stages

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
    "resolve_stages",
]

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


class ZeroEngine:
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
        self._coords = tuple(coords)
        self._group_of = group_of
        self._read_flat = read_flat
        self._device = torch.device(device) if device is not None else None
        self.chunks: list[Chunk] = []
        self.shard_params: dict[str, nn.Parameter] = {}
        self._chunk_of_param: dict[int, tuple[int, int]] = {}
        self._sync = True
        self._callback_queued = False
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
        self._handles = _register_optimizer_hooks(self)

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
        work = dist.all_gather_single(
            out, kept, group=self._group_of(chunk.zero_axes[0]), async_op=True
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

    def _gathered(self, chunk: Chunk) -> torch.Tensor:
        """The chunk's full buffer (all-gathered over P now unless prefetched)."""
        if chunk.prefetch is not None:
            work, out = chunk.prefetch
            chunk.prefetch = None
            work.wait()
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

    def _gather_flat(self, shard: torch.Tensor, zero_axes: Sequence[int]) -> torch.Tensor:
        """All-gather a flat shard over ``zero_axes`` (row-major shard index) into one buffer."""
        value = shard
        # Innermost axis first: its pieces are adjacent in the chunk.
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
        if chunk.num_param_axes:
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
        # Reduce-scatter (or slice, where the gradient is already whole) over G; the last
        # collective launched here runs asynchronously, overlapped with the rest of backward.
        value = flat
        last_scatter = chunk.scatter_axes[-1] if chunk.scatter_axes else None
        for axis in chunk.grad_axes:
            size = self.mesh_shape[axis]
            part = value.numel() // size
            if axis in chunk.scatter_axes:
                out = torch.empty(part, dtype=value.dtype, device=value.device)
                if axis == last_scatter and not chunk.allreduce_axes:
                    chunk.work = dist.reduce_scatter_single(
                        out, value, group=self._group_of(axis), async_op=True
                    )
                else:
                    dist.reduce_scatter_single(out, value, group=self._group_of(axis))
                value = out
            else:
                value = value[self._coords[axis] * part : (self._coords[axis] + 1) * part].clone()
        if chunk.allreduce_axes:
            chunk.work = dist.all_reduce(
                value, group=self._group_of(chunk.allreduce_axes[0]), async_op=True
            )
        chunk.reduced = value

    def _finish_backward(self) -> None:
        self._callback_queued = False
        for chunk in self.chunks:
            if chunk.reduced is None:
                continue
            if chunk.work is not None:
                chunk.work.wait()
                chunk.work = None
            for axis in chunk.allreduce_axes[1:]:
                dist.all_reduce(chunk.reduced, group=self._group_of(axis))
            # The optimizer's gradient is the O-shard of the reduced G-shard (a view: the G-shard
            # stays alive as the gradient storage, as the memory model counts it).
            lo = chunk.shard_in_grad
            grad_shard = chunk.reduced[lo : lo + chunk.shard_numel]
            chunk.reduced = None
            for slot, param in zip(chunk.slots, chunk.params):
                grad = grad_shard[slot.shard_lo : slot.shard_hi]
                if param.grad is None:
                    param.grad = grad
                else:
                    param.grad.add_(grad)
        for chunk in self.chunks:
            if chunk.num_param_axes:
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
        """All-gather the chunk's updated O-shards over ``O \\ P`` into its kept buffer (a
        collective over those axes; nothing when O = P)."""
        chunk = self.chunks[index]
        rest = chunk.zero_axes[chunk.num_param_axes :]
        if not rest:
            return
        assert chunk.kept is not None and chunk.shard is not None
        # From a copy: the shard is a view into the buffer being written.
        chunk.kept.copy_(self._gather_flat(self._compute_shard(chunk).clone(), rest))

    # -- state ------------------------------------------------------------------------------------

    def local_params(self) -> dict[int, torch.Tensor]:
        """id(shard parameter) -> this rank's full local block (a collective when some chunk
        is sharded over P, or under mixed precision)."""
        out: dict[int, torch.Tensor] = {}
        for chunk in self.chunks:
            if self.compute_dtype is None:
                assert chunk.kept is not None
                full = self._gather_flat(chunk.kept.detach(), chunk.param_axes)
            else:
                full = self._gather_flat(chunk.shard.detach(), chunk.zero_axes)  # type: ignore[union-attr]
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

    def slot_of(self, param: torch.Tensor) -> tuple[Chunk, Slot]:
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
            if chunk.kept is not None:
                # The part of the parameter inside this rank's kept range.
                kept_lo = chunk.kept_index * chunk.kept_numel
                a = max(slot.offset, kept_lo)
                b = min(slot.offset + slot.numel, kept_lo + chunk.kept_numel)
                if a < b:
                    chunk.kept[a - kept_lo : b - kept_lo].copy_(
                        flat[a - slot.offset : b - slot.offset]
                    )

    def zero_axes_of(self, param: torch.Tensor) -> tuple[int, ...]:
        """The mesh axes a managed parameter's optimizer shards are split over (O, in split
        order; empty if not managed)."""
        entry = self._chunk_of_param.get(id(param))
        return self.chunks[entry[0]].zero_axes if entry is not None else ()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []




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
        zero_axes = sorted({a for reduce in lowered.param_grad_reduce_axes.values() for a in reduce})
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
    )


_COMPUTE_DTYPES: dict[str | None, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}
