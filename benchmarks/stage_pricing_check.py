"""Stage pricing from probes vs the ILP on the real stage graphs.

    python benchmarks/stage_pricing_check.py                         # llama3-8b-8l, gpt2-xl-8l
    python benchmarks/stage_pricing_check.py --models llama3-8b-8l --tp 1 8 --stages 2 4

The stage planner prices a stage of ``k`` blocks (with the head or tail end) from one probe ILP
per (tp, microbatch) by attributing the probe's per-node costs to head, block and tail
(``autopar.planner.stage_pricing``). Here the model is split at even cuts into its real stage
graphs (``autopar.capture.stages.split_stages``, the runtime's split) and each stage graph is
solved by the same configuration solver on the same ``tp`` mesh, without a budget, ZeRO 0. The
table prints, per stage, the predicted and the real per-microbatch time (forward + backward +
collectives inside the stage) and saved activations, and their ratios.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from autopar.capture.export import capture  # noqa: E402
from autopar.capture.stages import split_stages  # noqa: E402
from autopar.mesh import Mesh, default_links  # noqa: E402
from autopar.options import PlanOptions  # noqa: E402
from autopar.parallelize_pipeline import find_stack  # noqa: E402
from autopar.planner.driver import Driver  # noqa: E402
from autopar.planner.problem import ZeroConfig  # noqa: E402
from autopar.planner.space import build_space  # noqa: E402
from autopar.planner.stage_pricing import StagePricer  # noqa: E402
from autopar.planner.stage_probes import ProbeCache  # noqa: E402
from autopar.planner.stages import even_stages  # noqa: E402
from autopar.presets import _split_layers, build_preset  # noqa: E402
from cost_models.hardware import get_device  # noqa: E402


def check(name: str, *, batch: int, seq: int, tp: int, stages: int, options: PlanOptions) -> list:
    device = get_device("h100")
    link = default_links(1, device)[0]
    base, _ = _split_layers(name)

    def probe(b: int):
        m, a, k = build_preset(f"{base}-2l", batch=b, seq=seq)
        return capture(m, a, k)

    parts = ProbeCache(probe, options=options, device=device).parts(batch, tp, link, recipe="auto")
    pricer = StagePricer(
        options=(parts,),
        dp=1,
        dp_link=link,
        pp_link=link,
        optimizer="adamw",
        mixed_precision=options.mixed_precision,
        budget=float("inf"),
    )
    model, args, kwargs = build_preset(name, batch=batch, seq=seq)
    whole = capture(model, args, kwargs)
    stack, num_blocks = find_stack(whole.gm)
    pipeline = even_stages(
        stack=stack, num_blocks=num_blocks, num_stages=stages, microbatches=1, schedule="1f1b"
    )
    rows = []
    mesh = Mesh(shape=(tp,), axis_names=("tp",), device=device, links=(link,))
    for graph in split_stages(whole, pipeline):
        first, last = graph.index == 0, graph.index == stages - 1
        k = graph.blocks[1] - graph.blocks[0]
        predicted = pricer.price(blocks=k, first=first, last=last, in_flight=1, microbatches=1)
        space = build_space(graph.captured, mesh, options)
        solved = Driver(space, budget=float("inf"), candidates=()).configurations.solve(
            ZeroConfig(), name="auto", budget=None
        )
        ev = solved.evaluation
        rows.append(
            {
                "model": name,
                "tp": tp,
                "stage": f"{graph.index}/{stages}",
                "blocks": k,
                "pred_s": predicted.forward_s + predicted.backward_s + predicted.step_s,
                "real_s": ev.step_s,
                "pred_act": predicted.memory["activations"],
                "real_act": ev.memory["activations"],
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="*", default=["llama3-8b-8l", "gpt2-xl-8l"])
    parser.add_argument("--tp", nargs="*", type=int, default=[1, 8])
    parser.add_argument("--stages", nargs="*", type=int, default=[2, 4])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=1024)
    args = parser.parse_args()
    options = PlanOptions(mixed_precision="bf16")
    print(
        "| model | tp | stage | blocks | predicted ms | ILP on stage graph ms | ratio "
        "| predicted act. MiB | stage graph act. MiB | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    worst = 1.0
    for name in args.models:
        for tp in args.tp:
            for stages in args.stages:
                for r in check(
                    name, batch=args.batch, seq=args.seq, tp=tp, stages=stages, options=options
                ):
                    t, a = r["pred_s"] / r["real_s"], r["pred_act"] / r["real_act"]
                    worst = max(worst, t, 1 / t)
                    print(
                        f"| {r['model']} | {r['tp']} | {r['stage']} | {r['blocks']} | "
                        f"{r['pred_s'] * 1e3:.2f} | {r['real_s'] * 1e3:.2f} | {t:.3f} | "
                        f"{r['pred_act'] / 2**20:.1f} | {r['real_act'] / 2**20:.1f} | {a:.3f} |",
                        flush=True,
                    )
    print(f"largest time ratio (either way): {worst:.3f}")


if __name__ == "__main__":
    main()
