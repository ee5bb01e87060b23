"""One priced bound (solver.budgeted.priced_bound) evaluated in a worker process while the
caller goes on with other work: two configurations' bounds side by side on two cores.

As in solver/parallel.py the worker is a fresh interpreter (``python -m solver.background``)
that reads one pickled job on stdin and writes the pickled answer on stdout: nothing is forked.
A priced bound is a function of its problem and arguments alone (every priced solve is exact,
solver/budgeted.py), so the worker's floats are the ones this process would compute. What
comes back is the bound, the step of a priced plan that fits (or None) and the bound found at
each multiplier (``Recorded.bounds``, the references derived bounds use); the priced solves'
answers and their series memo stay in the worker (a relaxation that follows makes them again:
the same answers, only slower).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from solver.budgeted import Recorded, priced_bound
from solver.parallel import worker_env
from solver.problem import Problem

__all__ = ["BoundJob", "start_priced_bound"]


class BoundJob:
    """A priced bound under way in a worker (:func:`start_priced_bound`)."""

    def __init__(self, future: Future) -> None:
        self._future = future

    def result(self) -> tuple[float, float | None, dict[float, float]] | None:
        """Wait for it: (bound, step of a priced plan that fits or None, bound per multiplier),
        or None when the worker gave no answer (the caller then evaluates the bound itself)."""
        try:
            status, value = self._future.result()
        except Exception:  # noqa: BLE001 - no worker, or no whole answer: the caller decides
            return None
        return value if status == "ok" else None


def start_priced_bound(problem: Problem, multiplier: float, **options: Any) -> BoundJob:
    """``priced_bound(problem, multiplier, **options, record=...)`` started in a worker
    process; returns at once. ``options``: priced_bound's keywords but ``record``."""
    env = worker_env()
    held = [pickle.dumps((problem, multiplier, options), protocol=pickle.HIGHEST_PROTOCOL)]

    def run() -> tuple[str, Any]:
        worker = subprocess.Popen(
            [sys.executable, "-m", "solver.background"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        try:
            with worker.stdin:  # the worker reads the whole job before it writes anything
                worker.stdin.write(held.pop())  # and the job's bytes are not held past it
            answer = worker.stdout.read()
        finally:
            worker.stdout.close()
            worker.wait()
        return pickle.loads(answer)

    # One thread waits on the worker's pipes (it holds no lock while it waits).
    pool = ThreadPoolExecutor(max_workers=1)
    future = pool.submit(run)
    pool.shutdown(wait=False)
    return BoundJob(future)


NICENESS = 10
"""How much lower the worker's scheduling priority is than its caller's: the caller's work is
the search's critical path (its largest min-plus products take both cores), the worker's
bound is needed only when the caller has taken the other configurations."""


def _worker() -> None:
    if hasattr(os, "nice"):  # Unix
        os.nice(NICENESS)
    problem, multiplier, options = pickle.load(sys.stdin.buffer)
    recorded = Recorded(edges=problem.edges)
    try:
        bound, fits = priced_bound(problem, multiplier, **options, record=recorded)
        answer: tuple[str, Any] = ("ok", (bound, fits, dict(recorded.bounds)))
    except Exception:  # noqa: BLE001 - the caller evaluates it itself and sees the error there
        answer = ("error", None)
    pickle.dump(answer, sys.stdout.buffer, protocol=pickle.HIGHEST_PROTOCOL)
    sys.stdout.buffer.flush()
    # Nothing to tear down but the interpreter: the caller waits for this exit, and freeing
    # the problem and the solves' memo object by object takes seconds on the largest rows.
    os._exit(0)


if __name__ == "__main__":
    _worker()
