"""The single-process reference that distributed tests compare against."""

from __future__ import annotations

from typing import Any

import torch


def model_loss(output: Any) -> torch.Tensor:
    """The scalar loss of a model output (Hugging Face models return a ModelOutput)."""
    return output if isinstance(output, torch.Tensor) else output.loss


def assert_close_named(
    what: str, got: torch.Tensor, want: torch.Tensor, *, rtol: float, atol: float
) -> None:
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def sgd_reference(
    model: torch.nn.Module, args: tuple, kwargs: dict, *, lr: float, steps: int
) -> dict[str, Any]:
    """First-step loss and gradients, then parameters and state after ``steps`` SGD steps."""
    loss = model_loss(model(*args, **kwargs))
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    sgd_steps(model, args, kwargs, lr=lr, steps=steps)
    return {
        "loss": loss.detach(),
        "grads": grads,
        "params": dict(model.named_parameters()),
        "state": model.state_dict(),
    }


def sgd_steps(model: torch.nn.Module, args: tuple, kwargs: dict, *, lr: float, steps: int) -> None:
    """``steps`` SGD steps: the first on the gradients the caller's backward left, each later
    one after a fresh forward and backward of ``(args, kwargs)``."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    opt.step()
    for _ in range(steps - 1):
        opt.zero_grad()
        model_loss(model(*args, **kwargs)).backward()
        opt.step()


def full_grads(pmodel: Any) -> dict[str, torch.Tensor]:
    """Every parameter's gradient of a ParallelModule gathered whole, by FQN (ZeRO shards read
    through the engine)."""
    from autopar.runtime.module import gather_full

    local = pmodel.zero.local_grads() if pmodel.zero is not None else {}
    out = {}
    for name, param in pmodel.named_parameters():
        grad = local.get(id(param), param.grad)
        out[name] = gather_full(grad, pmodel._param_placements[name], pmodel._axis_group)
    return out
