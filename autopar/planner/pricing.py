"""Pricing collectives on a mesh: resharding tables and gradient all-reduces.

``CommPricer`` turns the routes of :mod:`autopar.resharding` into seconds with the mesh's link
models (``cost_models.collective_time_s``), memoised because layers repeat; one route search
per source placement prices a whole row of a cost matrix (:func:`pair_table`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from autopar.mesh import Mesh
from autopar.placement import Placements
from autopar.resharding.pricing import price_table
from autopar.strategies.registry import TensorMeta
from cost_models import LinkSpec, collective_time_s

GRAD_BUCKET_BYTES = 25 * 2**20
"""Bucket size of the runtime's chunked gradient all-reduce (autopar.runtime.grad_sync)."""

COMM_KINDS = frozenset({"all_gather", "all_reduce", "reduce_scatter", "all_to_all"})


def _without_latency(link: LinkSpec) -> LinkSpec:
    return dataclasses.replace(
        link,
        latency_s=0.0,
        sync_s=0.0,
        collectives={kind: (0.0, beta) for kind, (_, beta) in link.collectives.items()},
        cpu_collectives={kind: (0.0, beta) for kind, (_, beta) in link.cpu_collectives.items()},
    )


class CommPricer:
    """Prices resharding and all-reduces on a mesh, memoised (layers repeat)."""

    def __init__(self, mesh: Mesh, act_itemsize: int | None) -> None:
        self.mesh = mesh
        self.act_itemsize = act_itemsize
        self._reshard: dict[tuple, float] = {}
        self._tables: dict = {}
        """``price_table``'s memo: routes, step prices and rows priced once across edges."""
        self._num_devices = math.prod(mesh.shape)

    def itemsize(self, meta: TensorMeta) -> int:
        if self.act_itemsize is not None and meta.dtype.is_floating_point:
            return self.act_itemsize
        return meta.dtype.itemsize

    def reshard_s(self, src: Placements, dst: Placements, meta: TensorMeta) -> float:
        """Seconds of converting ``src`` to ``dst`` (forward and backward steps)."""
        if src == dst:
            return 0.0
        key = (src, dst, meta.shape, meta.dtype)
        cost = self._reshard.get(key)
        if cost is None:
            cost = self._reshard[key] = float(self.reshard_table([src], [dst], meta)[0, 0])
        return cost

    def reshard_table(
        self,
        srcs: Sequence[Placements],
        dsts: Sequence[Placements],
        meta: TensorMeta,
        *,
        forward_only: bool = False,
    ) -> np.ndarray:
        """[src, dst] seconds of converting each of ``srcs`` to each of ``dsts`` (inf where
        impossible): one route search per source serves the whole row
        (:func:`autopar.resharding.pricing.price_table`, memoised across calls). Routes depend
        on the shape only through gcd(dim size, devices); bytes scale with the tensor's size."""
        total_bytes = float(math.prod(meta.shape)) * self.itemsize(meta)
        pattern = tuple(math.gcd(size, self._num_devices) for size in meta.shape)
        mesh = self.mesh

        def step_s(kind: str, axis: int, fraction: float) -> float:
            nbytes = fraction * total_bytes
            return collective_time_s(kind, nbytes, mesh.shape[axis], mesh.links[axis])

        # step_s depends on nothing but the bytes (one mesh per pricer): the memo's price key.
        fwd, bwd = price_table(
            srcs, dsts, pattern, mesh.shape, step_s, memo=self._tables, price_key=total_bytes
        )
        return fwd if forward_only else fwd + bwd

    def step_s(self, kind: str, axis: int, nbytes: float) -> float:
        return collective_time_s(kind, nbytes, self.mesh.shape[axis], self.mesh.links[axis])

    def grad_sync_s(self, nbytes: float, axis: int) -> float:
        """A parameter gradient's share of the bucketed all-reduce: its bytes at the link's
        bandwidth, plus the collective's latency once per ``GRAD_BUCKET_BYTES`` (the runtime
        reduces parameter gradients in flat buckets, not one collective per parameter). The
        last bucket's rounding up to a whole all-reduce is added once the whole graph is
        known (:func:`bucket_rounding`)."""
        size, link = self.mesh.shape[axis], self.mesh.links[axis]
        transfer = collective_time_s("all_reduce", nbytes, size, _without_latency(link))
        return transfer + self.all_reduce_latency_s(axis) * nbytes / GRAD_BUCKET_BYTES

    def all_reduce_latency_s(self, axis: int) -> float:
        """What one all-reduce on ``axis`` costs beyond its bytes (latency and ``sync_s``)."""
        size, link = self.mesh.shape[axis], self.mesh.links[axis]
        return collective_time_s("all_reduce", GRAD_BUCKET_BYTES, size, link) - collective_time_s(
            "all_reduce", GRAD_BUCKET_BYTES, size, _without_latency(link)
        )

    def all_reduce_s(self, nbytes: float, axis: int) -> float:
        return collective_time_s("all_reduce", nbytes, self.mesh.shape[axis], self.mesh.links[axis])

    def all_gather_s(self, nbytes: float, axis: int) -> float:
        return collective_time_s("all_gather", nbytes, self.mesh.shape[axis], self.mesh.links[axis])


def pair_table(
    pricer: CommPricer, srcs: list, dsts: list, meta: TensorMeta, *, forward_only: bool = False
) -> np.ndarray:
    """[src, dst] resharding seconds; a None placement (no such output / input) costs 0."""
    table = np.zeros((len(srcs), len(dsts)))
    rows = [i for i, p in enumerate(srcs) if p is not None]
    cols = [j for j, q in enumerate(dsts) if q is not None]
    if rows and cols:
        table[np.ix_(rows, cols)] = pricer.reshard_table(
            [srcs[i] for i in rows], [dsts[j] for j in cols], meta, forward_only=forward_only
        )
    return table


def bucket_rounding(
    nodes: Sequence, edges: Sequence, pricer: CommPricer, skip: frozenset = frozenset()
) -> tuple[float, ...]:
    """Price the gradient buckets' all-reduces as whole calls: add to each consumer's
    ``param_grad_comm_s`` its share of the last bucket's rounding; returns that share per mesh
    axis, in seconds per byte of a parameter input's largest Partial block.

    The runtime (``autopar.runtime.grad_sync``) packs the Partial parameter gradients of an
    axis into flat buckets of ``GRAD_BUCKET_BYTES`` and issues one all-reduce per bucket: with
    ``B`` bytes, ``floor(B / GRAD_BUCKET_BYTES) + 1`` all-reduces, each paying the latency
    once. :meth:`CommPricer.grad_sync_s` prices ``B / GRAD_BUCKET_BYTES`` of them by bytes;
    the rest, ``1 - frac(B / GRAD_BUCKET_BYTES)`` latencies, is shared over the parameter
    inputs whose gradient can be Partial on the axis (some strategy of their consumer makes it
    so) in proportion to their largest such block (``B`` sums those blocks), whatever block the
    chosen strategy has. So a layout where every such gradient is Partial pays exactly one
    latency per bucket (``ddp``; ``megatron`` on its batch axis, its sharded weights included;
    before: 0.24-0.38 of one on the cost-model benchmarks), one where only some are pays
    their part of the rounding. A node cost per input, not a per-bucket term: which
    gradients share a bucket depends on every consumer's layout, which the solver chooses.
    A ZeRO-3 parameter gives back the bytes' part, and its share of the rounding where
    every use it can have prices it (:func:`rounding_given_back`).

    Consumers' cost arrays are replaced, not written in place; nodes that shared an array
    (repeated layers) share the new one. ``skip``: (consumer, input) uses not in the pool, the
    later uses of a parameter read by several ops (``planner.shared_grads``: its gradient is
    one block of one bucket, its first use holds it)."""
    inputs, total = _bucket_pool(nodes, edges, pricer.mesh, skip)
    share = tuple(
        pricer.all_reduce_latency_s(a) * (1.0 - math.modf(t / GRAD_BUCKET_BYTES)[0]) / t
        if t > 0
        else 0.0
        for a, t in enumerate(total)
    )
    extra: dict[int, np.ndarray] = {}
    shares: dict[tuple[int, int], list[float]] = {}  # inputs sharing their tables (layers)
    for dst, partial, _, largest in inputs:
        add = extra.setdefault(dst, np.zeros(len(partial)))
        key = (id(partial), id(largest))
        if key not in shares:
            shares[key] = [sum(share[a] * largest[a] for a in axes) for axes in partial]
        add += shares[key]
    replaced: dict[tuple, np.ndarray] = {}
    for dst, add in extra.items():
        node = nodes[dst]
        key = (id(node.param_grad_comm_s), add.tobytes())
        if key not in replaced:
            replaced[key] = node.param_grad_comm_s + add
        node.param_grad_comm_s = replaced[key]
    return share


def _bucket_pool(
    nodes: Sequence,
    edges: Sequence,
    mesh: Mesh,
    skip: frozenset = frozenset(),
    sources: list[int] | None = None,
) -> tuple[list[tuple], list[float]]:
    """The parameter inputs whose gradient some consumer strategy makes Partial: per (consumer,
    input) ``(consumer index, axes, blocks, largest)``: per consumer strategy the mesh axes
    (size > 1) where the gradient is Partial and the input's local bytes, per axis the largest
    of those bytes where Partial (0 where never); and per axis the sum of the largest bytes.
    ``sources``: a list the parameter node of each input is appended to, in the same order."""
    inputs: list[tuple] = []
    total = [0.0] * mesh.ndim
    # The consumers of repeated layers share their strategy lists: each (strategies, input,
    # bytes) is walked once and its tables shared (read only) by the inputs alike (llama3-70b:
    # 720 parameter inputs, 9 alike classes).
    memo: dict[tuple[int, int, float], tuple] = {}
    for edge in edges:
        src, dst, j = nodes[edge.src], nodes[edge.dst], edge.input_index
        if src.kind != "param" or dst.kind != "op" or j < 0 or (edge.dst, j) in skip:
            continue
        assert src.local_numel is not None
        full_bytes = float(max(src.local_numel)) * src.itemsize
        key = (id(dst.strategies), j, full_bytes)
        if key not in memo:
            memo[key] = _partial_tables(dst.strategies, j, full_bytes, mesh)
        partial, blocks, largest = memo[key]
        total = [t + b for t, b in zip(total, largest)]
        inputs.append((edge.dst, partial, blocks, largest))
        if sources is not None:
            sources.append(edge.src)
    return inputs, total


def rounding_given_back(
    space, allowed: dict[str, Sequence[int]] | None = None, choice: Sequence[int] | None = None
) -> dict[str, tuple[float, ...]]:
    """Per parameter node name (an alias's uses counted on its owner): per mesh axis the
    last bucket's rounding (:func:`bucket_rounding`'s share per byte of each use's largest
    Partial block) that its consumers are priced with for certain: by the uses whose every
    allowed strategy (``allowed`` by consumer name, None: every strategy; ``choice``: the
    chosen one) makes its gradient Partial there. A parameter ZeRO-3 shards over an axis gives
    that back (``problem._param_state_of``): its gradient is reduce-scattered in its chunk and
    joins no bucket there. Where a consumer may leave the gradient whole, the parameter cannot
    tell whether the rounding was priced (subtracted, a whole gradient's stage 3 would be
    priced below its all-gathers), so it keeps it: recipes and chosen layouts give back all
    of it, the auto plan's open problems only where no consumer strategy leaves the gradient
    whole (README, "Session 36")."""
    nodes, mesh = space.nodes, space.mesh
    share = space.bucket_share_s or (0.0,) * mesh.ndim
    sources: list[int] = []
    inputs, _ = _bucket_pool(nodes, space.edges, mesh, space.shared_grad_uses, sources)
    out: dict[str, list[float]] = {}
    for (dst, partial, _, largest), src in zip(inputs, sources, strict=True):
        if choice is not None:
            certain = set(partial[choice[dst]])
        else:
            idx = allowed.get(nodes[dst].name) if allowed else None
            certain = set.intersection(
                *(set(partial[t]) for t in (range(len(partial)) if idx is None else idx))
            )
        if certain:
            owner = out.setdefault(nodes[src].alias_of or nodes[src].name, [0.0] * mesh.ndim)
            for a in certain:
                owner[a] += share[a] * largest[a]
    return {name: tuple(values) for name, values in out.items()}


def _partial_tables(
    strategies: Sequence, j: int, full_bytes: float, mesh: Mesh
) -> tuple[list[tuple[int, ...]], list[float], list[float]]:
    """Of input ``j`` (``full_bytes`` unsharded) of a consumer with ``strategies``: per
    strategy the axes where its gradient is Partial and its local bytes; per axis the largest
    of those bytes where Partial (:func:`_bucket_pool`)."""
    partial: list[tuple[int, ...]] = []
    blocks: list[float] = []
    largest = [0.0] * mesh.ndim
    for strategy in strategies:
        grads = strategy.input_grads[j] if j < len(strategy.input_grads) else None
        placements = strategy.inputs[j] if j < len(strategy.inputs) else None
        axes: tuple[int, ...] = ()
        block = 0.0
        if grads is not None and placements is not None:
            axes = tuple(a for a, p in enumerate(grads) if p.is_partial() and mesh.shape[a] > 1)
            shards = math.prod(mesh.shape[a] for a, p in enumerate(placements) if p.is_shard())
            block = full_bytes / shards
            for a in axes:
                largest[a] = max(largest[a], block)
        partial.append(axes)
        blocks.append(block)
    return partial, blocks, largest


def priced_bucket_calls(space, choice: Sequence[int]) -> list[float]:
    """Per mesh axis: the gradient-bucket all-reduces ``choice`` is priced with, in latencies
    (:meth:`CommPricer.grad_sync_s`'s bytes / ``GRAD_BUCKET_BYTES`` plus
    :func:`bucket_rounding`'s share) over every Partial parameter input, as the consumers'
    costs count them (ZeRO-3 parameters included: their ZeRO price gives it back)."""
    mesh = space.mesh
    pricer = CommPricer(mesh, None)
    share = space.bucket_share_s or (0.0,) * mesh.ndim
    calls = [0.0] * mesh.ndim
    pool = _bucket_pool(space.nodes, space.edges, mesh, space.shared_grad_uses)[0]
    for dst, partial, blocks, largest in pool:
        s = choice[dst]
        for a in partial[s]:
            if pricer.all_reduce_latency_s(a) > 0:
                calls[a] += blocks[s] / GRAD_BUCKET_BYTES
                calls[a] += share[a] * largest[a] / pricer.all_reduce_latency_s(a)
    return calls
