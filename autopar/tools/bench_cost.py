"""The cost-model benchmark: predicted vs measured op times, step times and peak memory.

Every rank (spawned here on 127.0.0.1 with gloo, or started by torchrun) builds the model, and:

1. **Per op** (``measure_ops``): for each node of the captured graph that does work, with the
   shardings of one plan (the auto plan by default), makes random inputs of the node's LOCAL
   shapes and times the ATen op forward plus backward (backward only where the planner prices
   one); the prediction is the node's planned compute seconds. Identical calls (repeated layers)
   are timed once. Ops whose arguments encode global sizes that local inputs contradict are
   counted as skipped. All ranks time at the same time (the contention a real step sees) and the
   timings are averaged over ranks.
2. **Per plan** (``prepare_plan``, ``time_plans``): lowers the captured graph with the plan's strategies
   (``autopar.lowering.lower``), wraps it in ``ParallelModule`` and times training steps
   (forward, backward and the gradient reduction; the optimizer step is not priced and not
   timed); the slowest rank's median step counts. Peak memory: the bytes of the local parameters
   and optimizer state (AdamW, after a warm-up step) plus the largest growth of allocated memory
   during forward and backward (``mallinfo2`` sampled after every ATen op; on CUDA the
   allocator's peak). Plans with ZeRO run only where the runtime supports ZeRO; otherwise they
   are skipped with a note.

``summarize`` turns the rank-0 results into MAPE per op family, step-time MAPE, Spearman's rank
correlation between predicted and measured plan ordering, and the memory error; ``report_text``
prints them (both in :mod:`autopar.tools.bench_report`, re-exported here). Peak memory is sampled
by :class:`autopar.tools.peak_memory.PeakMemory`.
"""

from __future__ import annotations

import inspect
import math
import os
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx

from autopar.tools.bench_report import report_text, summarize
from autopar.tools.calibration import spawn_local
from autopar.tools.peak_memory import PeakMemory
from autopar.tools.timing import fwd_bwd_callable, time_callable
from cost_models import matmul_flops


@dataclass(frozen=True, kw_only=True, slots=True)
class BenchConfig:
    """How much to measure."""

    steps: int = 5
    """Timed training steps per plan (after ``warmup`` untimed ones)."""
    warmup: int = 2
    op_repeat_s: float = 0.01
    """Each op timing repeats the op for at least this long."""
    op_trials: int = 3
    measure_ops: bool = True
    ops_plan: str = "auto"
    """The plan whose shardings the per-op measurement uses."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """What every rank builds: ``autopar.presets.build_preset(name, batch=, seq=)`` on CPU."""

    name: str
    batch: int
    seq: int


# --------------------------------------------------------------------------------------------
# Per-op measurement


def _loss(output: Any) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.loss


def measure_ops(
    captured: Any,
    plan_data: Mapping[str, Any],
    config: BenchConfig,
    device: torch.device,
) -> dict[str, Any]:
    """Predicted vs measured forward+backward seconds of every op under the plan's shardings.

    Returns ``{"ops": [{"name", "family", "target", "count", "predicted_s", "measured_s"}],
    "skipped": [(name, reason)]}`` (measured times of this rank; identical calls share one
    entry with their ``count``).
    """
    from autopar.capture.export import ASSERT_OPS
    from autopar.capture.flops import op_family
    from autopar.placement import local_shape
    from autopar.plan.document import Plan
    from autopar.planner.space import grad_nodes
    from autopar.strategies import input_nodes

    plan = Plan(data=dict(plan_data))
    choices = plan.choices()
    entries = {e["name"]: e for e in plan_data["nodes"]}
    mesh_shape = tuple(plan_data["mesh"]["shape"])
    needs = grad_nodes(captured.gm, captured.param_nodes)
    groups: dict[Any, dict[str, Any]] = {}
    skipped: list[tuple[str, str]] = []
    generator = torch.Generator(device=device).manual_seed(0)
    for node in captured.gm.graph.nodes:
        if node.op != "call_function" or node.name not in entries or node.target in ASSERT_OPS:
            continue
        family = op_family(node.target)
        if family == "view":
            continue
        strategy = choices[node.name]
        inputs = input_nodes(node)
        if not inputs:
            skipped.append((node.name, "no tensor inputs (a factory)"))
            continue
        sigs = []
        for j, inp in enumerate(inputs):
            val = inp.meta.get("val")
            if not isinstance(val, torch.Tensor):
                sigs = None
                break
            placements = strategy.inputs[j] if j < len(strategy.inputs) else None
            shape = tuple(val.shape) if placements is None else local_shape(tuple(val.shape), placements, mesh_shape)
            grad = inp.name in needs and val.dtype.is_floating_point and node.name in needs
            sigs.append((tuple(int(s) for s in shape), val.dtype, grad))
        if sigs is None:
            skipped.append((node.name, "an input is not a single tensor"))
            continue
        constants = repr(fx.node.map_arg((node.args, node.kwargs), lambda n: None))
        key = (node.target, tuple(sigs), constants, entries[node.name]["compute_s"])
        if key in groups:
            groups[key]["count"] += 1
            continue
        real: dict[fx.Node, torch.Tensor] = {}
        for inp, (shape, dtype, grad) in zip(inputs, sigs):
            if dtype.is_floating_point:
                t = torch.randn(shape, dtype=dtype, device=device, generator=generator)
                real[inp] = t.requires_grad_(grad)
            else:
                real[inp] = torch.zeros(shape, dtype=dtype, device=device)
        args = fx.node.map_arg(node.args, real.__getitem__)
        kwargs = fx.node.map_arg(node.kwargs, real.__getitem__)
        try:
            fn = fwd_bwd_callable(node.target, list(args), dict(kwargs))
            seconds = time_callable(fn, device=device, min_time_s=config.op_repeat_s, trials=config.op_trials)
        except Exception as exc:  # noqa: BLE001 - an op that cannot run on local shapes alone
            skipped.append((node.name, f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"))
            # Kept as NaN: every rank then reduces the same list of ops, whichever rank failed.
            seconds = math.nan
        groups[key] = {
            "name": node.name,
            "family": family,
            "target": str(node.target),
            "count": 1,
            "predicted_s": float(entries[node.name]["compute_s"]),
            "measured_s": seconds,
        }
    return {"ops": list(groups.values()), "skipped": skipped}


# --------------------------------------------------------------------------------------------
# Per-plan execution


def zero_supported() -> bool:
    """Whether ``ParallelModule`` can run ZeRO (the runtime's ZeRO engine is present)."""
    from autopar.runtime.module import ParallelModule

    return "zero_stage" in inspect.signature(ParallelModule.__init__).parameters


@dataclass(kw_only=True)
class PreparedPlan:
    """One plan ready to run on this rank: its module, local inputs and optimizer."""

    pmodel: Any
    optimizer: Any
    local_args: tuple[Any, ...]
    local_kwargs: dict[str, Any]

    def step(self) -> None:
        """Forward, backward and the gradient reduction (what the step time counts)."""
        _loss(self.pmodel(*self.local_args, **self.local_kwargs)).backward()

    def update(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def state_bytes(self) -> int:
        """Bytes of the local parameters and optimizer state."""
        seen: set[int] = set()
        total = 0
        for p in self.pmodel.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel() * p.element_size()
        for state in self.optimizer.state.values():
            total += sum(
                t.numel() * t.element_size()
                for t in state.values()
                if isinstance(t, torch.Tensor) and t.dim() > 0
            )
        return total


def prepare_plan(
    captured: Any,
    model: torch.nn.Module,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    plan_data: Mapping[str, Any],
    groups: Any,
) -> PreparedPlan | str:
    """Lower one plan and build its ParallelModule and AdamW; a string says why it cannot run."""
    from autopar.lowering import lower
    from autopar.plan.document import Plan
    from autopar.runtime.module import ParallelModule

    zero = plan_data["zero"]
    names = list(plan_data["mesh"]["axis_names"])
    extra: dict[str, Any] = {}
    if zero["stage"]:
        if not zero_supported():
            return f"ZeRO stage {zero['stage']} is not executable by this runtime yet"
        stages = zero.get("stages") or {}
        if len({v for v in stages.values() if v}) > 1:  # per-axis stages
            extra = {"zero_stage": tuple(stages.get(n, 0) for n in names)}
        else:
            extra = {"zero_stage": zero["stage"], "zero_axes": [names.index(a) for a in zero["axes"]]}
        # The plan's chunk size, as autoparallelize runs it (the runtime's own search, for plans
        # without one, makes at least 8 chunks: not the collectives the plan priced).
        extra["chunk_bytes"] = zero.get("chunk_bytes")
    lowered = lower(captured, Plan(data=dict(plan_data)).choices(), groups.mesh_shape, groups.key)
    pmodel = ParallelModule(lowered, model, groups, **extra)
    local = pmodel.shard_inputs(*args, **kwargs)
    local_args, local_kwargs = local if kwargs else (local, {})
    optimizer = torch.optim.AdamW(pmodel.parameters(), lr=1e-4)
    return PreparedPlan(pmodel=pmodel, optimizer=optimizer, local_args=tuple(local_args), local_kwargs=dict(local_kwargs))


def time_plans(prepared: Mapping[str, PreparedPlan], config: BenchConfig, device: torch.device) -> dict[str, dict[str, Any]]:
    """Median step seconds and peak bytes per plan on this rank. Steps of the plans are
    interleaved (one step of each plan in turn), so load from other processes on a shared
    machine falls on every plan alike instead of on whichever ran at a bad moment."""
    for plan in prepared.values():
        for _ in range(config.warmup):
            plan.step()
            plan.update()
    times: dict[str, list[float]] = {name: [] for name in prepared}
    for _ in range(config.steps):
        for name, plan in prepared.items():
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            plan.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[name].append(time.perf_counter() - start)
            plan.update()
    out = {}
    for name, plan in prepared.items():
        dist.barrier()
        with PeakMemory(device) as peak:
            plan.step()
        plan.optimizer.zero_grad(set_to_none=True)
        memory = None if peak.peak_delta is None else float(plan.state_bytes() + peak.peak_delta)
        out[name] = {"step_s": statistics.median(times[name]), "step_times_s": times[name], "peak_memory_bytes": memory}
    return out


# --------------------------------------------------------------------------------------------
# The job on every rank


def _reduce(values: list[float], op: Any) -> list[float]:
    # NCCL reduces CUDA tensors only (gloo either).
    nccl = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else None
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return t.tolist()


def bench_on_rank(model_spec: ModelSpec, plans: Mapping[str, Mapping[str, Any]], config: BenchConfig) -> dict[str, Any]:
    """Run the benchmark on this rank (inside an initialized process group); the result (the
    same on every rank) has ``ops`` (per-op entries, timings averaged over ranks), ``skipped_ops``
    and ``plans`` (per plan: predicted and measured step seconds and peak bytes, or ``skipped``)."""
    from autopar.capture.export import capture
    from autopar.comm.process_groups import axis_groups
    from autopar.presets import build_preset

    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    model, args, kwargs = build_preset(model_spec.name, batch=model_spec.batch, seq=model_spec.seq, device=device)
    captured = capture(model, args, kwargs)
    out: dict[str, Any] = {"ops": [], "skipped_ops": [], "plans": {}, "load_average": list(os.getloadavg())}
    if config.measure_ops and config.ops_plan in plans:
        ops = measure_ops(captured, plans[config.ops_plan], config, device)
        mean = _reduce([o["measured_s"] for o in ops["ops"]], dist.ReduceOp.SUM)
        for entry, total in zip(ops["ops"], mean):
            entry["measured_s"] = total / dist.get_world_size()
        out["ops"] = [o for o in ops["ops"] if math.isfinite(o["measured_s"])]  # NaN: failed somewhere
        out["skipped_ops"] = ops["skipped"]
    mesh_groups: dict[tuple, Any] = {}
    prepared: dict[str, PreparedPlan] = {}
    skipped: dict[str, str] = {}
    for name, data in plans.items():
        if data["model"]["graph_hash"] != captured.graph_hash:
            raise ValueError(
                f"plan {name!r} was made for another graph than {model_spec.name} at batch "
                f"{model_spec.batch}, seq {model_spec.seq}; plan with the same model and sizes"
            )
        key = (tuple(data["mesh"]["shape"]), tuple(data["mesh"]["axis_names"]))
        if key not in mesh_groups:
            mesh_groups[key] = axis_groups(key[0], key[1], key=f"bench-{len(mesh_groups)}")
        try:
            ready = prepare_plan(captured, model, args, kwargs, data, mesh_groups[key])
        except Exception as exc:  # noqa: BLE001 - a plan the runtime cannot execute is reported
            ready = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        if isinstance(ready, str):
            skipped[name] = ready
        else:
            prepared[name] = ready
    # A plan that failed to build on any rank is skipped on every rank (ranks running
    # different plans would pair mismatched collectives and hang).
    built = _reduce([1.0 if name in prepared else 0.0 for name in plans], dist.ReduceOp.MIN)
    for name, ok in zip(list(plans), built):
        if not ok and name in prepared:
            del prepared[name]
            skipped[name] = "failed to build on another rank"
    probe_start = _matmul_rate(device)
    measured = time_plans(prepared, config, device)
    out["matmul_flops_during_run"] = (probe_start + _matmul_rate(device)) / 2
    for name, data in plans.items():
        if name in skipped:
            result: dict[str, Any] = {"skipped": skipped[name]}
        else:
            m = measured[name]
            # step_times_s: every timed step, the slowest rank's (for the spread over repetitions)
            step_s, memory, *steps = _reduce([m["step_s"], m["peak_memory_bytes"] or -1.0, *m["step_times_s"]], dist.ReduceOp.MAX)
            result = {"step_s": step_s, "step_times_s": steps, "peak_memory_bytes": memory if memory >= 0 else None}
        result["predicted_step_s"] = data["predicted"]["step_s"]
        result["predicted_breakdown"] = data["predicted"]["breakdown"]
        result["predicted_peak_memory_bytes"] = data["predicted"]["peak_memory_bytes"]
        result["mesh"] = "x".join(str(s) for s in data["mesh"]["shape"])
        out["plans"][name] = result
    return out


def _matmul_rate(device: torch.device) -> float:
    """fp32 FLOP/s of a square matmul now (512 on CPU, 8192 on a GPU: sizes near the
    calibration's largest), averaged over ranks (machine speed drift probe)."""
    n = 8192 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device)
    seconds = time_callable(lambda: a @ a, device=device, min_time_s=0.05, trials=3)
    return _reduce([matmul_flops(n, n, n) / seconds], dist.ReduceOp.SUM)[0] / dist.get_world_size()


def _bench_rank(rank: int, world_size: int, model_spec: ModelSpec, plans: dict, config: BenchConfig) -> dict | None:
    result = bench_on_rank(model_spec, plans, config)
    return result if rank == 0 else None


def run_bench(
    model_spec: ModelSpec,
    plans: Mapping[str, Any],
    config: BenchConfig,
    *,
    nproc: int | None = None,
) -> dict[str, Any]:
    """Execute the benchmark for ``plans`` (name -> Plan) on ``nproc`` spawned gloo ranks, or,
    with ``nproc=None``, on the ranks of the current job (torchrun)."""
    datas = {name: (p.data if hasattr(p, "data") else dict(p)) for name, p in plans.items()}
    peak = next(iter(datas.values()))["mesh"]["device"]["peak_flops"].get("float32")
    sizes = {math.prod(d["mesh"]["shape"]) for d in datas.values()}
    if len(sizes) != 1:
        raise ValueError(f"every plan must use the same number of devices, got {sorted(sizes)}")
    if nproc is not None:
        if nproc not in sizes:
            raise ValueError(f"the plans need {sizes.pop()} ranks but nproc is {nproc}")
        return {**spawn_local(_bench_rank, nproc, model_spec, datas, config)[0], "calibrated_flops": peak}
    if not dist.is_initialized():
        import datetime

        from autopar.runtime.spawn import pg_timeout_s

        timeout = datetime.timedelta(seconds=pg_timeout_s())
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout=timeout)
    return {**bench_on_rank(model_spec, datas, config), "calibrated_flops": peak}


def bench_cost_cli(args: Any, config: BenchConfig) -> int:
    """``autopar bench-cost``: plan, execute, print, plot."""
    import json

    from autopar.capture.export import capture
    from autopar.mesh import Mesh
    from autopar.options import PlanOptions
    from autopar.presets import build_preset
    from autopar.tools.report import plans_for_recipes, plot_op_scatter, plot_prefix, plot_step_bars

    prefix = plot_prefix(args.plots, "bench_cost", "--plots")  # before hours of measuring
    links = args.links.split(",") if args.links else None
    device = args.device if args.profile or args.device != "h100" else "cpu"
    mesh = Mesh.parse(args.mesh, device=device, links=links, profile=args.profile)
    under_torchrun = "WORLD_SIZE" in os.environ and args.nproc is None
    rank = int(os.environ.get("RANK", "0")) if under_torchrun else 0
    options = PlanOptions(memory_budget=args.budget, optimizer=args.optimizer, solver=args.solver,
                          time_limit_s=args.time_limit, gap=args.gap, auto_margin=args.auto_margin)
    model, ex_args, ex_kwargs = build_preset(args.model, batch=args.batch, seq=args.seq)
    captured = capture(model, ex_args, ex_kwargs)
    recipes = [r for r in args.recipes.split(",") if r]
    plans = plans_for_recipes(captured, mesh, options, recipes=recipes, model_name=args.model)
    nproc = None if under_torchrun else (args.nproc or mesh.num_devices)
    result = run_bench(ModelSpec(name=args.model, batch=args.batch, seq=args.seq), plans, config, nproc=nproc)
    if rank != 0:
        return 0
    summary = summarize(result)
    title = f"{args.model} on {mesh.describe()}"
    print(report_text(result, summary, markdown=args.markdown, title=title))
    ran = [{"plan": n, "predicted_s": p["predicted_step_s"], "measured_s": p["step_s"]}
           for n, p in result["plans"].items() if "skipped" not in p]
    written = []
    if prefix is not None and result["ops"]:
        written.append(f"{prefix}_ops.png")
        plot_op_scatter(result["ops"], written[-1], title=title)
    if prefix is not None and ran:
        written.append(f"{prefix}_steps.png")
        plot_step_bars(ran, written[-1], title=title)
    if written:
        print(f"plots written to {' and '.join(written)}")
    if getattr(args, "html", None):
        from autopar.tools.html_report import write_comparison_html

        write_comparison_html(args.html, plans, title=title, bench=(result, summary))
        print(f"report written to {args.html}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"result": result, "summary": summary, "config": asdict(config)}, f, indent=1, default=str)
    return 0
