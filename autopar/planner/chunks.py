"""Chunk-size search for ZeRO: the planner records the chunk size, the runtime packs by it (torch-free).

Parameters are packed in order of first use into flat chunks (:func:`pack_chunks`); a chunk's
buffer is its content rounded up to a multiple of its shard count (:func:`chunk_numels`);
:func:`choose_chunk_bytes` picks the capacity that minimises the chunked collectives' exposed
seconds when given a price (:class:`ChunkPricing`, which the planner builds from the mesh's
links and the plan's compute time), and padding waste among equally priced sizes.

The price (:meth:`ChunkPricing.step_s`) is what the chunk size changes in a step: every chunk
pays each collective's latency once, and the runtime overlaps a chunk's gradient reduction with
the backward of the chunks used before it (and, under stage 3, a chunk's all-gather with the
compute of the chunk before it), so more chunks hide more bytes but pay more latencies. The
after-step refresh of the kept buffers (stages 1-2) runs after the optimizer, hidden by nothing.
On fast links with many bytes and compute to hide them (NCCL), that gives several chunks; where
collectives cannot overlap compute (gloo ranks on CPU cores: their copies, reductions and
transport use the cores the compute uses) every latency is exposed: the fewest chunks the
memory budget allows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cost_models import DeviceSpec, LinkSpec, collective_time_s

__all__ = [
    "CHUNK_TRANSIENTS",
    "DEFAULT_MAX_CHUNK_BYTES",
    "ChunkPricing",
    "MIN_CHUNKS",
    "choose_chunk_bytes",
    "chunk_numels",
    "pack_chunks",
    "planned_chunk_bytes",
    "round_up",
]

DEFAULT_MAX_CHUNK_BYTES = 32 * 2**20
"""Upper end of the chunk-size search (the largest parameter raises it)."""

MIN_CHUNKS = 8
"""The chunk-size search stops at 1/8 of the parameters (or the largest parameter): stage 3
gathers about two chunks at a time (the one in use and the prefetched one), not the model, and
in every stage a chunk's gradients are reduced while backward goes on, with one chunk of
flattened gradients in flight rather than the whole model's."""


CHUNK_TRANSIENTS = {1: 1, 2: 3, 3: 5}
"""Chunk-sized transients alive at once, by the largest ZeRO stage (the runtime's): stage 1, a
chunk's autograd gradients next to its flat buffer (which stays as the gradient storage); stage
2, also two flat gradients in flight (``runtime.zero_backward.MAX_IN_FLIGHT``); stage 3, also two
gathered chunks (the one in use and the prefetched one). The planner caps the chunk size so
that they fit in the memory budget's headroom over the plan's peak."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ChunkPricing:
    """What a chunk's collectives cost on the mesh, for :meth:`step_s`.

    ``axes`` are the ZeRO axes in the runtime's split order (P, then G minus P, then O minus
    G), each as ``(group size, link, stage)``; ``forward_s`` / ``backward_s`` the plan's
    compute seconds that collectives can hide behind. ``broadcast_refresh``: the runtime
    refreshes the kept buffer with one broadcast per rank (gloo) rather than one all-gather.
    ``overlap``: whether a collective in flight costs the compute nothing (its own engine and
    link, as NCCL on a GPU); False where ranks compute on the cores that run the collectives'
    copies, reductions and transport (gloo on CPU), so that every collective is exposed.
    ``whole``: per entry of ``axes``, whether the gradient is already whole there (not
    Partial: the runtime slices it on a G axis and reduces nothing on another); empty = Partial
    on every ZeRO axis (data-parallel). ``regather``: whether backward gathers the chunks over
    P again (``runtime.zero_gather``'s unpack hook does so only for a chunk some backward saves
    a parameter of; an embedding table's backward saves none).
    """

    axes: tuple[tuple[int, LinkSpec, int], ...]
    forward_s: float
    backward_s: float
    broadcast_refresh: bool = False
    overlap: bool = True
    whole: tuple[bool, ...] = ()
    regather: bool = True
    keeps_last: bool = False
    """Whether the last chunk stays gathered from forward into backward (the runtime keeps the
    chunk the graph uses last: ``runtime.zero_gather.ChunkGatherer.keep_for_backward``), so
    that it is not gathered again (where :attr:`regather`)."""

    @classmethod
    def on_mesh(
        cls,
        *,
        shape: Sequence[int],
        links: Sequence[LinkSpec],
        device: DeviceSpec,
        stages: Sequence[int],
        forward_s: float,
        backward_s: float,
        partial: Sequence[int] | None = None,
        regather: bool = True,
        keeps_last: bool = False,
    ) -> ChunkPricing:
        """The pricing of chunks split over the axes of ``shape`` with a stage >= 1 (and size
        > 1), in the runtime's split order (``runtime.zero_store``: stage 3 axes, then 2,
        then 1, each in mesh-axis order). Whether collectives overlap compute and how the
        refresh runs are the device's (``DeviceSpec.collectives_overlap_compute``,
        ``comm_backend``: set for the CPU preset and by ``autopar calibrate``). ``partial``: the
        mesh axes where the chunks' gradients are Partial (None: every ZeRO axis); ``regather``:
        whether backward gathers them again (some backward saves one of their parameters)."""
        axes = [a for a, n in enumerate(shape) if n > 1 and a < len(stages) and stages[a] >= 1]
        axes.sort(key=lambda a: -stages[a])
        return cls(
            whole=() if partial is None else tuple(a not in partial for a in axes),
            axes=tuple((int(shape[a]), links[a], int(stages[a])) for a in axes),
            forward_s=float(forward_s),
            backward_s=float(backward_s),
            # The runtime refreshes with broadcasts on gloo (runtime.zero_layout.fill_flat).
            broadcast_refresh=device.comm_backend == "gloo",
            overlap=device.collectives_overlap_compute,
            regather=regather,
            keeps_last=keeps_last,
        )

    @property
    def num_gathers(self) -> int:
        """All-gathers over P per chunk and step: before forward, and again before backward
        when :attr:`regather`."""
        return 2 if self.regather else 1

    def gather_s(self, nbytes: float) -> float:
        """All-gather of a chunk over P (stage 3), once (:attr:`num_gathers` per step)."""
        out, size = 0.0, nbytes
        for n, link, stage in self.axes:
            if stage == 3:
                out += collective_time_s("all_gather", size, n, link)
                size /= n
        return out

    def reduce_s(self, nbytes: float) -> float:
        """A chunk's gradient reduction: reduce-scatter over G, all-reduce over O minus G."""
        out = 0.0
        for kind, n, link, size in self._reductions(nbytes):
            out += collective_time_s(kind, size, n, link)
        return out

    def _reductions(self, nbytes: float) -> list[tuple[str, int, LinkSpec, float]]:
        """The gradient reduction's collectives (``runtime.zero_backward``), with bytes."""
        out, size = [], nbytes
        for k, (n, link, stage) in enumerate(self.axes):
            whole = bool(self.whole) and self.whole[k]
            if stage >= 2:
                if not whole:
                    out.append(("reduce_scatter", n, link, size))
                size /= n
            elif not whole:
                out.append(("all_reduce", n, link, size))
        return out

    def refresh_s(self, nbytes: float) -> float:
        """The after-step refresh over O minus P, innermost axis first (nothing under P)."""
        rest = [(n, link) for n, link, stage in self.axes if stage < 3]
        size = nbytes
        for n, _, stage in self.axes:
            size /= n if stage == 3 else 1
        block = size / math.prod(n for n, _ in rest) if rest else 0.0
        out = 0.0
        for n, link in reversed(rest):
            if self.broadcast_refresh:
                out += n * collective_time_s("broadcast", block, n, link)
            else:
                out += collective_time_s("all_gather", block * n, n, link)
            block *= n
        return out

    def calls(
        self, gather_bytes: float, reduce_bytes: float, last: bool = False
    ) -> list[tuple[str, int, float]]:
        """(kind, group size, bytes as ``collective_time_s`` takes them) of every collective a
        chunk of ``gather_bytes`` (compute dtype; ``reduce_bytes`` as fp32 gradient) issues in
        a step, in the runtime's order: the all-gathers over P before forward and again before
        backward where :attr:`regather` (``runtime.zero_gather``), the gradient reduction (``runtime.zero_backward``:
        a reduce-scatter per G axis, an all-reduce per O \\ G axis) and the after-step refresh
        over O \\ P (``runtime.zero_layout.fill_flat``: one broadcast per rank on gloo, else
        one all-gather). The same collectives :meth:`gather_s`, :meth:`reduce_s` and
        :meth:`refresh_s` price. ``last``: the stream's last chunk (gathered once where
        :attr:`keeps_last`)."""
        gathers: list[tuple[str, int, float]] = []
        size = gather_bytes
        for n, _, stage in self.axes:
            if stage == 3:
                gathers.append(("all_gather", n, size))
                size /= n
        reduces = [(kind, n, size) for kind, n, _, size in self._reductions(reduce_bytes)]
        rest = [n for n, _, stage in self.axes if stage < 3]
        block = gather_bytes / math.prod(n for n, _, _ in self.axes)
        refresh: list[tuple[str, int, float]] = []
        for n in reversed(rest):
            if self.broadcast_refresh:
                refresh += [("broadcast", n, block)] * n
            else:
                refresh.append(("all_gather", n, block * n))
            block *= n
        times = 1 if last and self.keeps_last else self.num_gathers
        return gathers * times + reduces + refresh

    def affine_s(
        self, *, gather_itemsize: int, reduce_itemsize: int, chunks: int = 1
    ) -> tuple[float, float]:
        """(seconds per chunk, seconds per element) of a chunk's collectives in a step, every
        one exposed (the ``overlap=False`` sum of :meth:`step_s`): each collective's latency
        (and ``sync_s``) once per chunk, its bytes per element. Gathers and the refresh move
        the compute dtype (``gather_itemsize``), the reduction the fp32 gradient. Averaged
        over the ``chunks`` of a stream of equal chunks where :attr:`keeps_last` (its last
        chunk gathers once)."""
        gathers = float(self.num_gathers)
        if self.keeps_last and self.regather:
            gathers -= 1.0 / max(chunks, 1)
        per_chunk = per_element = 0.0
        for price, itemsize, times in (
            (self.gather_s, gather_itemsize, gathers),
            (self.reduce_s, reduce_itemsize, 1),
            (self.refresh_s, gather_itemsize, 1),
        ):
            base, slope = _base_slope(price)
            per_chunk += times * base
            per_element += times * slope * itemsize
        return per_chunk, per_element

    def step_s(self, chunk_bytes: Sequence[float]) -> float:
        """Seconds the chunks' collectives add to a step beyond the compute they overlap.

        Chunks in order of first use. Forward (stage 3): chunk k's all-gather starts when the
        one before it ended and chunk k-1 started computing (one prefetch), its compute when
        the gather ended; compute per chunk is ``forward_s`` split by bytes. Backward runs the
        chunks in reverse: a chunk's reduction starts when its compute ended and the previous
        reduction did (one collective stream), after a re-gather like forward's (where
        :attr:`regather`; not the last chunk's where :attr:`keeps_last`). Then the
        refreshes, one after another. Exposed = what ends after the compute would have.
        Without ``overlap``, the sum of every collective.
        """
        total = float(sum(chunk_bytes)) or 1.0
        # Every collective time is affine in the bytes (alpha-beta): two evaluations each.
        gather, reduce, refresh = (
            _affine(price) for price in (self.gather_s, self.reduce_s, self.refresh_s)
        )
        kept = self.keeps_last and self.regather and bool(chunk_bytes)
        if not self.overlap:
            return sum(
                self.num_gathers * gather(b) + reduce(b) + refresh(b) for b in chunk_bytes
            ) - (gather(chunk_bytes[-1]) if kept else 0.0)
        exposed = 0.0
        for order, compute_s, reduces in (
            (list(chunk_bytes), self.forward_s, False),
            (list(reversed(chunk_bytes)), self.backward_s, True),
        ):
            comm_end = comp_end = start = 0.0
            for k, nbytes in enumerate(order):
                seconds = gather(nbytes) if self.regather or not reduces else 0.0
                if reduces and k == 0 and kept:
                    seconds = 0.0  # the last chunk, kept from forward
                if seconds > 0:  # compute waits for its gather, the gather for the stream
                    comm_end = max(comm_end, start) + seconds
                    start = max(comp_end, comm_end)
                else:
                    start = comp_end
                comp_end = start + compute_s * nbytes / total
                if reduces:
                    comm_end = max(comm_end, comp_end) + reduce(nbytes)
            exposed += max(comp_end, comm_end) - compute_s
        return exposed + sum(refresh(nbytes) for nbytes in chunk_bytes)


def _base_slope(price: Callable[[float], float]) -> tuple[float, float]:
    """``(a, b)`` with ``price(nbytes) = a + b * nbytes`` for ``nbytes > 0``, from two evaluations
    (every collective time is affine in the bytes: alpha-beta)."""
    one, two = price(2.0**20), price(2.0**21)
    slope = (two - one) / 2.0**20
    return one - slope * 2.0**20, slope


def _affine(price: Callable[[float], float]) -> Callable[[float], float]:
    """``price`` as ``a + b * nbytes`` for ``nbytes > 0`` (0 at 0), from two evaluations."""
    base, slope = _base_slope(price)
    return lambda nbytes: base + slope * nbytes if nbytes > 0 else 0.0


def round_up(n: int, multiple: int) -> int:
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
        sizes.append(round_up(max(size, 1), shards))
    return sizes


def choose_chunk_bytes(
    param_local_numels: Sequence[int],
    zero_shards: int,
    *,
    itemsize: int = 4,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    num_candidates: int = 512,
    min_chunks: int = 1,
    pricing: ChunkPricing | None = None,
) -> tuple[int, float]:
    """The chunk size (bytes) that minimises the chunks' exposed collective seconds under
    ``pricing`` (when given), then padding waste; and that waste as a fraction.

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
            parameter); the runtime passes :data:`MIN_CHUNKS` when it has no planned size.
        pricing: the chunks' collectives on the mesh (module docstring); None = padding only.
            The planner passes it with ``min_chunks=1`` and a ``max_chunk_bytes`` that keeps
            :data:`CHUNK_TRANSIENTS` within the memory budget.
    """
    if zero_shards < 1:
        raise ValueError(f"zero_shards must be >= 1, got {zero_shards}")
    numels = [int(n) for n in param_local_numels if n > 0]
    if not numels:
        return round_up(max_chunk_bytes // itemsize, zero_shards) * itemsize, 0.0
    total = sum(numels)
    lo = round_up(max(numels), zero_shards)
    cap = min(max_chunk_bytes // itemsize, total, -(-total // max(1, min_chunks)))
    hi = max(lo, round_up(cap, zero_shards))
    step = max(zero_shards, round_up(max(1, (hi - lo) // num_candidates), zero_shards))
    candidates = list(range(lo, hi + 1, step))
    if candidates[-1] != hi:
        candidates.append(hi)
    best_numel, best_key, best_waste = lo, (math.inf, math.inf), math.inf
    for chunk_numel in candidates:
        groups = pack_chunks(numels, chunk_numel)
        capacity = sum(chunk_numels(numels, groups, chunk_numel, zero_shards))
        waste = (capacity - total) / capacity
        seconds = 0.0
        if pricing is not None:
            # Priced on the bytes the runtime allocates (content-sized, as ChunkStore does);
            # rounded so that float noise does not beat a real tie.
            sizes = [round_up(sum(numels[i] for i in g), zero_shards) * itemsize for g in groups]
            seconds = round(pricing.step_s(sizes), 12)
        key = (seconds, waste)
        if key <= best_key:
            best_numel, best_key, best_waste = chunk_numel, key, waste
    return best_numel * itemsize, float(best_waste)


def planned_chunk_bytes(
    zero_numels: Sequence[int],
    pricing: ChunkPricing,
    *,
    max_stage: int,
    headroom_bytes: float,
    itemsize: int = 4,
) -> tuple[int, float]:
    """The planner's chunk size and its padding waste: the fewest exposed seconds under
    ``pricing``, with :data:`CHUNK_TRANSIENTS` chunks (by ``max_stage``) within
    ``headroom_bytes`` (the memory budget less the plan's predicted peak; never below the
    largest parameter). No fixed upper size: the price's latencies against its overlap decide."""
    shards = math.prod(n for n, _, _ in pricing.axes)
    cap = headroom_bytes / CHUNK_TRANSIENTS[max_stage]
    return choose_chunk_bytes(
        zero_numels,
        shards,
        itemsize=itemsize,
        max_chunk_bytes=max(int(cap), itemsize),
        pricing=pricing,
    )
