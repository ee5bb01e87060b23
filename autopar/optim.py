"""Optimizers for parameter shards: LAMB and LARS, gradient clipping, optimizer state dicts.

The global norms they need (the norm of a whole parameter from its pieces on every rank) are
:mod:`autopar.runtime.norms`; ``clip_grad_norm_`` and ``full_sq_norms`` are re-exported here,
next to the optimizers that use them, as the public names. LAMB and LARS take the norms of
every parameter of a group, with a ``.grad`` or not, and step those with one: under ZeRO a rank
holds no piece (and no ``.grad``) of the parameters its shard does not reach, yet joins the
norms' collectives for them as their owners do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from autopar.runtime.norms import SplitGroups, clip_grad_norm_, full_sq_norms

# The sharded (DTensor per state tensor, for torch.distributed.checkpoint) optimizer state dict
# lives with the model's sharded state dict; re-exported here next to the full form.
from autopar.runtime.state import (
    load_param_groups,
    load_sharded_optim_state_dict,
    named_param_groups,
    sharded_optim_state_dict,
)

__all__ = [
    "LAMB",
    "LARS",
    "clip_grad_norm_",
    "full_optim_state_dict",
    "full_sq_norms",
    "load_full_optim_state_dict",
    "load_sharded_optim_state_dict",
    "sharded_optim_state_dict",
]


class LAMB(torch.optim.Optimizer):
    """LAMB (You et al., 2020): Adam's update scaled per parameter by ``||p|| / ||update||``,
    with both norms over the whole parameter (``split_groups``; module docstring).

    The trust ratio is 1 where either norm is 0. Weight decay is added to the update (decoupled).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        *,
        split_groups: SplitGroups | None = None,
    ) -> None:
        super().__init__(
            params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        )
        self._split_groups = split_groups

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            # Norms of every parameter of the group, stepped here or not (module docstring).
            params = list(group["params"])
            updates: list[Tensor | None] = []
            for p in params:
                if p.grad is None:
                    updates.append(None)
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                m_hat = m / (1 - beta1 ** state["step"])
                v_hat = v / (1 - beta2 ** state["step"])
                update = m_hat / (v_hat.sqrt() + group["eps"])
                if group["weight_decay"]:
                    update.add_(p, alpha=group["weight_decay"])
                updates.append(update)
            norms = full_sq_norms(
                list(params) + updates, list(params) * 2, self._split_groups
            ).sqrt()
            w_norms, u_norms = norms[: len(params)], norms[len(params) :]
            for p, update, w, u in zip(params, updates, w_norms, u_norms):
                if update is None:
                    continue
                trust = (w / u).item() if w > 0 and u > 0 else 1.0
                p.add_(update, alpha=-group["lr"] * trust)
        return loss


class LARS(torch.optim.Optimizer):
    """LARS (You et al., 2017): SGD with momentum whose per-parameter learning rate is scaled by
    ``trust_coefficient * ||p|| / (||g|| + weight_decay * ||p||)``, norms over the whole
    parameter (``split_groups``; module docstring). The ratio is 1 where a norm is 0."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 0.1,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        trust_coefficient: float = 0.001,
        eps: float = 1e-9,
        *,
        split_groups: SplitGroups | None = None,
    ) -> None:
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "weight_decay": weight_decay,
            "trust_coefficient": trust_coefficient,
            "eps": eps,
        }
        super().__init__(params, defaults)
        self._split_groups = split_groups

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            # Norms of every parameter of the group, stepped here or not (module docstring).
            params = list(group["params"])
            grads = [p.grad for p in params]
            norms = full_sq_norms(list(params) + grads, list(params) * 2, self._split_groups).sqrt()
            w_norms, g_norms = norms[: len(params)], norms[len(params) :]
            wd = group["weight_decay"]
            for p, grad, w, g in zip(params, grads, w_norms, g_norms):
                if grad is None:
                    continue
                if w > 0 and g > 0:
                    trust = (group["trust_coefficient"] * w / (g + wd * w + group["eps"])).item()
                else:
                    trust = 1.0
                step = grad.add(p, alpha=wd) if wd else grad.clone()
                step.mul_(group["lr"] * trust)
                state = self.state[p]
                buf = state.get("momentum_buffer")
                if buf is None:
                    buf = state["momentum_buffer"] = step
                else:
                    buf.mul_(group["momentum"]).add_(step)
                p.sub_(buf)
        return loss


# ---------------------------------------------------------------------------------------------
# Full (gathered) optimizer state under the original parameter names


def full_optim_state_dict(pmodel: Any, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state with every per-element tensor gathered to the FULL parameter shape,
    keyed by parameter FQN: ``{"state": {fqn: {key: value}}, "param_groups": [{..., "params":
    [fqn, ...]}]}``. Independent of the mesh and ZeRO stage; a collective every rank must call.
    Scalars (such as Adam's ``step``) are copied as they are."""
    from autopar.runtime.module import gather_full

    if pmodel.zero is not None:
        # Ranks holding no piece of a parameter keep no state for it (runtime.zero_step).
        pmodel.zero.complete_optim_state(optimizer)
    names = {id(p): n for n, p in pmodel.named_parameters()}
    params = [p for p in pmodel.parameters() if p in optimizer.state]
    keys = sorted({k for p in params for k, v in optimizer.state[p].items()})
    state: dict[str, dict[str, Any]] = {names[id(p)]: {} for p in params}
    for key in keys:
        elementwise = {
            id(p): optimizer.state[p][key]
            for p in params
            if _is_elementwise(optimizer.state[p].get(key), p)
        }
        engine = pmodel.zero
        local = (
            engine.gather_pieces(
                {
                    id(p): elementwise[id(p)]
                    for p in params
                    if id(p) in elementwise and engine.manages(p)
                }
            )
            if engine is not None
            else {}
        )
        for p in params:
            value = optimizer.state[p].get(key)
            name = names[id(p)]
            if id(p) in elementwise:
                block = local.get(id(p), value)
                state[name][key] = gather_full(
                    block, pmodel._param_placements[name], pmodel.groups.groups.__getitem__
                )
            elif value is not None:
                state[name][key] = value.clone() if torch.is_tensor(value) else value
    return {"state": state, "param_groups": named_param_groups(optimizer, names)}


def load_full_optim_state_dict(
    pmodel: Any, optimizer: torch.optim.Optimizer, full: dict[str, Any]
) -> None:
    """Load :func:`full_optim_state_dict`'s result (from any mesh or stage): each rank keeps the
    pieces of every per-element tensor that its parameters hold; hyperparameters by group index."""
    from autopar.runtime.module import local_block

    by_name = dict(pmodel.named_parameters())
    mesh_shape = pmodel.lowered.mesh_shape
    load_param_groups(optimizer, full["param_groups"])
    for name, entries in full["state"].items():
        param = by_name[name]
        own: dict[str, Any] = {}
        for key, value in entries.items():
            placements = pmodel._param_placements[name]
            if torch.is_tensor(value) and value.dim() > 0:
                block = local_block(value, placements, mesh_shape, pmodel.coords)
                if pmodel.zero is not None and pmodel.zero.manages(param):
                    block = pmodel.zero.piece_of(param, block)
                own[key] = block.reshape(param.shape).clone().to(param.dtype)
            else:
                own[key] = value.clone() if torch.is_tensor(value) else value
        optimizer.state[param] = own


def _is_elementwise(value: Any, param: Tensor) -> bool:
    """A state tensor with one entry per parameter element (not a scalar such as ``step``)."""
    return torch.is_tensor(value) and value.dim() > 0 and value.shape == param.shape
