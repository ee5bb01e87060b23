"""CPU and wall seconds of each phase of one ``autopar plan`` command, in one process.

    PYTHONPATH=. python benchmarks/plan_phases.py plan gpt2-small-2l --mesh 2x2 --budget 1.5GiB \
        --no-cache --out X.json 2>&1 >/dev/null

Runs what ``python -m autopar plan ...`` runs (``cli.main(program=True)`` with the program's
collector threshold) and prefixes every line written to stderr (the CLI's progress lines) with
the process's CPU seconds (``time.process_time``: every thread, HiGHS's included) and the wall
seconds since start, after stamping the imports of torch and autopar.api. The CPU column is
the steadier figure on a shared machine; subtract consecutive lines for a phase.
"""

from __future__ import annotations

import gc
import os
import sys
import time

START = time.perf_counter()


class _Stamped:
    """stderr with every line prefixed by CPU and wall seconds."""

    def __init__(self, stream) -> None:
        self.stream, self.pending = stream, ""

    def write(self, text: str) -> int:
        self.pending += text
        while "\n" in self.pending:
            line, self.pending = self.pending.split("\n", 1)
            cpu, wall = time.process_time(), time.perf_counter() - START
            self.stream.write(f"[cpu {cpu:6.2f} wall {wall:6.2f}] {line}\n")
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return False


def main() -> None:
    sys.stderr = _Stamped(sys.__stderr__)
    import torch  # noqa: F401

    print("import torch", file=sys.stderr)
    import autopar.api  # noqa: F401
    from autopar.tools import cli

    print("import autopar.api", file=sys.stderr)
    gc.set_threshold(20_000, 10, 10)  # as the program (cli.run) sets it
    code = cli.main(sys.argv[1:], program=True)
    print("end", file=sys.stderr)
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(code)  # as the program: no teardown


if __name__ == "__main__":
    main()
