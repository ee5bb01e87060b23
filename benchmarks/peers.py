"""The variants of benchmarks/like_for_like.py: autopar's recipes and the PyTorch setups that
shard the same tensors the same way, each built on this rank and returned as a ``Variant``.

Every variant starts from the same GPT (``common.build_model``, seed 0), takes the GLOBAL batch
in its step and returns the global mean loss, so two sides of a pair can be compared step by
step. Torch's side of each pair:

* ``torch DDP``: DistributedDataParallel, batch split over every rank;
* ``DTensor TP (vocab)``: ``parallelize_module`` with Megatron's layout on the whole model:
  vocab-parallel token embedding (RowwiseParallel, Shard(0) of the table), column-parallel
  qkv and fc, row-parallel attention and MLP projections, a column-parallel (vocab-sharded)
  tied LM head whose logits stay a DTensor sharded over the vocabulary, and the cross entropy
  under ``loss_parallel``: the tensors autopar's ``megatron`` recipe shards;
* ``FSDP2``: ``fully_shard`` per block and at the root (reshard after forward);
* ``DDP + ZeroRedundancyOptimizer``: DDP with the optimizer state sharded over the ranks;
* ``FSDP2 + DTensor TP`` (2x2): the TP layout above on the inner axis, ``fully_shard`` on the
  outer one, batch split over the outer axis;
* ``DDP + checkpoint``: DDP with every block's forward under ``torch.utils.checkpoint``
  (non-reentrant), as autopar's ``checkpoint="all"`` recomputes every block.
"""

from __future__ import annotations

import argparse
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from common import batch_for, build_model
from runtime_vs_torch import _local_heads_attention


@dataclass(slots=True)
class Variant:
    """One side of a pair on this rank: its step on the global batch and its module."""

    step: Callable[[Any, Any], float]
    module: Any
    note: str = ""
    held_kib: float = 0.0
    """Resident memory kept after set-up and warm-up (filled by the benchmark)."""


def _optimizer(params: Any, name: str, lr: float) -> Any:
    import torch

    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    return torch.optim.SGD(params, lr=lr)


def _scalar(loss: Any) -> Any:
    return loss.to_local() if hasattr(loss, "to_local") else loss


def _dp_step(model: Any, opt: Any, dp_rank: int, dp_size: int, *, context: Any = None) -> Any:
    """Step on this data-parallel rank's share of the global batch (its mean loss: DDP and
    FSDP average gradients over the data-parallel ranks, so this is the global-mean step);
    returns the global mean loss (one scalar all-reduce over every rank)."""
    import contextlib

    import torch
    import torch.distributed as dist

    def step(idx: Any, targets: Any) -> float:
        local = idx.shape[0] // dp_size
        part = slice(dp_rank * local, (dp_rank + 1) * local)
        with context() if context else contextlib.nullcontext():
            loss = model(idx[part], targets[part])
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = _scalar(loss).detach().reshape(1).to(torch.float64)
        dist.all_reduce(total)
        # Every rank holds its data-parallel group's loss: the sum over all ranks counts each
        # data-parallel loss world/dp_size times.
        return float(total.item()) / dist.get_world_size()

    return step


def torch_ddp(args: argparse.Namespace, mesh: Any, optimizer: str, *, recompute: bool) -> Variant:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.checkpoint import checkpoint

    from autopar.models import GPTBlock

    model = build_model(args)
    if recompute:

        def forward(self: Any, x: Any) -> Any:
            return checkpoint(GPTBlock.forward, self, x, use_reentrant=False)

        for block in model.blocks:
            block.forward = types.MethodType(forward, block)
    model = DistributedDataParallel(model)
    opt = _optimizer(model.parameters(), optimizer, args.lr)
    return Variant(_dp_step(model, opt, dist.get_rank(), dist.get_world_size()), model)


def torch_zero1(args: argparse.Namespace, mesh: Any, optimizer: str) -> Variant:
    import torch
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(build_model(args))
    if optimizer == "adamw":
        kwargs = {"optimizer_class": torch.optim.AdamW, "weight_decay": 0.01}
    else:
        kwargs = {"optimizer_class": torch.optim.SGD}
    opt = ZeroRedundancyOptimizer(model.parameters(), lr=args.lr, **kwargs)
    return Variant(_dp_step(model, opt, dist.get_rank(), dist.get_world_size()), model)


def torch_fsdp2(args: argparse.Namespace, mesh: Any, optimizer: str) -> Variant:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = build_model(args)
    device_mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=device_mesh)
    fully_shard(model, mesh=device_mesh)
    opt = _optimizer(model.parameters(), optimizer, args.lr)
    return Variant(_dp_step(model, opt, dist.get_rank(), dist.get_world_size()), model)


def _megatron_tp(model: Any, tp_mesh: Any, tp_rank: int) -> None:
    """Megatron's layout on ``model`` over the 1-D DeviceMesh ``tp_mesh``, vocab-parallel
    embedding and head included; the tied head re-tied to the sharded table."""
    import torch
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    size = tp_mesh.size()
    width = model.config.n_embd
    part = width // size
    # Megatron's fused-qkv layout: rank r's rows are the q, k and v rows of its heads.
    order = torch.cat(
        [
            torch.arange(which * width + r * part, which * width + (r + 1) * part)
            for r in range(size)
            for which in range(3)
        ]
    )
    plan = {
        "wte": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    for i, block in enumerate(model.blocks):
        with torch.no_grad():
            block.attn.qkv.weight.copy_(block.attn.qkv.weight[order])
            block.attn.qkv.bias.copy_(block.attn.qkv.bias[order])
        block.attn.forward = types.MethodType(_local_heads_attention, block.attn)
        plan |= {
            f"blocks.{i}.attn.qkv": ColwiseParallel(),
            f"blocks.{i}.attn.proj": RowwiseParallel(),
            f"blocks.{i}.mlp.fc": ColwiseParallel(),
            f"blocks.{i}.mlp.proj": RowwiseParallel(),
        }
    tied = model.lm_head.weight is model.wte.weight
    parallelize_module(model, tp_mesh, plan)
    if tied:
        model.lm_head.weight = model.wte.weight
    del tp_rank


def torch_tp(args: argparse.Namespace, mesh: Any, optimizer: str) -> Variant:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    model = build_model(args)
    tp_mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    _megatron_tp(model, tp_mesh, dist.get_rank())
    opt = _optimizer(model.parameters(), optimizer, args.lr)
    return Variant(_dp_step(model, opt, 0, 1, context=loss_parallel), model)


def torch_fsdp_tp(args: argparse.Namespace, mesh: Any, optimizer: str) -> Variant:
    """FSDP2 over the outer axis of a 2-D mesh, DTensor TP (vocab-parallel) over the inner."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import loss_parallel

    model = build_model(args)
    device_mesh = init_device_mesh("cpu", tuple(mesh.shape), mesh_dim_names=("dp", "tp"))
    _megatron_tp(model, device_mesh["tp"], device_mesh.get_local_rank("tp"))
    for block in model.blocks:
        fully_shard(block, mesh=device_mesh["dp"])
    fully_shard(model, mesh=device_mesh["dp"])
    opt = _optimizer(model.parameters(), optimizer, args.lr)
    dp_rank, dp_size = device_mesh.get_local_rank("dp"), device_mesh["dp"].size()
    return Variant(_dp_step(model, opt, dp_rank, dp_size, context=loss_parallel), model)


def _planned_chunk_bytes(plan: dict[str, Any], model: Any, mesh: Any, zero: Any) -> int:
    """The chunk size the planner gives a plan of this ZeRO configuration
    (``autopar.plan.build``; the ``ddp`` recipe's plan has none, its stage being 0): priced on
    the mesh's links, the plan's compute split 1:2 between forward and backward (the planner
    has the per-node split; the plan document keeps the sum), its budget's headroom."""
    from autopar.planner.chunks import ChunkPricing, planned_chunk_bytes

    compute = plan["predicted"]["breakdown"]["compute_s"]
    pricing = ChunkPricing.on_mesh(
        shape=mesh.shape,
        links=mesh.links,
        device=mesh.device,
        stages=zero.stages,
        forward_s=compute / 3,
        backward_s=2 * compute / 3,
    )
    headroom = plan["memory_budget_bytes"] - plan["predicted"]["peak_memory_bytes"]
    numels = [p.numel() for p in model.parameters()]
    return planned_chunk_bytes(
        numels, pricing, max_stage=max(zero.stages), headroom_bytes=headroom
    )[0]


def autopar_variant(
    args: argparse.Namespace, mesh: Any, optimizer: str, *, recipe: str, **options: Any
) -> Variant:
    """autoparallelize(recipe=...), or the ``ddp`` recipe's plan with ZeRO stage ``stage``."""
    import torch.distributed as dist

    import autopar
    from autopar.planner.problem import ZeroConfig

    model = build_model(args)
    batch = batch_for(0, args)
    stage = options.pop("stage", None)
    plan = None
    if stage is not None and dist.get_rank() == 0:
        plan = autopar.plan(model, mesh, batch, recipe=recipe, optimizer=optimizer)
        zero = ZeroConfig(stages=(stage,) * len(mesh.shape))
        plan.data["zero"] = {
            **plan.data["zero"],
            **zero.to_json(mesh.axis_names),
            "chunk_bytes": getattr(args, "chunk_bytes", None)
            or _planned_chunk_bytes(plan.data, model, mesh, zero),
        }
    pmodel = autopar.autoparallelize(
        model,
        mesh,
        batch,
        plan=plan,
        recipe=recipe,
        optimizer=optimizer,
        price_baselines=False,
        **options,
    )
    del model
    opt = _optimizer(pmodel.parameters(), optimizer, args.lr)

    def step(idx: Any, targets: Any) -> float:
        loss = pmodel(*pmodel.shard_inputs(idx, targets))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.item())

    segments = len(pmodel.plan.data.get("checkpoint", {}).get("segments", []))
    note = f"zero {pmodel.plan.data['zero'].get('stages')}, {segments} checkpoint segments"
    return Variant(step, pmodel, note)


@dataclass(frozen=True, slots=True)
class Pair:
    """autopar's variant and its peer, the meshes they run on and their optimizer."""

    autopar: Callable[[argparse.Namespace, Any, str], Variant]
    peer: Callable[[argparse.Namespace, Any, str], Variant]
    peer_name: str
    meshes: tuple[str, ...]
    optimizer: str


def _auto(recipe: str, **options: Any) -> Callable[[argparse.Namespace, Any, str], Variant]:
    return lambda args, mesh, opt: autopar_variant(args, mesh, opt, recipe=recipe, **options)


PAIRS: dict[str, Pair] = {
    "ddp": Pair(
        _auto("ddp"),
        lambda a, m, o: torch_ddp(a, m, o, recompute=False),
        "torch DDP",
        ("2", "4"),
        "sgd",
    ),
    "megatron": Pair(_auto("megatron"), torch_tp, "DTensor TP (vocab)", ("2", "4"), "sgd"),
    "fsdp": Pair(_auto("fsdp"), torch_fsdp2, "FSDP2", ("2", "4"), "adamw"),
    "zero1": Pair(
        _auto("ddp", stage=1), torch_zero1, "DDP + ZeroRedundancyOptimizer", ("2", "4"), "adamw"
    ),
    "recompute": Pair(
        _auto("ddp", checkpoint="all"),
        lambda a, m, o: torch_ddp(a, m, o, recompute=True),
        "DDP + checkpoint",
        ("2", "4"),
        "sgd",
    ),
    "fsdp+tp": Pair(_auto("fsdp+tp"), torch_fsdp_tp, "FSDP2 + DTensor TP", ("2x2",), "adamw"),
}
"""Pairs by name; autopar's side is called ``autopar <name>``."""
