"""Errors raised by the solver, each with the fix in its message."""

from __future__ import annotations


class InfeasibleError(ValueError):
    """No plan exists: the edges' forbidden pairs (None entries) rule out every combination.

    ``nodes`` names the problem nodes the contradiction was found at (first the node left
    without a strategy), when known, so a caller can describe them in its own terms.
    """

    def __init__(self, message: str, *, nodes: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.nodes = nodes


class InfeasibleBudgetError(InfeasibleError):
    """The memory budget is too small for every allowed plan.

    ``min_budget_bytes`` is the smallest peak any allowed plan reaches (offset, resident memory
    and the largest transient), i.e. the smallest budget that fits; ``proven`` is False when a
    time limit stopped that search early, so the figure is only a budget known to fit.
    """

    def __init__(
        self, *, min_budget_bytes: float, budget_bytes: float, proven: bool = True
    ) -> None:
        self.min_budget_bytes = min_budget_bytes
        self.budget_bytes = budget_bytes
        self.proven = proven
        what = "the smallest budget that fits is" if proven else "a budget known to fit is"
        super().__init__(
            f"memory budget of {budget_bytes:.6g} bytes ({budget_bytes / 2**30:.3f} GiB) is too "
            f"small for every plan; {what} {min_budget_bytes:.6g} bytes "
            f"({min_budget_bytes / 2**30:.3f} GiB): raise the budget to at least that, or add "
            f"strategies that use less memory"
        )

    def __reduce__(self) -> tuple[object, ...]:
        # Keyword-only __init__ breaks Exception's default pickling (it replays self.args).
        return (
            _rebuild_budget_error,
            (self.min_budget_bytes, self.budget_bytes, self.proven),
        )


def _rebuild_budget_error(
    min_budget_bytes: float, budget_bytes: float, proven: bool
) -> InfeasibleBudgetError:
    return InfeasibleBudgetError(
        min_budget_bytes=min_budget_bytes, budget_bytes=budget_bytes, proven=proven
    )


class SolverStoppedError(RuntimeError):
    """The solver stopped before it found any plan: its memory ran out (HiGHS has no memory
    option; it reports "Memory limit reached"), a limit was reached or it was interrupted.

    ``reason`` is the backend's status in words ("Memory limit reached", "Time limit
    reached", ...), so a caller can say why without parsing the message.
    """

    def __init__(self, message: str, reason: str = "stopped") -> None:
        super().__init__(message)
        self.reason = reason

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.args[0], self.reason))


class SolverTimeoutError(SolverStoppedError):
    """The time limit ran out before the solver found any plan."""

    def __init__(self, message: str, reason: str = "Time limit reached") -> None:
        super().__init__(message, reason)


STOP_REASONS = (
    "Memory limit reached",
    "Time limit reached",
    "Interrupted",
    "Iteration limit reached",
    "Solution limit reached",
)
"""The reasons a MIP stops early, numbered for ``Solution.details["mip_stopped"]`` (a float:
the index here, or len(STOP_REASONS) for any other)."""


def stop_code(reason: str) -> float:
    """``reason``'s number in :data:`STOP_REASONS` (HiGHS's words, case and "by user" aside)."""
    words = reason.lower()
    for k, known in enumerate(STOP_REASONS):
        if known.split()[0].lower() in words:
            return float(k)
    return float(len(STOP_REASONS))


def stop_reason(code: float) -> str:
    """The words of a ``details["mip_stopped"]`` code."""
    k = int(code)
    return STOP_REASONS[k].lower() if 0 <= k < len(STOP_REASONS) else "stopped early"
