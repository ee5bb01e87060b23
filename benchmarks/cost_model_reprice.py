"""One cost model against another on the same measurements: the auto-vs-recipes table of
``benchmarks/cost_model.py`` runs with each model's predictions.

``dump`` prices every plan of every row of some ``cost_model.py`` runs again, with the profile
each row was planned with, under whatever ``autopar`` is on ``PYTHONPATH`` (run it once with
the tree before a change and once with the tree after), and writes the predictions as JSON.
``tables`` prints the table of the runs with each dump's predictions in place of the
recorded ones (measured times unchanged), with Spearman per row, pooled and the row mean.
The recipes are the same layouts under both models; the auto plan counts where both trees
chose the layout that ran (the dump records each plan's choices).

    PYTHONPATH=/path/to/old/tree python benchmarks/cost_model_reprice.py dump old.json t/w*/cost_model.json
    PYTHONPATH=. python benchmarks/cost_model_reprice.py dump new.json t/w*/cost_model.json
    PYTHONPATH=. python benchmarks/cost_model_reprice.py tables old.json new.json t/w*/cost_model.json
"""

from __future__ import annotations

import copy
import json
import sys
from typing import Any


def _key(world: int, model: str, name: str) -> str:
    return f"{world}/{model}/{name}"


def dump(out: str, paths: list[str]) -> None:
    from autopar.capture.export import capture
    from autopar.mesh import Mesh
    from autopar.options import PlanOptions
    from autopar.presets import build_preset
    from autopar.tools.report import plans_for_recipes
    from cost_models import load_profile

    priced: dict[str, Any] = {}
    for path in paths:
        for rep in json.load(open(path)):  # noqa: SIM115
            for model_key, m in rep["models"].items():
                model, args, kwargs = build_preset(
                    f"benchmarks.cost_model:{model_key}", batch=8, seq=128
                )
                captured = capture(model, args, kwargs)
                for mesh_text, profile_path in rep["profiles"].items():
                    names = [n for n, p in m["result"]["plans"].items()
                             if "skipped" not in p and p["mesh"] == mesh_text]  # fmt: skip
                    aliases = [a for a, kept in m["aliases"].items() if kept in names]
                    recipes = sorted({n.split("@")[0] for n in names + aliases} - {"ilp"})
                    profile = load_profile(profile_path)
                    base = Mesh.parse(mesh_text, device="cpu")
                    axis = tuple(f"a{i}" for i in range(base.ndim))
                    mesh = Mesh(shape=base.shape, axis_names=axis, device=profile.device,
                                links=tuple(profile.links[n] for n in axis))  # fmt: skip
                    made = plans_for_recipes(captured, mesh, PlanOptions(), recipes=recipes,
                                             model_name=model_key)  # fmt: skip
                    for recipe, plan in made.items():
                        priced[_key(rep["world"], model_key, f"{recipe}@{mesh_text}")] = {
                            "predicted_step_s": plan.predicted_step_s,
                            "choice": list(plan.choice or ()),
                        }
    with open(out, "w") as f:
        json.dump(priced, f)


def tables(old_path: str, new_path: str, paths: list[str]) -> None:
    sys.path.insert(0, "benchmarks")
    from cost_model import auto_vs_recipes_rows

    dumps = {"before": json.load(open(old_path)), "after": json.load(open(new_path))}  # noqa: SIM115
    reports = [rep for path in paths for rep in json.load(open(path))]  # noqa: SIM115
    for label, priced in dumps.items():
        other = dumps["after" if label == "before" else "before"]
        swapped = copy.deepcopy(reports)
        for rep in swapped:
            for model_key, m in rep["models"].items():
                plans = m["result"]["plans"]
                for name in list(plans):
                    if "skipped" in plans[name] or name.startswith("ilp"):
                        continue  # "ilp" is auto's layout where it differs: not re-planned
                    key = _key(rep["world"], model_key, name)
                    if name.startswith("auto") and priced[key]["choice"] != other[key]["choice"]:
                        print(f"{key}: the two trees choose different auto layouts")
                    plans[name]["predicted_step_s"] = priced[key]["predicted_step_s"]
        _, text = auto_vs_recipes_rows(swapped, reps=3)
        print(f"\n### predictions {label} ({old_path if label == 'before' else new_path})\n")
        print(text)


def main(argv: list[str]) -> int:
    if argv[:1] == ["dump"] and len(argv) >= 3:
        dump(argv[1], argv[2:])
    elif argv[:1] == ["tables"] and len(argv) >= 4:
        tables(argv[1], argv[2], argv[3:])
    else:
        print(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
