"""The split backward's two passes on one pipeline stage, in one process (issue 15).

    PYTHONPATH=. python benchmarks/weight_pass_time.py
    PYTHONPATH=. python benchmarks/weight_pass_time.py --blocks 8 --reps 20

A stage of ``--blocks`` GPT blocks (width 256, 4 heads, a microbatch of 2 x 128): torch's input
pass (``stage_backward_input``), then autopar's weight pass as the runtime runs it where the
stage does not recompute (the cut pass) and where it does (the replay pass), against the
stage's whole backward. Median milliseconds over ``--reps`` runs, one thread.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()

    import torch
    from torch.distributed.pipelining._backward import stage_backward_input

    from autopar.models import GPT, GPTConfig
    from autopar.runtime.pipeline_backward import weight_pass

    torch.manual_seed(0)
    torch.set_num_threads(1)
    config = GPTConfig(vocab_size=512, block_size=128, n_layer=args.blocks, n_head=4, n_embd=256)
    blocks = GPT(config).blocks
    params = list(blocks.parameters())

    def loss_of():
        x = torch.randn(2, 128, 256, requires_grad=True)
        h = x
        for block in blocks:
            h = block(h)
        return x, h.square().mean()

    def split(replay: bool) -> tuple[float, float]:
        x, loss = loss_of()
        start = time.perf_counter()
        _, groups = stage_backward_input([loss], None, [x], iter(params))
        middle = time.perf_counter()
        weight_pass(params, groups, replay=replay)
        end = time.perf_counter()
        for p in params:
            p.grad = None
        return middle - start, end - middle

    def whole() -> float:
        _, loss = loss_of()
        start = time.perf_counter()
        loss.backward()
        end = time.perf_counter()
        for p in params:
            p.grad = None
        return end - start

    rows = {}
    for _ in range(2):  # the first round warms up
        rows = {"cut": [], "replay": [], "whole": []}
        for _ in range(args.reps):
            rows["cut"].append(split(False))
            rows["replay"].append(split(True))
            rows["whole"].append((whole(), 0.0))
    full = statistics.median(t for t, _ in rows["whole"]) * 1e3
    print(f"stage of {args.blocks} GPT blocks: whole backward {full:.2f} ms")
    print("weight pass   input pass ms   weight pass ms   (input + weight) / whole")
    for name in ("cut", "replay"):
        first = statistics.median(t for t, _ in rows[name]) * 1e3
        second = statistics.median(t for _, t in rows[name]) * 1e3
        print(f"{name:12s}  {first:13.2f}   {second:14.2f}   {(first + second) / full:.2f}")


if __name__ == "__main__":
    main()
