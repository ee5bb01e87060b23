"""What is alive at the peak of one training step, per rank, for both sides of a like-for-like
pair (benchmarks/peers.py): the tensors the step allocates, by the op that made them.

    PYTHONPATH=. python benchmarks/step_live_bytes.py                   # fsdp, 4 ranks
    PYTHONPATH=. python benchmarks/step_live_bytes.py --pair fsdp --world 2 --top 12
    PYTHONPATH=. python benchmarks/step_live_bytes.py --timeline-mib 0.9  # + profiler timeline

Each rank runs the like-for-like set-up (the same GPT, warm-ups, optimizer), then one step of
each variant under a ``TorchDispatchMode`` that records every storage an op creates during the
step (an output whose storage no input shares), with the op, the phase (forward, backward,
optimizer) and the shape, and after every op sums the live bytes of the storages created so
far (``nbytes()`` at that moment: a storage resized to 0, as FSDP2 frees its unsharded
parameters, counts 0). Printed per rank and variant: the peak, the op it was reached at, and
what was alive then, grouped by (phase, op, shape); and what the step left alive. The peak is
at op granularity, as ``like_for_like.py``'s profiler count is (which it also prints). That
count also sees what the dispatch mode cannot: gloo's staging buffers, allocated inside the
collectives (on gloo's threads too). ``--timeline-mib`` prints a third, profiled step's events
that allocate or free at least that much, with the running sum the benchmark's peak is taken
of. The README's "Session 24" reads the 4-rank fsdp pair with it.
"""

from __future__ import annotations

import argparse
import gc
import sys
import weakref
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import batch_for, gloo_rank, spawn_ranks, warm_up  # noqa: E402


def _tracker() -> Any:
    """A dispatch mode that tracks the storages created under it (module docstring)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class LiveBytes(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.live: dict[int, tuple[Any, str, str, tuple[int, ...]]] = {}
            self.phase = "forward"
            self.peak = 0
            self.peak_at = ""
            self.peak_set: Counter[tuple[str, str, tuple[int, ...]]] = Counter()

        def total(self) -> int:
            total = 0
            for ref, *_ in self.live.values():
                storage = ref()
                if storage is not None:
                    total += storage.nbytes()
            return total

        def snapshot(self) -> Counter[tuple[str, str, tuple[int, ...]]]:
            out: Counter[tuple[str, str, tuple[int, ...]]] = Counter()
            for ref, op, phase, shape in self.live.values():
                storage = ref()
                if storage is not None and storage.nbytes():
                    out[(phase, op, shape)] += storage.nbytes()
            return out

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            inputs = {
                _ptr(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
            }
            phase = self.phase
            if phase == "forward" and torch._C._current_graph_task_id() != -1:
                phase = "backward"
            for t in tree_flatten(out)[0]:
                if not isinstance(t, torch.Tensor):
                    continue
                storage = t.untyped_storage()
                ptr = _ptr(t)
                if ptr is None or ptr in inputs or not storage.nbytes() or id(storage) in self.live:
                    continue
                key = id(storage)
                self.live[key] = (weakref.ref(storage), str(func), phase, tuple(t.shape))
                weakref.finalize(storage, self.live.pop, key, None)
            total = self.total()
            if total > self.peak:
                self.peak, self.peak_at = total, f"{phase} {func}"
                self.peak_set = self.snapshot()
            return out

    return LiveBytes


def _ptr(t: Any) -> int | None:
    """The tensor's storage address (None where torch cannot say: an invalidated storage)."""
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:
        return None


def traced_step(variant: Any, batch: Any) -> dict[str, Any]:
    """One step of ``variant`` under the tracker: peak, where, and what was alive."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    mode = _tracker()()
    # The optimizer step is the last phase: tag it by the optimizers' global pre-step hook.
    with mode:
        handle = register_optimizer_step_pre_hook(lambda *a: setattr(mode, "phase", "optimizer"))
        try:
            variant.step(*batch)
        finally:
            handle.remove()
    gc.collect()
    return {
        "peak_mib": mode.peak / 2**20,
        "peak_at": mode.peak_at,
        "at_peak": mode.peak_set,
        "after_mib": mode.total() / 2**20,
        "after": mode.snapshot(),
    }


def profiled_timeline(step: Any, batch: Any, min_bytes: int) -> list[str]:
    """One step under torch.profiler (as ``like_for_like.profile_counts`` counts its peak): the
    events that allocate or free at least ``min_bytes``, with the running sum, in start order
    (gloo's own threads included: its collectives allocate staging buffers there)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as p:
        step(*batch)
    live = peak = 0
    lines = []
    for evt in sorted(p.events(), key=lambda e: e.time_range.start):
        live += evt.self_cpu_memory_usage
        peak = max(peak, live)
        if abs(evt.self_cpu_memory_usage) >= min_bytes:
            parent = evt.cpu_parent
            while parent is not None and parent.cpu_parent is not None:
                parent = parent.cpu_parent
            lines.append(
                f"    {evt.self_cpu_memory_usage / 2**20:+7.2f} -> {live / 2**20:6.2f}  "
                f"{evt.name} (thread {evt.thread}, in {parent.name if parent else '-'})"
            )
    lines.append(f"    peak {peak / 2**20:.2f} MiB")
    return lines


def run_rank(rank: int, port: int, args: argparse.Namespace, results: Any) -> None:
    import torch.distributed as dist
    from like_for_like import profile_counts
    from peers import PAIRS

    import autopar

    with gloo_rank(rank, port, results, world_size=args.world):
        mesh = autopar.Mesh.from_world((args.world,), ("a0",))
        warm_up(autopar.Mesh.from_world((args.world,)))
        pair = PAIRS[args.pair]
        report = []
        for name, build in (("autopar", pair.autopar), ("peer", pair.peer)):
            variant = build(args, mesh, pair.optimizer)
            for i in range(args.warmup):
                variant.step(*batch_for(i, args))
            dist.barrier()
            counts = profile_counts(variant.step, batch_for(args.warmup, args))
            dist.barrier()
            traced = traced_step(variant, batch_for(args.warmup + 1, args))
            if args.timeline_mib:
                dist.barrier()
                timeline = profiled_timeline(
                    variant.step, batch_for(args.warmup + 2, args), int(args.timeline_mib * 2**20)
                )
                traced["timeline"] = timeline
            report.append((name, counts["step_peak_mib"], traced))
            del variant
            gc.collect()
        lines = [f"== rank {rank}"]
        for name, profiled, t in report:
            lines.append(
                f"{name}: profiler step peak {profiled:.2f} MiB; traced peak {t['peak_mib']:.2f}"
                f" MiB at {t['peak_at']}; left after the step {t['after_mib']:.2f} MiB"
            )
            for (phase, op, shape), nbytes in t["at_peak"].most_common(args.top):
                lines.append(f"    {nbytes / 2**20:7.3f}  {phase:9s} {op} {list(shape)}")
            rest = sum(t["at_peak"].values()) - sum(
                b for _, b in t["at_peak"].most_common(args.top)
            )
            lines.append(f"    {rest / 2**20:7.3f}  (the rest)")
            for (phase, op, shape), nbytes in t["after"].most_common(4):
                lines.append(f"    after: {nbytes / 2**20:7.3f}  {phase} {op} {list(shape)}")
            lines += t.get("timeline", [])
        gathered: list[Any] = [None] * args.world
        dist.all_gather_object(gathered, "\n".join(lines))
        if rank == 0:
            results.put(("ok", "\n".join(gathered)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pair", default="fsdp")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument(
        "--timeline-mib",
        type=float,
        default=0.0,
        help="also print a profiled step's events that allocate or free at least this many MiB",
    )
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    print(spawn_ranks(run_rank, (args,), 900.0, "step_live_bytes", args.world))


if __name__ == "__main__":
    main()
