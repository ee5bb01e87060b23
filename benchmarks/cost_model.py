"""How far to trust the cost model: calibrate, then predicted vs measured on real gloo ranks.

For each world size (2 ranks, one per core; 4 ranks, oversubscribed on 2 cores):

1. ``autopar calibrate`` on that many ranks (the profile then carries the contention of that
   world size);
2. for two models (a GPT and a LLaMA scaled so that compute is measurable on a CPU), plans on
   every mesh shape of that size (auto, ddp, megatron each; ZeRO recipes where the runtime runs
   them), all executed in one spawn by ``autopar.tools.bench_cost``;
3. prints per model: op MAPE per family, step MAPE, Spearman's rho over the plans, memory error,
   and the auto plan vs the fastest recipe measured in the same run; writes PNGs and a JSON.

    PYTHONPATH=. python benchmarks/cost_model.py                 # both world sizes, ~5 min
    PYTHONPATH=. python benchmarks/cost_model.py --world 2 --quick

The models are factories of this module (``benchmarks.cost_model:gpt``), so
``autopar bench-cost benchmarks.cost_model:gpt --mesh 2x2 --profile p.json`` runs one of them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch

from autopar.models import GPT, GPTConfig, Llama, LlamaConfig

WIDTH = 256
LAYERS = 2
VOCAB = 2048


def gpt(batch: int, seq: int) -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """A 2-layer GPT of width 256, 8 heads, vocabulary 2048 (about 3.7M parameters)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=seq, n_layer=LAYERS, n_head=8, n_embd=WIDTH))
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, VOCAB, (batch, seq), generator=g)
    return model, (idx, torch.randint(0, VOCAB, (batch, seq), generator=g))


def llama(batch: int, seq: int) -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """A 2-layer LLaMA of width 256, 8 heads (4 KV heads), FFN 688, vocabulary 2048."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, dim=WIDTH, n_layers=LAYERS, n_heads=8, n_kv_heads=4,
                         ffn_hidden=688, max_seq_len=seq)  # fmt: skip
    model = Llama(config)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, VOCAB, (batch, seq), generator=g)
    return model, (idx, torch.randint(0, VOCAB, (batch, seq), generator=g))


RECIPES = ("auto", "ddp", "megatron", "fsdp", "fsdp+tp", "replicated")
MODELS = {"gpt": "benchmarks.cost_model:gpt", "llama": "benchmarks.cost_model:llama"}


def meshes_for(world: int) -> list[str]:
    """Every mesh shape we plan on for a world size (1-D and 2-D)."""
    return {2: ["2"], 4: ["4", "2x2"]}[world]


def run_world(world: int, *, batch: int, seq: int, quick: bool, out_dir: str) -> dict[str, Any]:
    from autopar.capture.export import capture
    from autopar.mesh import Mesh
    from autopar.options import PlanOptions
    from autopar.presets import build_preset
    from autopar.tools.bench_cost import BenchConfig, ModelSpec, report_text, run_bench, summarize
    from autopar.tools.calibration import CalibrationConfig, calibrate
    from autopar.tools.report import plans_for_recipes, plot_op_scatter, plot_step_bars
    from cost_models import save_profile

    start = time.perf_counter()
    shape = (world,)
    profile = calibrate(shape, ("a0",), config=CalibrationConfig.tiny() if quick else CalibrationConfig(),
                        nproc=world, verbose=not quick)  # fmt: skip
    profile_path = os.path.join(out_dir, f"profile_{world}.json")
    save_profile(profile, profile_path)
    # A profile calibrated on a 1-D mesh of the world: every axis of every mesh gets its link.
    link = profile.links["a0"]
    config = BenchConfig(
        steps=3 if quick else 5, op_repeat_s=0.003 if quick else 0.01, ops_plan=f"auto@{meshes_for(world)[0]}"
    )
    report: dict[str, Any] = {"world": world, "profile": profile_path, "models": {}}
    for model_key, factory in MODELS.items():
        model, args, kwargs = build_preset(factory, batch=batch, seq=seq)
        captured = capture(model, args, kwargs)
        plans = {}
        for mesh_text in meshes_for(world):
            base = Mesh.parse(mesh_text, device=profile.device or "cpu")
            mesh = Mesh(shape=base.shape, axis_names=base.axis_names, device=base.device,
                        links=(link,) * base.ndim)  # fmt: skip
            made = plans_for_recipes(captured, mesh, PlanOptions(), recipes=RECIPES, model_name=model_key)
            for recipe, plan in made.items():
                plans[f"{recipe}@{mesh_text}"] = plan
        plans = _dedupe(plans)
        result = run_bench(ModelSpec(name=factory, batch=batch, seq=seq), plans, config, nproc=world)
        summary = summarize(result)
        title = f"{model_key}, {world} gloo ranks, batch {batch} x seq {seq}"
        print(report_text(result, summary, title=title, markdown=True))
        print(auto_vs_best(result))
        prefix = os.path.join(out_dir, f"cost_model_{model_key}_{world}")
        if result["ops"]:
            plot_op_scatter(result["ops"], f"{prefix}_ops.png", title=title)
        ran = [{"plan": n, "predicted_s": p["predicted_step_s"], "measured_s": p["step_s"]}
               for n, p in result["plans"].items() if "skipped" not in p]  # fmt: skip
        plot_step_bars(ran, f"{prefix}_steps.png", title=title)
        report["models"][model_key] = {"result": result, "summary": summary}
    report["seconds"] = time.perf_counter() - start
    return report


def _dedupe(plans: dict[str, Any]) -> dict[str, Any]:
    """Drop plans identical to an earlier one (same mesh and same choices): timing a plan twice
    would count the same point twice in the rank correlation."""
    seen: dict[tuple, str] = {}
    out = {}
    for name, plan in plans.items():
        zero = plan.data["zero"]
        key = (tuple(plan.data["mesh"]["shape"]), tuple(plan.choice or ()), zero["stage"] if zero["axes"] else 0)
        if key in seen:
            continue
        seen[key] = name
        out[name] = plan
    return out


def auto_vs_best(result: dict[str, Any]) -> str:
    """The auto plan(s) vs the fastest recipe measured in the same run, and where the cost
    model was wrong when auto is slower (the term whose predicted share is largest relative to
    the measured gap)."""
    plans = {n: p for n, p in result["plans"].items() if "skipped" not in p}
    autos = {n: p for n, p in plans.items() if n.startswith("auto")}
    recipes = {n: p for n, p in plans.items() if not n.startswith("auto")}
    if not autos or not recipes:
        return "auto vs best recipe: not enough executed plans"
    best_auto = min(autos, key=lambda n: autos[n]["step_s"])
    best = min(recipes, key=lambda n: recipes[n]["step_s"])
    a, b = autos[best_auto], recipes[best]
    ratio = a["step_s"] / b["step_s"]
    line = (f"auto vs best recipe: {best_auto} {a['step_s'] * 1e3:.1f} ms measured "
            f"({a['predicted_step_s'] * 1e3:.1f} ms predicted) vs {best} {b['step_s'] * 1e3:.1f} ms "
            f"({b['predicted_step_s'] * 1e3:.1f} ms predicted): auto is {ratio:.2f}x the recipe's time")  # fmt: skip
    if ratio > 1.0:
        pa, pb = a["predicted_breakdown"], b["predicted_breakdown"]
        diffs = {k: pb[k] - pa[k] for k in pa}
        term = max(diffs, key=lambda k: diffs[k])
        line += (f"; the model predicted auto faster by {sum(diffs.values()) * 1e3:.2f} ms, most "
                 f"of it in {term} ({diffs[term] * 1e3:.2f} ms), which the measurement contradicts")  # fmt: skip
    return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, action="append", choices=[2, 4], help="world sizes (default 2 and 4)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--quick", action="store_true", help="small calibration and few steps")
    parser.add_argument("--out", default="benchmarks/out", help="folder for PNGs, profiles, JSON")
    args = parser.parse_args(argv)
    from autopar.tools.report import plotting_unavailable

    missing = plotting_unavailable()  # this benchmark writes PNGs: say so before measuring
    if missing is not None:
        parser.error(missing)
    os.makedirs(args.out, exist_ok=True)
    reports = []
    for world in args.world or [2, 4]:
        reports.append(run_world(world, batch=args.batch, seq=args.seq, quick=args.quick, out_dir=args.out))
    print("\n| world | model | plans | step MAPE | Spearman | op MAPE | memory MAPE |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for rep in reports:
        for model_key, m in rep["models"].items():
            s = m["summary"]
            print(f"| {rep['world']} | {model_key} | {s['num_plans']} | {s['step_mape']:.1f}% | "
                  f"{s['spearman']:.3f} | {s['op_mape']:.1f}% | {s['memory_mape']:.1f}% |")  # fmt: skip
    with open(os.path.join(args.out, "cost_model.json"), "w") as f:
        json.dump(reports, f, indent=1, default=str)
    print(f"command: PYTHONPATH=. python benchmarks/cost_model.py {' '.join(sys.argv[1:])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
