"""Reading ZeRO's ``gathered_bytes`` on gloo ranks without racing gloo's worker threads."""

from __future__ import annotations

import time
from typing import Any


def settled_gathered_bytes(engine: Any, want: int, timeout_s: float = 10.0) -> int:
    """``engine.gathered_bytes`` once it equals ``want``, or its value after ``timeout_s``.

    A gathered buffer is counted until its storage dies. gloo's worker thread keeps its
    reference to a finished collective (its output buffer, and for a collective inside the
    autograd graph, through that output, the graph) until just after it reports completion,
    so right after a forward or a step a buffer the runtime already dropped can still be
    alive for a moment (CI saw 37,376 bytes there on one rank of two; 0 after 0.3 s with the
    cycle collector off). A buffer that is really kept stays counted: the caller's
    assertion still fails, with the value after the timeout.
    """
    deadline = time.monotonic() + timeout_s
    value = engine.gathered_bytes
    while value != want and time.monotonic() < deadline:
        time.sleep(0.01)
        value = engine.gathered_bytes
    return value
