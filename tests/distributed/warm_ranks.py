"""Warm-up the launcher's forkserver runs once, so that every rank forked from it starts warm.

Importing autopar's stages and running the first ``torch.export`` of a process cost about 2 s
of CPU (lazy imports and one-time tables in export, fake tensors and autograd); a later capture
of the tiny GPT costs 0.3 s. The forkserver imports this module once per test session and every
rank it forks inherits the warm state, instead of paying those 2 s in every rank of every spawn.
The first plan does the same for the planner and the ILP solver (rank 0 plans in
``autoparallelize``). A failure here only loses the speed-up (the forkserver must not die:
it re-raises nothing); the tests themselves then report the real error.
"""

from __future__ import annotations

import time

WARM_CPU_S: float | None = None
"""CPU seconds the warm-up took in the forkserver (None: it failed)."""


def _warm() -> None:
    import autopar
    import autopar.lowering
    import autopar.optim
    import autopar.plan.document
    import autopar.runtime.module
    from autopar.capture.export import capture
    from tests.models import tiny_gpt, tiny_mlp

    model, args, kwargs = tiny_gpt()
    capture(model, args, kwargs)
    model(*args, **kwargs).backward()
    model, args, kwargs = tiny_mlp()
    autopar.plan(model, autopar.Mesh.spec((2,)), args, kwargs)


_start = time.process_time()
try:
    _warm()
    WARM_CPU_S = time.process_time() - _start
except Exception:  # noqa: BLE001 - only the speed-up is lost
    WARM_CPU_S = None
