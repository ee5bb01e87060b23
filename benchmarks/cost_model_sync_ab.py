"""The sync_s change alone, on the same measurements: predicted order before and after.

``autopar calibrate`` measures ``LinkSpec.sync_s`` after a step-like computation
(``CalibrationConfig.sync_segment_s``) and keeps, in the profile's details, the figure it gets
after one ~1 ms matmul (the measurement before session 11) from the same minute. This script
takes runs of ``benchmarks/cost_model.py`` (their JSON and the profiles they calibrated), prices
every plan of every row again with each profile and with a copy whose ``sync_s`` is the
one-matmul figure, and prints per row the predicted order of both next to the measured one
(Spearman per row and pooled, times relative to the row's ddp recipe or, where ddp equals the
auto plan, to it). The recipes are the same layouts under both profiles; the auto plan counts
only where the one-matmul profile chooses the same layout as the run's.

    PYTHONPATH=. python benchmarks/cost_model_sync_ab.py after/w2*/cost_model.json after/w4*/cost_model.json
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

from cost_models.calibrate import spearman


def _one_matmul_profile(profile: Any) -> Any:
    """The profile with each link's sync_s replaced by its one-matmul measurement."""
    measured = profile.meta.get("measurements", {})
    links = {}
    for name, link in profile.links.items():
        short = measured.get(f"{name}/sync", {}).get("one_matmul")
        if short is None:
            raise ValueError(f"profile has no one-matmul sync figure for axis {name}; recalibrate")
        links[name] = dataclasses.replace(link, sync_s=short["sync_s"])
    return dataclasses.replace(profile, links=links)


def _priced(model_key: str, mesh_text: str, profile: Any, recipes: list[str]) -> dict[str, Any]:
    from autopar.capture.export import capture
    from autopar.mesh import Mesh
    from autopar.options import PlanOptions
    from autopar.presets import build_preset
    from autopar.tools.report import plans_for_recipes

    base = Mesh.parse(mesh_text, device="cpu")
    names = tuple(f"a{i}" for i in range(base.ndim))
    mesh = Mesh(shape=base.shape, axis_names=names, device=profile.device,
                links=tuple(profile.links[n] for n in names))  # fmt: skip
    model, args, kwargs = build_preset(f"benchmarks.cost_model:{model_key}", batch=8, seq=128)
    made = plans_for_recipes(capture(model, args, kwargs), mesh, PlanOptions(), recipes=recipes,
                             model_name=model_key)  # fmt: skip
    return {name: (plan.predicted_step_s, tuple(plan.choice or ())) for name, plan in made.items()}


def main(paths: list[str]) -> int:
    from cost_models import load_profile

    lines = ["| ranks | model | mesh | measured order (ms) | sync_s one matmul / segment (ms, per axis) "
             "| rho, one-matmul sync | rho, segment sync |", "|---|---|---|---|---|---:|---:|"]  # fmt: skip
    pooled: dict[str, tuple[list[float], list[float]]] = {"old": ([], []), "new": ([], [])}
    for path in paths:
        for rep in json.load(open(path)):  # noqa: SIM115
            for mesh_text, profile_path in rep["profiles"].items():
                profile = load_profile(profile_path)
                old = _one_matmul_profile(profile)
                for model_key, m in rep["models"].items():
                    row = {n.split("@")[0]: p for n, p in m["result"]["plans"].items()
                           if "skipped" not in p and p["mesh"] == mesh_text}  # fmt: skip
                    names = sorted(row)
                    new_p = _priced(model_key, mesh_text, profile, names)
                    old_p = _priced(model_key, mesh_text, old, names)
                    if old_p["auto"][1] != new_p["auto"][1]:
                        names.remove("auto")  # another layout: not measured
                    ref = "ddp" if "ddp" in names else "auto"
                    meas = [row[n]["step_s"] / row[ref]["step_s"] for n in names]
                    rhos = []
                    for key, priced in (("old", old_p), ("new", new_p)):
                        pred = [priced[n][0] / priced[ref][0] for n in names]
                        pooled[key][0].extend(pred)
                        pooled[key][1].extend(meas)
                        rhos.append(spearman(pred, meas))
                    order = ", ".join(f"{n} {row[n]['step_s'] * 1e3:.0f}"
                                      for n in sorted(names, key=lambda n: row[n]["step_s"]))  # fmt: skip
                    syncs = "; ".join(f"{old.links[a].sync_s * 1e3:.2f} / {profile.links[a].sync_s * 1e3:.2f}"
                                      for a in profile.links)  # fmt: skip
                    lines.append(f"| {rep['world']} | {model_key} | {mesh_text} | {order} | {syncs} | "
                                 f"{rhos[0]:.2f} | {rhos[1]:.2f} |")  # fmt: skip
    print("\n".join(lines))
    for key, label in (("old", "one-matmul sync"), ("new", "segment sync")):
        rho = spearman(*pooled[key]) if len(pooled[key][0]) > 2 else float("nan")
        print(f"pooled Spearman, {label}: {rho:.2f} over {len(pooled[key][0])} plans")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
