"""The pipeline cost check's GPT split by hand into torch ``PipelineStage`` s: its steps, idle
share and gaps between tasks without autopar's runtime (issue 15).

``benchmarks/pipeline_cost_check.py`` times its GPT (4 blocks of width 256, untied head, batch
16 x 128, SGD) through ``autoparallelize(..., pipeline=...)``. This script builds the same model
with the same seeds and cuts it as the check's 4-stage plans do (embedding and block 0; block 1;
block 2; block 3, the final norm and the head; the loss in the schedule), one stage per gloo
rank, and drives it with torch's own schedule (GPipe or 1F1B), each rank in its own session as
the check's ranks are. Every microbatch forward and backward is timestamped, so the same gap
table as ``benchmarks/pipeline_gaps.py`` comes out, beside the step and the busiest rank's idle
share (1 less its tasks' seconds over the step).

Usage (4 ranks; 2 warm-up and 15 timed steps per configuration; take the timing lock)::

    OMP_NUM_THREADS=1 PYTHONPATH=. flock -x /tmp/autopar-timing.lock \\
        python benchmarks/pipeline_bare_gaps.py gpipe/8 1f1b/8 gpipe/4
"""

from __future__ import annotations

import os
import socket
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

WORLD, STEPS, WARM_UP = 4, 15, 2
WIDTH, LAYERS, VOCAB, BATCH, SEQ = 256, 4, 1024, 16, 128  # the check's defaults


class First(nn.Module):
    def __init__(self, gpt: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.block = gpt.wte, gpt.wpe, gpt.blocks[0]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.block(self.wte(idx) + self.wpe(torch.arange(idx.shape[1])))


class Middle(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


class Last(nn.Module):
    def __init__(self, gpt: nn.Module) -> None:
        super().__init__()
        self.block, self.ln_f, self.lm_head = gpt.blocks[-1], gpt.ln_f, gpt.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(self.block(x)))


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def run_rank(rank: int, port: int, schedule_name: str, m: int, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    from autopar.models import GPT, GPTConfig
    from autopar.runtime.spawn import own_scheduling_group
    from autopar.tools.calibration_pipeline import _timed_stage_class

    own_scheduling_group()
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=LAYERS, n_head=8,
                        n_embd=WIDTH, tie_weights=False))  # fmt: skip
    module = (
        First(gpt) if rank == 0 else Last(gpt) if rank == WORLD - 1 else Middle(gpt.blocks[rank])
    )
    stage = _timed_stage_class()(module, rank, WORLD, torch.device("cpu"))
    schedule = (ScheduleGPipe if schedule_name == "gpipe" else Schedule1F1B)(
        stage, m, loss_fn=_loss
    )
    idx = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    target = torch.roll(idx, -1, dims=1)
    opt = torch.optim.SGD(module.parameters(), lr=1e-3)
    steps = []
    for k in range(WARM_UP + STEPS):
        stage.spans, stage.cpu_spans = [], []
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            schedule.step(idx)
        elif rank == WORLD - 1:
            schedule.step(target=target)
        else:
            schedule.step()
        end = time.perf_counter()
        opt.step()
        opt.zero_grad()
        if k >= WARM_UP:
            steps.append([start, end, [list(span) for span in stage.spans]])
    every: list[Any] = [None] * WORLD
    dist.all_gather_object(every, steps)
    if rank == 0:
        out.put(every)
    dist.destroy_process_group()


def measure(schedule: str, m: int) -> list[list[Any]]:
    """Per timed step, per rank ``[start, end, tasks]``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=run_rank, args=(r, port, schedule, m, out)) for r in range(WORLD)]
    for p in procs:
        p.start()
    every = out.get(timeout=600)
    for p in procs:
        p.join()
    return [[every[r][k] for r in range(WORLD)] for k in range(len(every[0]))]


def main(argv: list[str]) -> int:
    from benchmarks.pipeline_gaps import _figures, step_gaps

    for spec in argv or ["gpipe/8", "1f1b/8"]:
        schedule, m = spec.split("/")
        steps = measure(schedule, int(m))
        gaps = [g for ranks in steps for g in step_gaps(ranks, schedule, int(m))]
        walls = [max(r[1] for r in ranks) - min(r[0] for r in ranks) for ranks in steps]
        busy = [max(sum(t[2] - t[1] for t in r[2]) for r in ranks) for ranks in steps]
        idle = [1.0 - b / w for b, w in zip(busy, walls, strict=True)]
        print(f"{spec}: step {statistics.median(walls) * 1e3:.0f} ms, busiest rank idle "
              f"{statistics.median(idle):.3f}; local gaps {_figures([g for g in gaps if g.local])}; "
              f"remote {_figures([g for g in gaps if not g.local])}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
