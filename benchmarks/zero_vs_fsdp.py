"""autopar's ZeRO stages against PyTorch's DDP, ZeroRedundancyOptimizer and FSDP2, on 4 gloo
ranks (CPU), in one run.

    python benchmarks/zero_vs_fsdp.py                        # the default run (about 3 min)
    python benchmarks/zero_vs_fsdp.py --steps 10 --n-embd 384

Same GPT (autopar.models.GPT, fixed seed), same global batch split 4 ways, same AdamW step, each
variant in turn on the same 4 ranks (pure data parallelism; a mesh of 4, or 2x2 for the last
pair), paired as:

==========================  ===================================================================
autopar stage 0             torch DDP (DistributedDataParallel)
autopar stage 1             torch DDP + torch.distributed.optim.ZeroRedundancyOptimizer
autopar stage 2             FSDP2 ``fully_shard(reshard_after_forward=False)`` (NOT like for
                            like: FSDP2 keeps gathered parameters from forward to backward but
                            still shards them between steps, so it holds 1/N parameters at
                            rest; ZeRO-2 keeps the full parameters all the time and gathers
                            nothing in forward)
autopar stage 3             FSDP2 ``fully_shard`` (default: reshard after forward), per block
                            and at the root
autopar stages 2x3          FSDP2 HSDP 2x2: ``fully_shard`` on a 2-D DeviceMesh (replicate over
(2x2: stage 2 outer,        the outer axis, shard over the inner one), resharding after forward
3 inner)                    (NOT like for like: ZeRO-2 on the outer axis also shards gradients
                            and optimizer state over it, 4 ways in all; HSDP keeps them 2-way
                            sharded, replicated over the outer axis)
==========================  ===================================================================

autopar's stages 1-3 run the ``ddp`` recipe's plan (batch split, parameters Replicate) with the
plan's ``zero`` entry set to the stage per mesh axis (``ZeroConfig.to_json``); ``chunk_bytes`` is the runtime's own
choice (``--chunk search``: the padding search, capped at 1/8 of the parameters) or
one transformer block (``--chunk block``, FSDP2's wrapping unit here) or a byte count. Each
variant runs in a fresh spawn of the 4 ranks (after a throwaway warm-up step), so memory
figures do not depend on the order of the variants, and every spawn first runs one
step of a tiny GPT under DDP, FSDP2 and autopar (``common.warm_up``) so that one-time
costs (imports of torch.export and DTensor, gloo and allocator set-up) land on no variant.

Step time: per step, every rank waits at a barrier, then times forward + backward + optimizer
step; a step's time is the slowest rank's; the figure is the median over the timed steps after
warm-up. Memory, two figures per variant, largest over ranks:

* ``state MiB``: bytes of the distinct live storages of parameters (autopar: the shard
  parameters, whose storage is the chunk buffer in stages 1-2; DTensor: local shards),
  gradients and optimizer state after the last step (what the stages shard; DDP's gradient
  buckets and FSDP2's transient all-gather buffers are not parameters and are not counted);
* ``peak MiB``: peak resident set size during the steps (Linux VmHWM, reset through
  /proc/self/clear_refs after setup and a ``gc.collect()``) over the resident size at the
  variant's start (MALLOC_MMAP_THRESHOLD_=64 KiB so it follows tensor allocations): state plus
  activations and communication buffers. Without the collection, the autopar variants' peak
  included the dropped user model (about one model of parameters, left in reference cycles of
  the capture until Python's cycle collector runs), which is set-up garbage, not the step's.

"loss err" is the largest difference between the variant's losses and one process's.

Prints a rich table and writes benchmarks/out/zero_vs_fsdp.png and .json.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    WORLD_SIZE,
    Rows,
    add_model_options,
    batch_for,
    build_model,
    gloo_rank,
    local_tensor,
    memory_kib,
    plot_bars,
    ratio,
    reset_peak,
    spawn_ranks,
    table,
    timed_steps,
    warm_up,
    write_outputs,
)

VARIANTS = (
    "torch DDP",
    "autopar stage 0",
    "DDP + ZeroRedundancyOptimizer",
    "autopar stage 1",
    "FSDP2 no reshard",
    "autopar stage 2",
    "FSDP2",
    "autopar stage 3",
    "FSDP2 HSDP 2x2",
    "autopar stages 2x3",
)
PEERS = {
    "autopar stage 0": "torch DDP",
    "autopar stage 1": "DDP + ZeroRedundancyOptimizer",
    "autopar stage 2": "FSDP2 no reshard",
    "autopar stage 3": "FSDP2",
    "autopar stages 2x3": "FSDP2 HSDP 2x2",
}
HSDP = ("FSDP2 HSDP 2x2", "autopar stages 2x3")
"""Variants on a 2x2 mesh (outer, inner); the others run on a mesh of 4."""


def _adamw(params: Any, args: argparse.Namespace) -> Any:
    import torch

    return torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)


def _local_step(model: Any, opt: Any, rank: int) -> Any:
    """Step on this rank's quarter of the global batch (each rank's mean loss: DDP / FSDP
    average gradients, so this is the global-mean-loss step); returns the global mean loss."""
    import torch
    import torch.distributed as dist

    def step(idx: Any, targets: Any) -> float:
        local = idx.shape[0] // WORLD_SIZE
        part = slice(rank * local, (rank + 1) * local)
        loss = model(idx[part], targets[part])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        total = loss.detach().reshape(1).clone()
        dist.all_reduce(total)
        return float(total.item()) / WORLD_SIZE

    del torch
    return step


def torch_ddp(args: argparse.Namespace, rank: int, mesh: Any, zero_optim: bool) -> Any:
    import torch
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(build_model(args))
    if zero_optim:
        opt = ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.AdamW, lr=args.lr, weight_decay=0.01
        )
        state = lambda: opt.optim.state  # noqa: E731 - this rank's partition
    else:
        opt = _adamw(model.parameters(), args)
        state = lambda: opt.state  # noqa: E731
    return _local_step(model, opt, rank), model, state


def fsdp2(args: argparse.Namespace, rank: int, mesh: Any, reshard: bool) -> Any:
    """FSDP2 on ``mesh``'s shape: 1-D shards over it, 2-D is HSDP (replicate outer, shard
    inner)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = build_model(args)
    device_mesh = init_device_mesh("cpu", tuple(mesh.shape), mesh_dim_names=mesh.axis_names)
    for block in model.blocks:
        fully_shard(block, mesh=device_mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=device_mesh, reshard_after_forward=reshard)
    opt = _adamw(model.parameters(), args)
    return _local_step(model, opt, rank), model, lambda: opt.state


def autopar_stage(args: argparse.Namespace, rank: int, mesh: Any, stages: tuple[int, ...]) -> Any:
    """The ``ddp`` recipe's plan (batch split over every axis) with ZeRO ``stages`` per mesh
    axis."""
    import torch.distributed as dist

    import autopar
    from autopar.planner.problem import ZeroConfig

    model = build_model(args)
    batch = batch_for(0, args)
    plan = None
    if dist.get_rank() == 0:
        plan = autopar.plan(model, mesh, batch, recipe="ddp", optimizer="adamw")
        config = ZeroConfig(stages=stages)
        plan.data["zero"] = {
            **plan.data["zero"],
            **config.to_json(mesh.axis_names),
            "chunk_bytes": _chunk_bytes(args, model),
        }
    pmodel = autopar.autoparallelize(
        model, mesh, batch, plan=plan, recipe="ddp", optimizer="adamw", price_baselines=False
    )
    del model
    if any(stages):
        assert pmodel.zero is not None and pmodel.zero.stages == stages, pmodel.zero
    opt = _adamw(pmodel.parameters(), args)

    def step(idx: Any, targets: Any) -> float:
        loss = pmodel(*pmodel.shard_inputs(idx, targets))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        return float(loss.item())

    return step, pmodel, lambda: opt.state


def _chunk_bytes(args: argparse.Namespace, model: Any) -> int | None:
    """``--chunk``: "block" = one transformer block's bytes (FSDP2's unit here), "search" = the
    runtime's padding search (None), or a byte count."""
    if args.chunk == "search":
        return None
    if args.chunk == "block":
        return sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
    return int(args.chunk)


def setup(name: str, args: argparse.Namespace, rank: int, mesh: Any) -> Any:
    if name == "torch DDP":
        return torch_ddp(args, rank, mesh, zero_optim=False)
    if name == "DDP + ZeroRedundancyOptimizer":
        return torch_ddp(args, rank, mesh, zero_optim=True)
    if name == "FSDP2":
        return fsdp2(args, rank, mesh, reshard=True)
    if name in ("FSDP2 no reshard", "FSDP2 HSDP 2x2"):
        return fsdp2(args, rank, mesh, reshard=name != "FSDP2 no reshard")
    if name == "autopar stages 2x3":
        return autopar_stage(args, rank, mesh, (2, 3))
    return autopar_stage(args, rank, mesh, (int(name.rsplit(" ", 1)[1]),))


def state_bytes(module: Any, optim_state: Any) -> dict[str, int]:
    """Bytes of distinct live storages: parameters, gradients, optimizer state (this rank)."""
    import torch

    seen: set[int] = set()

    def count(tensors: Any) -> int:
        total = 0
        for t in tensors:
            storage = local_tensor(t).untyped_storage()
            if storage.data_ptr() not in seen and storage.nbytes():
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    params = list(module.parameters())
    state = [v for s in optim_state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
    return {
        "params": count(params),
        "grads": count(p.grad for p in params if p.grad is not None),
        "optimizer": count(state),
    }


def reference_losses(args: argparse.Namespace) -> list[float]:
    model = build_model(args)
    opt = _adamw(model.parameters(), args)
    out = []
    for i in range(args.warmup + args.steps):
        loss = model(*batch_for(i, args))
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(float(loss.item()))
    return out


def run_rank(
    rank: int, port: int, args: argparse.Namespace, name: str, want: list[float], results: Any
) -> None:
    import torch
    import torch.distributed as dist

    import autopar

    with gloo_rank(rank, port, results):
        flat = autopar.Mesh.from_world((WORLD_SIZE,), ("dp",))
        mesh = autopar.Mesh.from_world((2, 2), ("out", "in")) if name in HSDP else flat
        batches = [batch_for(i, args) for i in range(args.warmup + args.steps)]
        # One-time costs (imports, gloo and allocator set-up) land on no variant.
        warm_up(flat)
        dist.barrier()
        reset_peak()
        start_kib, _ = memory_kib()
        started = time.perf_counter()
        step, module, optim_state = setup(name, args, rank, mesh)
        setup_s = time.perf_counter() - started
        # Set-up garbage is no step's memory: autoparallelize leaves the user's model (which the
        # autopar variants drop) in reference cycles of its capture, about one model of
        # parameters until Python's cycle collector happens to run, during the steps or not.
        gc.collect()
        reset_peak()
        times, losses = timed_steps(step, batches, args.warmup)
        _, peak_kib = memory_kib()
        held = state_bytes(module, optim_state())
        step_times = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(step_times, op=dist.ReduceOp.MAX)
        figures = torch.tensor(
            [
                float(peak_kib - start_kib),
                float(held["params"]),
                float(held["grads"]),
                float(held["optimizer"]),
                setup_s,
            ],
            dtype=torch.float64,
        )
        dist.all_reduce(figures, op=dist.ReduceOp.MAX)
        row = {
            "median_step_s": statistics.median(step_times.tolist()),
            "step_times_s": step_times.tolist(),
            "peak_mib": float(figures[0]) / 1024,
            "params_mib": float(figures[1]) / 2**20,
            "grads_mib": float(figures[2]) / 2**20,
            "optimizer_mib": float(figures[3]) / 2**20,
            "state_mib": float(figures[1] + figures[2] + figures[3]) / 2**20,
            "setup_s": float(figures[4]),
            "loss_err": max(abs(a - b) for a, b in zip(losses, want)),
            "losses": losses,
        }
        if rank == 0:
            results.put(("ok", row))


def launch(args: argparse.Namespace, name: str, want: list[float]) -> dict[str, Any]:
    """One variant in a fresh spawn of 4 ranks (so memory figures do not depend on order)."""
    return spawn_ranks(run_rank, (args, name, want), args.timeout, f"benchmark variant {name!r}")


def report(rows: Rows, args: argparse.Namespace) -> None:
    from rich.console import Console

    out = table(
        args,
        (
            "variant",
            "step ms",
            "vs",
            "time ratio",
            "params",
            "grads",
            "optim",
            "state MiB",
            "state ratio",
            "peak MiB",
            "peak ratio",
            "loss err",
        ),
        optimizer="AdamW",
    )
    for name, row in rows.items():
        peer = PEERS.get(name)
        ratios = ["-", "-", "-"]
        if peer in rows:
            ratios = [
                ratio(row[key], rows[peer][key])
                for key in ("median_step_s", "state_mib", "peak_mib")
            ]
        out.add_row(
            name,
            f"{1000 * row['median_step_s']:.1f}",
            peer or "",
            ratios[0],
            f"{row['params_mib']:.2f}",
            f"{row['grads_mib']:.2f}",
            f"{row['optimizer_mib']:.2f}",
            f"{row['state_mib']:.2f}",
            ratios[1],
            f"{row['peak_mib']:.1f}",
            ratios[2],
            f"{row['loss_err']:.1e}",
        )
    Console(width=160).print(out)
    print("ratios: the autopar variant's figure over its peer's (below 1 is better); state MiB:")
    print("live parameter + gradient + optimizer-state storages per rank after the steps; peak")
    print("MiB: peak resident memory during the steps over the variant's start; largest rank.")
    print("autopar stage 2 vs FSDP2 no reshard and autopar stages 2x3 vs FSDP2 HSDP are not like")
    print("for like (see the module docstring).")


def plot(rows: Rows, path: Path) -> None:
    plot_bars(
        rows,
        (
            ("median step time (ms)", "median_step_s", 1000.0),
            ("param + grad + optimizer storages (MiB)", "state_mib", 1.0),
            ("peak resident memory over start (MiB)", "peak_mib", 1.0),
        ),
        title="autopar ZeRO stages (blue) vs DDP / ZeroRedundancyOptimizer / FSDP2 (grey)",
        path=path,
        figsize=(15, 5.5),
        rotation=45,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_options(
        parser,
        variants=VARIANTS,
        layers=4,
        seq=32,
        lr=1e-3,
        timeout_s=300.0,
        timeout_help="seconds per variant",
    )
    parser.add_argument(
        "--chunk",
        default="search",
        help="autopar chunk size: 'block' (one transformer block, FSDP2's unit), 'search' "
        "(the runtime's padding search) or bytes",
    )
    args = parser.parse_args()
    from autopar.tools.report import plotting_unavailable

    missing = plotting_unavailable()  # this benchmark writes PNGs: say so before measuring
    if missing is not None:
        parser.error(missing)
    if args.batch % WORLD_SIZE or args.n_embd % args.heads:
        parser.error("--batch must be divisible by 4, --n-embd by --heads")

    started = time.perf_counter()
    import torch

    torch.set_num_threads(1)
    want = reference_losses(args)
    rows, failed = {}, []
    for name in args.variants:
        try:
            rows[name] = launch(args, name, want)
        except RuntimeError as exc:  # the other variants still run and report
            print(exc, file=sys.stderr)
            failed.append(name)
    report(rows, args)
    write_outputs(rows, args, "zero_vs_fsdp", plot, started)
    if failed:
        raise SystemExit(f"variants failed: {failed}")


if __name__ == "__main__":
    main()
