"""Train a small GPT with autopar on CPU ranks, and the same model in one process.

    torchrun --nproc_per_node 4 examples/train_gpt.py --mesh 2x2             # autopar, gloo
    torchrun --nproc_per_node 4 examples/train_gpt.py --mesh 2x2 --recipe megatron
    python examples/train_gpt.py --single                                    # one process

Both print the same loss per step (rank 0 prints under torchrun): the model (fixed seed),
the data (synthetic, generated deterministically per step) and the optimizer (SGD) are the
same, and autopar's outputs are the single-process values (the global mean loss). The batch
passed to autopar is the GLOBAL batch; ``shard_inputs`` cuts this rank's part.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import autopar
from autopar.models import GPT, GPTConfig

CONFIG = GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=4, n_embd=64)


def synthetic_batch(
    step: int, batch: int, seq: int, vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch: random starts of the sequences t -> (5 t + 3) mod vocab
    (a pattern the model can learn), targets the next token. Deterministic in ``step``."""
    gen = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, vocab, (batch, 1), generator=gen)
    tokens = [start]
    for _ in range(seq):
        tokens.append((5 * tokens[-1] + 3) % vocab)
    sequence = torch.cat(tokens, dim=1)
    return sequence[:, :-1].contiguous(), sequence[:, 1:].contiguous()


def build_model() -> GPT:
    torch.manual_seed(0)
    return GPT(CONFIG)


def train_single(steps: int, batch: int, lr: float) -> list[float]:
    model = build_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        idx, targets = synthetic_batch(step, batch, CONFIG.block_size, CONFIG.vocab_size)
        loss = model(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        print(f"step {step} loss {loss.item():.6f}", flush=True)
    return losses


def train_distributed(
    mesh_text: str, steps: int, batch: int, lr: float, recipe: str
) -> list[float]:
    spec = autopar.Mesh.parse(mesh_text, device="cpu")
    mesh = autopar.Mesh.from_world(spec.shape, spec.axis_names)  # initializes gloo under torchrun
    rank = torch.distributed.get_rank()
    model = build_model()
    example = synthetic_batch(0, batch, CONFIG.block_size, CONFIG.vocab_size)
    started = time.perf_counter()
    pmodel = autopar.autoparallelize(model, mesh, example, recipe=recipe, optimizer="sgd")
    if rank == 0:
        print(
            f"# {recipe} plan on mesh {mesh.describe()}: planned and lowered in "
            f"{time.perf_counter() - started:.1f} s",
            flush=True,
        )
    opt = torch.optim.SGD(pmodel.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        idx, targets = synthetic_batch(step, batch, CONFIG.block_size, CONFIG.vocab_size)
        loss = pmodel(*pmodel.shard_inputs(idx, targets))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if rank == 0:
            print(f"step {step} loss {loss.item():.6f}", flush=True)
    torch.distributed.destroy_process_group()
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mesh", default="2x2", help="mesh under torchrun: 2x2, 4, dp=2,tp=2")
    parser.add_argument("--single", action="store_true", help="train in one process, no autopar")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8, help="global batch size")
    parser.add_argument("--lr", type=float, default=0.1, help="SGD learning rate")
    parser.add_argument("--recipe", default="auto", choices=["auto", "ddp", "megatron"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.single:
        train_single(args.steps, args.batch, args.lr)
    elif "RANK" not in os.environ:
        parser.error(
            "run under torchrun (torchrun --nproc_per_node 4 examples/train_gpt.py --mesh 2x2), "
            "or pass --single"
        )
    else:
        train_distributed(args.mesh, args.steps, args.batch, args.lr, args.recipe)


if __name__ == "__main__":
    main()
