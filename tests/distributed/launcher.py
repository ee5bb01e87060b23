"""The shared harness for multi-process gloo tests on 127.0.0.1.

Two entry points:

- :func:`run_distributed` spawns ``world_size`` processes, runs ``fn(rank, world_size, *args)``
  in each inside an initialized gloo process group and returns each rank's result.
- :func:`run_cases` runs a batch of named cases in one spawn (starting processes costs seconds,
  a case milliseconds) and returns one :class:`CaseResult` per case, so a module-scoped pytest
  fixture can run the batch once and each test checks its own case::

      @pytest.fixture(scope="module")
      def results_2x2() -> dict[str, CaseResult]:
          return run_cases(check_one_case, 4, CASES, (2, 2))

      @pytest.mark.parametrize("name", [name for name, _ in CASES])
      def test_case(results_2x2, name):
          results_2x2[name].check()

``fn`` / ``case_fn`` must be module-level functions (they are pickled into the children) and
their results picklable. Children come from a forkserver that imported torch once (spawn where
there is none): after the first run, starting 4 ranks takes well under a second instead of
importing torch in every child (3-10 s each on a busy machine). The forkserver also runs
tests/distributed/warm_ranks.py once (autopar's imports, a first capture and a first plan), which
saves about 2 s of CPU in every rank that captures.

Both run through autopar.runtime.spawn.spawn_ranks (read its docstring: every run is bounded,
a failing rank's peers get ``grace_s`` and are then killed, the error names every rank's story;
each rank has ``OMP_NUM_THREADS=1``, one torch thread and a fresh free port). This harness adds
a forkserver that imported torch once, ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (gloo then checks
that ranks pass matching shapes) and ``AUTOPAR_CHECK_COLLECTIVES=1`` (every autopar collective
first checks that its peers issue the same one: autopar.comm.collective_check) under ``env``. torch is already imported when ``env`` is
applied (it is preloaded in the forkserver), so variables torch reads only at import have no
effect; the debug level is re-read.
"""

from __future__ import annotations

import multiprocessing
import pickle
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from autopar.comm.collective_check import CHECK_ENV
from autopar.runtime.spawn import SpawnError, free_port, spawn_ranks

__all__ = ["CaseResult", "DistributedRunError", "free_port", "run_cases", "run_distributed"]

DistributedRunError = SpawnError
"""A rank failed, died, or the run passed its timeout; the message has every rank's story."""

_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.pipelining",  # pipeline tests and calibration's pipeline wait
    "autopar.resharding.simulator",
    "tests.distributed.warm_ranks",
]


def _context() -> Any:
    """A forkserver context whose server has imported torch once (each rank is then forked in
    about 0.1 s instead of importing torch for 3-10 s on a busy machine); spawn where forkserver
    is unavailable. Both start children from a clean interpreter state, unlike fork."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    env: dict[str, str] | None = None,
    pg_timeout_s: float = 60.0,
    grace_s: float = 5.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; each rank's result
    (autopar.runtime.spawn.spawn_ranks: the same arguments; ``env`` over the debug level and
    the collective check).

    Raises:
        DistributedRunError: with each failing rank's traceback, the ranks that died without
            reporting, or the ranks still running at the timeout.
    """
    return spawn_ranks(
        fn,
        world_size,
        *args,
        timeout_s=timeout_s,
        env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL", CHECK_ENV: "1", **(env or {})},
        pg_timeout_s=pg_timeout_s,
        grace_s=grace_s,
        context=_context(),
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class CaseResult:
    """The outcome of one named case on every rank."""

    name: str
    values: tuple[Any, ...]
    """Each rank's return value (None where that rank failed)."""
    errors: tuple[str | None, ...]
    """Each rank's traceback, or None where it passed."""

    @property
    def ok(self) -> bool:
        return all(e is None for e in self.errors)

    def check(self) -> tuple[Any, ...]:
        """Each rank's value; AssertionError with every failing rank's traceback otherwise."""
        if not self.ok:
            details = "\n".join(
                f"rank {r}: {e}" for r, e in enumerate(self.errors) if e is not None
            )
            raise AssertionError(f"case {self.name!r} failed:\n{details}")
        return self.values


def _run_case_batch(
    rank: int,
    world_size: int,
    case_fn: Callable[..., Any],
    cases: list[tuple[str, Any]],
    args: tuple[Any, ...],
    pg_timeout_s: float,
) -> list[tuple[str, bool, Any]]:
    """One rank's body in :func:`run_cases`: every case in order, stopping after a failure (a
    rank that failed mid-collective leaves its peers' next collectives mismatched)."""
    import torch
    import torch.distributed as dist

    # Statuses travel on their own group with a longer timeout, so a rank that failed early waits
    # for peers that are still timing out inside the case's collectives.
    status_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=2 * pg_timeout_s + 10))
    out: list[tuple[str, bool, Any]] = []
    for index, (name, case) in enumerate(cases):
        try:
            value = case_fn(rank, world_size, case, *args)
            pickle.dumps(value)
            out.append((name, True, value))
        except Exception:
            out.append((name, False, traceback.format_exc()))
        statuses = [torch.zeros(1, dtype=torch.int32) for _ in range(world_size)]
        ok = torch.tensor([int(out[-1][1])], dtype=torch.int32)
        dist.all_gather(statuses, ok, group=status_group)
        failed = [r for r, status in enumerate(statuses) if not int(status.item())]
        if failed:
            reason = f"skipped: case {name!r} failed on ranks {failed} before it"
            out.extend((later, False, reason) for later, _ in cases[index + 1 :])
            break
    return out


def run_cases(
    case_fn: Callable[..., Any],
    world_size: int,
    cases: Sequence[tuple[str, Any]] | Mapping[str, Any],
    *args: Any,
    timeout_s: float = 120.0,
    env: dict[str, str] | None = None,
    pg_timeout_s: float = 60.0,
) -> dict[str, CaseResult]:
    """Run ``case_fn(rank, world_size, case, *args)`` for every ``(name, case)`` in one spawn.

    A failing case is recorded (each rank's traceback) and the cases after it are reported as
    skipped. Names must be unique; ``case`` and the results must be picklable.

    Raises:
        DistributedRunError: the batch itself could not run (a rank died, or the timeout passed).
    """
    items = list(cases.items()) if isinstance(cases, Mapping) else [tuple(c) for c in cases]
    names = [name for name, _ in items]
    if len(set(names)) != len(names):
        raise ValueError(f"case names must be unique: {names}")
    per_rank = run_distributed(
        _run_case_batch,
        world_size,
        case_fn,
        items,
        args,
        pg_timeout_s,
        timeout_s=timeout_s,
        env=env,
        pg_timeout_s=pg_timeout_s,
    )
    results: dict[str, CaseResult] = {}
    for index, name in enumerate(names):
        rows = [rank_out[index] for rank_out in per_rank]
        results[name] = CaseResult(
            name=name,
            values=tuple(value if ok else None for _, ok, value in rows),
            errors=tuple(None if ok else value for _, ok, value in rows),
        )
    return results
