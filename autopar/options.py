"""PlanOptions: the one set of options shared by plan(), autoparallelize() and the CLI."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

RECIPES = ("auto", "ddp", "fsdp", "megatron", "fsdp+tp")
CHECKPOINT_MODES = ("auto", "none", "all")
SOLVERS = ("highs", "cbc")

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(value: int | float | str) -> int:
    """Bytes from an int or a string such as "40GiB", "80GB", "1.5 TiB", "512MiB"."""
    if isinstance(value, (int, float)):
        if value <= 0:
            raise ValueError(f"memory size must be positive, got {value}")
        return int(value)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(
            f"cannot read memory size {value!r}: use a number of bytes or e.g. '40GiB', '80GB', '512MiB'"
        )
    size = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if size <= 0:
        raise ValueError(f"memory size must be positive, got {value!r}")
    return int(size)


def format_bytes(num_bytes: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(num_bytes) >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{num_bytes:.0f} B"


def format_seconds(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds * 1e6:.1f} us"


def _zero_spec(spec: Any) -> int | tuple[int, ...] | tuple[tuple[str, int], ...] | None:
    """A ``zero_stage`` value in its stored form (mesh-free checks; the planner checks the
    length and the axis names against the mesh)."""
    valid = "an int 0-3, one stage 0-3 per mesh axis, or {axis name: stage 0-3}"
    if spec is None:
        return None
    if isinstance(spec, bool):
        raise ValueError(f"zero_stage must be {valid}, got {spec!r}")
    if isinstance(spec, int):
        if spec not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3 (or per axis: {valid}), got {spec}")
        return spec
    if isinstance(spec, Mapping):
        pairs = tuple(sorted((str(k), v) for k, v in spec.items()))
        bad = [f"{k}={v!r}" for k, v in pairs if not isinstance(v, int) or v not in (0, 1, 2, 3)]
        if bad or not pairs:
            raise ValueError(f"zero_stage must be {valid}; bad: {bad or spec!r}")
        return pairs
    if isinstance(spec, Sequence) and not isinstance(spec, str):
        items = tuple(spec)
        if items and all(isinstance(x, Sequence) and not isinstance(x, str) for x in items):
            return _zero_spec(dict(items))  # (name, stage) pairs, as stored
        bad = [
            x
            for x in items
            if isinstance(x, bool) or not isinstance(x, int) or x not in (0, 1, 2, 3)
        ]
        if bad or not items:
            raise ValueError(f"zero_stage must be {valid}; bad stages: {bad or list(items)}")
        return items
    raise ValueError(f"zero_stage must be {valid}, got {spec!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanOptions:
    """How to plan. Every field has a default; see DESIGN.md (Conventions: Options)."""

    recipe: str = "auto"
    """'auto' (the ILP chooses), or a fixed recipe: 'ddp', 'fsdp', 'megatron', 'fsdp+tp'."""
    memory_budget: int | str | None = None
    """Peak bytes per device (int or '40GiB'); None = the device's capacity minus a 10% reserve."""
    optimizer: str = "adamw"
    """Optimizer whose state is counted in memory: 'adamw', 'adam', 'sgd', 'sgd-momentum', ..."""
    mixed_precision: str | None = None
    """None (parameters' dtype throughout) or 'bf16' / 'fp16' (fp32 master weights)."""
    zero_stage: int | tuple[int, ...] | tuple[tuple[str, int], ...] | None = None
    """ZeRO stage on the data-parallel axes (0-3); or one stage per mesh axis (a sequence, or a
    mapping {axis name: stage}, kept as sorted (name, stage) pairs; unnamed axes get 0); None =
    the planner decides a stage per axis."""
    checkpoint: str = "auto"
    """Activation checkpointing: 'auto', 'none' or 'all'."""
    output_placements: tuple[str, ...] | None = None
    """Per output, compact placements such as 'S0,R'; None = Replicate on every axis."""
    time_limit_s: float | None = None
    """Solver time limit; the best plan found so far is returned with its gap."""
    gap: float = 0.01
    """Relative optimality gap at which the solver may stop (the plan reports its bound and
    gap); 0 proves the optimum. Under a memory budget a gap > 0 lets the Lagrangian relaxation
    of the budget (solver/lagrangian.py) answer without the MIP."""
    solver: str = "highs"
    """ILP backend: 'highs' or 'cbc'."""
    in_flight: int = 1
    """Microbatches whose saved activations a device holds at once: a pipeline stage's plan
    counts the microbatches its schedule keeps in flight (the stage planner sets it from the
    schedule); activation memory, and what recomputation frees, count this many times."""
    accumulation: int = 1
    """Microbatches whose gradients accumulate before one optimizer step (a pipeline stage's
    microbatches, gradient accumulation): the plan is one microbatch's, and the gradient
    synchronisation, issued once per step, counts ``1 / accumulation`` of its time in it (the
    stage planner sets it)."""
    auto_margin: float | str | None = None
    """The relative gain the auto plan's predicted step must have over the fastest recipe
    that fits, else the recipe's layout is chosen (autopar/planner/auto_margin.py). None (the
    default): near-ties only, on a device whose profile was measured (``TIE_MARGIN``, 2%, or
    the profile's error where smaller; 0 on datasheet devices); 0 = always the auto plan (a
    margin of the profile's full error kept ddp where the auto plan ran as fast or faster on 5
    of 6 rows in session 9, hence not the default); "profile" = the
    profile's measured error of a difference (``DeviceSpec.paired_error``, else
    ``DeviceSpec.step_error``; 0 for datasheet devices)."""

    def __post_init__(self) -> None:
        if self.recipe not in RECIPES:
            raise ValueError(f"unknown recipe {self.recipe!r}; choose one of {', '.join(RECIPES)}")
        if self.checkpoint not in CHECKPOINT_MODES:
            raise ValueError(
                f"unknown checkpoint mode {self.checkpoint!r}; choose one of {', '.join(CHECKPOINT_MODES)}"
            )
        if self.solver not in SOLVERS:
            raise ValueError(f"unknown solver {self.solver!r}; choose one of {', '.join(SOLVERS)}")
        object.__setattr__(self, "zero_stage", _zero_spec(self.zero_stage))
        if self.mixed_precision not in (None, "bf16", "fp16"):
            raise ValueError(
                f"mixed_precision must be None, 'bf16' or 'fp16', got {self.mixed_precision!r}"
            )
        if self.memory_budget is not None:
            parse_bytes(self.memory_budget)
        for name in ("in_flight", "accumulation"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not 0 <= self.gap < 1:
            raise ValueError(f"gap must be in [0, 1), got {self.gap}")
        if isinstance(self.auto_margin, str):
            if self.auto_margin != "profile":
                raise ValueError(
                    f"auto_margin must be a fraction in [0, 1) or 'profile', got {self.auto_margin!r}"
                )
        elif self.auto_margin is not None and not 0 <= self.auto_margin < 1:
            raise ValueError(
                f"auto_margin must be in [0, 1) (a fraction such as 0.05), got {self.auto_margin}"
            )

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> PlanOptions:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown plan option(s) {unknown}; known: {sorted(known)}")
        values = dict(kwargs)
        if isinstance(values.get("output_placements"), Sequence) and not isinstance(
            values.get("output_placements"), str
        ):
            values["output_placements"] = tuple(values["output_placements"])
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if out["auto_margin"] is None:
            del out["auto_margin"]  # the default: plans and cache keys stay as they were
        for name in ("in_flight", "accumulation"):
            if out[name] == 1:
                del out[name]  # likewise
        if isinstance(self.zero_stage, tuple):
            pairs = self.zero_stage and isinstance(self.zero_stage[0], tuple)
            out["zero_stage"] = dict(self.zero_stage) if pairs else list(self.zero_stage)
        if out["output_placements"] is not None:
            out["output_placements"] = list(out["output_placements"])
        return out
