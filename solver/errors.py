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


class SolverTimeoutError(RuntimeError):
    """The time limit ran out before the solver found any plan."""
