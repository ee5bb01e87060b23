"""Planning time where the memory budget binds: issue 16's must-show rows.

    python benchmarks/plan_time.py --set budget            # every row, back to back
    python benchmarks/plan_time.py --set budget --rows gpt2-small-2l llama-8l-2048
    python benchmarks/plan_time.py --set budget --exact    # also each row at --gap 0

Each row is the wall clock of the WHOLE command a user types, ``python -m autopar plan ...
--no-cache --out PLAN.json``, start-up and capture included, in a fresh process, so its peak
resident memory is that row's alone. Two memory figures: ``max RSS`` is the kernel's (wait4's
rusage: the largest of the command and each process it waited for, the solver's side-by-side
workers included, but not their sum), ``tree RSS`` the largest sum over the command's process
tree, sampled every 0.1 s. The solved model's size, objective, bound and gap are read from the
plan JSON (``solver``); "binds" says whether the budget-free stage-0 plan exceeds the budget.

The ``llama-8l-2048`` row's budget is 60% of that model's unconstrained peak, found first by
planning it with a 1 TiB budget (not timed in the row). Each command runs under an
address-space limit (``--max-memory``, default 8 GiB) so a runaway row cannot take a shared
machine down; a row that hits it or the time limit says so.
"""

from __future__ import annotations

import json
import os
import pathlib
import resource
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent

ROWS: dict[str, list[str]] = {
    "llama3-8b fp32": "llama3-8b --mesh 8x8 --device h100 --budget 80GiB --batch 32 --seq 8192".split(),
    "llama3-8b bf16": "llama3-8b --mesh 8x8 --device h100 --budget 80GiB --batch 32 --seq 8192 "
    "--mixed-precision bf16".split(),
    "llama3-70b fp32": "llama3-70b --mesh 8x16x8 --device h100 --budget 80GiB --batch 256 "
    "--seq 8192".split(),
    "llama3-70b bf16": "llama3-70b --mesh 8x16x8 --device h100 --budget 80GiB --batch 256 "
    "--seq 8192 --mixed-precision bf16".split(),
    "gpt2-small-2l": "gpt2-small-2l --mesh 2x2 --budget 1.5GiB".split(),
    "llama-8l-2048": "llama-8l-2048 --mesh 2x4".split(),  # budget: 60% of its free peak
}
FRACTION_OF_PEAK = 0.6


def _tree_rss_bytes(pid: int) -> int:
    """Resident bytes of ``pid`` and its descendants now (0 for processes already gone)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            continue
    return total


def run_plan(args: list[str], *, timeout_s: float, max_memory_gib: float) -> dict[str, Any]:
    """One ``autopar plan`` command in a fresh process: wall seconds, peak memory, its plan."""
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "plan.json"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        limit = int(max_memory_gib * 2**30)

        def cap() -> None:
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

        cmd = [sys.executable, "-m", "autopar", "plan", *args, "--no-cache", "--out", str(out)]
        start = time.perf_counter()
        with (
            open(pathlib.Path(tmp) / "stdout", "w+b") as so,
            open(pathlib.Path(tmp) / "stderr", "w+b") as se,
        ):
            proc = subprocess.Popen(
                cmd, env=env, cwd=tmp, stdout=so, stderr=se, preexec_fn=cap, start_new_session=True
            )
            tree_peak = 0
            timed_out = False
            while True:
                # wait4 reaps the child with its rusage: ru_maxrss is the largest of the command
                # and every process it waited for (the kernel's RUSAGE_BOTH).
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    break
                tree_peak = max(tree_peak, _tree_rss_bytes(proc.pid))
                if time.perf_counter() - start > timeout_s and not timed_out:
                    timed_out = True
                    os.killpg(proc.pid, signal.SIGKILL)  # the command and its solver workers
                time.sleep(0.1)
            proc.returncode = os.waitstatus_to_exitcode(status)
            wall_s = time.perf_counter() - start
            so.seek(0)
            se.seek(0)
            stdout, stderr = so.read(), se.read()
        max_rss = usage.ru_maxrss * 1024
        data = json.loads(out.read_text()) if out.exists() else None
    error = None
    if timed_out:
        error = f"timed out after {timeout_s:.0f} s"
    elif proc.returncode != 0:
        tail = stderr.decode(errors="replace").strip().splitlines()
        error = tail[-1] if tail else f"exit status {proc.returncode}"
    return {
        "command": "autopar plan " + " ".join(args),
        "wall_s": wall_s,
        "max_rss_bytes": max_rss,
        "tree_rss_bytes": tree_peak,
        "plan": data,
        "error": error,
        "stdout": stdout.decode(errors="replace"),
    }


def binds(plan: dict[str, Any]) -> bool:
    """Whether the budget-free stage-0 auto plan exceeds the budget (the budget binds)."""
    budget = plan["memory_budget_bytes"]
    free = [c for c in plan["solver"]["candidates"] if c.get("budget_free")]
    if free:
        return free[0]["peak_memory_bytes"] > budget
    return len(plan["solver"]["candidates"]) > 1 or bool(plan["checkpoint"]["segments"])


def free_peak_bytes(args: list[str], *, timeout_s: float, max_memory_gib: float) -> float:
    """The unconstrained peak per device of a row's model: its plan under a 1 TiB budget."""
    done = run_plan([*args, "--budget", "1TiB"], timeout_s=timeout_s, max_memory_gib=max_memory_gib)
    if done["plan"] is None:
        raise RuntimeError(f"{done['command']}: {done['error']}")
    return float(done["plan"]["predicted"]["peak_memory_bytes"])


def row_args(name: str, *, timeout_s: float, max_memory_gib: float) -> list[str]:
    """The row's command-line arguments (the 60%-of-peak row's budget computed here)."""
    args = list(ROWS[name])
    if "--budget" not in args:
        peak = free_peak_bytes(args, timeout_s=timeout_s, max_memory_gib=max_memory_gib)
        args += ["--budget", str(int(peak * FRACTION_OF_PEAK))]
        print(
            f"{name}: unconstrained peak {peak / 2**30:.3f} GiB; budget {FRACTION_OF_PEAK:.0%} of it",
            flush=True,
        )
    return args


def figures(done: dict[str, Any]) -> dict[str, Any]:
    """The table's cells of one finished command."""
    plan = done["plan"]
    out = {
        "wall s": f"{done['wall_s']:.1f}",
        "max RSS GiB": f"{done['max_rss_bytes'] / 2**30:.2f}",
        "tree RSS GiB": f"{done['tree_rss_bytes'] / 2**30:.2f}",
    }
    if plan is None:
        return {**out, "note": done["error"] or "no plan"}
    sol = plan["solver"]
    return {
        **out,
        "budget GiB": f"{plan['memory_budget_bytes'] / 2**30:.2f}",
        "binds": "yes" if binds(plan) else "no",
        "variables": f"{sol['num_variables']:,}",
        "objective ms": f"{sol['objective_s'] * 1e3:.3f}",
        "bound ms": f"{sol['bound_s'] * 1e3:.3f}",
        "gap": f"{sol['gap']:.2%}",
        "status": sol["status"],
        "recomputed": str(len(plan["checkpoint"]["segments"])),
        "peak GiB": f"{plan['predicted']['peak_memory_bytes'] / 2**30:.2f}",
    }


COLUMNS = (
    "row",
    "wall s",
    "max RSS GiB",
    "tree RSS GiB",
    "budget GiB",
    "binds",
    "variables",
    "objective ms",
    "bound ms",
    "gap",
    "status",
    "recomputed",
    "peak GiB",
    "exact ms",
    "note",
)


def run_rows(
    names: list[str], *, exact: bool, timeout_s: float, max_memory_gib: float
) -> list[dict[str, str]]:
    """Every row back to back (each in a fresh process); with ``exact`` also at --gap 0."""
    rows = []
    for name in names:
        args = row_args(name, timeout_s=timeout_s, max_memory_gib=max_memory_gib)
        done = run_plan(args, timeout_s=timeout_s, max_memory_gib=max_memory_gib)
        cells = {"row": name, **figures(done)}
        print(
            f"{done['command']}: " + ", ".join(f"{k} {v}" for k, v in cells.items() if k != "row"),
            flush=True,
        )
        if exact:
            again = run_plan(
                [*args, "--gap", "0", "--time-limit", "600"],
                timeout_s=max(timeout_s, 700),
                max_memory_gib=max_memory_gib,
            )
            plan = again["plan"]
            cells["exact ms"] = (
                f"{plan['solver']['objective_s'] * 1e3:.3f} ({plan['solver']['status']})"
                if plan
                else str(again["error"])
            )
        rows.append(cells)
    return rows


def print_table(rows: list[dict[str, str]], *, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in COLUMNS:
        table.add_column(
            col, justify="left" if col in ("row", "note", "status", "binds") else "right"
        )
    for row in rows:
        table.add_row(*(row.get(col, "") for col in COLUMNS))
    Console(width=250).print(table)
