"""How far to trust the cost model: calibrate, then predicted vs measured on real gloo ranks.

For each world size (2 ranks, one per core; 4 ranks, oversubscribed on 2 cores):

1. ``autopar calibrate`` on every mesh shape of that size (2; 4 and 2x2), each on itself (the
   profile then carries the contention of that world size and the group sizes of that mesh);
2. for three models (an MLP, a GPT and a LLaMA scaled so that compute is measurable on a CPU),
   plans on every mesh shape (auto and the recipes of ``--recipes``; ZeRO recipes where the
   runtime runs them), planned with that mesh's profile as calibrated and all executed in one
   spawn per model by ``autopar.tools.bench_cost`` (steps of the plans interleaved);
3. prints per model: step MAPE, Spearman's rho over the plans, memory error, the auto plan vs
   the fastest recipe; then one table of rows (model, mesh): every plan's predicted and measured
   ms, auto / best measured recipe with its spread over ``--reps`` repetitions, Spearman per row
   and pooled (``auto_vs_recipes_rows``); writes PNGs and a JSON (``--tables-from`` prints the
   table of earlier JSONs).

    PYTHONPATH=. python benchmarks/cost_model.py --world 4 --no-ops --reps 3 --steps 4 \
        --recipes ddp,megatron,fsdp,fsdp+tp                        # ~4 min on 2 loaded cores
    PYTHONPATH=. python benchmarks/cost_model.py --world 2 --quick

The models are factories of this module (``benchmarks.cost_model:gpt``), so
``autopar bench-cost benchmarks.cost_model:gpt --mesh 2x2 --profile p.json`` runs one of them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from typing import Any

import torch

from autopar.models import GPT, MLP, GPTConfig, Llama, LlamaConfig, MLPConfig
from cost_models.calibrate import spearman

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


def mlp(batch: int, seq: int) -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """A 3-layer MLP 256 -> 1024 -> 1024 -> 256 (about 1.6M parameters) on batch x seq rows."""
    torch.manual_seed(0)
    model = MLP(MLPConfig(in_features=WIDTH, hidden=4 * WIDTH, out_features=WIDTH, num_layers=3))
    g = torch.Generator().manual_seed(1)
    return model, (
        torch.randn(batch * seq, WIDTH, generator=g),
        torch.randn(batch * seq, WIDTH, generator=g),
    )


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
MODELS = {
    "mlp": "benchmarks.cost_model:mlp",
    "gpt": "benchmarks.cost_model:gpt",
    "llama": "benchmarks.cost_model:llama",
}


def meshes_for(world: int) -> list[str]:
    """Every mesh shape we plan on for a world size (1-D and 2-D)."""
    return {2: ["2"], 4: ["4", "2x2"]}[world]


def run_world(world: int, *, batch: int, seq: int, quick: bool, out_dir: str, models: list[str],
              steps: int, ops: bool, profile_paths: dict[str, str], recipes: tuple[str, ...] = RECIPES,
              auto_margin: float | str | None = None) -> dict[str, Any]:  # fmt: skip
    from autopar.capture.export import capture
    from autopar.mesh import Mesh
    from autopar.options import PlanOptions
    from autopar.presets import build_preset
    from autopar.tools.bench_cost import BenchConfig, ModelSpec, report_text, run_bench, summarize
    from autopar.tools.calibration import CalibrationConfig, calibrate
    from autopar.tools.report import plans_for_recipes, plot_op_scatter, plot_step_bars
    from cost_models import load_profile, save_profile

    start = time.perf_counter()
    # One calibration per mesh shape, on that mesh (as `autopar calibrate --mesh 2x2` does): a
    # 2x2 mesh's axes are groups of 2 contending with the other group, not a ring of 4.
    meshes = {}
    for mesh_text in meshes_for(world):
        path = profile_paths.get(mesh_text)
        if path is None:
            base = Mesh.parse(mesh_text, device="cpu")
            names = tuple(f"a{i}" for i in range(base.ndim))
            profile = calibrate(base.shape, names, config=CalibrationConfig.tiny() if quick else CalibrationConfig(),
                                nproc=world, verbose=not quick)  # fmt: skip
            path = os.path.join(out_dir, f"profile_{mesh_text}.json")
            save_profile(profile, path)
        meshes[mesh_text] = profile_mesh(mesh_text, load_profile(path))
        profile_paths[mesh_text] = path
    config = BenchConfig(
        steps=steps,
        measure_ops=ops,
        op_repeat_s=0.003 if quick else 0.01,
        ops_plan=f"auto@{meshes_for(world)[0]}",
    )
    report: dict[str, Any] = {"world": world, "profiles": dict(profile_paths), "models": {}}
    for model_key in models:
        factory = MODELS[model_key]
        model, args, kwargs = build_preset(factory, batch=batch, seq=seq)
        captured = capture(model, args, kwargs)
        plans = {}
        decisions = {}
        for mesh_text in meshes_for(world):
            made = plans_for_recipes(
                captured,
                meshes[mesh_text],
                PlanOptions(auto_margin=auto_margin),
                recipes=recipes,
                model_name=model_key,
            )
            choice = decisions[mesh_text] = made["auto"].data.get("auto_choice") or {}
            if choice.get("chosen", "auto") != "auto":
                # The recipe was kept within the profile's error: run the ILP's own plan too
                # ("ilp"), so the table shows what the margin bought (never a "best recipe").
                made["ilp"] = plans_for_recipes(captured, meshes[mesh_text], PlanOptions(auto_margin=0.0),
                                                recipes=("auto",), model_name=model_key)["auto"]  # fmt: skip
            for recipe, plan in made.items():
                plans[f"{recipe}@{mesh_text}"] = plan
        plans, aliases = _dedupe(plans)
        result = run_bench(
            ModelSpec(name=factory, batch=batch, seq=seq), plans, config, nproc=world
        )
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
        report["models"][model_key] = {"result": result, "summary": summary, "aliases": aliases,
                                       "decisions": decisions}  # fmt: skip
    report["seconds"] = time.perf_counter() - start
    return report


def _dedupe(plans: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """Drop plans identical to an earlier one (same mesh and same choices): timing a plan twice
    would count the same point twice in the rank correlation. Returns the kept plans and, per
    dropped name, the kept plan it equals."""
    seen: dict[tuple, str] = {}
    out = {}
    aliases = {}
    for name, plan in plans.items():
        zero = plan.data["zero"]
        key = (
            tuple(plan.data["mesh"]["shape"]),
            tuple(plan.choice or ()),
            zero["stage"] if zero["axes"] else 0,
        )
        if key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        out[name] = plan
    return out, aliases


def auto_vs_best(result: dict[str, Any]) -> str:
    """The auto plan(s) vs the fastest recipe measured in the same run, and where the cost
    model was wrong when auto is slower (the term whose predicted share is largest relative to
    the measured gap)."""
    plans = {n: p for n, p in result["plans"].items() if "skipped" not in p}
    autos = {n: p for n, p in plans.items() if n.startswith("auto")}
    recipes = {n: p for n, p in plans.items() if not n.startswith(("auto", "ilp"))}
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


def _rep_medians(times: list[float], reps: int) -> list[float]:
    """The median of each of ``reps`` consecutive groups of timed steps (one repetition each)."""
    size = max(1, len(times) // reps)
    return [
        statistics.median(times[i * size : (i + 1) * size]) for i in range(min(reps, len(times)))
    ]


def _mesh_rows(reports: list[dict[str, Any]]):
    """(report, model, its result, mesh, the measured plans on that mesh) for every row that
    has an auto plan."""
    for rep in reports:
        for model_key, m in rep["models"].items():
            plans = {n: p for n, p in m["result"]["plans"].items() if "skipped" not in p}
            for mesh in meshes_for(rep["world"]):
                row = {n: p for n, p in plans.items() if p["mesh"] == mesh}
                if f"auto@{mesh}" in row:
                    yield rep, model_key, m, mesh, row


def auto_vs_recipes_rows(
    reports: list[dict[str, Any]], reps: int
) -> tuple[list[dict[str, Any]], str]:
    """One row per (model, mesh): every plan's predicted and measured (median) ms, the auto plan
    over the fastest measured recipe on that mesh (median and min-max over ``reps`` repetitions,
    each the median of its share of the interleaved steps), Spearman's rho of predicted vs
    measured over the plans of the row; then rho pooled over all rows (every plan's times
    divided by its row's auto, so that rows of different models share one scale)."""
    rows: list[dict[str, Any]] = []
    pooled_pred: list[float] = []
    pooled_meas: list[float] = []
    for rep, model_key, m, mesh, row in _mesh_rows(reports):
        auto = f"auto@{mesh}"
        recipes = [n for n in row if n != auto and not n.startswith("ilp@")]
        best = min(recipes, key=lambda n: row[n]["step_s"])
        auto_reps = _rep_medians(row[auto]["step_times_s"], reps)
        best_reps = _rep_medians(row[best]["step_times_s"], reps)
        ratios = [a / b for a, b in zip(auto_reps, best_reps)]
        pred = [row[n]["predicted_step_s"] for n in row]
        meas = [row[n]["step_s"] for n in row]
        pooled_pred += [v / row[auto]["predicted_step_s"] for v in pred]
        pooled_meas += [v / row[auto]["step_s"] for v in meas]
        same = sorted(a.split("@")[0] for a, kept in m["aliases"].items() if kept == auto)
        rows.append({"world": rep["world"], "model": model_key, "mesh": mesh, "best": best,
                             "plans": {n.split("@")[0]: (row[n]["predicted_step_s"], row[n]["step_s"]) for n in row},
                             "auto_equals": same, "ratio": row[auto]["step_s"] / row[best]["step_s"],
                             "ratio_median": statistics.median(ratios),
                             "ratio_min": min(ratios), "ratio_max": max(ratios),
                             "spearman": spearman(pred, meas),
                             "decision": m.get("decisions", {}).get(mesh) or {}})  # fmt: skip
    lines = ["| ranks | model | mesh | auto predicted / measured ms | recipes predicted / measured ms "
             "| auto / best measured recipe: medians of all steps; per repetition median (min-max) | Spearman |", "|---|---|---|---|---|---|---:|"]  # fmt: skip
    for r in rows:
        auto_p, auto_m = r["plans"]["auto"]
        alias = f" (= {', '.join(r['auto_equals'])})" if r["auto_equals"] else ""
        if r["decision"]:
            d = r["decision"]
            alias += (f" [ILP gain {d['predicted_gain']:.1%} vs {d['recipe']}, margin "
                      f"{d['margin']:.1%}: {d['chosen']}]")  # fmt: skip
        others = "; ".join(f"{n} {p * 1e3:.0f} / {q * 1e3:.0f}" for n, (p, q) in
                           sorted(r["plans"].items(), key=lambda kv: kv[1][1]) if n != "auto")  # fmt: skip
        lines.append(f"| {r['world']} | {r['model']} | {r['mesh']} | {auto_p * 1e3:.0f} / {auto_m * 1e3:.0f}{alias} | "
                     f"{others} | {r['ratio']:.2f}x vs {r['best'].split('@')[0]}; per repetition {r['ratio_median']:.2f}x "
                     f"({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) | "
                     f"{r['spearman']:.2f} |")  # fmt: skip
    pooled = spearman(pooled_pred, pooled_meas) if len(pooled_pred) > 2 else math.nan
    mean_rho = statistics.mean(r["spearman"] for r in rows) if rows else math.nan
    lines.append(f"\nSpearman pooled over all rows (times relative to the row's auto): {pooled:.2f}; "
                 f"mean of the rows: {mean_rho:.2f}")  # fmt: skip
    return rows, "\n".join(lines)


def paired_and_margin_lines(reports: list[dict[str, Any]]) -> str:
    """Per row (model, mesh): the per-step paired ratio of the auto plan to each recipe (the
    steps of one round run back to back, so load that drifts between rounds cancels): median
    and min-max over the steps; then what each margin rule of ``auto_margin`` would have run
    on the row, priced by the row's own predictions and judged by its measured medians:
    margin 0 (the ILP's plan), ``"profile"`` (``paired_error``, else ``step_error``) and
    ``step_error`` (a
    margin keeps the fastest predicted recipe when the auto plan's predicted gain over it is
    below the margin). The chosen plan's measured median over the best measured recipe's."""
    from cost_models import load_profile

    lines = ["| ranks | model | mesh | auto / recipe per step: median (min-max) | "
             "chosen with margin 0 / 'profile' (paired_error, else step_error) / step_error: measured / best recipe |",
             "|---|---|---|---|---|"]  # fmt: skip
    for rep in reports:
        errors = {}
        for mesh, path in rep.get("profiles", {}).items():
            device = load_profile(path).device
            errors[mesh] = (device.paired_error, device.step_error)
        for _, model_key, m, mesh, row in _mesh_rows([rep]):
            auto = f"auto@{mesh}"
            cells = []
            for name in sorted(row, key=lambda n: row[n]["step_s"]):
                if name == auto:
                    continue
                r = [a / b for a, b in zip(row[auto]["step_times_s"], row[name]["step_times_s"])]
                cells.append(
                    f"{name.split('@')[0]} {statistics.median(r):.2f} ({min(r):.2f}-{max(r):.2f})"
                )
            # Candidates of the margin rule: every recipe (those equal to auto are auto).
            pred = {n: row[n]["predicted_step_s"] for n in row if not n.startswith(("auto", "ilp"))}
            for alias, kept in m["aliases"].items():
                if kept == auto and alias.endswith(f"@{mesh}"):
                    pred[alias] = row[auto]["predicted_step_s"]
            best_meas = min(row[n]["step_s"] for n in row if not n.startswith(("auto", "ilp")))
            ilp = f"ilp@{mesh}" if f"ilp@{mesh}" in row else auto  # the ILP's own plan
            paired, step = errors.get(mesh, (math.nan, math.nan))
            picks = []
            for margin in (0.0, paired if paired > 0 else step, step):
                chosen, tag = ilp, "ilp"
                best = min(pred, key=lambda n: pred[n]) if pred else None
                if best and margin > 0:
                    gain = (pred[best] - row[ilp]["predicted_step_s"]) / pred[best]
                    if gain < margin:  # a recipe equal to the auto plan ran as "auto"
                        chosen, tag = (best if best in row else auto), best.split("@")[0]
                picks.append(f"{tag} {row[chosen]['step_s'] / best_meas:.2f}x (m={margin:.1%})")
            lines.append(
                f"| {rep['world']} | {model_key} | {mesh} | {'; '.join(cells)} | {'; '.join(picks)} |"
            )
    return "\n".join(lines)


def profile_mesh(mesh_text: str, profile: Any) -> Any:
    """The mesh ``mesh_text`` with the device and the links (axes ``a0``, ``a1``, ...) of a
    calibrated ``profile``."""
    from autopar.mesh import Mesh

    base = Mesh.parse(mesh_text, device="cpu")
    links = tuple(profile.links[f"a{i}"] for i in range(base.ndim))
    return Mesh(shape=base.shape, axis_names=base.axis_names, device=profile.device or "cpu",
                links=links)  # fmt: skip


def refit_links(profile: Any) -> Any:
    """``profile`` with every link's collectives and wait between computations fitted again
    (``cost_models.calibrate.fit_link_kind``, ``chain_sync_s``, as this code fits) from the
    timings its calibration stored (``meta.measurements``)."""
    import dataclasses

    from cost_models.calibrate import chain_sync_s, fit_link_kind

    measured = (profile.meta or {}).get("measurements", {})
    shape = profile.meta["mesh"]["shape"]
    links = {}
    for name, link in profile.links.items():
        fits = dict(link.collectives)
        for kind in fits:
            timed = measured.get(f"{name}/{kind}")
            if timed:
                size = shape[int(name[1:])]
                fits[kind] = fit_link_kind(timed["bytes"], timed["seconds"], kind, size)[0]
        alpha, beta = fits.get("all_reduce", (link.latency_s, 1.0 / link.bandwidth_Bps))
        link = dataclasses.replace(
            link, collectives=fits, latency_s=alpha, bandwidth_Bps=1.0 / beta
        )
        sync = measured.get(f"{name}/sync", {})
        if {"seconds_per_call", "bytes", "group_size"} <= sync.keys():  # else the stored wait
            timed = sync["seconds_per_call"]
            sync_s, _ = chain_sync_s(link, timed["mixed"], timed["compute"], sync["bytes"],
                                     sync["group_size"])  # fmt: skip
            link = dataclasses.replace(link, sync_s=sync_s)
        links[name] = link
    return dataclasses.replace(profile, links=links)


def reprice(reports: list[dict[str, Any]], batch: int, seq: int, refit: bool = False) -> list[str]:
    """Price every plan of earlier runs (at ``batch`` x ``seq``, as they ran) again with this
    code and each run's own profiles, in place (``predicted_step_s``; the measured steps
    kept): what a cost-model change does to the same measurements; with ``refit``, each
    profile's collectives and wait fitted again from its stored timings first
    (:func:`refit_links`). Returns a line per plan whose predicted compute
    changed (its layout did, so its measured step is not of the plan priced now)."""
    from autopar.capture.export import capture
    from autopar.options import PlanOptions
    from autopar.presets import build_preset
    from autopar.tools.report import plans_for_recipes
    from cost_models import load_profile

    moved = []
    for rep in reports:
        meshes = {}
        for mesh_text, path in rep["profiles"].items():
            profile = load_profile(path)
            meshes[mesh_text] = profile_mesh(mesh_text, refit_links(profile) if refit else profile)
        for model_key, m in rep["models"].items():
            model, args, kwargs = build_preset(MODELS[model_key], batch=batch, seq=seq)
            captured = capture(model, args, kwargs)
            for name, ran in m["result"]["plans"].items():
                recipe, mesh_text = name.split("@")
                options = PlanOptions(auto_margin=0.0) if recipe == "ilp" else PlanOptions()
                recipe = "auto" if recipe == "ilp" else recipe
                plan = plans_for_recipes(captured, meshes[mesh_text], options, recipes=(recipe,),
                                         model_name=model_key)[recipe]  # fmt: skip
                predicted = plan.data["predicted"]
                before = ran.get("predicted_breakdown", {}).get("compute_s")
                if before is not None and abs(predicted["breakdown"]["compute_s"] - before) > 1e-9:
                    moved.append(f"{rep['world']} {model_key} {name}: another layout now")
                ran["predicted_step_s"] = predicted["step_s"]
                ran["predicted_breakdown"] = predicted["breakdown"]
    return moved


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--world", type=int, action="append", choices=[2, 4], help="world sizes (default 2 and 4)"
    )
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--quick", action="store_true", help="small calibration and few steps")
    parser.add_argument("--out", default="benchmarks/out", help="folder for PNGs, profiles, JSON")
    parser.add_argument(
        "--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}"
    )
    parser.add_argument(
        "--recipes", default=",".join(RECIPES), help="plans to run (auto is always run)"
    )
    parser.add_argument("--tables-from", nargs="+", metavar="JSON",
                        help="print the auto-vs-recipes table of earlier runs' cost_model.json files and exit")  # fmt: skip
    parser.add_argument("--reprice", action="store_true",
                        help="with --tables-from: price the runs' plans again with this code and their own profiles")  # fmt: skip
    parser.add_argument("--refit", action="store_true",
                        help="with --reprice: fit the profiles' collectives again from their stored timings")  # fmt: skip
    parser.add_argument(
        "--reps", type=int, default=3, help="repetitions (groups of interleaved steps)"
    )
    parser.add_argument("--steps", type=int, default=5, help="timed steps per plan per repetition")
    parser.add_argument("--no-ops", action="store_true", help="do not time the ops one by one")
    parser.add_argument("--auto-margin", default=None,
                        help="PlanOptions.auto_margin for the auto plan: a fraction or 'profile' (default 0)")  # fmt: skip
    parser.add_argument("--profile", action="append", default=[], metavar="MESH=PATH",
                        help="use this calibrated profile for a mesh (e.g. 2x2=p.json) instead of calibrating")  # fmt: skip
    args = parser.parse_args(argv)
    from autopar.tools.report import plotting_unavailable

    missing = plotting_unavailable()  # this benchmark writes PNGs: say so before measuring
    if missing is not None:
        parser.error(missing)
    if args.tables_from:
        reports = [rep for path in args.tables_from for rep in json.load(open(path))]  # noqa: SIM115
        if args.reprice:
            for line in reprice(reports, args.batch, args.seq, refit=args.refit):
                print(f"warning: {line}; its measured step is of the plan as run")
        print(auto_vs_recipes_rows(reports, args.reps)[1])
        print(paired_and_margin_lines(reports))
        return 0
    os.makedirs(args.out, exist_ok=True)
    reports = []
    recipes = tuple(dict.fromkeys(["auto", *args.recipes.split(",")]))
    profiles = dict(item.split("=", 1) for item in args.profile)
    models = args.models.split(",")
    margin = args.auto_margin if args.auto_margin in (None, "profile") else float(args.auto_margin)
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        parser.error(f"--models: unknown {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    for world in args.world or [2, 4]:
        reports.append(run_world(world, batch=args.batch, seq=args.seq, quick=args.quick, out_dir=args.out,
                                 models=models, steps=args.reps * args.steps, ops=not args.no_ops,
                                 profile_paths=profiles, recipes=recipes, auto_margin=margin))  # fmt: skip
    print("\n| world | model | plans | step MAPE | Spearman | op MAPE | memory MAPE |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for rep in reports:
        for model_key, m in rep["models"].items():
            s = m["summary"]
            print(f"| {rep['world']} | {model_key} | {s['num_plans']} | {s['step_mape']:.1f}% | "
                  f"{s['spearman']:.3f} | {s['op_mape']:.1f}% | {s['memory_mape']:.1f}% |")  # fmt: skip
    with open(os.path.join(args.out, "cost_model.json"), "w") as f:
        json.dump(reports, f, indent=1, default=str)
    print(
        "\nThe auto plan vs the recipes (predicted / measured ms per step; measured: slowest rank, median)"
    )
    print(auto_vs_recipes_rows(reports, args.reps)[1])
    print(paired_and_margin_lines(reports))
    print(f"command: PYTHONPATH=. python benchmarks/cost_model.py {' '.join(sys.argv[1:])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
