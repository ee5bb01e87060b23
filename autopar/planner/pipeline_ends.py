"""The step's head and tail: what a pipelined step does before its first microbatch forward and
after its last microbatch backward, priced with the link's collective terms.

``PipelineModule.step`` (``autopar.runtime.pipeline``) runs, on every rank:

- **head**: the inputs' check and torch's microbatch split (``torch.tensor_split``: views of
  the global batch, which every rank already holds), then the first stage's first forward. No
  collective and no copy: the head is priced 0 (``tests/unit/test_pipeline_ends.py`` checks
  that the split and ``local_block``'s cut of a data-parallel stage's inputs are views).
- **tail**: after the last backward (stage 0's, in GPipe and 1F1B), the loss broadcast: the
  last stage sums its microbatch losses and broadcasts the fp32 scalar over the pipeline
  axis's group, ``collective_time_s("broadcast", 4, pp, pp_link)``. The stages' data-parallel
  gradient reduction, which runs inside each stage's last backward, is the schedule's
  once-per-step ``step_s`` (``ScheduleTime.collectives_s``), not counted here again.

What is not priced (README, "Session 12"): the schedule's Python around the first and last
task and the wake-up of the rank that receives the broadcast; the shared-cores simulation
charges a wait (``DeviceSpec.task_wait_s``) after every task, the last one included, which
stands for that wake-up. The gradient sum of a weight tied across stages (an all-reduce over
the stages holding it) is not priced either.
"""

from __future__ import annotations

from dataclasses import dataclass

from cost_models import LinkSpec, collective_time_s

LOSS_BYTES = 4
"""The broadcast loss: one fp32 scalar (the sum of the last stage's microbatch losses)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineEnds:
    """The priced head and tail of one pipelined step."""

    head_s: float
    tail_s: float
    loss_broadcast_s: float
    """The tail's one term (module docstring)."""


def pipeline_ends(*, num_stages: int, pp_link: LinkSpec) -> PipelineEnds:
    """Head and tail of a step over ``num_stages`` pipeline ranks joined by ``pp_link``."""
    broadcast = collective_time_s("broadcast", LOSS_BYTES, num_stages, pp_link)
    return PipelineEnds(head_s=0.0, tail_s=broadcast, loss_broadcast_s=broadcast)
