"""What an autopar parallel module keeps in memory after construction, by kind.

    PYTHONPATH=. python benchmarks/module_heap.py                     # fsdp, 4 ranks, 2 layers
    PYTHONPATH=. python benchmarks/module_heap.py --layers 4 --pair ddp --world 2

The like-for-like benchmark's set-up on rank 0 of a gloo spawn: its GPT, its warm-up (one
build of the same variant at full size first, so one-time costs land elsewhere), then the
variant is built again and stepped twice under ``tracemalloc``. Printed: resident memory
(``VmRSS``) and Python heap (``tracemalloc``) the build added; the objects reachable from the
module by kind (counts: fx GraphModules and nodes, fake tensors, FakeTensorModes, ShapeEnvs,
exported programs, modules on the meta device); the heap the build left outside the module
(fx's global source cache of generated code); and, one kind at a time, what dropping it
frees (resident and heap; the module is unusable afterwards).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import sys
import tracemalloc
import types
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    add_model_options,
    batch_for,
    gloo_rank,
    memory_kib,
    spawn_ranks,
    warm_up,
)

FAKE_KEYS = ("val", "example_value", "tensor_meta")


def reachable(root: Any) -> tuple[dict[str, int], list[Any]]:
    """(counts by kind of the objects reachable from ``root``, its GraphModules); modules,
    classes and module globals are not followed. tests/unit/test_retained_state.py uses it."""
    import torch
    import torch.fx as fx
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    stop = {id(m.__dict__) for m in list(sys.modules.values()) if m is not None}
    kinds = {
        "GraphModule": fx.GraphModule,
        "fx.Node": fx.Node,
        "FakeTensor": FakeTensor,
        "FakeTensorMode": FakeTensorMode,
        "ShapeEnv": ShapeEnv,
        "ExportedProgram": torch.export.ExportedProgram,
        "nn.Module": torch.nn.Module,
    }
    counts = dict.fromkeys(kinds, 0)
    counts["meta tensors (not fake)"] = 0
    graphs: list[Any] = []
    seen: set[int] = set()
    todo = [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or id(obj) in stop or isinstance(obj, (types.ModuleType, type)):
            continue
        seen.add(id(obj))
        for name, cls in kinds.items():
            counts[name] += isinstance(obj, cls)
        if isinstance(obj, fx.GraphModule):
            graphs.append(obj)
        if isinstance(obj, torch.Tensor) and not isinstance(obj, FakeTensor) and obj.is_meta:
            counts["meta tensors (not fake)"] += 1
        todo.extend(gc.get_referents(obj))
    counts["objects"] = len(seen)
    return counts, graphs


def top_sites(diffs: list[Any], top: int) -> list[str]:
    """The heap left, summed by the innermost frame in autopar (or the benchmark) of each
    allocation: the ``top`` largest."""
    sums: dict[str, list[float]] = {}
    for diff in diffs:
        frames = list(diff.traceback)
        ours = next((f for f in reversed(frames) if "/autopar/" in f.filename), None)
        ours = ours or next((f for f in reversed(frames) if "benchmarks" in f.filename), None)
        key = "-" if ours is None else f"{'/'.join(ours.filename.split('/')[-2:])}:{ours.lineno}"
        entry = sums.setdefault(key, [0.0, 0])
        entry[0] += diff.size_diff
        entry[1] += diff.count_diff
    out = ["heap left, by the innermost autopar frame of the allocation (KiB, blocks):"]
    for key, (size, count) in sorted(sums.items(), key=lambda kv: -kv[1][0])[:top]:
        out.append(f"  {size / 1024:8.1f} {count:6d}  {key}")
    return out


def settle() -> tuple[float, float]:
    """(resident MiB, traced heap MiB) after a collection and a ``malloc_trim``."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return memory_kib()[0] / 1024, tracemalloc.get_traced_memory()[0] / 2**20


def run_rank(rank: int, port: int, args: argparse.Namespace, results: Any) -> None:
    import torch.fx.graph_module as fx_graph_module
    from peers import PAIRS

    import autopar

    with gloo_rank(rank, port, results, world_size=args.world):
        mesh = autopar.Mesh.from_world((args.world,), ("a0",))
        warm_up(autopar.Mesh.from_world((args.world,)))
        pair = PAIRS[args.pair]
        build = pair.peer if args.peer else pair.autopar
        # Traced from the warm-up build on, so that what a build frees of the one before (a
        # process-wide cache holding the latest capture) nets out.
        tracemalloc.start(args.frames)
        build(args, mesh, pair.optimizer).step(*batch_for(0, args))
        cache = fx_graph_module._loader.eval_cache
        sources_before = set(cache)
        rss0, heap0 = settle()
        snap0 = tracemalloc.take_snapshot()
        variant = build(args, mesh, pair.optimizer)
        for i in range(2):
            variant.step(*batch_for(i, args))
        rss1, heap1 = settle()
        snap1 = tracemalloc.take_snapshot()
        new_sources = [k for k in cache if k not in sources_before]
        lines = [
            f"{'peer' if args.peer else 'autopar'} {args.pair}, {args.world} ranks, {args.layers} layers (rank 0): the build and 2 "
            f"steps added {rss1 - rss0:.2f} MiB resident, {heap1 - heap0:.2f} MiB Python heap",
            f"fx source cache: {len(new_sources)} generated sources added, "
            f"{sum(len(cache[k]) for k in new_sources) / 2**20:.2f} MiB of text",
            "reachable from the module: "
            + ", ".join(f"{k} {v}" for k, v in reachable(variant.module)[0].items()),
        ]
        lines += top_sites(snap1.compare_to(snap0, "traceback"), args.top)
        if args.peer:
            if rank == 0:
                results.put(("ok", "\n".join(lines)))
            return
        pmodel = variant.module
        gms = reachable(pmodel)[1]

        def drop_fake() -> None:
            for gm in gms:
                for node in gm.graph.nodes:
                    for key in FAKE_KEYS:
                        node.meta.pop(key, None)

        def drop_meta() -> None:
            for gm in gms:
                for node in gm.graph.nodes:
                    node.meta.clear()

        def drop_sources() -> None:
            for key in new_sources:
                cache.pop(key, None)

        steps = [
            ("fake tensors in node.meta (val, example_value, tensor_meta)", drop_fake),
            ("the rest of node.meta (stack traces, module stacks, ...)", drop_meta),
            ("the train/eval re-lowering closure (meta skeleton, example batch)", None),
            ("the plan", None),
            ("fx's cached sources of the build's generated code", drop_sources),
        ]
        before = settle()
        for what, drop in steps:
            if drop is not None:
                drop()
            elif what.startswith("the train"):
                pmodel._lower_mode = None
            else:
                pmodel.plan = None
            after = settle()
            lines.append(
                f"  dropping {what}: frees {before[0] - after[0]:.2f} MiB resident, "
                f"{before[1] - after[1]:.2f} MiB heap"
            )
            before = after
        gc.collect()
        lines.append(
            "after the drops: " + ", ".join(f"{k} {v}" for k, v in reachable(pmodel)[0].items())
        )
        if rank == 0:
            results.put(("ok", "\n".join(lines)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default="fsdp")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--peer", action="store_true", help="measure the pair's PyTorch side")
    add_model_options(
        parser,
        variants=(),
        layers=2,
        seq=64,
        lr=1e-3,
        timeout_s=600.0,
        timeout_help="seconds for the spawn",
    )
    parser.add_argument("--frames", type=int, default=40, help="traceback depth kept")
    parser.add_argument("--top", type=int, default=30, help="allocation sites printed")
    args = parser.parse_args()
    print(spawn_ranks(run_rank, (args,), args.timeout, "module_heap", args.world))


if __name__ == "__main__":
    main()
