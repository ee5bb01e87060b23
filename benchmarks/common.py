"""What runtime_vs_torch.py and zero_vs_fsdp.py share: the GPT and its batches, the model and
step options, one gloo rank's set-up and timed steps, the spawn of the ranks, and the table,
ratio, plot and output code.

Both run WORLD_SIZE gloo ranks on CPU; a variant's step function takes the GLOBAL batch and
returns the step's loss; a row is a dict of figures per variant, compared with its peer's.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import re
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

WORLD_SIZE = 4
OUT_DIR = Path(__file__).resolve().parent / "out"

StepFn = Callable[[Any, Any], float]
Rows = dict[str, dict[str, Any]]


# --------------------------------------------------------------------------------------------
# Model and data (identical on every rank)


def build_model(args: argparse.Namespace) -> Any:
    """autopar.models.GPT of the options' shape, seed 0."""
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
    """Step ``step``'s global batch (idx, targets), the same on every rank."""
    import torch

    gen = torch.Generator().manual_seed(100 + step)
    idx = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
    targets = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
    return idx, targets


def add_model_options(
    parser: argparse.ArgumentParser,
    *,
    variants: Sequence[str],
    layers: int,
    seq: int,
    lr: float,
    timeout_s: float,
    timeout_help: str,
) -> None:
    """The GPT's shape, the batch, the steps and the variants; defaults per benchmark."""
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=seq)
    parser.add_argument(
        "--batch", type=int, default=8, help=f"global batch (divisible by {WORLD_SIZE})"
    )
    parser.add_argument("--steps", type=int, default=6, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--lr", type=float, default=lr)
    parser.add_argument("--variants", nargs="+", default=list(variants), choices=variants)
    parser.add_argument("--timeout", type=float, default=timeout_s, help=timeout_help)


# --------------------------------------------------------------------------------------------
# One rank


def memory_kib() -> tuple[int, int]:
    """(resident, peak resident) KiB of this process."""
    status = Path("/proc/self/status").read_text()
    return tuple(int(re.search(rf"{key}:\s+(\d+)", status).group(1)) for key in ("VmRSS", "VmHWM"))


def reset_peak() -> None:
    """Start a new peak resident size (VmHWM) from the current one."""
    Path("/proc/self/clear_refs").write_text("5")


def local_tensor(param: Any) -> Any:
    """A DTensor parameter's local shard; a plain tensor itself."""
    return param.to_local() if hasattr(param, "to_local") else param


@contextlib.contextmanager
def gloo_rank(rank: int, port: int, results: Any, world_size: int = WORLD_SIZE) -> Iterator[None]:
    """One thread, this rank in a ``world_size`` gloo group on 127.0.0.1:``port``; an error is
    put on ``results`` as ("error", text naming the rank) for the parent, then re-raised."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=300),
    )
    try:
        yield
    except BaseException as exc:  # noqa: B036 - the parent prints it
        import traceback

        results.put(("error", f"rank {rank}: {exc!r}\n{traceback.format_exc()}"))
        raise
    finally:
        dist.destroy_process_group()


def timed_steps(
    step: StepFn, batches: Sequence[tuple[Any, Any]], warmup: int
) -> tuple[list[float], list[float]]:
    """(seconds of each step after ``warmup``, every step's loss): all ranks meet at a barrier
    before each step; collective."""
    import torch.distributed as dist

    times, losses = [], []
    for i, (idx, targets) in enumerate(batches):
        dist.barrier()
        t0 = time.perf_counter()
        losses.append(step(idx, targets))
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times, losses


def warm_up(mesh: Any) -> None:
    """One step of a tiny GPT under torch DDP, FSDP2 and autopar (capture, plan, ZeRO-3), so
    that one-time costs (module imports: torch.export, DTensor; the autograd engine; gloo
    buffers; allocator arenas) are paid before any variant's memory is measured; collective."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    import autopar

    world = torch.distributed.get_world_size()
    tiny = argparse.Namespace(vocab=64, seq=8, layers=1, heads=4, n_embd=32, batch=world)
    batch = batch_for(0, tiny)
    DistributedDataParallel(build_model(tiny))(*batch).backward()
    sharded = build_model(tiny)
    fully_shard(sharded, mesh=init_device_mesh("cpu", (world,)))
    sharded(*batch).backward()
    pmodel = autopar.autoparallelize(
        build_model(tiny), mesh, batch, recipe="fsdp", price_baselines=False
    )
    pmodel(*pmodel.shard_inputs(*batch)).backward()
    torch.optim.AdamW(pmodel.parameters()).step()
    del pmodel, sharded
    gc.collect()


# --------------------------------------------------------------------------------------------
# Parent


def spawn_ranks(
    target: Any,
    extra: tuple[Any, ...],
    timeout_s: float,
    what: str,
    world_size: int = WORLD_SIZE,
) -> Any:
    """Run ``target(rank, port, *extra, results)`` on ``world_size`` spawned ranks and return the
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
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    try:
        status, payload = _first_result(results, procs, timeout_s)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    if status != "ok":
        raise RuntimeError(f"{what} failed:\n{payload}")
    return payload


def _first_result(results: Any, procs: Sequence[Any], timeout_s: float) -> tuple[str, Any]:
    """The first (status, payload) on ``results``; ("error", ...) as soon as every rank has
    exited without one (a crash before ``gloo_rank``, e.g. an import error) or on timeout."""
    import queue

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return results.get(timeout=1.0)
        except queue.Empty:
            if all(not proc.is_alive() for proc in procs):
                try:
                    return results.get(timeout=1.0)
                except queue.Empty:
                    codes = [proc.exitcode for proc in procs]
                    return "error", f"every rank exited (codes {codes}) without a result"
    return "error", f"no result within {timeout_s:.0f} s"


# --------------------------------------------------------------------------------------------
# Reporting


def table(args: argparse.Namespace, columns: Sequence[str], *, optimizer: str = "") -> Any:
    """A rich Table titled with the run's shape; "variant" and "vs" left-aligned."""
    from rich.table import Table

    title = (
        f"GPT {args.layers}x{args.n_embd} (vocab {args.vocab}), global batch {args.batch}x"
        f"{args.seq}, {optimizer + ', ' if optimizer else ''}{WORLD_SIZE} gloo ranks on CPU, "
        f"median of {args.steps} steps after {args.warmup}"
    )
    out = Table(title=title)
    for col in columns:
        out.add_column(col, justify="left" if col in ("variant", "vs") else "right")
    return out


def ratio(value: float, peer: float) -> str:
    """``value`` over its peer's, as "0.93x"."""
    return f"{value / max(peer, 1e-9):.2f}x"


def plot_bars(
    rows: Rows,
    panels: Sequence[tuple[str, str, float]],
    *,
    title: str,
    path: Path,
    figsize: tuple[float, float],
    rotation: int,
) -> None:
    """One bar panel per (y label, row key, factor): autopar's variants blue, peers grey."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows)
    colors = ["#1f77b4" if n.startswith("autopar") else "#888888" for n in names]
    fig, axes = plt.subplots(1, len(panels), figsize=figsize)
    for ax, (label, key, factor) in zip(axes, panels):
        ax.bar(names, [factor * rows[n][key] for n in names], color=colors)
        ax.set_ylabel(label)
        ax.tick_params(axis="x", rotation=rotation)
        if rotation > 30:
            for tick in ax.get_xticklabels():
                tick.set_horizontalalignment("right")
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 1, 0.93) if rotation > 30 else (0, 0, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(
    rows: Rows,
    args: argparse.Namespace,
    stem: str,
    plot: Callable[[Rows, Path], None],
    started: float,
) -> None:
    """benchmarks/out/<stem>.png and .json; exits non-zero when a step time is not finite."""
    OUT_DIR.mkdir(exist_ok=True)
    png = OUT_DIR / f"{stem}.png"
    plot(rows, png)
    (OUT_DIR / f"{stem}.json").write_text(
        json.dumps({"args": vars(args), "results": rows}, indent=1)
    )
    print(f"wrote {png} and {png.with_suffix('.json')} in {time.perf_counter() - started:.0f} s")
    if not math.isfinite(sum(row["median_step_s"] for row in rows.values())):
        raise SystemExit("a step time is not finite")
