"""Where a plan's step goes, node by node, against the planner's per-node price (issue 13).

    PYTHONPATH=. python benchmarks/node_times_in_situ.py benchmarks.cost_model:gpt --mesh 2 \
        --profile p_2.json --recipes ddp,megatron,fsdp --steps 12

``bench_cost_terms`` splits a step into collectives and the rest; this splits it by node of the
lowered graph, on real gloo ranks, one training step of each plan in turn:

- forward: each node run by an ``fx.Interpreter`` that times it (a collective node's time holds
  its copy, its autograd Function and the call);
- backward: a pre-hook on the ``grad_fn`` of each node's output stamps the time; the interval
  to the next stamp is that node's backward (its inner autograd nodes included; work that
  runs in backward hooks, such as the gradient buckets' all-reduces, lands on the node whose
  backward ran just before it);
- every ``torch.distributed`` collective the step issues: its wall time (until ``wait()`` on
  asynchronous ones) and the time since the previous collective ended (the computation before
  it, which sets its wait: README "Session 11").

Per plan it prints, per op kind, the median forward and backward ms against the plan's
``compute_s`` and ``seconds`` (compute plus the communication priced on that node), and per
collective call its bytes, the computation before it and its in-situ time against its price
(``collective_time_s`` with the profile's link, ``sync_s`` included). The interpreter adds about
10 us per node, so the per-node sums run a little above ``bench_cost_terms``' steps.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CALLS = ("all_reduce", "all_gather_single", "reduce_scatter_single", "all_to_all_single")
KIND_OF_CALL = {
    "all_reduce": "all_reduce",
    "all_gather_single": "all_gather",
    "reduce_scatter_single": "reduce_scatter",
    "all_to_all_single": "all_to_all",
}


def _timed_graph(gm: Any, rec: dict[str, Any]) -> Any:
    """``gm`` run by an interpreter that times each node and stamps each output's backward."""
    import torch
    import torch.fx as fx

    class Timed(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            start = time.perf_counter()
            out = super().run_node(n)
            rec["fwd"][n.name].append(time.perf_counter() - start)
            first = out[0] if isinstance(out, (tuple, list)) and out else out
            if isinstance(first, torch.Tensor) and first.grad_fn is not None:
                stamps = rec["stamps"]
                first.grad_fn.register_prehook(
                    lambda _g, name=n.name: stamps.append((time.perf_counter(), name))
                )
            return out

    return lambda *args: Timed(gm).run(*args)


def _instrument(dist: Any, calls: list[list[Any]], last: list[float]) -> None:
    """Record ``[call, bytes, wall s, s since the previous collective]`` of each collective."""

    class Work:
        def __init__(self, work: Any, entry: list[Any]) -> None:
            self._work, self._entry = work, entry

        def wait(self, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            out = self._work.wait(*args, **kwargs)
            last[0] = time.perf_counter()
            self._entry[2] += last[0] - start
            return out

    for name in CALLS:
        original = getattr(dist, name)

        def call(*args: Any, _fn: Any = original, _name: str = name, **kwargs: Any) -> Any:
            start = time.perf_counter()
            out = _fn(*args, **kwargs)
            tensor = args[0] if _name == "all_reduce" else args[1]
            nbytes = tensor.numel() * tensor.element_size()
            if _name == "all_gather_single":
                nbytes = args[0].numel() * args[0].element_size()  # the full output, as priced
            entry = [_name, nbytes, time.perf_counter() - start, start - last[0]]
            calls.append(entry)
            last[0] = time.perf_counter()
            return Work(out, entry) if out is not None else out

        setattr(dist, name, call)


def _rank(rank: int, world: int, factory: str, mesh: tuple[int, ...], datas: dict[str, Any],
          steps: int, batch: int, seq: int) -> dict[str, Any]:  # fmt: skip
    import torch
    import torch.distributed as dist

    from autopar.capture.export import capture
    from autopar.comm.process_groups import axis_groups
    from autopar.presets import build_preset
    from autopar.tools.bench_cost import _loss, prepare_plan

    calls: list[list[Any]] = []
    last = [0.0]
    _instrument(dist, calls, last)
    torch.manual_seed(0)
    model, args, kwargs = build_preset(factory, batch=batch, seq=seq)
    captured = capture(model, args, kwargs)
    groups = axis_groups(mesh, tuple(f"a{i}" for i in range(len(mesh))), key="in_situ")
    plans = {n: prepare_plan(captured, model, args, kwargs, d, groups) for n, d in datas.items()}
    recs: dict[str, dict[str, Any]] = {}
    for name, plan in plans.items():
        rec = recs[name] = {"fwd": defaultdict(list), "bwd": defaultdict(list), "stamps": [],
                            "calls": [], "step": []}  # fmt: skip
        # A ZeRO plan runs its own rewrite of the graph (chunk gathers inserted, not an fx
        # GraphModule): its step and collectives are timed, not its nodes.
        if plan.pmodel.zero is None:
            lowered = plan.pmodel.lowered
            object.__setattr__(lowered, "gm", _timed_graph(lowered.gm, rec))
    for step in range(steps + 2):  # two warm-up steps
        for name, plan in plans.items():
            rec = recs[name]
            dist.barrier()
            rec["stamps"].clear()
            calls.clear()
            start = last[0] = time.perf_counter()
            _loss(plan.pmodel(*plan.local_args, **plan.local_kwargs)).backward()
            end = time.perf_counter()
            plan.update()
            if step < 2:
                rec["fwd"].clear()
                continue
            rec["step"].append(end - start)
            rec["calls"].append([list(c) for c in calls])
            stamps = [*rec["stamps"], (end, "")]
            for (t0, node), (t1, _) in zip(stamps, stamps[1:]):
                rec["bwd"][node].append(t1 - t0)
    return {
        name: {
            "fwd": {k: statistics.median(v) for k, v in rec["fwd"].items()},
            "bwd": {k: statistics.median(v) for k, v in rec["bwd"].items()},
            "step": statistics.median(rec["step"]),
            "calls": [
                [
                    *rec["calls"][0][i][:2],
                    statistics.median(s[i][2] for s in rec["calls"]),
                    statistics.median(s[i][3] for s in rec["calls"]),
                ]  # fmt: skip
                for i in range(len(rec["calls"][0]))
            ],
        }
        for name, rec in recs.items()
    }


def op_kind(node: dict[str, Any]) -> str:
    """``linear``, ``layer_norm``, ...: the ATen op's name, or the node's for lowering-made ones."""
    op = node["op"]
    return op.split(".")[1] if op.startswith("aten.") else op


def kind_table(measured: dict[str, Any], plan: dict[str, Any]) -> list[tuple[str, list[float]]]:
    """Per op kind: [forward ms, backward ms, predicted compute ms, predicted seconds ms, nodes];
    nodes the lowering inserted (collectives, zero-outs) under their own names."""
    nodes = {n["name"]: n for n in plan["nodes"]}
    rows: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0, 0])
    for name in set(measured["fwd"]) | set(measured["bwd"]):
        node = nodes.get(name)
        kind = op_kind(node) if node else name.rstrip("_0123456789")
        row = rows[kind]
        row[0] += measured["fwd"].get(name, 0.0) * 1e3
        row[1] += measured["bwd"].get(name, 0.0) * 1e3
        if node:
            row[2] += node["compute_s"] * 1e3
            row[3] += node["seconds"] * 1e3
        row[4] += 1
    return sorted(rows.items(), key=lambda kv: -(kv[1][0] + kv[1][1] + kv[1][3]))


def report(res: list[dict[str, Any]], plans: dict[str, Any], link: Any, group: int) -> str:
    """Markdown tables of rank 0's medians (module docstring)."""
    from cost_models import collective_time_s

    out = []
    for name, plan in plans.items():
        measured = res[0][name]
        pred = plan["predicted"]
        out += [f"\n{name}: step {measured['step'] * 1e3:.1f} ms measured (rank 0, median), "
                f"{pred['step_s'] * 1e3:.1f} ms predicted",  # fmt: skip
                "| op kind | nodes | forward ms | backward ms | sum | predicted compute / seconds ms |",
                "|---|---:|---:|---:|---:|---|"]  # fmt: skip
        for kind, (fwd, bwd, comp, secs, count) in kind_table(measured, plan):
            if fwd + bwd + secs >= 0.05:
                out.append(f"| {kind} | {count} | {fwd:.2f} | {bwd:.2f} | {fwd + bwd:.2f} "
                           f"| {comp:.2f} / {secs:.2f} |")  # fmt: skip
        out += ["| collective | bytes | computation before ms | in situ ms (ranks 0 / 1) | priced ms |",
                "|---|---:|---:|---|---:|"]  # fmt: skip
        for i, (call, nbytes, wall, gap) in enumerate(measured["calls"]):
            other = res[1][name]["calls"][i][2] if len(res) > 1 else float("nan")
            priced = collective_time_s(KIND_OF_CALL[call], nbytes, group, link)
            out.append(f"| {call} | {nbytes} | {gap * 1e3:.2f} | {wall * 1e3:.2f} / {other * 1e3:.2f} "
                       f"| {priced * 1e3:.2f} |")  # fmt: skip
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    import math
    import os

    from autopar.runtime.spawn import spawn_ranks
    from autopar.tools.bench_cost_terms import plans_from_command_line

    args, mesh, made = plans_from_command_line(
        __doc__.splitlines()[0], argv, recipes="ddp,megatron", auto=False
    )
    if mesh.ndim != 1:
        raise ValueError(f"--mesh {args.mesh}: this benchmark prices collectives on a 1-D mesh")
    plans = {n: p.data for n, p in made.items()}
    load = os.getloadavg()
    res = spawn_ranks(_rank, math.prod(mesh.shape), args.model, mesh.shape, plans, args.steps,
                      args.batch, args.seq, timeout_s=600, env={"OMP_NUM_THREADS": "1"})  # fmt: skip
    print(f"load average before / after: {load} / {os.getloadavg()}")
    print(report(res, plans, mesh.link("a0"), mesh.shape[0]))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
