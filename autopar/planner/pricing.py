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
        reduces parameter gradients in flat buckets, not one collective per parameter)."""
        size, link = self.mesh.shape[axis], self.mesh.links[axis]
        bandwidth_only = _without_latency(link)
        transfer = collective_time_s("all_reduce", nbytes, size, bandwidth_only)
        latency = collective_time_s(
            "all_reduce", GRAD_BUCKET_BYTES, size, link
        ) - collective_time_s("all_reduce", GRAD_BUCKET_BYTES, size, bandwidth_only)
        return transfer + latency * nbytes / GRAD_BUCKET_BYTES

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
