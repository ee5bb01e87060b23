"""Where the gaps between a pipeline rank's tasks go, from a pipeline cost check's timelines.

``benchmarks/pipeline_cost_check.py --out DIR`` writes every step's task timelines (every
microbatch forward and backward of every rank, on the clock the machine's processes share).
For each task but a rank's first this prints its gap: from the moment it was ready (the later
of the rank's previous task's end and the end of the neighbour's task whose output it needs)
to its start, split by

- **local** (its input was there before the rank's previous task ended: the gap is the
  schedule's own work between two tasks) or **remote** (it waited for the neighbour's task:
  the gap is the transfer and the wake-up);
- how many other ranks were in a task at the ready moment (on 4 ranks over 2 cores: 2 means
  every core ran another rank's task);
- with ``--p2p DIR`` (the record ``AUTOPAR_P2P_TRACE=DIR`` makes, autopar/runtime/p2p_trace.py),
  the share of the long gaps' seconds spent posting receives and sends (torch's
  ``_batch_p2p``), waiting on them (``_wait_batch_p2p``) and in neither.

Usage::

    AUTOPAR_P2P_TRACE=/tmp/trace OMP_NUM_THREADS=1 PYTHONPATH=. python \\
        benchmarks/pipeline_cost_check.py --world 4 --profile P --microbatches 8 --reps 1 \\
        --out /tmp/check
    python benchmarks/pipeline_gaps.py /tmp/check/pipeline_cost_check_4.json --p2p /tmp/trace

(the check's configurations are timed one after another in one process per rank, so one
record covers them all: each gap takes the spans inside it.)
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from autopar.planner.shared_cores import rank_order

LONG_GAP_S = 0.005
"""Gaps from this long on are split into posting, waiting and the rest."""


@dataclass(frozen=True, slots=True)
class Gap:
    rank: int
    kind: str
    """The task's kind: "F" or "B"."""
    local: bool
    """Its input was there before the rank's previous task ended."""
    ready: float
    start: float
    previous_s: float
    """The rank's previous task's length."""
    others: int
    """Other ranks in a task at the ready moment."""

    @property
    def seconds(self) -> float:
        return self.start - self.ready


def step_gaps(ranks: Sequence[Any], schedule: str, microbatches: int) -> list[Gap]:
    """One step's gaps; ``ranks[i] = (start, end, tasks, ...)``, ``tasks`` rank i's
    ``(kind, start, end)`` in the order it ran them."""
    p = len(ranks)
    spans: dict[tuple[str, int, int], tuple[float, float]] = {}
    for i, rank in enumerate(ranks):
        for (kind, j), (_, a, b) in zip(rank_order(schedule, i, p, microbatches), rank[2]):
            spans[(kind, i, j)] = (a, b)
    gaps = []
    for i in range(p):
        previous = None
        for kind, j in rank_order(schedule, i, p, microbatches):
            a, b = spans[(kind, i, j)]
            if previous is not None:
                needed = spans.get((kind, i - 1 if kind == "F" else i + 1, j))
                needed_end = needed[1] if needed is not None else float("-inf")
                ready = max(previous[1], needed_end)
                others = sum(1 for (_, r, _), (c, d) in spans.items() if r != i and c <= ready < d)
                gaps.append(Gap(i, kind, previous[1] >= needed_end, ready, a,
                                previous[1] - previous[0], others))  # fmt: skip
            previous = (a, b)
    return gaps


def read_p2p(directory: str) -> dict[int, list[tuple[str, float, float]]]:
    """Per rank, its recorded ``(post|wait, start, end)`` spans."""
    spans: dict[int, list[tuple[str, float, float]]] = {}
    for path in glob.glob(os.path.join(directory, "p2p-*.jsonl")):
        rank = int(os.path.basename(path)[4:-6])
        with open(path) as f:
            spans[rank] = [(e[0], e[3], e[4]) for e in map(json.loads, f)]
    return spans


def split_gap(gap: Gap, spans: Sequence[tuple[str, float, float]]) -> dict[str, float]:
    """The gap's seconds inside posts, inside waits and in neither."""
    inside = {"post": 0.0, "wait": 0.0}
    for what, c, d in spans:
        overlap = min(d, gap.start) - max(c, gap.ready)
        if overlap > 0.0:
            inside[what] += overlap
    return {**inside, "other": max(0.0, gap.seconds - inside["post"] - inside["wait"])}


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def _figures(gaps: Sequence[Gap]) -> str:
    s = [g.seconds for g in gaps]
    if not s:
        return "none"
    return (f"n {len(s)}, mean {statistics.fmean(s) * 1e3:.2f}, 90th {_quantile(s, 0.9) * 1e3:.1f}, "
            f"97.5th {_quantile(s, 0.975) * 1e3:.1f} ms")  # fmt: skip


def report(check: dict[str, Any], p2p: dict[int, list[tuple[str, float, float]]] | None) -> str:
    """The gaps' table per configuration of a check's JSON (module docstring)."""
    lines = []
    for case in check["cases"]:
        gaps = [g for ranks in check["timelines"][case["key"]]
                for g in step_gaps(ranks, case["schedule"], case["microbatches"])]  # fmt: skip
        lines.append(f"{case['key']}: local {_figures([g for g in gaps if g.local])}; "
                     f"remote {_figures([g for g in gaps if not g.local])}")  # fmt: skip
        for others in sorted({g.others for g in gaps}):
            lines.append(f"  {others} other rank(s) in a task: "
                         f"{_figures([g for g in gaps if g.others == others])}")  # fmt: skip
        if p2p:
            long = [g for g in gaps if g.seconds >= LONG_GAP_S]
            total = {"post": 0.0, "wait": 0.0, "other": 0.0}
            for g in long:
                for k, v in split_gap(g, p2p.get(g.rank, ())).items():
                    total[k] += v
            whole = sum(total.values()) or 1.0
            lines.append(f"  gaps >= {LONG_GAP_S * 1e3:.0f} ms: {len(long)}, posting "
                         f"{total['post'] / whole:.2f}, waiting {total['wait'] / whole:.2f}, "
                         f"neither {total['other'] / whole:.2f} of their seconds")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("check", help="a pipeline_cost_check JSON")
    parser.add_argument("--p2p", default=None, metavar="DIR", help="an AUTOPAR_P2P_TRACE record")
    args = parser.parse_args(argv)
    with open(args.check) as f:
        check = json.load(f)
    print(report(check, read_p2p(args.p2p) if args.p2p else None))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
