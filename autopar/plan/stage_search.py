"""From a captured model and the user's pipeline options to the stage planner's search.

``autopar.plan(..., devices=64, per_node=8)`` and ``autopar plan MODEL --devices 64
--per-node 8`` search every ``pp x dp x tp`` factorisation; with a mesh, stages are searched
on its axis named ``pp`` (or, when ``stages``/``microbatches``/``schedule`` are given, its
outermost axis). This module checks those options (one-line errors), finds the model's stack of
blocks, and runs :class:`autopar.planner.pipeline.StagePlanner`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from autopar.capture.export import Captured
from autopar.mesh import Mesh, default_links
from autopar.options import PlanOptions
from autopar.planner.driver import memory_budget_bytes
from autopar.planner.pipeline import MeshShape, SearchResult, StageModel, StagePlanner, mesh_shapes
from autopar.planner.pipeline_schedule import PIPELINE_SCHEDULES
from autopar.planner.tying import stack_blocks


@dataclass(frozen=True, kw_only=True, slots=True)
class StageOptions:
    """What the user fixed of the pipeline (None: searched)."""

    devices: int | None = None
    per_node: int = 8
    stages: int | None = None
    microbatches: int | None = None
    schedule: str | None = None

    @property
    def wanted(self) -> bool:
        return any(
            x is not None for x in (self.devices, self.stages, self.microbatches, self.schedule)
        )


def model_stack(captured: Captured) -> tuple[str, int]:
    """The stack of repeated blocks (module path, number of blocks); ("", 0) when none."""
    counts = {stack: max(blocks) + 1 for stack, blocks in stack_blocks(captured.gm).items()}
    if not counts:
        return "", 0
    stack = max(counts, key=lambda k: counts[k])
    return stack, counts[stack]


def global_batch(captured: Captured) -> int:
    values = {n.name: n.meta.get("val") for n in captured.gm.graph.nodes if n.op == "placeholder"}
    sizes = {
        values[name].shape[0]
        for name in captured.input_nodes
        if isinstance(values.get(name), torch.Tensor) and values[name].dim() >= 1
    }
    if len(sizes) != 1:
        raise ValueError(
            f"pipeline microbatches split the inputs along dim 0, but the inputs' first dims "
            f"are {sorted(sizes) or 'absent'}: give inputs that share one batch dim"
        )
    return sizes.pop()


def check_stage_options(stage: StageOptions, *, batch: int, num_blocks: int, stack: str) -> None:
    """One-line errors for pipeline options that cannot work on this model."""
    if stage.schedule is not None and stage.schedule not in PIPELINE_SCHEDULES:
        raise ValueError(
            f"unknown schedule {stage.schedule!r}; choose from {', '.join(PIPELINE_SCHEDULES)}"
        )
    if stage.microbatches is not None and (stage.microbatches < 1 or batch % stage.microbatches):
        raise ValueError(
            f"{stage.microbatches} microbatches do not divide the global batch of {batch}: "
            f"choose a divisor of {batch}"
        )
    if (
        stage.schedule == "1f1b"
        and None not in (stage.microbatches, stage.stages)
        and stage.microbatches < stage.stages  # type: ignore[operator]
    ):
        raise ValueError(
            f"1f1b with {stage.microbatches} microbatches on {stage.stages} stages: torch's "
            f"Schedule1F1B needs at least as many microbatches as stages; use gpipe or "
            f"{stage.stages} or more microbatches"
        )
    if stage.stages is not None and stage.stages < 1:
        raise ValueError(f"stages must be >= 1, got {stage.stages}")
    if stage.stages is not None and stage.stages > 1:
        if num_blocks == 0:
            raise ValueError(
                "the model has no stack of repeated blocks (module paths like layers.0 or h.0): "
                "pipeline stages cut only between blocks; use --stages 1"
            )
        if num_blocks == 1:
            raise ValueError(
                f"the model has one block ({stack}.0): pipeline stages cut only between blocks, "
                f"so there is nothing to split; use --stages 1"
            )
        if stage.stages > num_blocks:
            raise ValueError(
                f"{stage.stages} pipeline stages for a stack of {num_blocks} blocks ({stack}): "
                f"a stage needs at least one block; use at most {num_blocks} stages"
            )


def fixed_mesh_shapes(
    mesh: Mesh, stages: int | None, num_blocks: int
) -> tuple[list[MeshShape], int]:
    """``pp x dp x tp`` shapes of a given mesh: stages on its ``pp`` axis (else the outermost),
    ``tp`` its axis named ``tp`` (else the innermost, when the mesh has more than one axis), the
    rest data parallel; a stage count dividing the pipeline axis leaves the remainder to ``dp``.
    Returns the shapes and the tensor-parallel size (megatron-3d's)."""
    names = mesh.axis_names
    pp_axis = names.index("pp") if "pp" in names else 0
    others = [a for a in range(mesh.ndim) if a != pp_axis]
    tp_axis = (names.index("tp") if "tp" in names else others[-1]) if others else None
    tp = mesh.shape[tp_axis] if tp_axis is not None else 1
    dp_axes = [a for a in others if a != tp_axis]
    dp = math.prod(mesh.shape[a] for a in dp_axes)
    dp_link = min(
        (mesh.links[a] for a in dp_axes),
        key=lambda link: link.bandwidth_Bps,
        default=mesh.links[pp_axis],
    )
    size = mesh.shape[pp_axis]
    counts = [stages] if stages is not None else [p for p in range(1, size + 1) if size % p == 0]
    out = []
    for p in counts:
        if size % p:
            raise ValueError(
                f"{p} stages do not divide the mesh's pipeline axis {names[pp_axis]} of size {size}"
            )
        if p > max(num_blocks, 1):
            continue
        out.append(
            MeshShape(
                pp=p,
                dp=dp * (size // p),
                tp=tp,
                pp_link=mesh.links[pp_axis],
                dp_link=dp_link
                if p == size
                else min(dp_link, mesh.links[pp_axis], key=lambda link: link.bandwidth_Bps),
                tp_link=mesh.links[tp_axis] if tp_axis is not None else mesh.links[pp_axis],
            )
        )
    return out, tp


def search_stages(
    captured: Captured,
    probe: Callable[[int], Captured],
    *,
    model_name: str,
    mesh: Mesh | None,
    stage: StageOptions,
    options: PlanOptions,
    device: str = "h100",
    progress: Callable[[str], None] | None = None,
) -> tuple[SearchResult, StageModel, Mesh]:
    """Run the stage planner; returns its result, the model as it saw it, and a reference mesh
    (the given one, or one of the right device for ``devices``).

    Raises:
        ValueError: bad pipeline options (see :func:`check_stage_options`) or nothing fits.
    """
    stack, num_blocks = model_stack(captured)
    batch = global_batch(captured)
    check_stage_options(stage, batch=batch, num_blocks=num_blocks, stack=stack)
    if mesh is None:
        if stage.devices is None:
            raise ValueError("give a mesh or a number of devices to plan pipeline stages on")
        mesh = Mesh.spec((1,), ("dp",), device=device)
        intra = default_links(1, mesh.device)[0]
        inter = default_links(2, mesh.device)[0]
        shapes = mesh_shapes(
            stage.devices, stage.per_node, max(num_blocks, 1), intra=intra, inter=inter
        )
        if stage.stages is not None:
            shapes = [s for s in shapes if s.pp == stage.stages]
        megatron_tp = max(s.tp for s in shapes) if shapes else None
    else:
        shapes, megatron_tp = fixed_mesh_shapes(mesh, stage.stages, num_blocks)
    if num_blocks == 0:
        shapes = [s for s in shapes if s.pp == 1]
    if not shapes:
        raise ValueError(f"no pipeline x data x tensor mesh of {stage.devices} devices to search")
    fqns = tuple(captured.param_nodes[n] for n in captured.param_nodes)
    model = StageModel(
        name=model_name,
        batch=batch,
        probe=probe,
        num_blocks=max(num_blocks, 1),
        stack=stack,
        param_fqns=fqns,
    )
    planner = StagePlanner(
        model,
        options=options,
        budget=memory_budget_bytes(mesh, options),
        device=mesh.device,
        progress=progress,
    )
    schedules = PIPELINE_SCHEDULES if stage.schedule is None else (stage.schedule,)
    result = planner.search(
        shapes, microbatches=stage.microbatches, schedules=schedules, megatron_tp=megatron_tp
    )
    return result, model, mesh


def slice_inputs(value, size: int):
    """The first ``size`` rows of every tensor of ``value`` (a microbatch of the inputs)."""
    return torch.utils._pytree.tree_map(
        lambda x: x[:size] if isinstance(x, torch.Tensor) and x.dim() >= 1 else x, value
    )
