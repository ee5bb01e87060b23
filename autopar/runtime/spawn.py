"""Ranks on this machine: run a function on N gloo processes on 127.0.0.1 and collect results.

Used by calibration (``autopar calibrate``, ``autopar bench-cost``) and by the tests' launcher
(tests/distributed/launcher.py, which adds a forkserver that imported torch once and
``TORCH_DISTRIBUTED_DEBUG=DETAIL``).

Environment of every rank: ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``LOCAL_RANK``/``WORLD_SIZE``
/``LOCAL_WORLD_SIZE`` as torchrun sets them, ``OMP_NUM_THREADS=1`` and ``torch.set_num_threads(1)``
(each rank gets one core's worth), a fresh free port picked in the parent (a taken port makes the
ranks other than 0 hang in init forever), plus ``env``. On Linux a rank ends when the process
that started it dies, so no orphaned rank holds a port.

Every rank leads its own session (:func:`own_scheduling_group`), as torchrun starts ranks: Linux's
autogroup scheduler shares the cores between sessions, so ranks in one session would split one
share (a rank alone then ran up to 2x faster than each of two busy ones on a loaded machine;
README, "Session 9"), and tests, ``autoparallelize`` spawns, calibration and torchrun jobs would
not meet the same scheduling. Being in another session also means the terminal's signals do not
reach the ranks: Ctrl-C interrupts the parent, whose clean-up kills them; a parent killed
outright (SIGKILL) takes them with it through the parent-death signal (Linux), and they are
daemons, so a parent that exits kills them too.

Every run is bounded: the process group's timeout bounds a collective a peer never joins,
``timeout_s`` the whole run (ranks still alive then are killed). When a rank fails, the others
get ``grace_s`` to report and are then killed, so a failure never hangs; the error names every
rank's story (its traceback, the exit code it died with, or why it was killed).
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue as queue_lib
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

__all__ = [
    "DEFAULT_PG_TIMEOUT_S",
    "SpawnError",
    "free_port",
    "own_scheduling_group",
    "pg_timeout_s",
    "spawn_ranks",
]

DEFAULT_PG_TIMEOUT_S = 60.0
"""Process-group timeout of the runs autopar launches itself (``bench-cost``, ``calibrate``): how
long a collective waits for a peer before it fails naming the rank and the collective. One
collective of those runs takes about a second at most on gloo, so a minute means a rank is stuck
(two minutes was the old hang); where ranks reach a collective far apart (a big model's per-op
timings on a loaded machine), raise it with ``AUTOPAR_PG_TIMEOUT_S``."""


def pg_timeout_s() -> float:
    """``AUTOPAR_PG_TIMEOUT_S`` from the environment, else :data:`DEFAULT_PG_TIMEOUT_S`.

    Raises:
        ValueError: the variable is set but not a positive number of seconds.
    """
    text = os.environ.get("AUTOPAR_PG_TIMEOUT_S", "").strip()
    if not text:
        return DEFAULT_PG_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"AUTOPAR_PG_TIMEOUT_S must be a positive number of seconds, got {text!r}")
    return value


class SpawnError(RuntimeError):
    """A rank failed, died, or the run passed its timeout; the message has every rank's story."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0, read, release)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def own_scheduling_group() -> None:
    """Make this process its own session (``os.setsid``), as torchrun starts ranks; a no-op where
    it already leads its session (under torchrun), leads a process group (``setsid`` refuses
    that) or the platform has no sessions."""
    if hasattr(os, "setsid") and os.getsid(0) != os.getpid() and os.getpgid(0) != os.getpid():
        os.setsid()


def _die_with_parent() -> None:
    """Linux: end this rank when the process that started it dies."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    env: dict[str, str],
    pg_timeout_s: float,
    results: Any,
    own_session: bool = True,
) -> None:
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "OMP_NUM_THREADS": "1",
            **env,
        }
    )
    _die_with_parent()  # survives setsid: it is tied to the parent, not the session
    if own_session:
        own_scheduling_group()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.set_debug_level_from_env()  # torch may have been imported before env was applied
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
        )
        # Pickled here, so an unpicklable result is this rank's error, not a queue thread's.
        results.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # noqa: B036 - report everything, the parent decides
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    env: dict[str, str] | None = None,
    pg_timeout_s: float = 60.0,
    grace_s: float = 5.0,
    context: Any = None,
    own_sessions: bool = True,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; each rank's result.

    Args:
        fn: a module-level function (it is pickled into the children); its return value must
            be picklable.
        timeout_s: bound on the whole run; ranks still running then are killed.
        env: extra environment variables for every rank.
        pg_timeout_s: the process group's timeout (a collective a peer never joins raises).
        grace_s: how long the other ranks may still report after one failed (they may be
            blocked in a collective with it) before they are killed.
        context: the multiprocessing context to start ranks from (default: spawn).
        own_sessions: each rank leads its own session (module docstring); False: the caller's.

    Raises:
        SpawnError: with each failing rank's traceback, the ranks that died without
            reporting, or the ranks still running at the timeout.
    """
    ctx = context or multiprocessing.get_context("spawn")
    results, port = ctx.Queue(), free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(
                rank,
                world_size,
                port,
                fn,
                args,
                dict(env or {}),
                pg_timeout_s,
                results,
                own_sessions,
            ),  # fmt: skip
            name=f"autopar-rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    outcomes: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout_s
    first_failure: float | None = None
    try:
        while len(outcomes) < world_size:
            now = time.monotonic()
            if now > deadline:
                break
            if first_failure is not None and now > first_failure + grace_s:
                break
            try:
                rank, ok, payload = results.get(timeout=0.2)
            except queue_lib.Empty:
                dead = [
                    r for r, p in enumerate(procs) if r not in outcomes and p.exitcode is not None
                ]
                for r in dead:
                    # A last chance for a result still in the pipe, then count it as died.
                    time.sleep(0.5)
                    if r not in outcomes and results.empty():
                        outcomes[r] = (
                            False,
                            f"exited with code {procs[r].exitcode} without reporting",
                        )
                        first_failure = first_failure or time.monotonic()
                continue
            outcomes[rank] = (ok, payload)
            if not ok and first_failure is None:
                first_failure = time.monotonic()
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(timeout=10)
        results.close()

    failures = [f"rank {r}: {outcomes[r][1]}" for r in sorted(outcomes) if not outcomes[r][0]]
    missing = [r for r in range(world_size) if r not in outcomes]
    if failures or missing:
        if missing:
            why = (
                "killed after another rank failed"
                if failures
                else f"still running at the {timeout_s:g} s timeout, killed"
            )
            failures.append(f"ranks {missing}: {why}")
        raise SpawnError(f"{fn.__name__} on {world_size} ranks failed:\n" + "\n".join(failures))
    return [pickle.loads(outcomes[r][1]) for r in range(world_size)]
