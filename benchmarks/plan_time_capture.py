"""Capture CPU with and without the splice check, alternated in one process.

    flock /tmp/autopar-timing.lock python benchmarks/plan_time_capture.py
    python benchmarks/plan_time_capture.py --model llama3-70b --batch 8 --rounds 2

``autopar plan`` captures the built-in presets of ``autopar.presets.SPLICE_PROVEN`` without the
run-time check export (``capture(..., check_splice=False)``; the check is a CI test instead).
This prints, per round, the CPU and wall seconds of ``capture`` checked and unchecked, the
number of ``torch.export`` calls and the graph hash (the same either way), after a 2-layer
warm-up (torch's first-export costs), the order alternating between rounds; then the ratios.
"""

from __future__ import annotations

import argparse
import importlib
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from autopar.presets import build_preset  # noqa: E402

export_module = importlib.import_module("autopar.capture.export")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    warm, warm_args, warm_kwargs = build_preset(f"{args.model}-2l", batch=1, seq=16)
    export_module.capture(warm, warm_args, warm_kwargs)
    exports = [0]
    export = torch.export.export

    def counted(*a, **k):
        exports[0] += 1
        return export(*a, **k)

    torch.export.export = counted
    model, ex_args, ex_kwargs = build_preset(args.model, batch=args.batch, seq=args.seq)
    rows: dict[bool, list[tuple[float, float, int, str]]] = {True: [], False: []}
    for index in range(args.rounds):
        for check in (True, False) if index % 2 == 0 else (False, True):
            exports[0] = 0
            wall, cpu = time.perf_counter(), time.process_time()
            captured = export_module.capture(model, ex_args, ex_kwargs, check_splice=check)
            rows[check].append(
                (
                    time.process_time() - cpu,
                    time.perf_counter() - wall,
                    exports[0],
                    captured.graph_hash,
                )
            )
    print(
        f"{args.model} b{args.batch} s{args.seq}, load average {os.getloadavg()[0]:.1f} at the end"
    )
    for check, found in rows.items():
        label = "checked  " if check else "unchecked"
        print(
            label,
            "  ".join(
                f"cpu {c:.2f} s wall {w:.2f} s exports {n} hash {h[:8]}" for c, w, n, h in found
            ),
        )
    ratios = [round(u[0] / c[0], 2) for u, c in zip(rows[False], rows[True], strict=True)]
    print("CPU unchecked / checked per round:", ratios)


if __name__ == "__main__":
    main()
