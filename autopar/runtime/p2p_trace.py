"""A diagnostic record of a pipeline schedule's point-to-point posts and waits (issue 15).

torch's schedules (``torch.distributed.pipelining.schedules``) post each task's receives and
sends through ``_batch_p2p`` and wait on them through ``_wait_batch_p2p``. With the environment
variable ``AUTOPAR_P2P_TRACE`` set to a directory, :class:`autopar.runtime.pipeline.PipelineModule`
wraps both (:func:`install`), and every call appends one JSON line to ``DIR/p2p-<rank>.jsonl``:
``["post", desc, ops, start, end]`` or ``["wait", "", works, start, end]`` on the monotonic clock
the machine's processes share (``time.perf_counter``), the clock of the runtime's task
timelines. ``benchmarks/pipeline_gaps.py`` splits the gaps between tasks into posting,
waiting and the rest with it.

Off unless asked: nothing is wrapped and nothing is written without the variable. The record is
flushed line by line (a rank ended by ``os._exit`` keeps what it wrote).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

__all__ = ["ENV", "install", "trace_directory"]

ENV = "AUTOPAR_P2P_TRACE"

_installed: dict[str, Any] = {}


def trace_directory() -> str | None:
    """The directory the record goes to (None: no record)."""
    return os.environ.get(ENV) or None


def install(directory: str, rank: int) -> None:
    """Wrap the schedules' post and wait functions (once per process) so that each call is
    recorded in ``directory/p2p-<rank>.jsonl``."""
    if _installed:
        return
    import torch.distributed.pipelining.schedules as schedules

    os.makedirs(directory, exist_ok=True)
    out = open(os.path.join(directory, f"p2p-{rank}.jsonl"), "a", buffering=1)  # noqa: SIM115
    post, wait = schedules._batch_p2p, schedules._wait_batch_p2p

    def traced_post(p2p_ops: list, desc: str | None = None) -> Any:
        start = time.perf_counter()
        works = post(p2p_ops, desc=desc)
        out.write(json.dumps(["post", desc or "", len(p2p_ops), start, time.perf_counter()]) + "\n")
        return works

    def traced_wait(work: list) -> None:
        start = time.perf_counter()
        wait(work)
        out.write(json.dumps(["wait", "", len(work), start, time.perf_counter()]) + "\n")

    schedules._batch_p2p, schedules._wait_batch_p2p = traced_post, traced_wait
    _installed.update(file=out, post=post, wait=wait)


def uninstall() -> None:
    """Restore torch's functions and close the record (tests)."""
    if not _installed:
        return
    import torch.distributed.pipelining.schedules as schedules

    schedules._batch_p2p, schedules._wait_batch_p2p = _installed["post"], _installed["wait"]
    _installed["file"].close()
    _installed.clear()
