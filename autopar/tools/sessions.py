"""One scheduling group per CPU rank, as torchrun starts ranks (README, "Session 9").

Linux's autogroup scheduler shares the cores fairly between sessions, not processes: ranks
spawned into one session (``autopar.runtime.spawn``, ``torch.multiprocessing``) split one share,
so a rank computing alone ran up to 2x faster than each of two busy ones whenever other
sessions loaded the machine, and 1x when they did not. torchrun starts every rank in its own
session (``start_new_session=True``), and so does ``autopar.runtime.spawn.spawn_ranks`` (where
:func:`own_scheduling_group` lives); calibration and the pipeline benchmark call it too, for ranks
started some other way.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from autopar.runtime.spawn import own_scheduling_group

__all__ = ["own_scheduling_group", "session_count"]


def session_count() -> int:
    """How many distinct sessions the ranks of the default process group run in."""
    session = torch.tensor([os.getsid(0) if hasattr(os, "getsid") else 0], dtype=torch.int64)
    every = [torch.zeros_like(session) for _ in range(dist.get_world_size())]
    dist.all_gather(every, session)
    return len({int(s) for s in every})
