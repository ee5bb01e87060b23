"""Which stack of layers the capture may replicate: a ModuleList of provably identical layers.

``find_repeated_layers`` is the first half of ``autopar.capture.layer_replication``: the layers
must be alike in everything an export could read (class, submodules, parameter and buffer
shapes, dtypes and ``requires_grad``, plain attributes public or private, train/eval flag, no
hooks) and no parameter may be shared with anything outside its layer.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

MIN_LAYERS = 8
"""Shallower stacks are exported whole: two small exports would not be cheaper."""

# What every nn.Module holds (parameters, hooks, training, ...); the rest is the layer's own
# configuration, public or private, and must be equal across the layers.
_MODULE_INTERNALS = frozenset(vars(nn.Module()))
_HOOKS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
)


def find_repeated_layers(
    model: nn.Module, *, min_layers: int = MIN_LAYERS
) -> tuple[nn.Module, str, str] | None:
    """(parent module, attribute, FQN) of the longest ModuleList of identical layers, or None.

    Identical: same class, same submodule tree, parameter and buffer names, shapes, dtypes and
    requires_grad, equal plain attributes, no hooks, and no parameter shared with anything else.
    """
    best: tuple[nn.Module, str, str] | None = None
    best_len = min_layers - 1
    for parent_path, parent in model.named_modules():
        for attr, child in parent._modules.items():
            if not isinstance(child, nn.ModuleList) or len(child) <= best_len:
                continue
            if type(child) is not nn.ModuleList or not _all_alike(list(child)):
                continue
            best = (parent, attr, f"{parent_path}.{attr}" if parent_path else attr)
            best_len = len(child)
    if best is None:
        return None
    layers = getattr(best[0], best[1])
    if sum(m is layers for _, m in model.named_modules(remove_duplicate=False)) > 1:
        return None  # reachable under two names: cutting one would not cut what forward runs
    inside = {id(p) for layer in layers for p in layer.parameters()}
    counts: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        counts[id(param)] = counts.get(id(param), 0) + 1
    if any(counts[key] > 1 for key in inside):
        return None
    return best


def _all_alike(layers: list[nn.Module]) -> bool:
    try:
        first = _layer_signature(layers[0])
        return all(_layer_signature(layer) == first for layer in layers[1:])
    except Exception:  # an attribute whose == raises or is not a bool: not provably alike
        return False


def _layer_signature(layer: nn.Module) -> list[Any]:
    signature: list[Any] = []
    for name, module in layer.named_modules():
        if any(getattr(module, hooks, None) for hooks in _HOOKS):
            raise ValueError("hooked layer")
        plain = {
            key: value
            for key, value in vars(module).items()
            if key not in _MODULE_INTERNALS and not isinstance(value, (nn.Module, torch.Tensor))
        }
        state = [
            (key, tuple(t.shape), t.dtype, t.requires_grad, t.device.type)
            for key, t in (*module._parameters.items(), *module._buffers.items())
            if t is not None
        ]
        signature.append(
            (
                name,
                type(module),
                module.training,
                sorted(plain.items()),
                state,
                sorted(module._non_persistent_buffers_set),
            )
        )
    return signature
