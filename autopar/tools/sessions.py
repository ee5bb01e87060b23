"""One scheduling group per CPU rank, as torchrun starts ranks (README, "Session 9").

Linux's autogroup scheduler shares the cores fairly between sessions, not processes: ranks
spawned into one session (``autopar.runtime.spawn``, ``torch.multiprocessing``) split one share,
so a rank computing alone ran up to 2x faster than each of two busy ones whenever other
sessions loaded the machine, and 1x when they did not. torchrun starts every rank in its own
session (``start_new_session=True``); calibration and the pipeline benchmark do the same so
that what they measure is what a torchrun job meets.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def own_scheduling_group() -> None:
    """Make this process its own session (``os.setsid``); a no-op where it already leads its
    session (under torchrun) or the platform has no sessions."""
    if hasattr(os, "setsid") and os.getsid(0) != os.getpid():
        os.setsid()


def session_count() -> int:
    """How many distinct sessions the ranks of the default process group run in."""
    session = torch.tensor([os.getsid(0) if hasattr(os, "getsid") else 0], dtype=torch.int64)
    every = [torch.zeros_like(session) for _ in range(dist.get_world_size())]
    dist.all_gather(every, session)
    return len({int(s) for s in every})
