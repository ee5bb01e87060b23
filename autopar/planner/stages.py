"""Pipeline stages: what the inter-op planner decides and the pipeline runtime executes.

A pipelined plan cuts the model's stack of repeated blocks (``layers.0 .. layers.N-1``, found by
``planner.tying``'s stack names) into ``len(stages)`` contiguous stages, only between blocks:
stage 0 also owns everything before the first block (embeddings), the last stage everything
after the last block (final norm, head, loss). Each stage runs on its own submesh: the ranks of
one index along the pipeline axis of the plan's mesh (``axis``), and is planned (layouts, ZeRO,
recomputation) by the ordinary ILP on that submesh with the microbatch's shapes.

``schedule`` names one of torch.distributed.pipelining's schedules:

- ``"gpipe"``: ``ScheduleGPipe`` (all forwards, then all backwards);
- ``"1f1b"``: ``Schedule1F1B``;
- ``"interleaved-1f1b"``: ``ScheduleInterleaved1F1B`` with ``virtual_stages`` stages per rank
  (stage ``s`` runs on pipeline rank ``s % ranks``);
- ``"zero-bubble"``: ``ScheduleInterleavedZeroBubble`` (ZB-H1-like; ``virtual_stages`` stages per
  rank, placed as interleaved 1F1B's), each backward split into an input pass and a weight pass;
- ``"zbv"``: ``ScheduleZBVZeroBubble`` and ``"dualpipev"``: ``ScheduleDualPipeV``, both with
  exactly 2 stages per rank in a V: rank ``r`` of ``p`` runs stages ``r`` and ``2p - 1 - r``
  (:func:`stage_rank`), so the first and the last stage are on rank 0.

This module is the interface between ``planner`` (which chooses a :class:`PipelinePlan`),
``plan`` (which stores it as the plan JSON's ``pipeline`` entry) and ``runtime`` (which
splits the captured graph at ``cut_fqns`` and drives the schedule). It depends on nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv", "dualpipev")
MULTI_STAGE_SCHEDULES = ("interleaved-1f1b", "zero-bubble", "zbv", "dualpipev")
"""Schedules that may run several stages per pipeline rank (``virtual_stages``)."""
V_SCHEDULES = ("zbv", "dualpipev")
"""Schedules with exactly 2 stages per rank placed in a V (:func:`stage_rank`)."""


def stage_rank(schedule: str, stage: int, ranks: int) -> int:
    """The pipeline rank that runs ``stage`` of ``ranks * virtual_stages`` under ``schedule``:
    ``stage % ranks`` (looped), or in a V for :data:`V_SCHEDULES` (``stage`` on the way down,
    ``2 * ranks - 1 - stage`` on the way back)."""
    if schedule in V_SCHEDULES:
        return stage if stage < ranks else 2 * ranks - 1 - stage
    return stage % ranks


@dataclass(frozen=True, kw_only=True, slots=True)
class Stage:
    """One pipeline stage (a virtual stage under an interleaved schedule)."""

    index: int
    """Position in the pipeline, 0 = the one fed the inputs."""
    blocks: tuple[int, int]
    """Repeated blocks ``[first, last)`` of the stack this stage runs."""
    first_fqn: str
    """Module path of the stage's first block (e.g. ``"layers.4"``): where it is cut from the
    previous stage; stage 0's is the first block's too."""
    pp_rank: int
    """Index along the pipeline axis of the ranks that run this stage."""
    ranks: tuple[int, ...] = ()
    """Global ranks of the stage's submesh (row-major over the remaining axes)."""
    param_fqns: tuple[str, ...] = ()
    """Parameters this stage owns (filled by the planner from the capture)."""
    predicted: dict[str, float] = field(default_factory=dict)
    """The stage's figures per microbatch: forward_s, backward_s, peak_memory_bytes, ..."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelinePlan:
    """Stages, microbatches and schedule of a pipelined plan (the JSON ``pipeline`` entry)."""

    axis: int
    """Mesh axis the stages are laid along (by default the outermost, or one named ``pp``)."""
    stack: str
    """Module path of the stack of blocks that is cut (e.g. ``"layers"``, ``"transformer.h"``)."""
    num_blocks: int
    stages: tuple[Stage, ...]
    microbatches: int
    schedule: str
    virtual_stages: int = 1
    """Stages per pipeline rank (> 1 only for interleaved schedules)."""
    predicted: dict[str, float] = field(default_factory=dict)
    """step_s, bubble_s, bubble_fraction, p2p_s, compute_s, collectives_s of the whole step."""

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.schedule!r}; choose from {SCHEDULES}")
        if self.microbatches < 1:
            raise ValueError(f"microbatches must be >= 1, got {self.microbatches}")
        if not self.stages:
            raise ValueError("a pipeline needs at least one stage")
        covered = [b for s in self.stages for b in range(*s.blocks)]
        if covered != list(range(self.num_blocks)):
            raise ValueError(
                f"stages must cover blocks 0..{self.num_blocks - 1} in order without gaps, got "
                f"{[s.blocks for s in self.stages]}"
            )

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def cut_fqns(self) -> tuple[str, ...]:
        """Module paths where stages 1.. begin (the split points, e.g. ``("layers.4",)``)."""
        return tuple(s.first_fqn for s in self.stages[1:])

    def to_json(self) -> dict[str, Any]:
        return {
            "axis": self.axis,
            "stack": self.stack,
            "num_blocks": self.num_blocks,
            "microbatches": self.microbatches,
            "schedule": self.schedule,
            "virtual_stages": self.virtual_stages,
            "predicted": dict(self.predicted),
            "stages": [
                {
                    "index": s.index,
                    "blocks": list(s.blocks),
                    "first_fqn": s.first_fqn,
                    "pp_rank": s.pp_rank,
                    "ranks": list(s.ranks),
                    "param_fqns": list(s.param_fqns),
                    "predicted": dict(s.predicted),
                }
                for s in self.stages
            ],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PipelinePlan:
        return cls(
            axis=int(data["axis"]),
            stack=data["stack"],
            num_blocks=int(data["num_blocks"]),
            microbatches=int(data["microbatches"]),
            schedule=data["schedule"],
            virtual_stages=int(data.get("virtual_stages", 1)),
            predicted=dict(data.get("predicted", {})),
            stages=tuple(
                Stage(
                    index=int(s["index"]),
                    blocks=(int(s["blocks"][0]), int(s["blocks"][1])),
                    first_fqn=s["first_fqn"],
                    pp_rank=int(s["pp_rank"]),
                    ranks=tuple(int(r) for r in s.get("ranks", ())),
                    param_fqns=tuple(s.get("param_fqns", ())),
                    predicted=dict(s.get("predicted", {})),
                )
                for s in data["stages"]
            ),
        )


def even_stages(
    *,
    stack: str,
    num_blocks: int,
    num_stages: int,
    axis: int = 0,
    virtual_stages: int = 1,
    microbatches: int,
    schedule: str,
) -> PipelinePlan:
    """Blocks split as evenly as possible over ``num_stages * virtual_stages`` stages (earlier
    stages take the remainder); what a user who fixes only the stage count gets.

    Raises:
        ValueError: more stages than blocks.
    """
    total = num_stages * virtual_stages
    if total > num_blocks:
        raise ValueError(
            f"{total} pipeline stages for a stack of {num_blocks} blocks ({stack}): a stage "
            f"needs at least one block; use at most {num_blocks} stages"
        )
    base, extra = divmod(num_blocks, total)
    stages, start = [], 0
    for k in range(total):
        size = base + (1 if k < extra else 0)
        stages.append(
            Stage(
                index=k,
                blocks=(start, start + size),
                first_fqn=f"{stack}.{start}",
                pp_rank=stage_rank(schedule, k, num_stages),
            )
        )
        start += size
    return PipelinePlan(
        axis=axis,
        stack=stack,
        num_blocks=num_blocks,
        stages=tuple(stages),
        microbatches=microbatches,
        schedule=schedule,
        virtual_stages=virtual_stages,
    )
