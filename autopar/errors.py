"""Errors autopar raises for users. Each message says what went wrong and what to change."""

from __future__ import annotations


class AutoparError(Exception):
    """Base class of autopar's user-facing errors."""


class UnsupportedModelError(AutoparError):
    """The model cannot be captured as a static graph (names the source line and the fix)."""


class PlanningError(AutoparError):
    """No plan satisfies the request (e.g. the memory budget is too small; says what fits)."""


class PlanMismatchError(AutoparError):
    """A saved plan was made for another model, mesh or input shapes."""
