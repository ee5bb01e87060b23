"""Torch-free cost models: devices and links, compute (roofline), collectives, training memory.

Everything here prices plain numbers (FLOPs, bytes, group sizes, specs); nothing imports torch
or autopar.
"""

from __future__ import annotations

from cost_models.comm import (
    collective_steps_and_wire_bytes,
    collective_time_s,
    fit_alpha_beta,
    send_time_s,
)
from cost_models.compute import (
    ATTENTION_BACKWARD_FACTOR,
    COMPUTE_BOUND_FAMILIES,
    ELEMENTWISE_FLOPS_PER_ELEMENT,
    OTHER_COMPUTE_EFFICIENCY,
    attention_flops,
    attention_pairs,
    backward_flops_factor,
    compute_time_s,
    elementwise_flops,
    matmul_flops,
    normalize_dtype,
    op_bytes,
    peak_flops_for,
)
from cost_models.hardware import (
    COLLECTIVE_KINDS,
    COMM_BACKENDS,
    DEVICES,
    LINKS,
    DeviceSpec,
    FrozenMap,
    LinkSpec,
    get_device,
    get_link,
)
from cost_models.memory import (
    MIXED_PRECISIONS,
    OPTIMIZERS,
    MemoryBreakdown,
    optimizer_state_buffers,
    training_state_bytes,
)
from cost_models.profile import (
    PROFILE_SCHEMA,
    PROFILE_VERSION,
    Profile,
    load_profile,
    save_profile,
)

__all__ = [
    "ATTENTION_BACKWARD_FACTOR",
    "COLLECTIVE_KINDS",
    "COMM_BACKENDS",
    "COMPUTE_BOUND_FAMILIES",
    "DEVICES",
    "ELEMENTWISE_FLOPS_PER_ELEMENT",
    "LINKS",
    "MIXED_PRECISIONS",
    "OPTIMIZERS",
    "OTHER_COMPUTE_EFFICIENCY",
    "PROFILE_SCHEMA",
    "PROFILE_VERSION",
    "DeviceSpec",
    "FrozenMap",
    "LinkSpec",
    "MemoryBreakdown",
    "Profile",
    "attention_flops",
    "attention_pairs",
    "backward_flops_factor",
    "collective_steps_and_wire_bytes",
    "collective_time_s",
    "compute_time_s",
    "elementwise_flops",
    "fit_alpha_beta",
    "get_device",
    "get_link",
    "load_profile",
    "matmul_flops",
    "normalize_dtype",
    "op_bytes",
    "optimizer_state_buffers",
    "peak_flops_for",
    "save_profile",
    "send_time_s",
    "training_state_bytes",
]
