"""The ZeRO configurations the planner weighs, and the one a user forces.

The runtime takes a ZeRO stage per mesh axis (``autopar.runtime.zero``). Under the cost model
stages 0-2 on an axis cost the same time and stage 2 keeps the fewest bytes, so the auto plan
solves stage 0 without a budget and then only the undominated configurations (stage 2 or 3 on
each data-parallel axis): :func:`zero_configurations` lists every configuration with the one
that dominates it, :func:`zero_candidates` the ones solved, :func:`forced_zero` reads a user's
``zero_stage``.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

from autopar.mesh import Mesh
from autopar.planner.problem import ZeroConfig


def zero_configurations(mesh_shape: Sequence[int]) -> list[tuple[ZeroConfig, ZeroConfig | None]]:
    """Every ZeRO configuration the runtime can run, with the one that dominates it (or None).

    The runtime takes a stage per mesh axis (``autopar.runtime.zero``), so the space is every
    assignment of a stage 0-3 to each axis of size > 1 (axes of size 1 stay 0), stage 0
    everywhere first. Under the cost model stages 0, 1 and 2 on an axis cost the same time
    (reduce-scatter + all-gather = all-reduce; no parameter gathers), and stage 2 keeps the fewest
    bytes of the three (it shards the gradients and the optimizer state over the axis, stage 1
    only the state, stage 0 neither). So raising every axis at stage 0 or 1 to 2 gives the same
    step time for every layout with never more memory: that configuration dominates (its ILP's
    optimum is at least as good under any budget). Stage 3 on an axis trades an all-gather over
    it for parameter memory, a different trade-off per axis, so the candidates are every
    choice of 2 or 3 per axis (2^k of them on k axes). Stage 0 everywhere is kept (it is the
    budget-free lower bound, and wins ties).
    """
    axes = tuple(a for a in range(len(mesh_shape)) if mesh_shape[a] > 1)
    out: list[tuple[ZeroConfig, ZeroConfig | None]] = [(ZeroConfig(), None)]
    ndim = len(mesh_shape)
    for values in itertools.product((0, 1, 2, 3), repeat=len(axes)):
        if not any(values):
            continue
        stages = [0] * ndim
        top = [0] * ndim
        for a, x in zip(axes, values):
            stages[a] = x
            top[a] = 2 if x < 2 else x
        zero = ZeroConfig(stages=stages)
        dominating = ZeroConfig(stages=top)
        out.append((zero, dominating if dominating != zero else None))
    return out


def zero_candidates(num_axes: int, mesh_shape: Sequence[int]) -> list[ZeroConfig]:
    """ZeRO configurations the auto plan solves when stage 0 does not fit: the undominated ones
    of :func:`zero_configurations` (stage 2 or 3 on each data-parallel axis)."""
    return [z for z, by in zero_configurations(mesh_shape[:num_axes]) if by is None and z.stage]


def forced_zero(spec: int | Sequence[int] | Mapping[str, int], mesh: Mesh) -> ZeroConfig:
    """The ZeroConfig of a user's ``zero_stage``: an int (that stage on every axis of size > 1),
    one stage per mesh axis, or {axis name: stage} (axes not named: 0).

    Raises:
        ValueError: a wrong length, an unknown axis name or a stage outside 0-3 (the message
            lists what is valid).
    """
    names = mesh.axis_names
    if isinstance(spec, tuple) and spec and isinstance(spec[0], tuple):
        spec = dict(spec)  # PlanOptions keeps a mapping as (name, stage) pairs
    if isinstance(spec, int):
        if spec not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {spec}")
        return ZeroConfig(stage=spec, axes=tuple(a for a in range(mesh.ndim) if mesh.shape[a] > 1))
    if isinstance(spec, Mapping):
        unknown = sorted(set(spec) - set(names))
        if unknown:
            raise ValueError(
                f"zero_stage names unknown mesh axes {unknown}; the mesh's axes are {list(names)}"
            )
        values = [spec.get(name, 0) for name in names]
    else:
        values = list(spec)
        if len(values) != mesh.ndim:
            raise ValueError(
                f"zero_stage {values} has {len(values)} stages but the mesh has {mesh.ndim} axes "
                f"({', '.join(names)}): give one stage per axis, or {{axis name: stage}}"
            )
    bad = [v for v in values if not isinstance(v, int) or v not in (0, 1, 2, 3)]
    if bad:
        raise ValueError(f"zero_stage per-axis stages must each be 0, 1, 2 or 3, got {bad}")
    # An axis of size 1 shards nothing: its stage has no effect.
    return ZeroConfig(stages=[v if mesh.shape[a] > 1 else 0 for a, v in enumerate(values)])
