"""pytest plugin: print the CPU seconds of a run, its ranks included (``-p tests.cpu_seconds``).

On a shared machine wall time says more about the neighbours than about the tests; CPU time does
not. Ranks are forked by the launcher's forkserver, which reaps them, so their CPU time reaches
pytest's ``RUSAGE_CHILDREN`` only once the forkserver itself has exited and been reaped: this
plugin stops it at the end of the session, then prints one line to stderr::

    CPU self=11.9s children=51.4s total=63.3s

(Gloo collectives wait partly asleep, so a latency-bound file's wall time can fall by more than
its CPU time.)
"""

from __future__ import annotations

import resource
import sys


def pytest_unconfigure(config: object) -> None:
    from multiprocessing import forkserver

    stop = getattr(forkserver._forkserver, "_stop", None)  # private; present in 3.8-3.13
    if stop is not None:
        stop()
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    self_s = own.ru_utime + own.ru_stime
    children_s = kids.ru_utime + kids.ru_stime
    print(
        f"\nCPU self={self_s:.1f}s children={children_s:.1f}s total={self_s + children_s:.1f}s",
        file=sys.stderr,
    )
