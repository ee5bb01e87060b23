"""The ZeRO configurations the planner weighs, and the one a user forces.

The runtime takes a ZeRO stage per mesh axis (``autopar.runtime.zero``). Raising an axis at
stage 0 or 1 to stage 2 never keeps more bytes; whether it costs no more time depends on the
links: the planner prices each stage's collectives per chunk as the runtime issues them
(``autopar.planner.zero_pricing``: stage 1 all-reduces a chunk's gradient and stage 2
reduce-scatters it, both refresh the kept buffer after the step; stage 0 all-reduces buckets),
so :func:`price_dominance` checks it on the prices, parameter by parameter. The auto plan
solves stage 0 without a budget and then only the configurations no raise dominates:
:func:`zero_configurations` lists every configuration with the one that dominates it,
:func:`zero_candidates` the ones solved, :func:`forced_zero` reads a user's ``zero_stage``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence

from autopar.mesh import Mesh
from autopar.planner.problem import StrategySpace, ZeroConfig, _param_key, open_streams, param_state

Dominance = Callable[[ZeroConfig, ZeroConfig], bool]
"""``dominates(zero, by)``: whether ``by`` (``zero`` with some stages raised) costs no more time
for every layout (it never keeps more bytes), so that its optimum is at least as good under
any budget."""


def zero_configurations(
    mesh_shape: Sequence[int], dominates: Dominance | None = None
) -> list[tuple[ZeroConfig, ZeroConfig | None]]:
    """Every ZeRO configuration the runtime can run, with the one that dominates it (or None).

    The runtime takes a stage per mesh axis (``autopar.runtime.zero``), so the space is every
    assignment of a stage 0-3 to each axis of size > 1 (axes of size 1 stay 0), stage 0
    everywhere first. A configuration with axes at stage 0 or 1 is dominated by one with some
    of them raised to 2 (all first) when ``dominates`` says that costs no more time
    (:func:`price_dominance`: on the planner's prices; it never keeps more bytes). ``None``
    takes every such raise as dominating: the enumeration's shape, which was the rule while
    stages 0-2 were all priced as the bucketed all-reduce (2^k candidates on k axes). Stage 3
    on an axis trades an all-gather over it for parameter memory, so it is never raised.
    Stage 0 everywhere is kept (it is the budget-free lower bound, and wins ties).
    """
    axes = tuple(a for a in range(len(mesh_shape)) if mesh_shape[a] > 1)
    out: list[tuple[ZeroConfig, ZeroConfig | None]] = [(ZeroConfig(), None)]
    ndim = len(mesh_shape)
    for values in itertools.product((0, 1, 2, 3), repeat=len(axes)):
        if not any(values):
            continue
        stages = [0] * ndim
        for a, x in zip(axes, values):
            stages[a] = x
        zero = ZeroConfig(stages=stages)
        out.append((zero, _dominator(zero, stages, axes, dominates)))
    return out


def _dominator(
    zero: ZeroConfig, stages: list[int], axes: tuple[int, ...], dominates: Dominance | None
) -> ZeroConfig | None:
    """The first raise of some of ``zero``'s axes at stage 0 or 1 to 2 (all of them first,
    then fewer) that dominates it, or None."""
    low = [a for a in axes if stages[a] < 2]
    for size in range(len(low), 0, -1):
        for raised_axes in itertools.combinations(low, size):
            raised = ZeroConfig(stages=[2 if a in raised_axes else x for a, x in enumerate(stages)])
            if dominates is None or dominates(zero, raised):
                return raised
    return None


def zero_candidates(
    num_axes: int, mesh_shape: Sequence[int], dominates: Dominance | None = None
) -> list[ZeroConfig]:
    """ZeRO configurations the auto plan solves when stage 0 does not fit: the undominated ones
    of :func:`zero_configurations` (with ``dominates=None``, stage 2 or 3 on each axis)."""
    return [
        z
        for z, by in zero_configurations(mesh_shape[:num_axes], dominates)
        if by is None and z.stage
    ]


def price_dominance(space: StrategySpace) -> Dominance:
    """:data:`Dominance` on the planner's prices: ``by`` dominates ``zero`` when every strategy
    of every parameter costs no more ZeRO time under ``by`` than under ``zero`` (the only
    costs a configuration changes: ``problem.param_state``, with the auto plan's streams).
    Exact for the auto solve: its objective under ``by`` is then no more than under ``zero``
    for every layout, and its memory no more. Memoised per configuration."""
    keys: dict[tuple, tuple] = {}
    for node in space.nodes:
        if node.kind == "param" and node.alias_of is None and node.local_numel is not None:
            for s in range(len(node.strategies)):
                keys.setdefault(_param_key(space, node, s), (node, s))
    seconds: dict[ZeroConfig, list[float]] = {}
    verdicts: dict[tuple[ZeroConfig, ZeroConfig], bool] = {}

    def zero_seconds(zero: ZeroConfig) -> list[float]:
        if zero not in seconds:
            streams = open_streams(space, zero)
            seconds[zero] = [param_state(space, n, s, zero, streams)[1] for n, s in keys.values()]
        return seconds[zero]

    def dominates(zero: ZeroConfig, by: ZeroConfig) -> bool:
        if (zero, by) not in verdicts:
            verdicts[(zero, by)] = all(
                b <= a * (1 + 1e-12) for a, b in zip(zero_seconds(zero), zero_seconds(by))
            )
        return verdicts[(zero, by)]

    return dominates


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
