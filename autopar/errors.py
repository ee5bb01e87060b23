"""Errors autopar raises for users. Each message says what went wrong and what to change, and
each error that reports a figure keeps it as an attribute, so callers never parse messages."""

from __future__ import annotations


class AutoparError(Exception):
    """Base class of autopar's user-facing errors."""


class UnsupportedModelError(AutoparError):
    """The model cannot be captured as a static graph (names the source line and the fix)."""


class PlanningError(AutoparError):
    """No plan satisfies the request (e.g. the memory budget is too small; says what fits)."""


class BudgetError(PlanningError):
    """The memory budget is too small for every plan asked for.

    Attributes:
        budget_bytes: the budget per device that was asked for.
        min_budget_bytes: the smallest budget per device that fits (for a recipe: its peak).
        what: the configuration the figure is for ("any ZeRO stage", "recipe 'ddp'", ...).
    """

    def __init__(self, message: str, *, budget_bytes: float, min_budget_bytes: float, what: str) -> None:
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.min_budget_bytes = min_budget_bytes
        self.what = what

    def __reduce__(self) -> tuple[object, ...]:
        # Keyword-only __init__ breaks Exception's default pickling (it replays self.args).
        return (_rebuild_budget_error, (str(self), self.budget_bytes, self.min_budget_bytes, self.what))


def _rebuild_budget_error(message: str, budget: float, needed: float, what: str) -> BudgetError:
    return BudgetError(message, budget_bytes=budget, min_budget_bytes=needed, what=what)


class PlanMismatchError(AutoparError):
    """A saved plan was made for another model, mesh or input shapes."""
