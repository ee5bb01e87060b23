"""ZeRO-3's collectives priced per chunk, as the runtime issues them.

The runtime (``autopar.runtime.zero_store``) packs the ZeRO-managed parameters into flat chunks,
a stream of chunks per set of mesh axes the parameters are sharded over and of axes where their
gradients are Partial, and issues every collective once per chunk: over the stage-3 axes P an
all-gather before forward (``runtime.zero_gather``, prefetched), another before backward where
some backward saves one of the chunk's parameters (the unpack hook gathers it again; an
embedding table's backward saves none: :func:`saved_param_nodes`), and the gradient's
reduce-scatter over the axes of P where it is Partial (``runtime.zero_backward``; sliced
elsewhere), each for the sum of the chunk's parameters' bytes
(:meth:`autopar.planner.chunks.ChunkPricing.calls`). So a chunk pays each collective's latency
(and the link's ``sync_s``) once; before, the planner priced one all-gather per parameter.

The ILP still chooses a layout per parameter, so a chunk's price is split over its parameters:
a parameter of ``n`` local elements in stream ``k`` (its P axes, and those of them where its
gradient is Partial) pays

    n * per_element[k] + per_chunk[k] * chunks[k] * n / elements[k]

(bytes exactly; the stream's latencies apportioned by elements) less the gradient all-reduce its
consumers already price on those axes (``CommPricer.grad_sync_s``: latency per 25 MiB bucket),
never below 0 (ZeRO never makes a step faster than stage 0 under the model).

Stages 1-2, and the reduction and refresh on an axis below stage 3, stay priced as that bucketed
all-reduce (a reduce-scatter and an all-gather move its bytes): the runtime issues them per chunk
too (a reduce-scatter, then one broadcast per rank on gloo), but pricing them would make stage 0
on an axis faster than stage 2, and ``planner.zero_choice`` prunes stages 0-1 on an axis where
stage 2 is solved because they cost the same time. For the same reason a stream is keyed by its
P axes only (the runtime also splits streams by the stage-1-2 axes): exact where every ZeRO axis
is at stage 3 (``fsdp``), or the others at 0 (``fsdp+tp``).

What a stream holds depends on every parameter's layout, which the solver chooses; so the
grouping is fixed before the solve:

(:func:`problem_streams`): ``elements[k]`` counts every parameter that can take a layout of
stream ``k`` among its allowed strategies (its largest such block), its gradient taken as
Partial on the axes where some allowed consumer strategy makes it so
(:func:`allowed_partial_axes`: for a recipe the axes the runtime reduces; for the auto plan
nearly every data axis), the stream gathered again in backward if a backward saves one of its
parameters (per stream: exact with one chunk per stream, gloo). ``evaluate`` prices a chosen
layout with the same streams (the figures a plan reports are the ones the ILP optimised; and a
configuration's optimum stays comparable with another's, which ``zero_choice``'s pruning relies on). That is exact for the
recipes (one layout per parameter: :func:`chosen_streams`, the layout's own streams and
Partial axes, gives the same) and where every parameter that can join a stream does (the
data-parallel plans ZeRO-3 is chosen with); where only some join, the shares sum to less than
the stream's latencies (ZeRO-3's latency priced a little cheap).

``chunks[k]`` is the number of chunks the planner's chunk size gives (``plan.build._chunk_size``):
one per stream where collectives do not overlap compute (gloo: the fewest chunks the budget
allows, one unless the budget's headroom caps the chunk), else the stream packed by
``DEFAULT_MAX_CHUNK_BYTES`` (an estimate: the planned size is searched after the solve).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from autopar.planner.chain_grads import allowed_carried_axes, carried_partial_axes
from autopar.planner.chunks import DEFAULT_MAX_CHUNK_BYTES, ChunkPricing, pack_chunks
from autopar.planner.pricing import rounding_given_back
from autopar.planner.saved_activations import saved_parameters

__all__ = [
    "GradInfo",
    "StreamPrice",
    "ZeroStreams",
    "allowed_partial_axes",
    "chosen_streams",
    "gathered_axes",
    "partial_axes",
    "priced_calls",
    "problem_streams",
    "saved_param_nodes",
    "stream_price",
]

GradInfo = tuple[tuple[int, ...], bool, tuple[float, ...]]
"""Of a parameter: the mesh axes where its gradient is priced Partial (reduced), whether
some backward saves it (its chunk is gathered again in backward), and per mesh axis the
gradient buckets' rounding its consumers price for certain (``pricing.rounding_given_back``;
empty: none), which ZeRO-3 gives back on the axes it reduces."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StreamPrice:
    """One stream of chunks: the stage-3 axes its parameters are sharded over, its price."""

    axes: tuple[int, ...]
    """P: the stage-3 axes (mesh-axis order)."""
    partial: tuple[int, ...]
    """Axes of P where the gradients are Partial (reduce-scattered; elsewhere sliced)."""
    stages: tuple[int, ...]
    """The stage priced on every mesh axis for this stream: 3 on P, else 0."""
    elements: float
    """Local elements of the parameters in the stream."""
    chunks: int
    per_chunk_s: float
    """Seconds one chunk's collectives cost beyond their bytes (latencies, ``sync_s``)."""
    per_element_s: float
    """Seconds per element of the stream's collectives (bandwidth)."""
    collectives: tuple[tuple[str, int], ...]
    """(kind, group size) of each collective one chunk issues per step."""
    regathers: bool = True
    """Whether backward gathers the chunks again: some member is saved by a backward."""
    keeps_last: bool = False
    """Whether the stream holds the parameter the graph uses last: its last chunk stays
    gathered from forward into backward (``ChunkPricing.keeps_last``)."""

    @property
    def latency_per_element_s(self) -> float:
        return self.per_chunk_s * self.chunks / self.elements if self.elements else 0.0


@dataclass(frozen=True, kw_only=True, slots=True)
class ZeroStreams:
    """The streams of one ZeRO configuration (hashable: a memo key)."""

    streams: tuple[StreamPrice, ...]
    grads: dict[str, GradInfo] = field(default_factory=dict, compare=False, hash=False)
    """Per parameter node (an alias's entry is its owner's): :data:`GradInfo` as priced."""
    grads_key: int = 0
    """A hash of ``grads`` (which is left out of comparisons: hashing it per memo lookup
    would cost its length), so streams priced with other gradients compare unequal."""

    def grad_of(self, name: str) -> GradInfo:
        """:data:`GradInfo` of parameter node ``name``; a parameter no op uses: nothing."""
        return self.grads.get(name, ((), False, ()))

    def get(self, axes: tuple[int, ...], partial: tuple[int, ...]) -> StreamPrice | None:
        for stream in self.streams:
            if stream.axes == axes and stream.partial == partial:
                return stream
        return None


def gathered_axes(space, node, s: int, zero) -> tuple[int, ...]:
    """P of parameter strategy ``s``: the axes it is Replicate on, of size > 1, at stage 3."""
    mesh = space.mesh
    placements = node.strategies[s].outputs[0]
    return tuple(
        a
        for a in range(mesh.ndim)
        if mesh.shape[a] > 1 and zero.stage_of(a) == 3 and placements[a].is_replicate()
    )


def stream_price(
    space,
    zero,
    axes: tuple[int, ...],
    partial: tuple[int, ...],
    numels: Sequence[float],
    regathers: bool = True,
    keeps_last: bool = False,
) -> StreamPrice:
    """The price of a stream on ``axes`` (gradients Partial on ``partial``) holding
    parameters of ``numels`` local elements (in order of first use); ``regathers``: some
    backward saves one of them (backward gathers the chunks again); ``keeps_last``: it holds
    the parameter the graph uses last (its last chunk is not gathered again)."""
    device = space.mesh.device
    stages = tuple(3 if a in axes else 0 for a in range(space.mesh.ndim))
    pricing = _pricing(space, stages, partial, regathers, keeps_last)
    itemsize = 4  # the runtime's chunks are fp32 (runtime.zero_store refuses other dtypes)
    if device.collectives_overlap_compute:
        capacity = max(DEFAULT_MAX_CHUNK_BYTES // itemsize, 1)
        chunks = len(pack_chunks([int(n) for n in numels], capacity))
    else:
        chunks = 1
    per_chunk, per_element = pricing.affine_s(
        gather_itemsize=2 if space.options.mixed_precision else itemsize,
        reduce_itemsize=itemsize,
        chunks=chunks,
    )
    return StreamPrice(
        axes=axes,
        partial=partial,
        stages=stages,
        elements=float(sum(numels)),
        chunks=chunks,
        per_chunk_s=per_chunk,
        per_element_s=per_element,
        collectives=tuple((kind, n) for kind, n, _ in pricing.calls(1.0, 1.0)),
        regathers=regathers,
        keeps_last=keeps_last,
    )


def _pricing(
    space,
    stages: tuple[int, ...],
    partial: tuple[int, ...],
    regathers: bool,
    keeps_last: bool = False,
) -> ChunkPricing:
    mesh = space.mesh
    return ChunkPricing.on_mesh(
        shape=mesh.shape,
        links=mesh.links,
        device=mesh.device,
        stages=stages,
        forward_s=0.0,
        backward_s=0.0,
        partial=partial,
        regather=regathers,
        keeps_last=keeps_last,
    )


Key = tuple[tuple[int, ...], tuple[int, ...]]
"""A stream: (P axes, the P axes where the gradients are Partial)."""


def _streams(
    space,
    zero,
    members: dict[Key, list[tuple[float, bool]]],
    grads: dict[str, GradInfo],
    last: set[Key] | None = None,
) -> ZeroStreams:
    """``last``: the streams that hold the parameter the graph uses last."""
    return ZeroStreams(
        streams=tuple(
            stream_price(
                space,
                zero,
                axes,
                partial,
                [n for n, _ in members[(axes, partial)]],
                any(saved for _, saved in members[(axes, partial)]),
                keeps_last=last is not None and (axes, partial) in last,
            )
            for axes, partial in sorted(members)
            if axes and sum(n for n, _ in members[(axes, partial)]) > 0
        ),
        grads=grads,
        # A digest, not hash(): equal in every process (str hashes are salted per process).
        grads_key=int.from_bytes(
            hashlib.blake2b(repr(sorted(grads.items())).encode(), digest_size=8).digest(), "big"
        ),
    )


def last_used_param(space) -> str | None:
    """The parameter node (an alias counts for its owner) whose last consumer comes latest in
    the graph: the runtime keeps its chunk gathered from forward into backward
    (``runtime.zero_graph.rewrite_graph``). Memoised in the space's evaluation cache."""
    cache: dict[Any, Any] = space.evaluation_cache
    if "last_used_param" not in cache:
        nodes, latest, out = space.nodes, -1, None
        for edge in space.edges:
            src = nodes[edge.src]
            if src.kind == "param" and edge.input_index >= 0 and edge.dst > latest:
                latest, out = edge.dst, src.alias_of or src.name
        cache["last_used_param"] = out
    return cache["last_used_param"]


def saved_param_nodes(space) -> frozenset[str]:
    """Parameter nodes some backward saves (an alias counts for its owner): their chunks are
    gathered again for backward (``saved_activations.saved_parameters``). Memoised in the
    space's evaluation cache."""
    cache: dict[Any, Any] = space.evaluation_cache
    out = cache.get("saved_params")
    if out is None:
        from autopar.planner.space import grad_nodes

        gm = space.captured.gm
        needs = space.needs_grad
        if needs is None:
            needs = grad_nodes(gm, space.captured.param_nodes)
        saved = saved_parameters(gm.graph, needs)
        out = frozenset(
            node.alias_of or node.name
            for node in space.nodes
            if node.kind == "param" and node.name in saved
        )
        cache["saved_params"] = out
    return out


def partial_axes(space, choice: Sequence[int]) -> dict[int, tuple[int, ...]]:
    """Per parameter node (an alias counts for its original): the mesh axes where its
    gradient is Partial under ``choice``, from its consumers' chosen input-gradient layouts
    (what ``space`` prices the gradient all-reduce on, and the runtime reduces), and those
    on which a chain of ops on it alone carries one back (``planner.chain_grads``)."""
    mesh, nodes = space.mesh, space.nodes
    out: dict[int, set[int]] = {}
    for edge in space.edges:
        src = nodes[edge.src]
        if src.kind != "param" or edge.input_index < 0:
            continue
        grads = nodes[edge.dst].strategies[choice[edge.dst]].input_grads
        grad = grads[edge.input_index] if edge.input_index < len(grads) else None
        if grad is None:
            continue
        owner = space.index[src.alias_of] if src.alias_of is not None else edge.src
        out.setdefault(owner, set()).update(
            a for a, p in enumerate(grad) if p.is_partial() and mesh.shape[a] > 1
        )
    for owner, axes in carried_partial_axes(space, choice).items():
        out.setdefault(owner, set()).update(axes)
    return {i: tuple(sorted(axes)) for i, axes in out.items()}


def allowed_partial_axes(
    space, allowed: dict[str, Sequence[int]] | None
) -> dict[int, tuple[int, ...]]:
    """Per parameter node (an alias counts for its original): the mesh axes where some
    allowed strategy of some consumer makes its gradient Partial (where the solve prices its
    reduction; for a recipe, whose consumers' layouts are fixed on the data axes, the axes the
    runtime reduces)."""
    mesh, nodes = space.mesh, space.nodes
    memo: dict[tuple, frozenset[int]] = {}  # repeated layers share strategy lists
    out: dict[int, set[int]] = {}
    for edge in space.edges:
        src, dst, j = nodes[edge.src], nodes[edge.dst], edge.input_index
        if src.kind != "param" or j < 0:
            continue
        idx = allowed.get(dst.name) if allowed else None
        key = (id(dst.strategies), j, None if idx is None else tuple(idx))
        axes = memo.get(key)
        if axes is None:
            found: set[int] = set()
            for t in range(len(dst.strategies)) if idx is None else idx:
                grads = dst.strategies[t].input_grads
                grad = grads[j] if j < len(grads) else None
                if grad is not None:
                    found.update(
                        a for a, p in enumerate(grad) if p.is_partial() and mesh.shape[a] > 1
                    )
            axes = memo[key] = frozenset(found)
        owner = space.index[src.alias_of] if src.alias_of is not None else edge.src
        out.setdefault(owner, set()).update(axes)
    for owner, carried in allowed_carried_axes(space, allowed).items():
        out.setdefault(owner, set()).update(carried)
    return {i: tuple(sorted(axes)) for i, axes in out.items()}


def _grads(
    space, partial: dict[int, tuple[int, ...]], given: dict[str, tuple[float, ...]]
) -> dict[str, GradInfo]:
    saved = saved_param_nodes(space)
    return {
        node.name: (partial.get(i, ()), node.name in saved, given.get(node.name, ()))
        for i, node in enumerate(space.nodes)
        if node.kind == "param" and node.alias_of is None
    }


def chosen_streams(space, choice: Sequence[int], zero) -> ZeroStreams:
    """The streams of a chosen layout (the runtime's grouping: by P axes and the axes where
    the gradients are Partial, from the consumers' chosen layouts)."""
    if zero.stage < 3:
        return ZeroStreams(streams=())
    grads = _grads(space, partial_axes(space, choice), rounding_given_back(space, choice=choice))
    members: dict[Key, list[tuple[float, bool]]] = {}
    last, last_used = set(), last_used_param(space)
    for node, s in zip(space.nodes, choice):
        if node.kind != "param" or node.alias_of is not None or node.local_numel is None:
            continue
        axes = gathered_axes(space, node, s, zero)
        if axes:
            partial, saved, _ = grads[node.name]
            key = (axes, tuple(a for a in axes if a in partial))
            members.setdefault(key, []).append((float(node.local_numel[s]), saved))
            if node.name == last_used:
                last.add(key)
    return _streams(space, zero, members, grads, last)


def problem_streams(space, zero, allowed: dict[str, Sequence[int]] | None) -> ZeroStreams:
    """The streams a solve prices with (module docstring): every parameter counted in each
    stream one of its allowed strategies belongs to, at its largest block there, its gradient
    Partial where some allowed consumer strategy makes it so (:func:`allowed_partial_axes`)."""
    if zero.stage < 3:
        return ZeroStreams(streams=())
    if not allowed:
        return _open_streams(space, zero)
    grads = _grads(space, allowed_partial_axes(space, allowed), rounding_given_back(space, allowed))
    members: dict[Key, list[tuple[float, bool]]] = {}
    last, last_used = set(), last_used_param(space)
    for node in space.nodes:
        if node.kind != "param" or node.alias_of is not None or node.local_numel is None:
            continue
        idx = allowed[node.name] if node.name in allowed else range(len(node.strategies))
        largest: dict[tuple[int, ...], float] = {}
        for s in idx:
            axes = gathered_axes(space, node, s, zero)
            if axes:
                largest[axes] = max(largest.get(axes, 0.0), float(node.local_numel[s]))
        partial, saved, _ = grads[node.name]
        for axes, numel in largest.items():
            key = (axes, tuple(a for a in axes if a in partial))
            members.setdefault(key, []).append((numel, saved))
            if node.name == last_used:
                last.add(key)
    return _streams(space, zero, members, grads, last)


def _open_streams(space, zero) -> ZeroStreams:
    """:func:`problem_streams` with every strategy allowed, the same streams from what no ZeRO
    configuration changes, kept in the space's evaluation cache (the plan document prices the
    chosen layouts under each of a mesh's configurations, 62 on 8x16x8: 1.1 s of llama3-70b's
    plan, now 0.3 s, when each walked every strategy of every parameter): the gradients, and per
    parameter the largest block of each set of axes of size > 1 it can be Replicate on. A
    stream's largest block is then the largest over the sets that leave the same stage-3 axes
    (the same maxima of the same floats, taken in another order)."""
    cache: dict[Any, Any] = space.evaluation_cache
    found = cache.get("open_stream_parts")
    if found is None:
        mesh = space.mesh
        blocks: list[tuple[str, dict[tuple[int, ...], float]]] = []
        for node in space.nodes:
            if node.kind != "param" or node.alias_of is not None or node.local_numel is None:
                continue
            largest: dict[tuple[int, ...], float] = {}
            for s, strategy in enumerate(node.strategies):
                placements = strategy.outputs[0]
                replicate = tuple(
                    a
                    for a in range(mesh.ndim)
                    if mesh.shape[a] > 1 and placements[a].is_replicate()
                )
                numel = float(node.local_numel[s])
                largest[replicate] = max(largest.get(replicate, 0.0), numel)
            blocks.append((node.name, largest))
        found = cache["open_stream_parts"] = (
            _grads(space, allowed_partial_axes(space, None), rounding_given_back(space)),
            blocks,
        )
    grads, blocks = found
    members: dict[Key, list[tuple[float, bool]]] = {}
    last, last_used = set(), last_used_param(space)
    for name, by_replicate in blocks:
        largest = {}
        for replicate, numel in by_replicate.items():
            axes = tuple(a for a in replicate if zero.stage_of(a) == 3)
            if axes:
                largest[axes] = max(largest.get(axes, 0.0), numel)
        partial, saved, _ = grads[name]
        for axes, numel in largest.items():
            key = (axes, tuple(a for a in axes if a in partial))
            members.setdefault(key, []).append((numel, saved))
            if name == last_used:
                last.add(key)
    return _streams(space, zero, members, grads, last)


def priced_calls(space, streams: ZeroStreams) -> list[tuple[str, int, float]]:
    """(kind, group size, bytes) of every ZeRO collective a step is priced with under
    ``streams``: each chunk's :meth:`ChunkPricing.calls` (a stream's elements split evenly over
    its chunks; the runtime pads each chunk to a multiple of its shard count)."""
    gather_itemsize = 2 if space.options.mixed_precision else 4
    out: list[tuple[str, int, float]] = []
    for stream in streams.streams:
        pricing = _pricing(
            space, stream.stages, stream.partial, stream.regathers, stream.keeps_last
        )
        elements = stream.elements / stream.chunks
        for k in range(stream.chunks):
            out += pricing.calls(
                elements * gather_itemsize, elements * 4, last=k == stream.chunks - 1
            )
    return out
