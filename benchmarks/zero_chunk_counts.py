"""ZeRO's collectives per step: what the plan prices (before and after pricing per chunk) vs
what the runtime issues, counted on real gloo ranks.

For each model of ``benchmarks/cost_model.py`` and mesh of a world size, the recipes ``ddp``,
``fsdp`` and ``fsdp+tp`` and the auto plan with ZeRO stage 1 and 2 forced (``zero1``,
``zero2``) are planned on the ``cpu`` preset (or ``--profile MESH=PATH``), then run one step
each (after two warm-up steps) in one spawn per model and mesh, with
``autopar.tools.bench_cost_terms.CollectiveLog`` recording every ZeRO chunk collective and
gradient-bucket all-reduce rank 0 issues. Per plan:

- priced before (per parameter): one all-gather per ZeRO-3 parameter and P axis, and the
  gradient all-reduce's latency as a fraction (bytes / 25 MiB per axis: ``CommPricer.grad_sync_s``);
- priced now: every chunk's collectives (``autopar.planner.zero_pricing.priced_calls``) and
  the non-ZeRO gradients' bucket fraction;
- issued: the collectives of one step, and their bytes (all-gather: the full output).

    PYTHONPATH=. python benchmarks/zero_chunk_counts.py --world 2 --world 4
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from typing import Any

MODELS = ("mlp", "gpt", "llama")
BUCKET_BYTES = 25 * 2**20


def _priced(plan: Any) -> dict[str, Any]:
    """The plan's priced ZeRO and gradient collectives, before and after per-chunk pricing."""
    from autopar.planner.problem import ZeroConfig
    from autopar.planner.zero_pricing import (
        chosen_streams,
        gathered_axes,
        partial_axes,
        priced_calls,
    )

    space, choice = plan.space, plan.choice
    mesh = space.mesh
    zero = ZeroConfig.from_json(plan.data["zero"], mesh.axis_names)
    old_gathers = 0
    bucket_bytes = {"old": 0.0, "new": 0.0}
    partial = partial_axes(space, choice)
    for i, (node, s) in enumerate(zip(space.nodes, choice)):
        if node.kind != "param" or node.alias_of is not None or node.local_numel is None:
            continue
        nbytes = float(node.local_numel[s]) * node.itemsize
        own = gathered_axes(space, node, s, zero)
        old_gathers += len(own)
        reduced = partial.get(i, ())
        bucket_bytes["old"] += nbytes * len(reduced)
        bucket_bytes["new"] += nbytes * len([a for a in reduced if a not in own])
    calls = priced_calls(space, chosen_streams(space, choice, zero))
    return {
        "old_zero": old_gathers,
        "old_buckets": bucket_bytes["old"] / BUCKET_BYTES,
        "new_zero": len(calls),
        "new_zero_kinds": Counter(kind for kind, _, _ in calls),
        "new_zero_bytes": sum(b for _, _, b in calls),
        "new_buckets": bucket_bytes["new"] / BUCKET_BYTES,
        "chunk_bytes": plan.data["zero"]["chunk_bytes"],
    }


def _plans(model_key: str, mesh_text: str, profile_path: str | None) -> dict[str, Any]:
    from autopar.capture.export import capture
    from autopar.mesh import Mesh
    from autopar.options import PlanOptions
    from autopar.presets import build_preset
    from autopar.tools.report import plans_for_recipes
    from cost_models import load_profile

    mesh = Mesh.parse(mesh_text, device="cpu")
    if profile_path:
        profile = load_profile(profile_path)
        names = tuple(f"a{i}" for i in range(mesh.ndim))
        mesh = Mesh(shape=mesh.shape, axis_names=names, device=profile.device,
                    links=tuple(profile.links[n] for n in names))  # fmt: skip
    model, args, kwargs = build_preset(f"benchmarks.cost_model:{model_key}", batch=8, seq=128)
    captured = capture(model, args, kwargs)
    recipes = ("ddp", "fsdp", "fsdp+tp") if mesh.ndim > 1 else ("ddp", "fsdp")
    made = plans_for_recipes(captured, mesh, PlanOptions(), recipes=recipes, model_name=model_key)
    for stage in (1, 2):
        forced = plans_for_recipes(captured, mesh, PlanOptions(zero_stage=stage), recipes=("auto",),
                                   model_name=model_key)  # fmt: skip
        made[f"zero{stage}"] = forced["auto"]
    return made


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, action="append", default=[])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--profile", action="append", default=[], metavar="MESH=PATH")
    parser.add_argument("--meshes", default=None, help="only these meshes, e.g. 2x2,4")
    args = parser.parse_args(argv)
    from autopar.tools.bench_cost_terms import count_collectives

    profiles = dict(p.split("=", 1) for p in args.profile)
    print(
        "| model | mesh | plan | chunk bytes | priced before: ZeRO all-gathers + bucket "
        "all-reduce units | priced now: ZeRO collectives (kinds) + bucket units | issued: "
        "ZeRO collectives (kinds) + bucket all-reduces | ZeRO bytes priced now / issued |"
    )
    print("|---|---|---|---:|---|---|---|---|")
    for world in args.world or [2]:
        for mesh_text in {2: ["2"], 4: ["4", "2x2"]}[world]:
            if args.meshes and mesh_text not in args.meshes.split(","):
                continue
            shape = tuple(int(n) for n in mesh_text.split("x"))
            for model_key in args.models.split(","):
                plans = _plans(model_key, mesh_text, profiles.get(mesh_text))
                issued = count_collectives(f"benchmarks.cost_model:{model_key}", 8, 128, shape,
                                           {n: p.data for n, p in plans.items()})  # fmt: skip
                for name, plan in plans.items():
                    priced = _priced(plan)
                    calls = issued[name]
                    zero_calls = [c for c in calls if c[1].startswith("zero")]
                    buckets = [c for c in calls if c[1].startswith("grad bucket")]
                    kinds = Counter(c[0] for c in zero_calls)
                    zero_bytes = sum(c[3] for c in zero_calls)
                    new_kinds = ", ".join(
                        f"{k} {v}" for k, v in sorted(priced["new_zero_kinds"].items())
                    )
                    got_kinds = ", ".join(f"{k} {v}" for k, v in sorted(kinds.items()))
                    ratio = priced["new_zero_bytes"] / zero_bytes if zero_bytes else float("nan")
                    print(f"| {model_key} | {mesh_text} | {name} | {priced['chunk_bytes'] or '-'} "
                          f"| {priced['old_zero']} + {priced['old_buckets']:.2f} "
                          f"| {priced['new_zero']} ({new_kinds or '-'}) + {priced['new_buckets']:.2f} "
                          f"| {len(zero_calls)} ({got_kinds or '-'}) + {len(buckets)} "
                          f"| {priced['new_zero_bytes'] / 1e6:.2f} / {zero_bytes / 1e6:.2f} MB ({ratio:.4f}) |",
                          flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
