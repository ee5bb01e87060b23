"""What each pipeline rank holds when its stored stage plans run, against the budget (issue 15).

    PYTHONPATH=. python benchmarks/stage_plan_memory.py
    PYTHONPATH=. python benchmarks/stage_plan_memory.py --model gpt2-xl --devices 64 --budgets 12GiB 72GiB

``autopar plan MODEL --devices N --per-node 8`` (bf16, AdamW, the preset's batch and sequence,
fresh cache) with its stage plans, per budget; then per pipeline rank, from the plan JSON:

- **priced**: the stage search's peak for the rank (the largest of its stages' predicted peaks;
  since session 22 each counts what the rank's other stages hold);
- **stage plans**: what the stored intra-op plans hold when run as the schedule runs them: the
  state, inputs and buffers of every stage on the rank, plus the largest of their activations
  times the microbatches in flight on the rank, plus that stage's transient memory. A plan
  solved with ``in_flight`` (session 22) already counts its in-flight activations; an older one
  counts one microbatch, multiplied here;
- the ZeRO stage and recomputed segments of the stage plans against the search's;
- **step ms**: one optimizer step of the rank's stages, priced by the search (``m`` times
  forward + backward, plus the gradient sync) and by the stored stage plans (``m`` times a
  microbatch's step, the gradient sync once: a plan solved with ``accumulation`` counts
  ``1 / accumulation`` of it per microbatch).

Stages are grouped by the pipeline rank torch's schedule runs them on (``stage_rank``: V
schedules fold back, 0, 1, 1, 0).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pipeline_plans import CASES  # noqa: E402  (the presets' batch and sequence at scale)

STATE = ("params", "grads", "optimizer", "master", "inputs_buffers")


def plan_file(model: str, devices: int, budget: str, out: Path) -> None:
    batch, seq = CASES[model]["batch"], CASES[model]["seq"]
    cmd = [
        sys.executable, "-m", "autopar", "plan", model, "--devices", str(devices),
        "--per-node", "8", "--batch", str(batch), "--seq", str(seq),
        "--mixed-precision", "bf16", "--budget", budget, "--no-cache", "--out", str(out),
    ]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def ranks(data: dict) -> list[dict]:
    """Per pipeline rank: priced peak, the stage plans' held memory, ZeRO and segments."""
    from autopar.planner.stages import stage_rank

    pipe = data["pipeline"]
    stored = pipe["stage_plans"]
    pp, m = data["mesh"]["shape"][0], pipe["microbatches"]
    by_rank: dict[int, list[tuple[dict, dict]]] = {}
    for stage in pipe["stages"]:
        entry = stored[stage["index"]]
        if "renamed_from" in entry:
            entry = stored[entry["renamed_from"]]
        rank = stage_rank(pipe["schedule"], stage["index"], pp)
        by_rank.setdefault(rank, []).append((stage["predicted"], entry))
    rows = []
    for rank, members in sorted(by_rank.items()):
        held = sum(sum(e["predicted"]["memory"][k] for k in STATE) for _, e in members)
        busiest = 0.0
        for priced, entry in members:
            memory = entry["predicted"]["memory"]
            counted = entry["options"].get("in_flight", 1)
            copies = priced["in_flight"] / counted
            busiest = max(busiest, memory["activations"] * copies + memory["transient"])
        priced_s = sum(
            m * (p["forward_s"] + p["backward_s"]) + p["grad_sync_s"] for p, _ in members
        )
        plan_s = 0.0
        for _, entry in members:
            step, sync = (
                entry["predicted"]["step_s"],
                entry["predicted"]["breakdown"]["grad_sync_s"],
            )
            plan_s += m * (step - sync) + sync * entry["options"].get("accumulation", 1)
        rows.append(
            {
                "rank": rank,
                "priced_ms": priced_s * 1e3,
                "plans_ms": plan_s * 1e3,
                "stages": len(members),
                "priced_gib": max(p["peak_memory_bytes"] for p, _ in members) / 2**30,
                "plans_gib": (held + busiest) / 2**30,
                "zero": [
                    (int(p["zero_stage"]), e["zero"]["stages"].get("dp", 0)) for p, e in members
                ],
                "segments": [
                    (int(p["recomputed_blocks"]), len(e["checkpoint"]["segments"]))
                    for p, e in members
                ],
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-xl", choices=sorted(CASES))
    parser.add_argument("--devices", type=int, help="default: the case's (pipeline_plans.py)")
    parser.add_argument("--budgets", nargs="+", default=["12GiB", "16GiB", "72GiB"])
    args = parser.parse_args()
    print(
        "| budget | schedule, mesh | rank | stages | priced peak GiB | stage plans hold GiB | "
        "fits | ZeRO on dp (priced, plan) | recomputed (priced blocks, plan segments) | "
        "step ms priced / stage plans |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for budget in args.budgets:
            out = Path(tmp) / f"{budget}.json"
            plan_file(args.model, args.devices or CASES[args.model]["devices"], budget, out)
            data = json.loads(out.read_text())
            limit = data["memory_budget_bytes"] / 2**30
            shape = "x".join(map(str, data["mesh"]["shape"]))
            where = f"{data['pipeline']['schedule']} m={data['pipeline']['microbatches']}, {shape}"
            for row in ranks(data):
                fits = "yes" if row["plans_gib"] <= limit * (1 + 1e-9) else "**NO**"
                print(
                    f"| {budget} | {where} | {row['rank']} | {row['stages']} | "
                    f"{row['priced_gib']:.2f} | {row['plans_gib']:.2f} | {fits} | "
                    f"{row['zero']} | {row['segments']} | "
                    f"{row['priced_ms']:.1f} / {row['plans_ms']:.1f} |"
                )


if __name__ == "__main__":
    main()
