"""autopar's runtime against PyTorch's own parallelism, on 4 gloo ranks (CPU), in one run.

    python benchmarks/runtime_vs_torch.py                    # the default run (about 2-3 min)
    python benchmarks/runtime_vs_torch.py --steps 10 --n-embd 384 --seq 128

Same GPT (autopar.models.GPT, fixed seed), same global batch, same SGD step, each variant in
turn on the same 4 ranks (mesh of 4, pure data or pure tensor parallelism):

* ``torch DDP``        torch.nn.parallel.DistributedDataParallel, batch split 4 ways;
* ``autopar ddp``      autoparallelize(recipe="ddp"): batch split, chunked gradient all-reduce;
* ``DTensor TP``       torch.distributed.tensor.parallel.parallelize_module: ColwiseParallel on
                       attn.qkv and mlp.fc, RowwiseParallel on attn.proj and mlp.proj, local
                       outputs; the fused qkv rows reordered per rank (Megatron's layout) and
                       the attention written with local head counts, as plain-tensor TP needs
                       (DTensor has no CPU SDPA rule); embeddings and the tied LM head
                       replicated;
* ``autopar megatron`` autoparallelize(recipe="megatron"): column/row-parallel attention and
                       MLP, vocab-parallel embedding and LM head;
* ``autopar auto``     autoparallelize(): the ILP's plan.

Step time: per step, every rank waits at a barrier, then times forward + backward + optimizer
step; a step's time is the slowest rank's; the figure is the median over the timed steps after
warm-up. Before the first variant every rank runs one step of a tiny GPT under DDP, FSDP2 and
autopar, so one-time costs (imports of torch.export and DTensor, gloo and allocator set-up) land
on no variant. Memory: peak resident set size during the steps (Linux VmHWM, reset through
/proc/self/clear_refs after the variant's setup) minus the resident size at the variant's
start, the largest over ranks (setup's own peak, which includes planning on rank 0, is a
separate column); glibc is
told to return every allocation of 64 KiB or more to the OS on free (MALLOC_MMAP_THRESHOLD_),
so the figure follows tensor allocations. It covers the variant's model, its shards, gradients,
activations and communication buffers. "loss err" is the largest difference between the
variant's losses and the single-process model's on the same batches.

Prints a rich table and writes benchmarks/out/runtime_vs_torch.png and .json.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import (
    WORLD_SIZE,
    Rows,
    StepFn,
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

PEERS = {"autopar ddp": "torch DDP", "autopar megatron": "DTensor TP", "autopar auto": "torch DDP"}
VARIANTS = ("torch DDP", "autopar ddp", "DTensor TP", "autopar megatron", "autopar auto")

Setup = Callable[[argparse.Namespace, int, Any], tuple[StepFn, Any]]


# --------------------------------------------------------------------------------------------
# Variants: each returns a step function on the GLOBAL batch -> the step's loss


def sgd_step(loss: Any, opt: Any) -> float:
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.item())


def torch_ddp(args: argparse.Namespace, rank: int, mesh: Any) -> tuple[StepFn, Any]:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(build_model(args))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    local = args.batch // WORLD_SIZE

    def step(idx: Any, targets: Any) -> float:
        # Each rank's mean loss; DDP averages gradients, so this is the global-mean-loss step.
        part = slice(rank * local, (rank + 1) * local)
        loss = model(idx[part], targets[part])
        value = sgd_step(loss, opt)
        total = torch.tensor([value])
        torch.distributed.all_reduce(total)
        return float(total.item()) / WORLD_SIZE

    return step, model


def _local_heads_attention(self: Any, x: Any) -> Any:
    """CausalSelfAttention.forward written with local head counts (``view(..., -1, head_dim)``,
    ``chunk(3)``): the same function on one device, and what tensor parallelism with plain local
    tensors needs (torchtitan writes its attention this way)."""
    import torch.nn.functional as F

    batch, seq, _ = x.shape
    q, k, v = self.qkv(x).chunk(3, dim=2)
    q = q.view(batch, seq, -1, self.head_dim).transpose(1, 2)
    k = k.view(batch, seq, -1, self.head_dim).transpose(1, 2)
    v = v.view(batch, seq, -1, self.head_dim).transpose(1, 2)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(batch, seq, -1)))


def dtensor_tp(args: argparse.Namespace, rank: int, mesh: Any) -> tuple[StepFn, Any]:
    import types

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model = build_model(args)
    device_mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    width = args.n_embd
    part = width // WORLD_SIZE
    # Megatron's fused-qkv layout: rank r's rows are the q, k and v rows of its heads.
    order = torch.cat(
        [
            torch.arange(which * width + r * part, which * width + (r + 1) * part)
            for r in range(WORLD_SIZE)
            for which in range(3)
        ]
    )
    for block in model.blocks:
        with torch.no_grad():
            block.attn.qkv.weight.copy_(block.attn.qkv.weight[order])
            block.attn.qkv.bias.copy_(block.attn.qkv.bias[order])
        block.attn.forward = types.MethodType(_local_heads_attention, block.attn)
        parallelize_module(
            block,
            device_mesh,
            {
                "attn.qkv": ColwiseParallel(),
                "attn.proj": RowwiseParallel(),
                "mlp.fc": ColwiseParallel(),
                "mlp.proj": RowwiseParallel(),
            },
        )
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)

    def step(idx: Any, targets: Any) -> float:
        return sgd_step(model(idx, targets), opt)

    return step, model


def autopar_variant(recipe: str) -> Setup:
    def setup(args: argparse.Namespace, rank: int, mesh: Any) -> tuple[StepFn, Any]:
        import torch

        import autopar

        model = build_model(args)
        pmodel = autopar.autoparallelize(
            model, mesh, batch_for(0, args), recipe=recipe, optimizer="sgd"
        )
        del model
        opt = torch.optim.SGD(pmodel.parameters(), lr=args.lr)

        def step(idx: Any, targets: Any) -> float:
            return sgd_step(pmodel(*pmodel.shard_inputs(idx, targets)), opt)

        return step, pmodel

    return setup


SETUPS: dict[str, Setup] = {
    "torch DDP": torch_ddp,
    "autopar ddp": autopar_variant("ddp"),
    "DTensor TP": dtensor_tp,
    "autopar megatron": autopar_variant("megatron"),
    "autopar auto": autopar_variant("auto"),
}


# --------------------------------------------------------------------------------------------
# One rank


def reference_losses(args: argparse.Namespace) -> list[float]:
    import torch

    model = build_model(args)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    return [sgd_step(model(*batch_for(i, args)), opt) for i in range(args.warmup + args.steps)]


def run_rank(rank: int, port: int, args: argparse.Namespace, results: Any) -> None:
    import torch
    import torch.distributed as dist

    import autopar

    with gloo_rank(rank, port, results):
        mesh = autopar.Mesh.from_world((WORLD_SIZE,))
        want = reference_losses(args)
        batches = [batch_for(i, args) for i in range(args.warmup + args.steps)]
        warm_up(mesh)
        rows = {}
        for name in args.variants:
            gc.collect()
            reset_peak()
            start_kib, _ = memory_kib()
            started = time.perf_counter()
            step, module = SETUPS[name](args, rank, mesh)
            setup_s = time.perf_counter() - started
            _, setup_peak_kib = memory_kib()
            reset_peak()
            local_params = sum(local_tensor(p).numel() for p in module.parameters())
            times, losses = timed_steps(step, batches, args.warmup)
            _, peak_kib = memory_kib()
            # Slowest rank per step, largest memory over ranks, in one all_reduce each.
            step_times = torch.tensor(times, dtype=torch.float64)
            dist.all_reduce(step_times, op=dist.ReduceOp.MAX)
            peak = torch.tensor(
                [float(peak_kib - start_kib), float(setup_peak_kib - start_kib), setup_s],
                dtype=torch.float64,
            )
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            rows[name] = {
                "median_step_s": statistics.median(step_times.tolist()),
                "step_times_s": step_times.tolist(),
                "peak_mib": float(peak[0]) / 1024,
                "setup_peak_mib": float(peak[1]) / 1024,
                "setup_s": float(peak[2]),
                "local_params": local_params,
                "loss_err": max(abs(a - b) for a, b in zip(losses, want)),
                "losses": losses,
            }
            del step, module
        if rank == 0:
            results.put(("ok", rows))


# --------------------------------------------------------------------------------------------
# Parent


def launch(args: argparse.Namespace) -> Rows:
    return spawn_ranks(run_rank, (args,), args.timeout, "benchmark")


def report(rows: Rows, args: argparse.Namespace) -> None:
    from rich.console import Console

    out = table(
        args,
        (
            "variant",
            "step ms",
            "vs",
            "time ratio",
            "peak MiB",
            "mem ratio",
            "local params",
            "loss err",
            "setup s",
            "setup MiB",
        ),
    )
    for name, row in rows.items():
        peer = PEERS.get(name)
        time_ratio = mem_ratio = "-"
        if peer in rows:
            time_ratio = ratio(row["median_step_s"], rows[peer]["median_step_s"])
            mem_ratio = ratio(row["peak_mib"], rows[peer]["peak_mib"])
        out.add_row(
            name,
            f"{1000 * row['median_step_s']:.1f}",
            peer or "",
            time_ratio,
            f"{row['peak_mib']:.1f}",
            mem_ratio,
            f"{row['local_params'] / 1e6:.2f}M",
            f"{row['loss_err']:.1e}",
            f"{row['setup_s']:.1f}",
            f"{row['setup_peak_mib']:.1f}",
        )
    Console(width=140).print(out)
    print("time ratio / mem ratio: the variant's figure over its peer's (below 1 is better);")
    print("peak MiB: peak resident memory during the steps over the variant's start (model,")
    print("shards, gradients, activations, buffers), largest rank; setup: capture + plan + shard.")


def plot(rows: Rows, path: Path) -> None:
    plot_bars(
        rows,
        (
            ("median step time (ms)", "median_step_s", 1000.0),
            ("peak resident memory over start (MiB)", "peak_mib", 1.0),
        ),
        title="autopar (blue) vs PyTorch DDP / DTensor TP (grey), 4 gloo ranks, CPU",
        path=path,
        figsize=(11, 4),
        rotation=30,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_options(
        parser,
        variants=VARIANTS,
        layers=2,
        seq=64,
        lr=0.05,
        timeout_s=900.0,
        timeout_help="seconds for the whole run",
    )
    args = parser.parse_args()
    from autopar.tools.report import plotting_unavailable

    missing = plotting_unavailable()  # this benchmark writes PNGs: say so before measuring
    if missing is not None:
        parser.error(missing)
    if args.batch % WORLD_SIZE or args.n_embd % args.heads or args.heads % WORLD_SIZE:
        parser.error("--batch and --heads must be divisible by 4, --n-embd by --heads")

    started = time.perf_counter()
    rows = launch(args)
    report(rows, args)
    write_outputs(rows, args, "runtime_vs_torch", plot, started)


if __name__ == "__main__":
    main()
