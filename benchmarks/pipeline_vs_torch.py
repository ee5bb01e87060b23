"""autopar's pipeline runtime against a hand-written torch.distributed.pipelining split + DDP.

    python benchmarks/pipeline_vs_torch.py                 # 4 gloo ranks, pp=2 x dp=2, 1F1B
    python benchmarks/pipeline_vs_torch.py --n-embd 384 --microbatches 8 --steps 8

Same GPT (autopar.models.GPT, 4 blocks, untied head, fixed seed), same global batch, same SGD
step, on the same 4 ranks, in one run:

* ``autopar``: ``autoparallelize(model, Mesh((2, 2), ("pp", "dp")), batch, recipe="ddp",
  pipeline=dict(microbatches=M, schedule="1f1b"))``, ``pmodel.step(idx, targets)``;
* ``torch``: the model cut by hand after block 1 (embeddings + blocks 0-1 | blocks 2-3 + final
  norm + head), each half in ``DistributedDataParallel`` over the dp group, torch's
  ``PipelineStage`` over the pp group and ``Schedule1F1B`` with a cross-entropy loss function
  (torch's documented recipe); each dp rank feeds its half of the batch.

Step time: per step, a barrier, then forward + backward (the whole schedule) + SGD step; a
step's time is the slowest rank's; a repetition's figure is the median over its steps. The two
variants alternate for ``--reps`` repetitions; the table gives the median and min-max over them
and the ratio of medians. Peak memory: one more step per variant under
``autopar.tools.peak_memory.PeakMemory`` (growth of glibc's allocated bytes, sampled after every
ATen op), the largest over ranks. Also prints the largest loss difference between the variants.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from autopar.models import GPT, GPTConfig
from autopar.runtime.spawn import spawn_ranks


def _config(args: argparse.Namespace) -> GPTConfig:
    return GPTConfig(
        vocab_size=args.vocab,
        block_size=args.seq,
        n_layer=4,
        n_head=args.n_head,
        n_embd=args.n_embd,
        tie_weights=False,
    )


def _batch(step: int, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    idx = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
    return idx, torch.roll(idx, -1, dims=1)


class _Head(nn.Module):
    """Embeddings and the first two blocks."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.wte, self.wpe, self.blocks = gpt.wte, gpt.wpe, gpt.blocks[:2]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return x


class _Tail(nn.Module):
    """The last two blocks, final norm and head: logits."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.blocks, self.ln_f, self.lm_head = gpt.blocks[2:], gpt.ln_f, gpt.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _torch_variant(args: argparse.Namespace, mesh: Any) -> tuple[Any, Any]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    gpt = GPT(_config(args))
    pp, dp = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    half = _Head(gpt) if pp == 0 else _Tail(gpt)
    module = DistributedDataParallel(half, process_group=mesh.get_group("dp"))
    stage = PipelineStage(module, pp, 2, torch.device("cpu"), group=mesh.get_group("pp"))

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

    schedule = Schedule1F1B(stage, args.microbatches, loss_fn=loss_fn)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    rows = args.batch // 2

    def step(idx: torch.Tensor, targets: torch.Tensor) -> float:
        idx, targets = idx[dp * rows : (dp + 1) * rows], targets[dp * rows : (dp + 1) * rows]
        losses: list[torch.Tensor] = []
        if pp == 0:
            schedule.step(idx)
        else:
            schedule.step(target=targets, losses=losses)
        opt.step()
        opt.zero_grad()
        loss = torch.stack(losses).detach().mean() if losses else torch.zeros(())
        dist.all_reduce(loss)  # the two last-stage dp ranks' means, summed
        return float(loss) / 2

    return step, module


def _autopar_variant(args: argparse.Namespace, mesh: Any) -> tuple[Any, Any]:
    import autopar

    torch.manual_seed(0)
    gpt = GPT(_config(args))
    pmodel = autopar.autoparallelize(
        gpt,
        mesh,
        _batch(0, args),
        recipe="ddp",
        optimizer="sgd",
        price_baselines=False,
        pipeline={"microbatches": args.microbatches, "schedule": "1f1b"},
    )
    opt = torch.optim.SGD(pmodel.parameters(), lr=0.1)

    def step(idx: torch.Tensor, targets: torch.Tensor) -> float:
        loss = pmodel.step(idx, targets)
        opt.step()
        opt.zero_grad()
        return float(loss)

    return step, pmodel


def _slowest(seconds: float) -> float:
    value = torch.tensor([seconds])
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def run_rank(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    import autopar
    from autopar.tools.peak_memory import PeakMemory

    torch_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    variants = {
        "autopar": _autopar_variant(args, autopar.Mesh.from_world((2, 2), ("pp", "dp"))),
        "torch": _torch_variant(args, torch_mesh),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    losses: dict[str, list[float]] = {name: [] for name in variants}
    for step, _ in variants.values():
        step(*_batch(0, args))  # warm-up (first-call costs)
    for _ in range(args.reps):
        for name, (step, _) in variants.items():
            per_step = []
            for s in range(args.steps):
                batch = _batch(1 + s, args)
                dist.barrier()
                start = time.perf_counter()
                losses[name].append(step(*batch))
                per_step.append(_slowest(time.perf_counter() - start))
            times[name].append(statistics.median(per_step))
    peaks = {}
    for name, (step, _) in variants.items():
        dist.barrier()
        with PeakMemory(torch.device("cpu")) as peak:
            step(*_batch(0, args))
        value = torch.tensor([float(peak.peak_delta or 0)])
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        peaks[name] = float(value)
    return {"times": times, "peaks": peaks, "losses": losses}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--n-head", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    out = spawn_ranks(run_rank, 4, args, timeout_s=1800, pg_timeout_s=600)[0]
    times, peaks, losses = out["times"], out["peaks"], out["losses"]
    print(
        f"GPT 4 blocks, n_embd {args.n_embd}, seq {args.seq}, batch {args.batch}, "
        f"{args.microbatches} microbatches, 1F1B, pp=2 x dp=2 on 4 gloo ranks; "
        f"{args.reps} repetitions of {args.steps} steps"
    )
    print(f"{'variant':10} {'step s (median, min-max)':>28} {'peak MiB':>10}")
    for name in times:
        t = times[name]
        print(
            f"{name:10} {statistics.median(t):>10.3f} ({min(t):.3f}-{max(t):.3f})"
            f"{'':6} {peaks[name] / 2**20:>10.1f}"
        )
    step_ratio = statistics.median(times["autopar"]) / statistics.median(times["torch"])
    memory_ratio = peaks["autopar"] / max(peaks["torch"], 1.0)
    diff = max(abs(a - b) for a, b in zip(losses["autopar"], losses["torch"], strict=True))
    print(f"autopar / torch: step time {step_ratio:.3f}x, peak memory {memory_ratio:.3f}x")
    print(f"largest loss difference between the variants: {diff:.2e}")


if __name__ == "__main__":
    main()
