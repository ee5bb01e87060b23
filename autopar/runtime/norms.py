"""Global norms of sharded tensors, and gradient clipping by the global norm.

Under tensor parallelism and ZeRO each rank holds pieces of a parameter. A norm of the whole
parameter is the square root of the sum, over the process groups the parameter is split across,
of the local sums of squares. ``split_groups(param)`` names those groups
(:meth:`autopar.runtime.module.ParallelModule.split_groups`); a group a parameter is replicated
over is not summed over, so replicated parts count once. Without ``split_groups`` (one process)
the norms are the local ones, so the same code is the single-process reference.

Collectives are issued in the same order on every rank: one all-reduce per distinct group, in
order of first appearance in the parameter list (every rank holds the same list, in the same
order, split the same way). So the lists never depend on which parameters have a ``.grad``
on this rank: under ZeRO a parameter none of whose elements lie in this rank's shard has no
``.grad`` here (the optimizer skips it) while its owners' pieces have one; a missing gradient
counts as zeros. ``autopar.optim`` (LAMB, LARS) builds on these.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

SplitGroups = Callable[[Tensor], Sequence[Any]]


def full_sq_norms(
    tensors: Sequence[Tensor | None], params: Sequence[Tensor], split_groups: SplitGroups | None
) -> Tensor:
    """Squared 2-norms of the FULL tensors whose local pieces are ``tensors`` (``params[i]``
    tells how ``tensors[i]`` is split; None: this rank holds nothing of it, e.g. a missing
    gradient). One fp32 value per tensor, the same on every rank."""
    if not tensors:
        return torch.zeros(0)
    sq = torch.stack(
        [
            torch.zeros((), device=p.device) if t is None else t.detach().float().pow(2).sum()
            for t, p in zip(tensors, params, strict=True)
        ]
    )
    if split_groups is None:
        return sq
    groups_per: list[Sequence[Any]] = [tuple(split_groups(p)) for p in params]
    distinct: list[Any] = []
    for groups in groups_per:
        for group in groups:
            if not any(group is g for g in distinct):
                distinct.append(group)
    for group in distinct:
        mask = torch.tensor([any(group is g for g in groups) for groups in groups_per])
        part = sq[mask].contiguous()
        dist.all_reduce(part, group=group)
        sq[mask] = part
    return sq


def clip_grad_norm_(
    params: Iterable[Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    split_groups: SplitGroups | None = None,
) -> Tensor:
    """Scale gradients so that their global 2-norm is at most ``max_norm`` (as
    ``torch.nn.utils.clip_grad_norm_``, over every shard on every axis). Returns the total norm."""
    if norm_type != 2.0:
        raise ValueError(f"clip_grad_norm_ supports the 2-norm only, got norm_type={norm_type}")
    # Every parameter, with or without a .grad here, so that every rank reduces the same list.
    params = list(params)
    sq = full_sq_norms([p.grad for p in params], params, split_groups)
    total = sq.sum().sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef.to(p.grad.dtype))
    return total
