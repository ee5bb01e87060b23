"""The pipelined step's head and tail (``autopar.planner.pipeline_ends``) and how the schedule
model adds them: priced by the collectives they stand for, nothing when they are zero."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.pipelining.microbatch import TensorChunkSpec, split_args_kwargs_into_chunks

from autopar.placement import Replicate, Shard
from autopar.planner.pipeline_ends import LOSS_BYTES, pipeline_ends
from autopar.planner.pipeline_schedule import StageCost, schedule_time
from autopar.runtime.materialize import local_block
from cost_models import LinkSpec, collective_time_s

CALIBRATED = LinkSpec(name="calibrated-pp", bandwidth_Bps=8e8, latency_s=4e-4,
                      collectives={"broadcast": (1.5e-4, 8e-10)}, sync_s=5e-4)  # fmt: skip
STAGES = [StageCost(forward_s=1.0, backward_s=2.0, p2p_s=0.2, step_s=0.1),
          StageCost(forward_s=1.5, backward_s=2.5, p2p_s=0.2, step_s=0.3)]  # fmt: skip
FIELDS = ("step_s", "bubble_s", "compute_s", "p2p_s", "collectives_s")


def test_a_two_stage_tail_is_the_loss_broadcast():
    """2 stages: the tail is one broadcast of the fp32 loss over the pipeline link (alpha for
    its one step, beta for 4 bytes, the link's sync), the head nothing."""
    ends = pipeline_ends(num_stages=2, pp_link=CALIBRATED)
    assert ends.head_s == 0.0
    assert ends.tail_s == pytest.approx(1.5e-4 + 8e-10 * 4 + 5e-4)
    assert ends.tail_s == ends.loss_broadcast_s
    preset = LinkSpec(name="ib", bandwidth_Bps=5e10, latency_s=5e-6)
    four = pipeline_ends(num_stages=4, pp_link=preset)
    assert four.tail_s == pytest.approx(3 * 5e-6 + 4 / 5e10)
    assert four.tail_s == collective_time_s("broadcast", LOSS_BYTES, 4, preset)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("shared", [{}, {"1": 1.6, "2": 1.0}])
def test_the_simulated_step_adds_head_and_tail_and_nothing_else(schedule, shared):
    """With a 2-stage plan's ends the simulated step is the old one plus the collectives they
    price; with zero ends it is the old one, field by field."""
    kw = dict(microbatches=4, schedule=schedule, busy_rank_speed=shared, task_wait_s=0.01)
    old = schedule_time(STAGES, **kw)
    zero = schedule_time(STAGES, **kw, head_s=0.0, tail_s=0.0)
    assert zero == old
    ends = pipeline_ends(num_stages=2, pp_link=CALIBRATED)
    new = schedule_time(STAGES, **kw, head_s=ends.head_s, tail_s=ends.tail_s)
    assert new.step_s == pytest.approx(old.step_s + ends.loss_broadcast_s, rel=1e-12)
    assert (new.head_s, new.tail_s) == (0.0, ends.loss_broadcast_s)
    for field in FIELDS[1:]:
        assert getattr(new, field) == getattr(old, field)
    assert new.to_json()["tail_s"] == ends.tail_s
    assert new.bubble_fraction < old.bubble_fraction  # same bubble, longer step


def test_the_closed_forms_add_head_and_tail_too():
    """Without a shared-cores device (and for interleaving, always the closed form)."""
    for kw in (dict(schedule="gpipe"), dict(schedule="interleaved-1f1b", num_ranks=1)):
        old = schedule_time(STAGES, microbatches=4, **kw)
        new = schedule_time(STAGES, microbatches=4, **kw, head_s=0.25, tail_s=0.5)
        assert new.step_s == pytest.approx(old.step_s + 0.75)
        assert [getattr(new, f) for f in FIELDS[1:]] == [getattr(old, f) for f in FIELDS[1:]]


def test_the_head_copies_nothing():
    """Why the head is priced 0: torch's microbatch split and a data-parallel stage's cut of
    its global inputs are views of the batch every rank holds."""
    batch = torch.arange(16 * 8).reshape(16, 8)
    chunks, _ = split_args_kwargs_into_chunks((batch,), {}, 4, (TensorChunkSpec(0),))
    assert all(c[0].untyped_storage().data_ptr() == batch.untyped_storage().data_ptr()
               for c in chunks)  # fmt: skip
    block = local_block(chunks[1][0], (Shard(0), Replicate()), (2, 2), (1, 0))
    assert block.untyped_storage().data_ptr() == batch.untyped_storage().data_ptr()
    assert torch.equal(block, batch[6:8])
