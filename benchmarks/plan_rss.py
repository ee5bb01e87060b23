"""The planner's resident memory per phase (issue 16 item 6).

    python benchmarks/plan_rss.py run plan llama3-70b --mesh 8x16x8 ... 2> LOG   # `autopar ARGS`
    python benchmarks/plan_rss.py phases LOG                                  # peak per phase

``run`` runs the CLI in this process with VmRSS / VmHWM (/proc/self/status) sampled every
0.5 s, one stderr line whenever it moved by more than 100 MiB, among the CLI's progress lines
(capture, strategies, each recipe, each ZeRO configuration budget-free and budgeted, the
bounds). ``phases`` prints, for each progress line, the largest RSS sampled since the line
before it: the peak of the phase that line ends.
"""

from __future__ import annotations

import re
import sys
import threading
import time

PROGRESS = ("capture", "strategies", "solve ", "ZeRO", "bound ZeRO", "skip", "planned", "autopar")


def _status() -> tuple[int, int]:
    """(VmRSS, VmHWM) in MiB."""
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f if line.startswith(("VmRSS", "VmHWM")))
    return tuple(int(fields[k].split()[0]) // 1024 for k in ("VmRSS", "VmHWM"))  # type: ignore[return-value]


def run(argv: list[str]) -> int:
    start = time.perf_counter()

    def sample() -> None:
        last = -1000
        while True:
            rss, hwm = _status()
            if abs(rss - last) > 100:
                elapsed = time.perf_counter() - start
                print(
                    f"[rss {elapsed:7.1f} s] {rss} MiB (peak {hwm} MiB)",
                    file=sys.stderr,
                    flush=True,
                )
                last = rss
            time.sleep(0.5)

    threading.Thread(target=sample, daemon=True).start()
    from autopar.tools.cli import main

    code = main(argv)
    rss, hwm = _status()
    print(f"[rss final] {rss} MiB (peak {hwm} MiB)", file=sys.stderr)
    return code


def phases(path: str) -> None:
    peak, elapsed = 0, 0.0
    sample = re.compile(r"\[rss\s+([\d.]+) s\] (\d+) MiB")
    for line in open(path):
        found = sample.match(line)
        if found:
            elapsed, peak = float(found.group(1)), max(peak, int(found.group(2)))
        elif line.startswith(PROGRESS):
            print(f"{elapsed:7.1f} s  peak {peak:5d} MiB  | {line.strip()[:110]}")
            peak = 0
    print(f"{elapsed:7.1f} s  peak {peak:5d} MiB  | (after the last line)")


if __name__ == "__main__":
    if sys.argv[1:2] == ["run"]:
        sys.exit(run(sys.argv[2:]))
    phases(sys.argv[2])
