"""Pipeline stages on torch.distributed.pipelining: this rank's stages and torch's schedule.

A :class:`PipelineModule` holds this rank's stage(s) (one, or ``virtual_stages`` under an
interleaved schedule), each a :class:`~autopar.runtime.module.ParallelModule` lowered on the
stage's submesh (the ranks with this rank's index along the pipeline axis: tensor, data
parallelism, ZeRO and recomputation inside a stage work as in a one-stage plan), wrapped in
torch's ``PipelineStage`` over the pipeline axis's process group and driven by torch's
``ScheduleGPipe`` / ``Schedule1F1B`` / ``ScheduleInterleaved1F1B`` and the split-backward
schedules ``ScheduleInterleavedZeroBubble`` / ``ScheduleZBVZeroBubble`` / ``ScheduleDualPipeV``
(:data:`SPLIT_BACKWARD`). There is no scheduler here.

A training step is ``loss = pmodel.step(*global_inputs)`` (every rank passes the same GLOBAL
batch; it is cut into ``microbatches`` along dim 0, and each stage takes the model inputs it
consumes, e.g. the tokens in the first stage and the targets in the last), then
``opt.step()``. The gradients it leaves equal one process's on the whole batch:

- each microbatch's loss is the microbatch mean (the captured loss); torch's loss function
  here divides it by the number of microbatches, so the accumulated gradients are those of the
  global mean (``scale_grads=False``: nothing is rescaled afterwards);
- the data-parallel gradient reduction inside a stage runs once per step, on the stage's last
  microbatch backward (the others run under ``ParallelModule.no_sync``); under the
  split-backward schedules every pass runs under ``no_sync`` (the weight passes call
  ``torch.autograd.grad``, which runs no gradient hooks: :mod:`autopar.runtime.pipeline_backward`)
  and the stages' reductions (all-reduce buckets, ZeRO's reduce-scatters) run after the
  schedule, in stage order, before the tied-weight sums. Tensor-parallel collectives inside the
  passes match across a stage's submesh because its ranks run the same schedule on the same
  graph (the tests run with ``AUTOPAR_CHECK_COLLECTIVES=1``, which checks every one);
- a stage's outputs are laid out as the next stage's inputs are planned (the same local block
  travels between the ranks of equal submesh coordinate), and the lowering's mean-over-shards
  convention for sharded outputs is undone, since the next stage returns exact gradients;
- a parameter used by two stages (an embedding tied to the output layer) is a copy in each;
  their gradients are summed over the stages holding it after the schedule.

The returned loss is the global mean over the whole batch on EVERY rank: the last stage sums
its microbatch losses (each already divided by the number of microbatches) and broadcasts the
sum over the pipeline axis's group. Under fp16 mixed precision each microbatch loss is also
multiplied by ``grad_scaler``'s scale before its backward (the returned loss is unscaled).
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.utils._pytree import tree_flatten

from autopar.lowering.local_ops import autopar_scale_grad
from autopar.placement import SectionShard, Shard
from autopar.planner.stages import MULTI_STAGE_SCHEDULES, V_SCHEDULES
from autopar.runtime import p2p_trace
from autopar.runtime.grad_scaler import ShardedGradScaler
from autopar.runtime.materialize import local_block
from autopar.runtime.module import ParallelModule
from autopar.runtime.pipeline_backward import weight_pass
from autopar.runtime.pipeline_tied import TiedWeight, sum_tied_whole

__all__ = ["PipelineModule", "StageModule", "input_key"]

SCHEDULE_CLASSES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved-1f1b": ScheduleInterleaved1F1B,
    "zero-bubble": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}
SPLIT_BACKWARD = ("zero-bubble", "zbv", "dualpipev")
"""Schedules that split each microbatch backward into an input pass and a weight pass."""


def input_key(index: int) -> str:
    """The keyword under which flattened model input ``index`` reaches every stage (the
    schedule's own keywords, ``target`` and ``losses``, cannot clash with it)."""
    return f"autopar_input_{index}"


class StageModule(nn.Module):
    """The module torch's ``PipelineStage`` runs: one stage's ParallelModule taking the previous
    stage's local outputs positionally and the global microbatch's model inputs by keyword.

    Args:
        pmodule: the stage lowered on its submesh.
        model_inputs: flattened model input index of each of the stage's keyword inputs.
        is_last: the stage returns the model's outputs (the loss).
    """

    def __init__(
        self, pmodule: ParallelModule, model_inputs: Sequence[int], *, is_last: bool
    ) -> None:
        super().__init__()
        self.pmodule = pmodule
        self.model_inputs = tuple(model_inputs)
        self.is_last = is_last
        self.plain_outputs = False
        """Return no views (torch's input pass of a split backward detaches the outputs in
        place, which views refuse); set for split-backward schedules."""
        lowered = pmodule.lowered
        # Sharded outputs get the lowering's mean-over-shards gradient convention; the next
        # stage sends exact gradients, so they are scaled back by the number of shards.
        self.output_shards = tuple(
            _num_shards(p, lowered.mesh_shape) for p in lowered.output_placements
        )

    def forward(self, *activations: torch.Tensor, **inputs: torch.Tensor) -> Any:
        lowered = self.pmodule.lowered
        first = len(activations)
        local: dict[str, Any] = {}
        for k, index in enumerate(self.model_inputs):
            value = inputs[input_key(index)]
            placements = lowered.input_placements[first + k]
            if isinstance(value, torch.Tensor) and placements is not None:
                value = local_block(value, placements, lowered.mesh_shape, self.pmodule.coords)
            local[lowered.input_names[first + k]] = value
        out = self.pmodule(*activations, **local)
        if self.is_last:
            return out
        out = tuple(
            autopar_scale_grad(o, float(n)) if n > 1 else o
            for o, n in zip(out, self.output_shards, strict=True)
        )
        if self.plain_outputs:
            out = tuple(o.clone() if o._is_view() else o for o in out)
        return out


def _num_shards(placements: Sequence[Any], mesh_shape: Sequence[int]) -> int:
    count = 1
    for size, p in zip(mesh_shape, placements, strict=True):
        if isinstance(p, (Shard, SectionShard)):
            count *= size
    return count


class _Stage(PipelineStage):
    """torch's PipelineStage; all but a stage's last microbatch backward skip the gradient
    reduction of its ParallelModule (as torch does for DDP), so it runs once per step.

    ``busy_s`` adds up the wall seconds of its microbatch forwards and backwards (the work the
    schedule runs between its point-to-point waits): :attr:`PipelineModule.busy_s`."""

    busy_s: float = 0.0
    recomputes: bool = False
    """The stage's graph recomputes checkpointed segments: its weight pass replays (one
    autograd call, one recomputation; :mod:`autopar.runtime.pipeline_backward`)."""
    defer_reduction: bool = False
    """Every backward pass runs under ``no_sync``; :meth:`PipelineModule.step` reduces the
    accumulated gradients after the schedule (split-backward schedules)."""

    @contextlib.contextmanager
    def _busy(self) -> Iterator[None]:
        """Adds the wall seconds of the block to :attr:`busy_s`."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.busy_s += time.perf_counter() - start

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        with self._busy():
            return super().forward_one_chunk(*args, **kwargs)

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        with self._busy():
            return super().backward_one_chunk(*args, **kwargs)

    def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        with self._busy():
            return super().backward_weight_one_chunk(*args, **kwargs)

    def backward_maybe_with_nosync(
        self, backward_type: Any, bwd_kwargs: dict, last_backward: bool = False
    ) -> Any:
        sync = last_backward and not self.defer_reduction
        context = contextlib.nullcontext() if sync else self.submod.pmodule.no_sync()
        with context:
            if backward_type == "weight":  # ZeRO's chunks whole, the input pass not replayed
                weight_pass(
                    self.submod.parameters(), bwd_kwargs["param_groups"], replay=self.recomputes
                )
                return (), None
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)


class PipelineModule(nn.Module):
    """This rank's pipeline stages and the schedule that runs them (module docstring).

    Args:
        stages: this rank's stages as ``(stage index, StageModule)``, in stage order.
        num_stages: stages in the whole pipeline.
        pp_group: the pipeline axis's process group of this rank (the loss's broadcast).
        p2p_group: a group of the same ranks for the stages' sends and receives.
        last_pp_rank: group rank (along the pipeline axis) holding the last stage.
        schedule: a name of :data:`SCHEDULE_CLASSES`.
        microbatches: microbatches per step.
        num_inputs: flattened model inputs of one step.
        shared: per parameter used by several stages, its ``pipeline_tied.TiedWeight``: the
            FQN, the process group over which its gradient is summed (None when all its
            copies are on this rank), and whether its copies' layouts differ (summed whole).
        device: where the stages run.
        training: the mode the stages' graphs were captured in (the module starts in it).
    """

    def __init__(
        self,
        stages: Sequence[tuple[int, StageModule]],
        *,
        num_stages: int,
        pp_group: Any,
        p2p_group: Any,
        last_pp_rank: int,
        schedule: str,
        microbatches: int,
        num_inputs: int,
        shared: Sequence[TiedWeight] = (),
        device: torch.device,
        training: bool = True,
    ) -> None:
        super().__init__()
        self.stage_modules = nn.ModuleList(module for _, module in stages)
        self.stage_indices = tuple(index for index, _ in stages)
        self.microbatches = microbatches
        self.num_inputs = num_inputs
        self.pp_group = pp_group
        self.last_pp_rank = last_pp_rank
        self.shared = tuple(shared)
        self.plan: Any = None
        """The stage plans (one Plan per stage of this rank) and the PipelinePlan."""
        self.pipeline: Any = None
        self.grad_scaler = ShardedGradScaler(
            [dist.group.WORLD],
            enabled=any(module.pmodule.grad_scaler.is_enabled() for _, module in stages),
        )
        """fp16 loss scaling over every rank of every stage (all agree to skip a step): each
        microbatch loss is scaled before its backward, :meth:`step` returns the loss unscaled;
        then ``pmodel.grad_scaler.step(opt)`` and ``.update()``. A pass-through in fp32 / bf16."""
        pipeline_stages = [
            _Stage(module, index, num_stages, device, group=p2p_group) for index, module in stages
        ]
        self._defer_reduction = schedule in SPLIT_BACKWARD
        for stage in pipeline_stages:
            stage.defer_reduction = self._defer_reduction
            stage.submod.plain_outputs = self._defer_reduction
            stage.recomputes = bool(stage.submod.pmodule.plan.checkpoint_segments())
        self._stages = pipeline_stages
        if (trace := p2p_trace.trace_directory()) is not None:  # a diagnostic, off by default
            p2p_trace.install(trace, dist.get_rank())
        self.busy_s = 0.0
        """Wall seconds this rank spent in its stages' microbatch forwards and backwards during
        the last :meth:`step` (the schedule's waits for sends and receives, the loss broadcast
        and the tied-weight gradient sum excluded): ``1 - busy_s / step seconds`` is this
        rank's measured bubble (``benchmarks/pipeline_cost_check.py``)."""
        cls = SCHEDULE_CLASSES[schedule]
        self._schedule_name = schedule
        try:
            self.schedule = cls(
                pipeline_stages if schedule in MULTI_STAGE_SCHEDULES else pipeline_stages[0],
                microbatches,
                loss_fn=self._microbatch_loss,
                scale_grads=False,
            )
        except ValueError as error:
            reason = " ".join(str(error).split())
            raise ValueError(
                f"torch's {cls.__name__} refuses {microbatches} microbatches on {num_stages} "
                f"stages: {reason}; choose another microbatch count or schedule"
            ) from None
        self._has_last = any(module.is_last for module in self.stage_modules)
        self.prepare_mode: Any = None
        """``prepare_mode(training)``: lower this rank's stages for the other train/eval mode
        (a collective over every rank; set by ``autoparallelize``), called by :meth:`step` the
        first time it runs in a mode."""
        self._prepared_modes = {training}
        self.train(training)

    def _microbatch_loss(self, output: torch.Tensor, target: Any) -> torch.Tensor:
        # Microbatch means of equal microbatches: their mean is the global mean.
        return self.grad_scaler.scale(output / self.microbatches)

    def train(self, mode: bool = True) -> PipelineModule:
        """Switch train/eval mode (eval: forward-only :meth:`step`). Refused for the V-shaped
        schedules, whose torch 2.13 eval path hands a backward input between the two stages
        of a rank even without backward."""
        if not mode and self._schedule_name in V_SCHEDULES:
            raise ValueError(
                f"eval mode does not run under schedule {self._schedule_name!r} (torch 2.13's "
                f"V-shaped schedules fail without backward); evaluate with another schedule"
            )
        return super().train(mode)

    @property
    def pmodules(self) -> list[ParallelModule]:
        """This rank's stages as ParallelModules (original FQNs, local shards)."""
        return [module.pmodule for module in self.stage_modules]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """In eval mode, the forward-only pass of :meth:`step` (the global mean loss on every
        rank); a training step is ``pmodel.step``."""
        if self.training:
            raise RuntimeError(
                "a pipelined module trains with pmodel.step(*global_inputs) (forward and "
                "backward of the whole schedule, returns the loss); call pmodel.eval() first for "
                "a forward-only pass"
            )
        return self.step(*args, **kwargs)

    def step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """One forward and backward of the GLOBAL batch ``(args, kwargs)`` (the same on every
        rank) under the schedule; returns the global mean loss (detached) on every rank and
        leaves the gradients in the parameters. In eval mode (``pmodel.eval()``), forward
        only: the stages' eval-mode graphs, the global mean loss on every rank, no gradients."""
        leaves, _ = tree_flatten((args, kwargs))
        if len(leaves) != self.num_inputs:
            raise ValueError(
                f"the model was captured with {self.num_inputs} input leaves (args and kwargs "
                f"flattened) but step() got {len(leaves)}; pass the global batch as in the "
                f"example inputs"
            )
        inputs = {}
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                if leaf.ndim == 0 or leaf.shape[0] % self.microbatches:
                    raise ValueError(
                        f"input {i} has shape {tuple(leaf.shape)}: its batch dim (0) does not "
                        f"split into {self.microbatches} microbatches"
                    )
                inputs[input_key(i)] = leaf
        losses: list[torch.Tensor] = []
        target = torch.zeros(self.microbatches)
        for stage in self._stages:
            stage.busy_s = 0.0
        if self.training not in self._prepared_modes:
            if self.prepare_mode is None:
                raise RuntimeError("this pipelined module cannot switch train/eval mode")
            self.prepare_mode(self.training)
            self._prepared_modes.add(self.training)
        if not self.training:
            # Forward only (torch's schedules skip their backward actions): the stages' graphs
            # of eval mode, no gradients, no reductions.
            with torch.no_grad():
                self.schedule.eval(target=target, losses=losses, return_outputs=False, **inputs)
            self.busy_s = sum(stage.busy_s for stage in self._stages)
            return self._broadcast_loss(losses)
        self.schedule.step(target=target, losses=losses, return_outputs=False, **inputs)
        self.busy_s = sum(stage.busy_s for stage in self._stages)
        if self._defer_reduction:
            # The weight passes (torch.autograd.grad on the parameters' gradient accumulators)
            # run no gradient hooks: reduce the gradients every pass accumulated, once per step,
            # in stage order (the same on every rank of a stage's submesh).
            for pmodule in self.pmodules:
                pmodule.reduce_accumulated_grads()
        self._sum_shared_grads()
        return self._broadcast_loss(losses)

    def _broadcast_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The sum of the last stage's microbatch losses (each already divided by the number
        of microbatches), sent over the pipeline axis's group: the global mean on every rank."""
        if self._has_last:
            loss = torch.stack([x.detach() for x in losses]).sum() / self.grad_scaler.get_scale()
        else:
            loss = torch.zeros((), dtype=torch.float32)
        device = next(iter(self.parameters())).device
        loss = loss.to(device)
        dist.broadcast(loss, group=self.pp_group, group_src=self.last_pp_rank)
        return loss

    def _sum_shared_grads(self) -> None:
        for fqn, group, whole in self.shared:
            copies = [
                (pmodule, named[fqn])
                for pmodule in self.pmodules
                if fqn in (named := dict(pmodule.named_parameters(remove_duplicate=False)))
            ]
            if not copies:
                continue
            if whole:
                sum_tied_whole(fqn, copies, group)
                continue
            copies = [p for _, p in copies]
            # Under ZeRO the copies are shards holding the same elements (parallelize_pipeline).
            total = torch.zeros_like(copies[0])
            for p in copies:
                if p.grad is not None:
                    total += p.grad
            if group is not None:
                dist.all_reduce(total, group=group)
            for p in copies:
                if p.grad is not None:  # in place: ZeRO's .grad views its gradient buffer
                    p.grad.copy_(total)
                elif p.numel():  # an empty ZeRO slot has no gradient on this rank
                    p.grad = total.clone()

    def state_dict(self, *args: Any, sharded: bool = False, **kwargs: Any) -> Any:
        """This rank's stages' state under the original FQNs: full tensors (gathered over the
        stage's submesh; a collective over it), or with ``sharded=True`` DTensors of this
        rank's shards for ``torch.distributed.checkpoint`` (which saves every stage's keys and
        loads them into any stage count)."""
        if args:
            raise TypeError("PipelineModule.state_dict takes keyword arguments only")
        out: OrderedDict[str, Any] = OrderedDict()
        for pmodule in self.pmodules:
            out.update(pmodule.state_dict(sharded=sharded, **kwargs))
        return out

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load full tensors or the sharded form (as ``ParallelModule.load_state_dict``); each
        stage takes its own keys, and with ``strict`` every key must belong to some stage of
        this rank or be one it does not own (a checkpoint of the whole model loads into any
        stage)."""
        for pmodule in self.pmodules:
            own = dict(pmodule._named_state())
            pmodule.load_state_dict(
                {k: v for k, v in state_dict.items() if k in own}, strict=strict
            )
        return None
