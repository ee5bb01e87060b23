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
import json
import math
import os
import re
import socket
import statistics
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

WORLD_SIZE = 4
OUT_DIR = Path(__file__).resolve().parent / "out"
PEERS = {"autopar ddp": "torch DDP", "autopar megatron": "DTensor TP", "autopar auto": "torch DDP"}
VARIANTS = ("torch DDP", "autopar ddp", "DTensor TP", "autopar megatron", "autopar auto")

StepFn = Callable[[Any, Any], float]
Setup = Callable[[argparse.Namespace, int, Any], tuple[StepFn, Any]]


# --------------------------------------------------------------------------------------------
# Model and data (identical on every rank)


def build_model(args: argparse.Namespace) -> Any:
    import torch

    from autopar.models import GPT, GPTConfig

    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=args.vocab,
        block_size=args.seq,
        n_layer=args.layers,
        n_head=args.heads,
        n_embd=args.n_embd,
    )
    return GPT(config)


def batch_for(step: int, args: argparse.Namespace) -> tuple[Any, Any]:
    import torch

    gen = torch.Generator().manual_seed(100 + step)
    idx = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
    targets = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
    return idx, targets


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


def _memory_kib() -> tuple[int, int]:
    """(resident, peak resident) KiB of this process."""
    status = Path("/proc/self/status").read_text()
    return tuple(int(re.search(rf"{key}:\s+(\d+)", status).group(1)) for key in ("VmRSS", "VmHWM"))


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def _local(param: Any) -> Any:
    """A DTensor parameter's local shard; a plain tensor itself."""
    return param.to_local() if hasattr(param, "to_local") else param


def warm_up(mesh: Any) -> None:
    """One step of a tiny GPT under torch DDP, FSDP2 and autopar (capture, plan, ZeRO-3), so
    that one-time costs (module imports: torch.export, DTensor; the autograd engine; gloo
    buffers; allocator arenas) are paid before any variant's memory is measured; collective."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    import autopar

    tiny = argparse.Namespace(vocab=64, seq=8, layers=1, heads=4, n_embd=32, batch=WORLD_SIZE)
    batch = batch_for(0, tiny)
    DistributedDataParallel(build_model(tiny))(*batch).backward()
    sharded = build_model(tiny)
    fully_shard(sharded, mesh=init_device_mesh("cpu", (WORLD_SIZE,)))
    sharded(*batch).backward()
    pmodel = autopar.autoparallelize(
        build_model(tiny), mesh, batch, recipe="fsdp", price_baselines=False
    )
    pmodel(*pmodel.shard_inputs(*batch)).backward()
    torch.optim.AdamW(pmodel.parameters()).step()
    del pmodel, sharded
    gc.collect()


def reference_losses(args: argparse.Namespace) -> list[float]:
    import torch

    model = build_model(args)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    return [sgd_step(model(*batch_for(i, args)), opt) for i in range(args.warmup + args.steps)]


def run_rank(rank: int, port: int, args: argparse.Namespace, results: Any) -> None:
    import torch
    import torch.distributed as dist

    import autopar

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=timedelta(seconds=300),
    )
    try:
        mesh = autopar.Mesh.from_world((WORLD_SIZE,))
        want = reference_losses(args)
        batches = [batch_for(i, args) for i in range(args.warmup + args.steps)]
        warm_up(mesh)
        rows = {}
        for name in args.variants:
            gc.collect()
            _reset_peak()
            start_kib, _ = _memory_kib()
            started = time.perf_counter()
            step, module = SETUPS[name](args, rank, mesh)
            setup_s = time.perf_counter() - started
            _, setup_peak_kib = _memory_kib()
            _reset_peak()
            local_params = sum(_local(p).numel() for p in module.parameters())
            times, losses = [], []
            for i, (idx, targets) in enumerate(batches):
                dist.barrier()
                t0 = time.perf_counter()
                losses.append(step(idx, targets))
                if i >= args.warmup:
                    times.append(time.perf_counter() - t0)
            _, peak_kib = _memory_kib()
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
    except BaseException as exc:  # noqa: B036 - the parent prints it
        import traceback

        results.put(("error", f"rank {rank}: {exc!r}\n{traceback.format_exc()}"))
        raise
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# Parent


def spawn_ranks(target: Any, extra: tuple[Any, ...], timeout_s: float, what: str) -> Any:
    """Run ``target(rank, port, *extra, results)`` on WORLD_SIZE spawned ranks and return the
    payload the first rank puts on ``results`` as ("ok", payload) (else raise with its text)."""
    import multiprocessing

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # Children inherit these: one thread per rank, and glibc returning >= 64 KiB blocks on free
    # so that resident-size peaks follow tensor allocations.
    os.environ.update({"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"})
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=target, args=(rank, port, *extra, results), daemon=True)
        for rank in range(WORLD_SIZE)
    ]
    for proc in procs:
        proc.start()
    try:
        status, payload = results.get(timeout=timeout_s)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    if status != "ok":
        raise RuntimeError(f"{what} failed:\n{payload}")
    return payload


def launch(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    return spawn_ranks(run_rank, (args,), args.timeout, "benchmark")


def report(rows: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    title = (
        f"GPT {args.layers}x{args.n_embd} (vocab {args.vocab}), global batch {args.batch}x"
        f"{args.seq}, 4 gloo ranks on CPU, median of {args.steps} steps after {args.warmup}"
    )
    table = Table(title=title)
    for col in (
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
    ):
        table.add_column(col, justify="left" if col in ("variant", "vs") else "right")
    for name, row in rows.items():
        peer = PEERS.get(name)
        ratio = mem_ratio = "-"
        if peer in rows:
            ratio = f"{row['median_step_s'] / rows[peer]['median_step_s']:.2f}x"
            mem_ratio = f"{row['peak_mib'] / max(rows[peer]['peak_mib'], 1e-9):.2f}x"
        table.add_row(
            name,
            f"{1000 * row['median_step_s']:.1f}",
            peer or "",
            ratio,
            f"{row['peak_mib']:.1f}",
            mem_ratio,
            f"{row['local_params'] / 1e6:.2f}M",
            f"{row['loss_err']:.1e}",
            f"{row['setup_s']:.1f}",
            f"{row['setup_peak_mib']:.1f}",
        )
    Console(width=140).print(table)
    print("time ratio / mem ratio: the variant's figure over its peer's (below 1 is better);")
    print("peak MiB: peak resident memory during the steps over the variant's start (model,")
    print("shards, gradients, activations, buffers), largest rank; setup: capture + plan + shard.")


def plot(rows: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows)
    colors = ["#888888" if not n.startswith("autopar") else "#1f77b4" for n in names]
    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(11, 4))
    ax_time.bar(names, [1000 * rows[n]["median_step_s"] for n in names], color=colors)
    ax_time.set_ylabel("median step time (ms)")
    ax_mem.bar(names, [rows[n]["peak_mib"] for n in names], color=colors)
    ax_mem.set_ylabel("peak resident memory over start (MiB)")
    for ax in (ax_time, ax_mem):
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle("autopar (blue) vs PyTorch DDP / DTensor TP (grey), 4 gloo ranks, CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="global batch (divisible by 4)")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds for the whole run")
    args = parser.parse_args()
    if args.batch % WORLD_SIZE or args.n_embd % args.heads or args.heads % WORLD_SIZE:
        parser.error("--batch and --heads must be divisible by 4, --n-embd by --heads")

    started = time.perf_counter()
    rows = launch(args)
    report(rows, args)
    OUT_DIR.mkdir(exist_ok=True)
    png = OUT_DIR / "runtime_vs_torch.png"
    plot(rows, png)
    (OUT_DIR / "runtime_vs_torch.json").write_text(
        json.dumps({"args": vars(args), "results": rows}, indent=1)
    )
    print(f"wrote {png} and {png.with_suffix('.json')} in {time.perf_counter() - started:.0f} s")
    if not math.isfinite(sum(row["median_step_s"] for row in rows.values())):
        raise SystemExit("a step time is not finite")


if __name__ == "__main__":
    main()
