"""Train a small GPT with pipeline stages on CPU ranks, and the same model in one process.

    torchrun --nproc-per-node 4 examples/train_gpt_pipeline.py --mesh pp=2,dp=2 --schedule 1f1b
    torchrun --nproc-per-node 4 examples/train_gpt_pipeline.py --mesh pp=4 --schedule gpipe
    torchrun --nproc-per-node 2 examples/train_gpt_pipeline.py --mesh pp=2 --mixed-precision bf16
    python examples/train_gpt_pipeline.py --single [--mixed-precision bf16]   # one process

Both print the same loss per step (rank 0 prints under torchrun; under ``--mixed-precision`` the
single process runs under ``torch.autocast`` with fp32 weights, and the losses agree to bf16's
or fp16's precision), then the median step time. ``pmodel.step(idx, targets)``
takes the GLOBAL batch on every rank (each stage takes what it consumes: the first stage the
tokens, the last the targets), runs torch.distributed.pipelining's schedule forward and
backward over the microbatches and returns the global mean loss on every rank.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

import torch

import autopar
from autopar.models import GPT, GPTConfig

CONFIG = GPTConfig(vocab_size=128, block_size=16, n_layer=4, n_head=4, n_embd=64)


def synthetic_batch(step: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch: sequences t -> (5 t + 3) mod vocab from random starts,
    targets the next token. Deterministic in ``step``."""
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = [torch.randint(0, CONFIG.vocab_size, (batch, 1), generator=gen)]
    for _ in range(CONFIG.block_size):
        tokens.append((5 * tokens[-1] + 3) % CONFIG.vocab_size)
    sequence = torch.cat(tokens, dim=1)
    return sequence[:, :-1].contiguous(), sequence[:, 1:].contiguous()


def build_model() -> GPT:
    torch.manual_seed(0)
    return GPT(CONFIG)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", default="pp=2,dp=2", help="mesh with a pp axis, e.g. pp=2,dp=2")
    parser.add_argument(
        "--schedule",
        default="1f1b",
        help="gpipe, 1f1b, interleaved-1f1b, zero-bubble, zbv or dualpipev",
    )
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--recipe", default="auto", help="plan inside each stage")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--mixed-precision", default=None, help="bf16 or fp16 (default fp32)")
    parser.add_argument("--single", action="store_true", help="train in one process")
    args = parser.parse_args()
    model = build_model()
    seconds = []
    if args.single or "RANK" not in os.environ:
        half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.mixed_precision)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr)
        scaler = torch.amp.GradScaler("cpu", enabled=args.mixed_precision == "fp16")
        for step in range(args.steps):
            started = time.perf_counter()
            with torch.autocast("cpu", dtype=half) if half else contextlib.nullcontext():
                loss = model(*synthetic_batch(step, args.batch))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            seconds.append(time.perf_counter() - started)
            print(f"step {step} loss {loss.item():.6f}", flush=True)
        print(f"# median step {statistics.median(seconds):.4f} s", flush=True)
        return
    spec = autopar.Mesh.parse(args.mesh, device="cpu")
    mesh = autopar.Mesh.from_world(spec.shape, spec.axis_names)  # initializes gloo under torchrun
    rank = torch.distributed.get_rank()
    started = time.perf_counter()
    pipeline = {"microbatches": args.microbatches, "schedule": args.schedule}
    pmodel = autopar.autoparallelize(
        model,
        mesh,
        synthetic_batch(0, args.batch),
        pipeline=pipeline,
        recipe=args.recipe,
        optimizer="sgd",
        mixed_precision=args.mixed_precision,
        price_baselines=False,
    )
    if rank == 0:
        stages = [(s.index, s.blocks, s.pp_rank) for s in pmodel.pipeline.stages]
        print(
            f"# {len(stages)} stages (index, blocks, pp rank) {stages}, {args.schedule}, "
            f"{args.microbatches} microbatches on mesh {mesh.describe()}: planned and lowered "
            f"in {time.perf_counter() - started:.1f} s",
            flush=True,
        )
    opt = torch.optim.SGD(pmodel.parameters(), lr=args.lr)
    for step in range(args.steps):
        started = time.perf_counter()
        loss = pmodel.step(*synthetic_batch(step, args.batch))
        opt.step()
        opt.zero_grad()
        seconds.append(time.perf_counter() - started)
        if rank == 0:
            print(f"step {step} loss {loss.item():.6f}", flush=True)
    if rank == 0:
        print(f"# median step {statistics.median(seconds):.4f} s", flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
