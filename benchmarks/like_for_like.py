"""autopar's runtime against PyTorch's, like for like: the same GPT, batch, optimizer and
sharded tensors on both sides of each pair, steps interleaved, on 2 ranks, 4 ranks and 2x2.

    python benchmarks/like_for_like.py                                 # every pair, every mesh
    python benchmarks/like_for_like.py --meshes 2 --pairs megatron ddp --reps 3 --steps 4

Pairs (benchmarks/peers.py): ``ddp`` vs torch DDP; ``megatron`` vs DTensor TP with the
vocab-parallel embedding and head and ``loss_parallel``; ``fsdp`` vs FSDP2; ``zero1`` (the ddp
plan with ZeRO stage 1) vs DDP + ZeroRedundancyOptimizer; ``recompute`` (the ddp recipe with
``checkpoint="all"``) vs DDP with every block under ``torch.utils.checkpoint``; ``fsdp+tp`` vs
FSDP2 + DTensor TP (2x2 only).

One spawn per mesh runs every variant in the same processes. After ``--warmup`` steps each,
the timed steps are interleaved: for each step index, every variant runs one step (the
order rotated from step to step), all ranks meeting at a barrier before each; a step's time is
the slowest rank's. This repeats ``--reps`` times; each repetition gives a ratio (autopar's
median step over its peer's), and the table shows the median ratio and its min-max. The "CPU
ratio" is the same for the CPU seconds a step costs the process (``time.process_time``: its
threads, gloo's included; the largest rank's), which waiting for a descheduled peer on a shared
machine does not inflate as it inflates wall time. "loss
diff" is the largest difference between the two sides' losses over every step (both run the
same batches from the same initial weights).

Then one more step per variant runs under ``torch.profiler`` (CPU, memory): its ATen op count
(top level, as dispatched from Python or autograd), its copies (``aten::copy_`` and ``aten::cat``
calls and the bytes they write), its collectives (gloo calls), the bytes it allocates, and the peak of live bytes it
allocates over the step's start. These counts do not depend on the machine's load.
"held MiB" is the resident memory the variant keeps after its set-up and warm-up (model,
shards, optimizer state, persistent buffers; resident size after ``gc.collect()``, set-up
sequential, MALLOC_MMAP_THRESHOLD_=64 KiB), "mem ratio" compares held + step peak.

Prints one table per mesh and writes benchmarks/out/like_for_like.json (no plot).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import OUT_DIR, batch_for, gloo_rank, memory_kib, spawn_ranks, warm_up  # noqa: E402

MESHES = ("2", "4", "2x2")
COPY_OPS = ("aten::copy_", "aten::cat")
"""Ops that copy data (clone and contiguous copy through ``aten::copy_``)."""


def mesh_shape(name: str) -> tuple[int, ...]:
    return tuple(int(n) for n in name.split("x"))


def profile_counts(step: Any, batch: tuple[Any, Any]) -> dict[str, float]:
    """One step under torch.profiler: op, copy, collective and allocation counts."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True) as p:
        step(*batch)
    events = sorted(p.events(), key=lambda e: e.time_range.start)
    ops = copies = copy_bytes = collectives = 0
    live = peak = allocated = 0
    names: dict[str, int] = {}
    for evt in events:
        # Each event's own allocations net of its frees, in start order: the running sum is
        # the live bytes allocated since the step began (at op granularity).
        live += evt.self_cpu_memory_usage
        peak = max(peak, live)
        allocated += max(evt.self_cpu_memory_usage, 0)
        if evt.name.startswith("gloo:"):
            collectives += 1
        if not evt.name.startswith("aten::"):
            continue
        parent = evt.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if parent is None:
            ops += 1
            names[evt.name] = names.get(evt.name, 0) + 1
        if evt.name in COPY_OPS:
            copies += 1
            if evt.name == "aten::cat":
                # The profiler records no shapes of a tensor list: cat writes what it allocates.
                copy_bytes += max(evt.self_cpu_memory_usage, 0)
            else:
                copy_bytes += 4 * _numel(evt.input_shapes[0] if evt.input_shapes else [])
    return {
        "ops": ops,
        "copies": copies,
        "copy_mib": copy_bytes / 2**20,
        "collectives": collectives,
        "alloc_mib": allocated / 2**20,
        "step_peak_mib": peak / 2**20,
        "op_names": dict(sorted(names.items(), key=lambda kv: -kv[1])),
    }


def _numel(shape: Any) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def warm_up_pairs(args: argparse.Namespace, mesh_name: str, mesh: Any) -> None:
    """Build each side of every pair once at full size and step it once, then drop it, so
    that one-time costs of each code path at these shapes (autopar's capture, planning,
    lowering and runtime modules and the heap they leave; DTensor TP, ZeroRedundancyOptimizer,
    checkpoint) land on no variant's held memory. Measured on the megatron pair (2 ranks): the
    first autopar variant built in a process held 9.0 MiB and a second, identical one 4.4 MiB
    (DTensor TP 4.7 MiB), with the same live tensor bytes (3.6 MiB); warmed on a tiny GPT
    instead, it still held 5.7 MiB against 4.0."""
    from peers import PAIRS

    for pair_name in args.pairs:
        pair = PAIRS[pair_name]
        if mesh_name in pair.meshes:
            for build in (pair.autopar, pair.peer):
                build(args, mesh, pair.optimizer).step(*batch_for(0, args))
                gc.collect()


def build_variants(args: argparse.Namespace, mesh_name: str, mesh: Any) -> dict[str, Any]:
    """Every variant of the pairs that run on this mesh, in a fixed order, with what it holds."""
    import torch.distributed as dist
    from peers import PAIRS

    variants: dict[str, Any] = {}
    for pair_name in args.pairs:
        pair = PAIRS[pair_name]
        if mesh_name not in pair.meshes:
            continue
        for name, build in ((f"autopar {pair_name}", pair.autopar), (pair.peer_name, pair.peer)):
            gc.collect()
            start_kib, _ = memory_kib()
            variant = build(args, mesh, pair.optimizer)
            for i in range(args.warmup):
                variant.step(*batch_for(i, args))
            dist.barrier()
            gc.collect()
            variant.held_kib = memory_kib()[0] - start_kib
            variants[name] = variant
    return variants


def interleaved(args: argparse.Namespace, variants: dict[str, Any]) -> tuple[Any, dict]:
    """(times[variant, rep, step] on this rank, losses per variant per batch index)."""
    import torch
    import torch.distributed as dist

    names = list(variants)
    # [variant, rep, step, (wall s, CPU s of this process)]
    times = torch.zeros(len(names), args.reps, args.steps, 2, dtype=torch.float64)
    losses: dict[str, dict[int, float]] = {name: {} for name in names}
    for rep in range(args.reps):
        for s in range(args.steps):
            index = args.warmup + rep * args.steps + s
            batch = batch_for(index, args)
            for k in range(len(names)):
                v = (k + s + rep) % len(names)
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                losses[names[v]][index] = variants[names[v]].step(*batch)
                times[v, rep, s, 0] = time.perf_counter() - t0
                times[v, rep, s, 1] = time.process_time() - c0
    return times, losses


def run_rank(rank: int, port: int, args: argparse.Namespace, mesh_name: str, results: Any) -> None:
    import torch
    import torch.distributed as dist

    import autopar

    shape = mesh_shape(mesh_name)
    world = _numel(shape)
    with gloo_rank(rank, port, results, world_size=world):
        torch.set_num_threads(1)
        names = ("dp", "tp") if len(shape) == 2 else ("a0",)
        mesh = autopar.Mesh.from_world(shape, names)
        # One-time costs (imports of torch.export and DTensor, gloo and allocator set-up) land
        # on no variant's held memory.
        warm_up(autopar.Mesh.from_world((world,)))
        warm_up_pairs(args, mesh_name, mesh)
        variants = build_variants(args, mesh_name, mesh)
        times, losses = interleaved(args, variants)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        index = args.warmup + args.reps * args.steps
        counts = {}
        for name, variant in variants.items():
            dist.barrier()
            counts[name] = profile_counts(variant.step, batch_for(index, args))
        held = torch.tensor([v.held_kib for v in variants.values()], dtype=torch.float64)
        dist.all_reduce(held, op=dist.ReduceOp.MAX)
        peaks = torch.tensor([c["step_peak_mib"] for c in counts.values()], dtype=torch.float64)
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        rows = {}
        for i, (name, variant) in enumerate(variants.items()):
            rows[name] = {
                "times_s": times[i, :, :, 0].tolist(),
                "cpu_s": times[i, :, :, 1].tolist(),
                "losses": [losses[name][k] for k in sorted(losses[name])],
                "held_mib": float(held[i]) / 1024,
                **counts[name],
                "step_peak_mib": float(peaks[i]),
                "note": variant.note,
            }
        if rank == 0:
            results.put(("ok", rows))


def pair_rows(rows: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per pair present: ratios per repetition, loss diff, profile counts."""
    from peers import PAIRS

    out = []
    for pair_name in args.pairs:
        ours, peer = f"autopar {pair_name}", PAIRS[pair_name].peer_name
        if ours not in rows or peer not in rows:
            continue
        a, b = rows[ours], rows[peer]
        ratios = [
            statistics.median(ta) / statistics.median(tb)
            for ta, tb in zip(a["times_s"], b["times_s"])
        ]
        cpu_ratios = [
            statistics.median(ta) / statistics.median(tb)
            for ta, tb in zip(a.get("cpu_s", []), b.get("cpu_s", []))
        ]
        mem_a = a["held_mib"] + a["step_peak_mib"]
        mem_b = b["held_mib"] + b["step_peak_mib"]
        out.append(
            {
                "pair": pair_name,
                "peer": peer,
                "ms": [1000 * statistics.median(sum(r["times_s"], [])) for r in (a, b)],
                "ratio": statistics.median(ratios),
                "ratio_min": min(ratios),
                "ratio_max": max(ratios),
                "cpu_ratio": [statistics.median(cpu_ratios), min(cpu_ratios), max(cpu_ratios)]
                if cpu_ratios
                else None,
                "loss_diff": max(abs(x - y) for x, y in zip(a["losses"], b["losses"])),
                "mem_ratio": mem_a / max(mem_b, 1e-9),
                **{key: [a[key], b[key]] for key in _COUNTED},
                "held_mib": [a["held_mib"], b["held_mib"]],
                "note": a["note"],
            }
        )
    return out


_COUNTED = ("ops", "copies", "copy_mib", "collectives", "alloc_mib", "step_peak_mib")


def report(mesh_name: str, pairs: list[dict[str, Any]], args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    out = Table(
        title=f"{mesh_name} gloo ranks: GPT {args.layers}x{args.n_embd} (vocab {args.vocab}), "
        f"global batch {args.batch}x{args.seq}; {args.reps} reps x {args.steps} interleaved "
        "steps; autopar / peer"
    )
    for col in (
        "pair",
        "peer",
        "step ms",
        "time ratio (min-max)",
        "CPU ratio (min-max)",
        "loss diff",
        "ops",
        "copies (MiB)",
        "colls",
        "alloc MiB",
        "step peak MiB",
        "held MiB",
        "mem ratio",
    ):
        out.add_column(col, justify="left" if col in ("pair", "peer") else "right")
    for row in pairs:
        a, b = row["ms"]
        out.add_row(
            row["pair"],
            row["peer"],
            f"{a:.0f} / {b:.0f}",
            f"{row['ratio']:.2f}x ({row['ratio_min']:.2f}-{row['ratio_max']:.2f})",
            _cpu_ratio(row),
            f"{row['loss_diff']:.1e}",
            "{} / {}".format(*row["ops"]),
            "{} ({:.1f}) / {} ({:.1f})".format(
                row["copies"][0], row["copy_mib"][0], row["copies"][1], row["copy_mib"][1]
            ),
            "{} / {}".format(*row["collectives"]),
            "{:.1f} / {:.1f}".format(*row["alloc_mib"]),
            "{:.1f} / {:.1f}".format(*row["step_peak_mib"]),
            "{:.1f} / {:.1f}".format(*row["held_mib"]),
            f"{row['mem_ratio']:.2f}x",
        )
    Console(width=200).print(out)


def _cpu_ratio(row: dict[str, Any]) -> str:
    """The CPU-seconds ratio of a pair row as "median (min-max)" ("-" in older runs)."""
    if not row.get("cpu_ratio"):
        return "-"
    return "{:.2f}x ({:.2f}-{:.2f})".format(*row["cpu_ratio"])


def markdown(results: dict[str, Any], before: dict[str, Any] | None) -> str:
    """The pairs of every mesh as one markdown table; with ``before`` (an earlier run's JSON
    results), its time ratio and copied / allocated MiB too, as before -> now."""
    lines = [
        "| ranks | pair | peer | time ratio (min-max) | CPU ratio (min-max) | loss diff | ops | "
        "copied MiB | allocated MiB | step peak MiB | held MiB | mem ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mesh_name, result in results.items():
        old = {}
        if before is not None and mesh_name in before:
            old = {row["pair"]: row for row in before[mesh_name]["pairs"]}
        for row in result["pairs"]:
            was = old.get(row["pair"])

            def pair_of(key: str, digits: int = 1, row: dict = row, was: Any = was) -> str:
                now = f"{row[key][0]:.{digits}f} / {row[key][1]:.{digits}f}"
                return now if was is None else f"{was[key][0]:.{digits}f} -> {now}"

            ratio = f"{row['ratio']:.2f}x ({row['ratio_min']:.2f}-{row['ratio_max']:.2f})"
            cpu = _cpu_ratio(row)
            if was is not None:
                ratio = f"{was['ratio']:.2f}x -> {ratio}"
                cpu = f"{_cpu_ratio(was)} -> {cpu}"
            lines.append(
                f"| {mesh_name} | {row['pair']} | {row['peer']} | {ratio} | {cpu} | "
                f"{row['loss_diff']:.1e} | {pair_of('ops', 0)} | {pair_of('copy_mib')} | "
                f"{pair_of('alloc_mib')} | {pair_of('step_peak_mib')} | {pair_of('held_mib')} | "
                f"{row['mem_ratio']:.2f}x |"
            )
    return "\n".join(lines)


def main() -> None:
    from peers import PAIRS

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="global batch (divisible by 4)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per repetition")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--meshes", nargs="+", default=list(MESHES), choices=MESHES)
    parser.add_argument("--pairs", nargs="+", default=list(PAIRS), choices=list(PAIRS))
    parser.add_argument(
        "--chunk-bytes",
        type=int,
        default=None,
        help="zero1: this ZeRO chunk size instead of the planner's priced one",
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per mesh")
    parser.add_argument("--out", default=str(OUT_DIR / "like_for_like.json"))
    parser.add_argument(
        "--table",
        nargs="+",
        metavar="JSON",
        help="print the markdown table of a run's JSON (a second JSON: an earlier run, shown "
        "as before -> now) and exit without measuring",
    )
    args = parser.parse_args()
    if args.table:
        now, *then = (json.loads(Path(p).read_text())["results"] for p in args.table)
        print(markdown(now, then[0] if then else None))
        return
    if args.batch % 4 or args.n_embd % args.heads or args.heads % 4:
        parser.error("--batch and --heads must be divisible by 4, --n-embd by --heads")

    started = time.perf_counter()
    results = {}
    for mesh_name in args.meshes:
        world = _numel(mesh_shape(mesh_name))
        rows = spawn_ranks(run_rank, (args, mesh_name), args.timeout, mesh_name, world)
        pairs = pair_rows(rows, args)
        report(mesh_name, pairs, args)
        results[mesh_name] = {"variants": rows, "pairs": pairs}
    Path(args.out).parent.mkdir(exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    print(f"wrote {args.out} in {time.perf_counter() - started:.0f} s (machine shared: ratios")
    print("are noisy; op, copy, collective and allocation counts are not)")


if __name__ == "__main__":
    main()
