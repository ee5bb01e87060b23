"""Pricing the split-backward schedules (``zero-bubble``, ``zbv``, ``dualpipev``) by simulating
torch's own action order (issue 15).

These schedules split each microbatch backward of a stage into an input pass ``I`` (gradients
of the stage's inputs, what the previous stage waits for) and a weight pass ``W`` (parameter
gradients, which nothing downstream waits for), and move the ``W`` into what would be bubbles.
Their step has no closed form: it depends on the order torch's schedule class gives each rank
and on the three times. So:

- **the order is torch's**: :func:`action_orders` builds each rank's list of actions with the
  schedule class's own order-building methods (``_calculate_single_rank_operations``, and
  ``_add_bubbles_to_actions`` for ``ScheduleInterleavedZeroBubble``), which read only the rank
  count, stage count and microbatch count, on an instance made without a process group. An
  ``OVERLAP_F_B`` action (DualPipeV) is its sub-actions one after the other (on one CPU
  stream they run in sequence). :func:`refusal` repeats the checks of the classes'
  constructors, so the planner never offers an order torch would refuse;
- **the timeline is event-driven** (:func:`simulate`): each rank runs its actions in order,
  an action starting when its rank is free and its input has arrived: ``F`` of stage ``s``
  after ``F`` of ``s - 1`` (plus its send when the stages are on different ranks), ``I`` or
  a full ``B`` of ``s`` after the ``I``/``B`` of ``s + 1`` (the last stage: after its own
  ``F``), ``W`` after its own ``I``. The step is the last action's end;
- **the times are the stage's**: ``F`` is ``forward_s``, ``I`` the backward without the
  weight gradients (``backward_s - weight_s``), ``B`` the whole ``backward_s``; each adds
  half the stage's sends (``p2p_s``, as the closed forms count them). ``W`` is what
  autopar's weight pass (autopar/runtime/pipeline_backward.py) computes: on a stage that
  does not recompute, the cut pass runs each intermediate's parameter-side products once,
  one autograd call per intermediate, so ``W = weight_s * (1 + WEIGHT_PASS_OVERHEAD)`` (the
  calls' cost: ``benchmarks/weight_pass_time.py`` measures a 4-block GPT stage's input and
  weight passes at 1.39-1.41x its whole backward on CPU; 0.5 is fitted to four runs of
  ``benchmarks/pipeline_zero_bubble.py``, README "Session 21: the weight pass without the
  replay"); on a stage that recomputes, the replay
  pass (one autograd call, so the segments recompute once) runs every backward node between
  the intermediates again: ``W = weight_s + WEIGHT_PASS_REPLAY * (backward_s - weight_s)``,
  with ``WEIGHT_PASS_REPLAY`` 1.0 (until session 21 every stage's weight pass replayed:
  zero-bubble and ZBV measured 1.21-1.43x interleaved 1F1B's step, 1.03-1.12x since);
- **in flight**: a microbatch's activations on a stage stay from its ``F`` until its ``W``
  (or ``B``) ends, since the weight pass reads them. :func:`in_flight_counts` walks each
  rank's order (no timing needed: a rank runs its order in sequence) and returns the most
  chunk-microbatches a rank holds at once, the count the stage pricing multiplies one
  chunk's activations by (as for interleaved 1F1B).

The same simulator on GPipe's and 1F1B's orders gives the closed forms of
:mod:`planner.pipeline_schedule` on equal stages (tests/unit/test_split_schedules.py).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

SPLIT_SCHEDULES = ("zero-bubble", "zbv", "dualpipev")
"""The split-backward schedules priced here (``planner.stages.SCHEDULES``' names)."""

SPLIT_VIRTUAL = 2
"""Stages per rank the stage planner gives them: ZBV and DualPipeV take exactly 2 (a V), and
the interleaved zero-bubble schedule is offered with 2 as interleaved 1F1B is."""

WEIGHT_PASS_REPLAY = 1.0
"""Share of the input pass that the weight pass of a stage that recomputes computes again
(module docstring)."""

WEIGHT_PASS_OVERHEAD = 0.5
"""The cut weight pass's cost beyond its products, as a share of them (module docstring)."""


def replays(stage) -> bool:
    """The stage's weight pass is the replay pass: its plan recomputes blocks."""
    return bool(stage.detail.get("recomputed_blocks"))


@dataclass(frozen=True, slots=True)
class Act:
    """One compute action: ``kind`` "F", "I", "W" or "B" (a whole backward) of ``stage`` on
    ``microbatch``."""

    kind: str
    stage: int
    microbatch: int


def refusal(schedule: str, ranks: int, microbatches: int, virtual: int = SPLIT_VIRTUAL) -> str:
    """Why torch's class for ``schedule`` refuses this shape ("" when it does not)."""
    if schedule not in SPLIT_SCHEDULES:
        return f"{schedule!r} is not a split-backward schedule ({', '.join(SPLIT_SCHEDULES)})"
    if ranks < 1 or microbatches < 1 or virtual < 1:
        return "ranks, microbatches and stages per rank must be >= 1"
    if schedule in ("zbv", "dualpipev") and virtual != 2:
        return f"{schedule} runs exactly 2 stages per rank"
    if schedule == "dualpipev" and microbatches < ranks * virtual:
        return f"dualpipev needs at least as many microbatches as stages ({ranks * virtual})"
    if schedule == "zero-bubble":
        rounds = max(1, microbatches // ranks)
        if microbatches % rounds:
            return f"zero-bubble needs the microbatches to be a multiple of {rounds} rounds"
    return ""


@functools.lru_cache(maxsize=64)
def action_orders(
    schedule: str, ranks: int, microbatches: int, virtual: int = SPLIT_VIRTUAL
) -> tuple[tuple[Act, ...], ...]:
    """Each rank's compute actions in torch's order for ``schedule`` (module docstring).

    Raises:
        ValueError: torch's class refuses the shape (:func:`refusal`).
    """
    reason = refusal(schedule, ranks, microbatches, virtual)
    if reason:
        raise ValueError(reason)
    from torch.distributed.pipelining import schedules as torch_schedules

    cls = {
        "zero-bubble": torch_schedules.ScheduleInterleavedZeroBubble,
        "zbv": torch_schedules.ScheduleZBVZeroBubble,
        "dualpipev": torch_schedules.ScheduleDualPipeV,
    }[schedule]
    # The attributes the order builders read, as the constructors set them.
    builder = object.__new__(cls)
    builder.pp_group_size = ranks
    builder._n_microbatches = microbatches
    builder.n_local_stages = virtual
    builder._num_stages = builder.num_stages = ranks * virtual
    builder.number_of_rounds = max(1, microbatches // ranks)
    builder.microbatches_per_round = microbatches // builder.number_of_rounds
    order = {}
    for rank in range(ranks):
        builder.rank = rank
        order[rank] = builder._calculate_single_rank_operations(rank)
    if schedule == "zero-bubble":
        builder.pipeline_order = order
        order = builder._add_bubbles_to_actions(ranks * virtual)
    return tuple(tuple(_flatten(order[rank])) for rank in range(ranks))


def _flatten(actions) -> list[Act]:
    """torch's actions as :class:`Act`: placeholders dropped, an overlap split in order."""
    out: list[Act] = []
    for action in actions:
        if action is None:
            continue
        if action.sub_actions is not None:
            out.extend(_flatten(action.sub_actions))
            continue
        kind = action.computation_type.value
        if kind not in ("F", "I", "W", "B"):
            raise ValueError(f"unexpected action {action!r} in a compute order")
        out.append(Act(kind, action.stage_index, action.microbatch_index))
    return out


def action_seconds(stage, kind: str) -> float:
    """Seconds of one action of ``kind`` on a stage (a ``StageCost``; module docstring)."""
    half_send = stage.p2p_s / 2
    if kind == "F":
        return stage.forward_s + half_send
    if kind == "B":
        return stage.backward_s + half_send
    input_pass = stage.backward_s - stage.weight_s
    if kind == "I":
        return input_pass + half_send
    if replays(stage):
        return stage.weight_s + WEIGHT_PASS_REPLAY * input_pass
    return stage.weight_s * (1 + WEIGHT_PASS_OVERHEAD)


@dataclass(frozen=True, kw_only=True, slots=True)
class Simulated:
    """One simulated step of a schedule (:func:`simulate`)."""

    pipeline_s: float
    """From the first action's start to the last one's end."""
    busy_s: tuple[float, ...]
    """Per rank: seconds in its actions."""
    p2p_s: tuple[float, ...]
    """Per rank: the sends in those seconds."""


def simulate(
    orders: Sequence[Sequence[Act]], stages: Sequence, stage_ranks: Sequence[int]
) -> Simulated:
    """The event-driven timeline of ``orders`` (per rank) with ``stages``' costs (module
    docstring); ``stage_ranks[s]``: the rank that runs stage ``s`` (a send between two stages on
    one rank takes no time).

    Raises:
        ValueError: the orders deadlock (an action waits for one that never runs)."""
    num = len(stages)
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * len(orders)
    busy = [0.0] * len(orders)
    sends = [0.0] * len(orders)
    position = [0] * len(orders)
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for rank, order in enumerate(orders):
            while position[rank] < len(order):
                act = order[position[rank]]
                ready = _ready(act, done, num, stages, stage_ranks)
                if ready is None:
                    break
                seconds = action_seconds(stages[act.stage], act.kind)
                start = max(free[rank], ready)
                free[rank] = done[act.kind, act.stage, act.microbatch] = start + seconds
                busy[rank] += seconds
                if act.kind != "W":
                    sends[rank] += stages[act.stage].p2p_s / 2
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = [
                order[position[r]] for r, order in enumerate(orders) if position[r] < len(order)
            ]
            raise ValueError(f"the schedule's orders deadlock at {stuck[:4]}")
    return Simulated(pipeline_s=max(free), busy_s=tuple(busy), p2p_s=tuple(sends))


def _ready(act: Act, done: dict, num: int, stages: Sequence, stage_ranks: Sequence[int]):
    """When ``act``'s input is there (None: not yet produced)."""
    s, mb = act.stage, act.microbatch
    if act.kind == "F":
        if s == 0:
            return 0.0
        source = ("F", s - 1, mb)
        link = stages[s - 1].p2p_s / 2 if stage_ranks[s - 1] != stage_ranks[s] else 0.0
    elif act.kind == "W":
        source, link = ("I", s, mb), 0.0
    elif s == num - 1:
        source, link = ("F", s, mb), 0.0
    else:
        source = ("I", s + 1, mb) if ("I", s + 1, mb) in done else ("B", s + 1, mb)
        link = stages[s + 1].p2p_s / 2 if stage_ranks[s + 1] != stage_ranks[s] else 0.0
    finished = done.get(source)
    return None if finished is None else finished + link


def in_flight_counts(orders: Sequence[Sequence[Act]]) -> tuple[int, ...]:
    """Per rank: the most chunk-microbatches whose activations it holds at once (from an
    ``F`` until that stage's ``W`` or ``B`` of the microbatch)."""
    out = []
    for order in orders:
        held = most = 0
        for act in order:
            if act.kind == "F":
                held += 1
                most = max(most, held)
            elif act.kind in ("W", "B"):
                held -= 1
        out.append(most)
    return tuple(out)


@functools.lru_cache(maxsize=256)
def rank_in_flight(
    schedule: str, ranks: int, microbatches: int, virtual: int = SPLIT_VIRTUAL
) -> tuple[int, ...]:
    """:func:`in_flight_counts` of torch's order for this shape, kept (the stage search asks
    once per stage kind priced)."""
    return in_flight_counts(action_orders(schedule, ranks, microbatches, virtual))
