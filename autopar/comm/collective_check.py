"""Every autopar collective runs through :func:`run_collective`: a failure names the rank and the
collective, and in check mode the ranks first agree on what they are about to issue.

Ranks that issue their collectives in different orders deadlock: each waits in a different
collective until the process group's timeout (the bench-cost fsdp hang: rank 0 in a ZeRO-3
all-gather, rank 1 in an all-reduce). The runtime is written so that the order is the same on
every rank by construction; check mode makes any departure from that fail at once, with one line.

Check mode (``AUTOPAR_CHECK_COLLECTIVES=1``; the tests set it): before each collective, the ranks
of its group all-gather a fingerprint -- the collective's sequence number on that group, its op,
what it carries and its shape and dtype -- and on any difference every rank raises
:class:`CollectiveMismatchError`::

    collective mismatch on axis dp: rank 0 issued #12 all_gather(zero chunk 3, 4096 x f32)
    while rank 1 issued #12 all_reduce(activation, 8x8192 x f32)

The check is itself a collective, so it pairs with the peer's check whatever that peer was about
to issue. It costs one small all-gather per collective (a latency, no bandwidth): it is for tests
and debugging, off by default.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

__all__ = [
    "CHECK_ENV",
    "CollectiveFailedError",
    "CollectiveMismatchError",
    "check_same",
    "checks_enabled",
    "describe",
    "run_collective",
    "wait_collective",
]

CHECK_ENV = "AUTOPAR_CHECK_COLLECTIVES"
"""Environment variable: set to 1 to check every autopar collective's fingerprint across ranks."""

_FINGERPRINT_BYTES = 192

T = TypeVar("T")

# Sequence numbers of checked collectives per process group (by group name). Process-wide by
# nature: the count must run across every module and engine that shares a group.
_sequence: dict[str, int] = {}

_DTYPE_NAMES = {
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float64: "f64",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.uint8: "u8",
    torch.bool: "bool",
}


class CollectiveMismatchError(RuntimeError):
    """Ranks of one group were about to issue different collectives (check mode)."""


class CollectiveFailedError(RuntimeError):
    """A collective failed or timed out; the message names the rank and the collective."""


def checks_enabled() -> bool:
    """Whether check mode is on (``AUTOPAR_CHECK_COLLECTIVES`` set to anything but 0)."""
    return os.environ.get(CHECK_ENV, "") not in ("", "0")


def describe(op: str, what: str, tensor: torch.Tensor) -> str:
    """``all_gather(zero chunk 3, 4096 x f32)``: the op, what it carries, shape and dtype."""
    shape = "x".join(str(s) for s in tensor.shape) or "scalar"
    dtype = _DTYPE_NAMES.get(tensor.dtype, str(tensor.dtype).removeprefix("torch."))
    return f"{op}({what}, {shape} x {dtype})"


def check_same(description: str, group: Any, axis_label: str, device: torch.device) -> None:
    """Check mode's agreement (module docstring): every rank of ``group`` must pass the same
    ``description`` at the same sequence number; else CollectiveMismatchError on every rank."""
    ranks = dist.get_process_group_ranks(group)
    key = getattr(group, "group_name", None) or repr(ranks)
    number = _sequence.get(key, 0)
    _sequence[key] = number + 1
    text = f"#{number} {description}".encode("ascii", "replace")[:_FINGERPRINT_BYTES]
    mine = torch.zeros(_FINGERPRINT_BYTES, dtype=torch.uint8, device=device)
    mine[: len(text)] = torch.tensor(list(text), dtype=torch.uint8, device=device)
    theirs = [torch.empty_like(mine) for _ in ranks]
    dist.all_gather(theirs, mine, group=group)
    texts = [bytes(t.cpu().tolist()).rstrip(b"\0").decode("ascii") for t in theirs]
    for position in range(1, len(texts)):
        if texts[position] != texts[0]:
            raise CollectiveMismatchError(
                f"collective mismatch on axis {axis_label}: rank {ranks[0]} issued {texts[0]} "
                f"while rank {ranks[position]} issued {texts[position]}"
            )


def _failed(description: str, group: Any, axis_label: str, exc: BaseException) -> RuntimeError:
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return CollectiveFailedError(
        f"rank {dist.get_rank()}: {description} on axis {axis_label} (group ranks "
        f"{dist.get_process_group_ranks(group)}) failed: {first}"
    )


def run_collective(
    op: str, what: str, tensor: torch.Tensor, group: Any, axis_label: str, call: Callable[[], T]
) -> T:
    """Issue one collective: ``call()`` (which issues it on ``group``), checked first in check
    mode, its failure (a timeout, a lost peer) re-raised naming this rank and the collective.

    Args:
        op: ``all_gather``, ``all_reduce``, ``reduce_scatter``, ...
        what: what it carries, for people (``zero chunk 3``, ``grad bucket 0``).
        tensor: the input (its shape and dtype go into the fingerprint).
        axis_label: the mesh axis' name.
    """
    try:
        if checks_enabled():
            check_same(describe(op, what, tensor), group, axis_label, tensor.device)
        return call()
    except CollectiveMismatchError:
        raise
    except Exception as exc:  # re-raised with the context a user needs to find the culprit
        raise _failed(describe(op, what, tensor), group, axis_label, exc) from exc


def wait_collective(
    work: Any, op: str, what: str, tensor: torch.Tensor, group: Any, axis_label: str
) -> None:
    """Wait for an asynchronous collective; a failure names this rank and the collective."""
    try:
        work.wait()
    except Exception as exc:
        raise _failed(describe(op, what, tensor), group, axis_label, exc) from exc
