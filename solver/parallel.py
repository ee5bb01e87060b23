"""Solve several independent problems at once, one worker process each.

A plan solves one ILP per baseline recipe and per ZeRO configuration; they share nothing, so on
a machine with several cores they run side by side. Each worker is a fresh interpreter started
with ``python -m solver.parallel`` (this package is torch-free, so it starts in well under a
second) that reads one pickled job on stdin and writes the pickled result on stdout. Nothing is
forked (the caller's threads, torch's and HiGHS's, never cross a fork) and the caller's
``__main__`` is never re-imported (a training script without a ``__main__`` guard stays safe).

Results equal ``solver.solve``'s in this process: same input, same solver, same options. A job
whose solve fails (an infeasible budget, a timeout without a plan) gets the worker's exception
back whole, attributes included (the solver's errors pickle); a crashed interpreter's job is
solved again here.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from solver.errors import SolverStoppedError
from solver.problem import Problem
from solver.shrink import solve
from solver.tables import ArrayTable

__all__ = [
    "ISOLATE_ENTRIES",
    "MIN_PARALLEL_ENTRIES",
    "problem_entries",
    "solve_all",
    "solve_isolated",
]

MIN_PARALLEL_ENTRIES = 2_000_000
"""Below this many cost-matrix entries in all problems together a worker's start (about half a
second) costs more than it saves: they are solved one after another in this process."""


ISOLATE_ENTRIES = 500_000
"""From this many cost entries on, a budgeted MIP runs in a worker process
(:func:`solve_isolated`): its branch and bound may grow until memory runs out, and past the
address-space limit HiGHS can die of it (a stack that cannot grow is a segmentation fault),
which must not take the planner with it."""


def problem_entries(problem: Problem) -> int:
    """Cost entries of a problem (node strategies plus distinct edge matrices' pairs): a
    size that tracks presolve, elimination and model-building time."""
    seen: set[int] = set()
    total = sum(len(n.cost_s) for n in problem.nodes)
    for edge in problem.edges:
        if id(edge.cost_s) not in seen:
            seen.add(id(edge.cost_s))
            table = edge.cost_s
            total += table.matrix.size if isinstance(table, ArrayTable) else sum(map(len, table))
    return total


def usable_cores() -> int:
    """The cores this process may run on (its affinity, where the platform says)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def worker_env() -> dict[str, str]:
    """The environment of a worker interpreter: this one's, importing this package from where
    this process found it, one thread per worker."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("AUTOPAR_SOLVER_THREADS", "1")  # solver.minplus: workers run side by side
    return env


def solve_all(
    problems: Sequence[Problem],
    *,
    workers: int | None = None,
    return_exceptions: bool = False,
    **options: Any,
) -> list[Any]:
    """``[solve(p, **options) for p in problems]``, up to ``workers`` at a time (default: the
    usable cores) when the problems are large enough to gain (:data:`MIN_PARALLEL_ENTRIES`).

    Raises what ``solve`` raises, for the first failing problem in order; with
    ``return_exceptions`` a failing problem's exception takes its place in the list instead
    (every problem is solved), as ``asyncio.gather`` does.
    """
    if workers is None:
        workers = usable_cores()
    workers = min(workers, len(problems))
    entries = [problem_entries(p) for p in problems]
    if workers < 2 or sum(entries) < MIN_PARALLEL_ENTRIES:
        return [_solve_here(p, return_exceptions, options) for p in problems]

    def run(problem: Problem) -> tuple[bool, Any]:
        status, value, _ = _in_worker(problem, options, None)
        if status == "ok" or (status == "raise" and return_exceptions):
            return True, value
        if status == "raise":
            return False, value
        return _attempt(problem, return_exceptions, options)

    # The largest job is solved here, beside the workers: its pickling and the worker's
    # unpickling of it would cost more than the rest (llama3-70b b256: the auto plan's stage-0
    # problem, 3.4e6 entries, solved in 0.85 s, took the side-by-side batch from 1.1 s one
    # after another to 1.7 s; at home, 0.9 s). Threads only wait on the workers' pipes; each
    # other job starts as soon as a worker is free.
    home = max(range(len(problems)), key=entries.__getitem__)
    others = [p for k, p in enumerate(problems) if k != home]
    with ThreadPoolExecutor(max_workers=workers - 1) as pool:  # workers >= 2 here
        away = pool.map(run, others)
        here = _attempt(problems[home], return_exceptions, options)
        done = list(away)
    done.insert(home, here)
    for ok, value in done:  # the first failing problem in order raises, as one after another
        if not ok:
            raise value
    return [value for _, value in done]


def solve_isolated(
    problem: Problem, *, memory_limit_bytes: int | None = None, **options: Any
) -> Any:
    """``solve(problem, **options)`` in a worker process, so that the solver dying (out of
    memory past the address-space limit, a signal) ends the worker, not the caller.

    ``memory_limit_bytes``: the worker's address space is limited to its size once it has
    loaded the problem plus this many bytes (RLIMIT_AS, Linux); None keeps the limit this
    process has (a shell's ``ulimit -v`` applies to each process alone).

    Raises:
        SolverStoppedError: the worker ended without an answer (its exit status in the
            message; ``reason`` "Memory limit reached" where it was killed by a signal or ran
            out of memory, the likely cause), or what ``solve`` raised in it.
    """
    status, value, code = _in_worker(problem, options, memory_limit_bytes)
    if status == "ok":
        return value
    if status == "raise":
        if isinstance(value, MemoryError):
            raise SolverStoppedError(
                f"the solver ran out of memory: {value}", "Memory limit reached"
            )
        raise value
    raise SolverStoppedError(
        f"the solver's worker process ended without an answer (exit status {code}; a negative "
        "status is the signal that ended it, e.g. -11 when memory ran out)",
        "Memory limit reached",
    )


def _in_worker(
    problem: Problem, options: dict[str, Any], memory_limit_bytes: int | None
) -> tuple[str, Any, int]:
    """(status, value, the worker's exit status): ("ok", the answer), ("raise", the exception
    it raised) or ("error", None) when it ended without an answer."""
    env = worker_env()
    payload = pickle.dumps((problem, options, memory_limit_bytes), protocol=pickle.HIGHEST_PROTOCOL)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "solver.parallel"],
            input=payload,
            capture_output=True,
            env=env,
            check=False,
        )
    except Exception:  # noqa: BLE001 - no worker started (as before: the caller decides)
        return "error", None, -1
    try:
        status, value = pickle.loads(done.stdout)
    except Exception:  # noqa: BLE001 - a crashed worker wrote no (whole) answer
        status, value = "error", None
    return status, value, done.returncode


def _attempt(
    problem: Problem, return_exceptions: bool, options: dict[str, Any]
) -> tuple[bool, Any]:
    """(True, ``solve``'s answer or, with ``return_exceptions``, its exception) or (False,
    the exception it raised)."""
    try:
        return True, _solve_here(problem, return_exceptions, options)
    except Exception as error:  # noqa: BLE001 - raised by the caller in the problems' order
        return False, error


def _solve_here(problem: Problem, return_exceptions: bool, options: dict[str, Any]) -> Any:
    if not return_exceptions:
        return solve(problem, **options)
    try:
        return solve(problem, **options)
    except Exception as error:  # noqa: BLE001 - handed back in the problem's place
        return error


def _worker() -> None:
    problem, options, memory_limit_bytes = pickle.load(sys.stdin.buffer)
    if memory_limit_bytes is not None:
        import resource

        with open("/proc/self/statm") as statm:  # its first field: the address space in pages
            used = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        limit = used + memory_limit_bytes
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        answer: tuple[str, Any] = ("ok", solve(problem, **options))
    except Exception as error:  # noqa: BLE001 - sent back whole where it pickles (the solver's
        # errors keep their attributes through pickling); else the caller re-solves to raise it
        try:
            pickle.dumps(error)
            answer = ("raise", error)
        except Exception:  # noqa: BLE001
            answer = ("error", None)
    pickle.dump(answer, sys.stdout.buffer, protocol=pickle.HIGHEST_PROTOCOL)
    sys.stdout.buffer.flush()


if __name__ == "__main__":
    _worker()
