"""The stage planner: pipeline stages, microbatches and schedule, planned with the intra-op ILP.

For each mesh shape ``pp x dp x tp`` (one given with ``--mesh``, or every factorisation of
``--devices`` with ``tp`` inside a node, :func:`mesh_shapes`), each microbatch count ``m``
(dividing the batch, the microbatch dividing over ``dp``, at most ``8 * pp``) and each schedule
(GPipe, 1F1B, interleaved 1F1B with 2 virtual stages per rank, and the split-backward
``zero-bubble``, ``zbv`` and ``dualpipev`` with 2 stages per rank, priced on torch's action
order by ``planner.split_schedules``), the planner:

1. prices every stage kind (``k`` blocks, with the head and/or tail end, at its position's
   in-flight count) from the probes of ``planner.stage_pricing``: one ILP per (``tp``, local
   microbatch), shared by every mesh, microbatch count and schedule that needs it;
2. chooses the cut points by the exact dynamic programme of ``planner.pipeline_schedule``
   (interleaved schedules split the blocks evenly over their ``pp * v`` chunks);
3. prices the step (bubble, point-to-point, gradient sync, the step's head and tail:
   ``planner.pipeline_ends``) and ranks the candidates.

``pp = 1`` is the plan without stages (with ``m > 1``: gradient accumulation, ``m`` passes of
``batch / m`` per step). ``megatron-3d`` is the
same search restricted to Megatron-LM's recipe (:meth:`StagePlanner.megatron_candidate`):
``tp`` the node size, Megatron's layouts, ZeRO-1 (its distributed optimizer) on ``dp``, even
stages, 1F1B, and the stage and microbatch counts with the fastest step (with stages whenever
some stage count fits; without only on one node or when none does). Its choices are a subset
of the auto search's, so the auto plan is never predicted slower.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from autopar.capture.export import Captured
from autopar.options import PlanOptions
from autopar.planner.pipeline_ends import pipeline_ends
from autopar.planner.pipeline_meshes import MeshShape, mesh_shapes, microbatch_counts
from autopar.planner.pipeline_schedule import (
    PIPELINE_SCHEDULES,
    ScheduleTime,
    StageCost,
    best_cuts,
    even_sizes,
    in_flight,
    schedule_time,
)
from autopar.planner.split_schedules import SPLIT_SCHEDULES, SPLIT_VIRTUAL, refusal
from autopar.planner.stage_pricing import Parts, StagePricer
from autopar.planner.stage_probes import ProbeCache
from autopar.planner.stages import stage_rank
from cost_models.hardware import get_device

INTERLEAVED_VIRTUAL = 2
assert INTERLEAVED_VIRTUAL == SPLIT_VIRTUAL  # the split schedules' stages per rank
_SCHEDULE_ORDER = {
    "none": 0,
    "1f1b": 1,
    "interleaved-1f1b": 2,
    "gpipe": 3,
    "dualpipev": 4,
    "zbv": 5,
    "zero-bubble": 6,
}


RESERVE_PASSES = 4
"""Pricing passes that settle what each stage reserves for its rank's other stages."""


def _rank_shared_stages(
    pricer: StagePricer, schedule: str, sizes: list[int], p: int, m: int, v: int
) -> list[StageCost] | None:
    """Every chunk of a schedule with ``v`` stages per rank, priced so that the RANK fits: a
    rank holds its chunks' states, inputs and buffers at once, and its in-flight
    chunk-microbatches (each chunk is priced with all of them, at its own activation size, a
    bound on the rank's). Each chunk reserves what the rank's other chunks hold at rest; a
    chunk pushed to more ZeRO or recomputation by its reserve holds less, and one priced
    differently may hold more, so reserves only grow, pass by pass, until every chunk's covers
    its partners' (else None: the candidate does not fit)."""
    ranks = [stage_rank(schedule, c, p) for c in range(len(sizes))]
    reserve = [0.0] * len(sizes)
    for _ in range(RESERVE_PASSES):
        stages = []
        for c, k in enumerate(sizes):
            cost = pricer.price(
                blocks=k,
                first=c == 0,
                last=c == len(sizes) - 1,
                in_flight=in_flight(schedule, ranks[c], p, m, v),
                microbatches=m,
                reserve_bytes=reserve[c],
            )
            if cost is None:
                return None
            stages.append(cost)
        held = [s.memory["state"] + s.memory["inputs_buffers"] for s in stages]
        needed = [
            sum(h for o, h in enumerate(held) if o != c and ranks[o] == ranks[c])
            for c in range(len(sizes))
        ]
        if all(n <= r for n, r in zip(needed, reserve, strict=True)):
            return stages
        reserve = [max(n, r) for n, r in zip(needed, reserve, strict=True)]
    return None


@dataclass(frozen=True, kw_only=True, slots=True)
class StageModel:
    """What the stage planner needs of a model.

    Args:
        name: for tables.
        batch: the GLOBAL batch.
        probe: local microbatch size -> the model (or a few-block variant with the same blocks
            and ends) captured at that batch.
        num_blocks: blocks in the model's stack.
        stack: module path of the stack (e.g. "layers").
        param_fqns: the whole model's parameters, for the stages' ``param_fqns``.
    """

    name: str
    batch: int
    probe: Callable[[int], Captured]
    num_blocks: int
    stack: str
    param_fqns: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    """One priced pipeline configuration."""

    mesh: MeshShape
    microbatches: int
    schedule: str
    """A schedule of ``planner.stages.SCHEDULES``, or "none" (one stage)."""
    virtual_stages: int
    sizes: tuple[int, ...]
    """Blocks per (virtual) stage, in pipeline order."""
    stages: tuple[StageCost, ...]
    time: ScheduleTime
    recipe: str = "auto"

    @property
    def step_s(self) -> float:
        return self.time.step_s

    @property
    def peak_memory_bytes(self) -> float:
        return max(s.peak_memory_bytes for s in self.stages)

    @property
    def num_stages(self) -> int:
        return self.mesh.pp


@dataclass(kw_only=True)
class SearchResult:
    ranked: list[Candidate]
    """Every candidate that fits, fastest first."""
    megatron_3d: Candidate | None
    best_without_stages: Candidate | None
    probes: int
    seconds: float
    notes: list[str] = field(default_factory=list)

    @property
    def best(self) -> Candidate:
        return self.ranked[0]


class StagePlanner:
    """Searches pipeline configurations of one model (see the module docstring).

    Args:
        model: the model's probes and stack.
        options: the plan options (optimizer, precision, solver, checkpoint).
        budget: memory budget per device.
        device: the device preset or spec the probes are priced on.
        progress: receives one line per finished mesh.
    """

    def __init__(
        self,
        model: StageModel,
        *,
        options: PlanOptions,
        budget: float,
        device,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        self.model = model
        self.options = options
        self.budget = budget
        self.probes = ProbeCache(model.probe, options=options, device=device)
        # Ranks sharing cores: their speed by how many compute, and the wait per task.
        self.busy_rank_speed = get_device(device).busy_rank_speed
        self.task_wait_s = get_device(device).task_wait_s
        self.core_wait_s = get_device(device).core_wait_s
        self.task_gap_s = get_device(device).task_gap_s
        self.task_gap_by_others_s = get_device(device).task_gap_by_others_s
        self._report = progress or (lambda line: None)

    def search(
        self,
        meshes: list[MeshShape],
        *,
        microbatches: int | None = None,
        schedules: tuple[str, ...] = PIPELINE_SCHEDULES,
        megatron_tp: int | None = None,
    ) -> SearchResult:
        """Every candidate on ``meshes`` (fixed ``microbatches`` if given), ranked, and
        ``megatron-3d`` on the meshes whose tensor-parallel size is ``megatron_tp`` (the node
        size; None: not priced).

        Raises:
            ValueError: nothing fits (the message says what was tried).
        """
        start = time.perf_counter()
        batch = self.model.batch
        found: list[Candidate] = []
        megatron: Candidate | None = None
        tried = 0
        for mesh in meshes:
            counts = microbatch_counts(batch, mesh.dp, mesh.pp)
            if microbatches is not None:
                counts = [microbatches] if microbatches in counts else []
            for m in counts:
                tried += 1
                recipe_mesh = mesh.tp == megatron_tp
                auto = self._menu(mesh, m, megatron=recipe_mesh)
                if auto is None:
                    continue
                found.extend(self._candidates(mesh, m, auto, schedules))
                if recipe_mesh:
                    one = self.megatron_candidate(mesh, m)
                    # Pipeline across nodes: the fastest with stages, else without.
                    if one is not None and (
                        megatron is None
                        or (one.mesh.pp == 1, one.step_s) < (megatron.mesh.pp == 1, megatron.step_s)
                    ):
                        megatron = one
            self._report(f"stages on {mesh.label}: {len(found)} candidates so far")
        # Ties (GPipe and 1F1B take the same time) go to the schedule keeping less in flight.
        found.sort(key=lambda c: (c.step_s, c.peak_memory_bytes, _SCHEDULE_ORDER[c.schedule]))
        if not found:
            raise ValueError(
                f"no pipeline configuration of {self.model.name} fits the memory budget of "
                f"{self.budget / 2**30:.1f} GiB per device ({tried} mesh and microbatch "
                f"choices tried): raise the budget, use more devices or a smaller batch"
            )
        no_stages = next((c for c in found if c.mesh.pp == 1), None)
        return SearchResult(
            ranked=found,
            megatron_3d=megatron,
            best_without_stages=no_stages,
            probes=self.probes.solved,
            seconds=time.perf_counter() - start,
        )

    def _menu(self, mesh: MeshShape, m: int, *, megatron: bool) -> tuple[Parts, ...] | None:
        local = self.model.batch // (m * mesh.dp)
        parts = [self.probes.parts(local, mesh.tp, mesh.tp_link, recipe="auto")]
        if megatron:
            parts.append(self.probes.parts(local, mesh.tp, mesh.tp_link, recipe="megatron"))
        usable = tuple(p for p in parts if p is not None)
        return usable or None

    def _pricer(self, mesh: MeshShape, parts: tuple[Parts, ...], zero=None) -> StagePricer:
        extra = {} if zero is None else {"zero_stages": zero}
        return StagePricer(
            options=parts,
            dp=mesh.dp,
            dp_link=mesh.dp_link,
            pp_link=mesh.pp_link,
            optimizer=self.options.optimizer,
            mixed_precision=self.options.mixed_precision,
            budget=self.budget,
            recompute=self.options.checkpoint != "none",
            **extra,
        )

    def _candidates(
        self,
        mesh: MeshShape,
        m: int,
        parts: tuple[Parts, ...],
        schedules: tuple[str, ...],
        *,
        pricer: StagePricer | None = None,
    ) -> list[Candidate]:
        pricer = pricer or self._pricer(mesh, parts)
        p, n = mesh.pp, self.model.num_blocks
        if p == 1:  # gradient accumulation over m microbatches
            one = pricer.price(blocks=n, first=True, last=True, in_flight=1, microbatches=m)
            if one is None:
                return []
            t = schedule_time([one], microbatches=m, schedule="1f1b")
            return [
                Candidate(
                    mesh=mesh,
                    microbatches=m,
                    schedule="none",
                    virtual_stages=1,
                    sizes=(n,),
                    stages=(one,),
                    time=t,
                )
            ]
        out = []
        for schedule in schedules:
            if schedule == "1f1b" and m < p:
                continue  # torch's Schedule1F1B refuses fewer microbatches than stages
            if schedule == "interleaved-1f1b" or schedule in SPLIT_SCHEDULES:
                found = self._interleaved(mesh, m, pricer, schedule)
                if found is not None:
                    out.append(found)
                continue
            memo: dict[tuple[int, int], StageCost | None] = {}

            def table(i: int, k: int, schedule=schedule, memo=memo) -> StageCost | None:
                flight = in_flight(schedule, i, p, m)
                key = (flight * 4 + (i == 0) * 2 + (i == p - 1), k)
                if key not in memo:
                    memo[key] = pricer.price(
                        blocks=k, first=i == 0, last=i == p - 1, in_flight=flight, microbatches=m
                    )
                return memo[key]

            cuts = best_cuts(table, num_blocks=n, num_stages=p, microbatches=m)
            if cuts is None:
                continue
            sizes = cuts[0]
            stages = tuple(table(i, k) for i, k in enumerate(sizes))
            ends = pipeline_ends(num_stages=p, pp_link=mesh.pp_link)
            t = schedule_time(
                stages,  # type: ignore[arg-type]
                microbatches=m,
                schedule=schedule,
                busy_rank_speed=self.busy_rank_speed,
                ranks_per_stage=mesh.dp * mesh.tp,
                task_wait_s=self.task_wait_s,
                core_wait_s=self.core_wait_s,
                task_gap_s=self.task_gap_s,
                task_gap_by_others_s=self.task_gap_by_others_s,
                head_s=ends.head_s,
                tail_s=ends.tail_s,
            )
            out.append(
                Candidate(
                    mesh=mesh,
                    microbatches=m,
                    schedule=schedule,
                    virtual_stages=1,
                    sizes=tuple(sizes),
                    stages=stages,
                    time=t,
                )
            )  # type: ignore[arg-type]
        return out

    def _interleaved(
        self, mesh: MeshShape, m: int, pricer: StagePricer, schedule: str
    ) -> Candidate | None:
        """``schedule`` with 2 stages per rank (interleaved 1F1B, or a split-backward one),
        the blocks split evenly over the ``2 * pp`` stages; None where torch's class refuses
        the shape."""
        p, v, n = mesh.pp, INTERLEAVED_VIRTUAL, self.model.num_blocks
        if p * v > n:
            return None
        if schedule == "interleaved-1f1b" and m % p:
            return None  # torch's interleaved schedule wants whole rounds of microbatches
        if schedule in SPLIT_SCHEDULES and refusal(schedule, p, m, v):
            return None
        return self._fixed_split(mesh, m, pricer, schedule, even_sizes(n, p * v), v)

    def _fixed_split(
        self, mesh: MeshShape, m: int, pricer: StagePricer, schedule: str, sizes: list[int], v: int
    ) -> Candidate | None:
        p = mesh.pp
        stages = _rank_shared_stages(pricer, schedule, sizes, p, m, v)
        if stages is None:
            return None
        ends = pipeline_ends(num_stages=p, pp_link=mesh.pp_link)
        t = schedule_time(
            stages,
            microbatches=m,
            schedule=schedule,
            num_ranks=p,
            head_s=ends.head_s,
            tail_s=ends.tail_s,
        )
        return Candidate(
            mesh=mesh,
            microbatches=m,
            schedule=schedule,
            virtual_stages=v,
            sizes=tuple(sizes),
            stages=tuple(stages),
            time=t,
        )

    def megatron_candidate(self, mesh: MeshShape, m: int) -> Candidate | None:
        """Megatron-LM's 3-D recipe on ``mesh`` with ``m`` microbatches (module docstring)."""
        local = self.model.batch // (m * mesh.dp)
        parts = self.probes.parts(local, mesh.tp, mesh.tp_link, recipe="megatron")
        if parts is None or mesh.pp > self.model.num_blocks or (mesh.pp > 1 and m < mesh.pp):
            return None  # (1F1B: torch needs at least as many microbatches as stages)
        pricer = self._pricer(mesh, (parts,), zero=(1,))
        if mesh.pp == 1:
            found = next(iter(self._candidates(mesh, m, (parts,), (), pricer=pricer)), None)
        else:
            sizes = even_sizes(self.model.num_blocks, mesh.pp)
            found = self._fixed_split(mesh, m, pricer, "1f1b", sizes, 1)
        return None if found is None else _as_recipe(found, "megatron-3d")


def _as_recipe(candidate: Candidate, recipe: str) -> Candidate:
    return dataclasses.replace(candidate, recipe=recipe)


__all__ = [
    "Candidate",
    "MeshShape",
    "SearchResult",
    "StageModel",
    "StagePlanner",
    "mesh_shapes",
    "microbatch_counts",
]
