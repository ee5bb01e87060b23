"""autopar/planner/split_schedules.py: torch's action orders for the split-backward schedules,
the event-driven timeline, in-flight counts, and the stage search offering them (issue 15)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.planner.pipeline_schedule import StageCost, schedule_time
from autopar.planner.split_schedules import (
    SPLIT_SCHEDULES,
    WEIGHT_PASS_OVERHEAD,
    Act,
    action_orders,
    action_seconds,
    in_flight_counts,
    refusal,
    simulate,
)
from autopar.planner.stages import stage_rank

SETTINGS = dict(deadline=None, derandomize=True, database=None)


def _gpipe(p: int, m: int) -> list[list[Act]]:
    return [
        [Act("F", r, k) for k in range(m)] + [Act("B", r, k) for k in range(m)] for r in range(p)
    ]


def _one_f_one_b(p: int, m: int) -> list[list[Act]]:
    out = []
    for r in range(p):
        warm = min(p - r - 1, m)
        order = [Act("F", r, k) for k in range(warm)]
        for k in range(m - warm):
            order += [Act("F", r, warm + k), Act("B", r, k)]
        order += [Act("B", r, k) for k in range(m - warm, m)]
        out.append(order)
    return out


@settings(**SETTINGS, max_examples=40)
@given(
    p=st.integers(1, 5),
    m=st.integers(1, 9),
    f=st.floats(0.1, 3.0),
    b=st.floats(0.1, 3.0),
    gpipe=st.booleans(),
)
def test_gpipe_and_1f1b_orders_give_the_closed_form_on_equal_stages(p, m, f, b, gpipe) -> None:
    # Equal stages, no sends: (m + p - 1) (f + b), the closed form of pipeline_schedule.
    if not gpipe and m < p:
        m = p
    stages = [StageCost(forward_s=f, backward_s=b) for _ in range(p)]
    orders = (_gpipe if gpipe else _one_f_one_b)(p, m)
    sim = simulate(orders, stages, list(range(p)))
    closed = schedule_time(stages, microbatches=m, schedule="gpipe" if gpipe else "1f1b")
    assert sim.pipeline_s == pytest.approx(closed.step_s, rel=1e-12)
    assert max(sim.busy_s) == pytest.approx(m * (f + b), rel=1e-12)


@pytest.mark.parametrize("schedule", SPLIT_SCHEDULES)
@pytest.mark.parametrize(("p", "m"), [(2, 4), (2, 8), (4, 8), (4, 16)])
def test_torch_orders_run_every_action_once(schedule, p, m) -> None:
    orders = action_orders(schedule, p, m)
    placed = [stage_rank(schedule, s, p) for s in range(2 * p)]
    seen = [a for order in orders for a in order]
    assert len(seen) == len(set(seen))  # no action twice
    # Every action runs on the rank its stage is placed on (interleaved, or in a V).
    assert all(placed[a.stage] == r for r, order in enumerate(orders) for a in order)
    # Each microbatch on each stage: one F, and a full B or an I with its W.
    for s in range(2 * p):
        for k in range(m):
            kinds = sorted(a.kind for a in seen if a.stage == s and a.microbatch == k)
            assert kinds in (["B", "F"], ["F", "I", "W"]), (s, k, kinds)
    # Equal stages with the weight pass as long as the input pass: the timeline completes.
    stages = [StageCost(forward_s=1.0, backward_s=2.0, weight_s=1.0) for _ in range(2 * p)]
    sim = simulate(orders, stages, placed)
    assert sim.pipeline_s >= max(sim.busy_s) > 0


def test_in_flight_counts_follow_the_order() -> None:
    order = [[Act("F", 0, 0), Act("F", 0, 1), Act("I", 0, 0), Act("W", 0, 0), Act("F", 0, 2)]]
    assert in_flight_counts(order) == (2,)  # the W frees microbatch 0 before 2 starts
    # ZBV on 4 ranks with 8 microbatches: rank 0 holds every microbatch of its first stage.
    assert in_flight_counts(action_orders("zbv", 4, 8))[0] == 8


def test_refusals_are_torchs() -> None:
    assert "at least as many microbatches" in refusal("dualpipev", 4, 4)
    assert "exactly 2" in refusal("zbv", 2, 4, 3)
    assert "multiple of" in refusal("zero-bubble", 4, 9, 2)
    assert refusal("zero-bubble", 4, 8, 2) == ""
    with pytest.raises(ValueError, match="at least as many"):
        action_orders("dualpipev", 4, 4)


def test_the_weight_pass_replays_the_input_pass_only_where_the_stage_recomputes() -> None:
    # autopar's weight pass (split_schedules' module docstring): the cut pass runs the
    # products once, at WEIGHT_PASS_OVERHEAD more; a recomputing stage's replay pass computes
    # the input gradients between the intermediates again.
    plain = StageCost(forward_s=1.0, backward_s=3.0, weight_s=1.0, p2p_s=0.2)
    assert action_seconds(plain, "I") == pytest.approx(2.0 + 0.1)
    assert action_seconds(plain, "W") == pytest.approx(1.0 * (1 + WEIGHT_PASS_OVERHEAD))
    assert action_seconds(plain, "B") == pytest.approx(3.0 + 0.1)
    recomputing = dataclasses.replace(plain, detail={"recomputed_blocks": 1})
    assert action_seconds(recomputing, "I") == pytest.approx(2.0 + 0.1)
    assert action_seconds(recomputing, "W") == pytest.approx(1.0 + 2.0)


def test_a_split_schedule_fills_the_bubble_when_the_weight_pass_is_cheap() -> None:
    # 4 ranks, 8 microbatches: 1F1B idles (p - 1) (f + b) = 9 of 33; ZBV with the cut weight
    # pass (no replay) is faster, with the replay pass (a recomputing stage: W = the whole
    # backward) slower.
    p, m = 4, 8
    chunk = StageCost(forward_s=0.5, backward_s=1.0, weight_s=0.5)
    replaying = dataclasses.replace(chunk, detail={"recomputed_blocks": 1})
    one = schedule_time(
        [StageCost(forward_s=1.0, backward_s=2.0)] * p, microbatches=m, schedule="1f1b"
    )
    replayed = schedule_time([replaying] * (2 * p), microbatches=m, schedule="zbv", num_ranks=p)
    plain = schedule_time([chunk] * (2 * p), microbatches=m, schedule="zbv", num_ranks=p)
    assert plain.step_s < one.step_s < replayed.step_s
    assert plain.bubble_fraction < one.bubble_fraction


def _search(p: int, m: int, parts) -> list:
    """The stage planner's candidates on ``pp = p`` with ``m`` microbatches, every schedule
    offered, priced from ``parts`` (no probe is solved), fastest first as the search ranks."""
    from autopar.options import PlanOptions
    from autopar.planner.pipeline import StageModel, StagePlanner
    from autopar.planner.pipeline_meshes import MeshShape
    from autopar.planner.pipeline_schedule import PIPELINE_SCHEDULES
    from autopar.planner.stage_pricing import StagePricer
    from cost_models.hardware import LINKS

    link = LINKS["nvlink"]
    mesh = MeshShape(pp=p, dp=1, tp=1, pp_link=link, dp_link=link, tp_link=link)
    model = StageModel(
        name="synthetic", batch=m, probe=lambda local: None, num_blocks=4 * p, stack="layers"
    )
    planner = StagePlanner(model, options=PlanOptions(), budget=2.0**50, device="h100")
    pricer = StagePricer(
        options=(parts,), dp=1, dp_link=link, pp_link=link, optimizer="sgd",
        mixed_precision=None, budget=2.0**50,
    )  # fmt: skip
    found = planner._candidates(mesh, m, (parts,), PIPELINE_SCHEDULES, pricer=pricer)
    return sorted(found, key=lambda c: c.step_s)


def _parts(weight_share: float):
    from autopar.planner.stage_pricing import Part, Parts

    block = Part(forward_s=1e-3, backward_s=2e-3, weight_s=2e-3 * weight_share)
    return Parts(head=Part(), block=block, tail=Part(), layouts="auto", num_probe_blocks=1)


def test_the_stage_search_takes_a_split_schedule_only_where_it_pays(monkeypatch) -> None:
    import autopar.planner.split_schedules as split

    # 4 pipeline ranks, 16 blocks, 4 microbatches (DualPipeV needs 8: not offered). The
    # split schedules' bubble is smaller than interleaved 1F1B's; with the cut weight pass
    # (stages that do not recompute) the bubble saving decides and zero-bubble wins.
    few = _search(4, 4, _parts(0.5))
    assert {c.schedule for c in few} == {"gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv"}
    assert few[0].schedule == "zero-bubble"
    # Where every weight pass replays the input pass (stages that recompute), the split
    # schedules are slower despite their smaller bubble, and not chosen.
    monkeypatch.setattr(split, "replays", lambda stage: True)
    replayed = _search(4, 4, _parts(0.5))
    best, zb = replayed[0], next(c for c in replayed if c.schedule == "zero-bubble")
    assert best.schedule == "interleaved-1f1b"
    assert zb.time.bubble_fraction < best.time.bubble_fraction and zb.step_s > best.step_s
    monkeypatch.undo()
    # 8 microbatches: DualPipeV (most backwards whole, so little replay) leaves no idle time
    # on its busiest rank and wins; its step is its simulated schedule's.
    eight = _search(4, 8, _parts(0.5))
    assert eight[0].schedule == "dualpipev" and eight[0].virtual_stages == 2
    assert (
        eight[0].time.bubble_fraction
        < next(c for c in eight if c.schedule == "interleaved-1f1b").time.bubble_fraction
    )
    again = schedule_time(list(eight[0].stages), microbatches=8, schedule="dualpipev", num_ranks=4)
    assert eight[0].step_s == pytest.approx(
        again.step_s + eight[0].time.head_s + eight[0].time.tail_s
    )
