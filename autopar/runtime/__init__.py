"""autopar's runtime: process groups per mesh axis and autograd-aware collectives.

ZeRO chunks and ParallelModule live in their own modules of this package (``zero``, ``module``)
and are imported from there.
"""

from __future__ import annotations

from autopar.comm.collectives import (
    GradAllReduce,
    all_gather,
    all_reduce,
    all_to_all,
    apply_step,
    grad_all_reduce,
    local_slice,
    reduce_scatter,
    run_steps,
    zero_out,
)
from autopar.comm.process_groups import (
    AxisGroups,
    axis_groups,
    lookup_axis_group,
    lookup_axis_groups,
    register_axis_groups,
)

__all__ = [
    "AxisGroups",
    "GradAllReduce",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "apply_step",
    "axis_groups",
    "grad_all_reduce",
    "local_slice",
    "lookup_axis_group",
    "lookup_axis_groups",
    "reduce_scatter",
    "register_axis_groups",
    "run_steps",
    "zero_out",
]
