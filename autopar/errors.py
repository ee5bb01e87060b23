"""Errors autopar raises for users. Each message says what went wrong and what to change, and
each error that reports a figure keeps it as an attribute, so callers never parse messages."""

from __future__ import annotations

from typing import Any


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

    def __init__(
        self, message: str, *, budget_bytes: float, min_budget_bytes: float, what: str
    ) -> None:
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.min_budget_bytes = min_budget_bytes
        self.what = what

    def __reduce__(self) -> tuple[object, ...]:
        # Keyword-only __init__ breaks Exception's default pickling (it replays self.args).
        return (
            _rebuild_budget_error,
            (str(self), self.budget_bytes, self.min_budget_bytes, self.what),
        )


def _rebuild_budget_error(message: str, budget: float, needed: float, what: str) -> BudgetError:
    return BudgetError(message, budget_bytes=budget, min_budget_bytes=needed, what=what)


class NoLayoutError(PlanningError):
    """A recipe's layouts contradict each other on this model and mesh (no plan at all).

    Attributes:
        recipe: the recipe ("auto" included).
        nodes: the graph nodes where the solver found no compatible layout (may be empty).
    """

    def __init__(self, message: str, *, recipe: str, nodes: tuple[str, ...]) -> None:
        super().__init__(message)
        self.recipe = recipe
        self.nodes = nodes

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_no_layout_error, (str(self), self.recipe, self.nodes))


def _rebuild_no_layout_error(message: str, recipe: str, nodes: tuple[str, ...]) -> NoLayoutError:
    return NoLayoutError(message, recipe=recipe, nodes=nodes)


class PlanMismatchError(AutoparError):
    """A saved plan was made for another model, mesh or input shapes."""


def describe_node(gm: Any, name: str, param_fqns: dict[str, str]) -> str:
    """A graph node in user terms: its module path, op and output shape, e.g.
    ``module bert.embeddings.dropout (aten.dropout, output [2, 16, 768])``."""
    node = next((n for n in gm.graph.nodes if n.name == name), None)
    if node is None:
        return repr(name)
    if name in param_fqns:
        return f"parameter {param_fqns[name]} {_shape_of(node)}"
    if node.op == "placeholder":
        return f"input {name} {_shape_of(node)}"
    stack = node.meta.get("nn_module_stack") or {}
    path = next(reversed(stack.values()))[0] if stack else ""
    target = getattr(node.target, "__name__", str(node.target))
    op = "aten." + target.split(".")[0] if hasattr(node.target, "overloadpacket") else target
    where = f"module {path}" if path else "the top-level module"
    return f"{where} ({op}, output {_shape_of(node)}, node {name})"


def _shape_of(node: Any) -> str:
    val = node.meta.get("val")
    shapes = [
        list(v.shape)
        for v in (val if isinstance(val, (list, tuple)) else [val])
        if hasattr(v, "shape")
    ]
    return " ".join(str(s) for s in shapes) if shapes else "[]"


def infeasible_error(
    error: Exception, *, gm: Any, param_fqns: dict[str, str], recipe: str, mesh: str
) -> NoLayoutError:
    """The solver's "node X has no strategy left" in user terms (one line): which recipe, the
    module, op and shapes where the layouts contradict each other, and what to try."""
    names = tuple(getattr(error, "nodes", ()))
    if names:
        where = describe_node(gm, names[0], param_fqns)
        if len(names) > 1:
            where += f", next to {describe_node(gm, names[1], param_fqns)}"
        what = f"no layout of {where} is compatible with its neighbours"
    else:
        what = "the layouts the sharding rules allow contradict each other"
    hint = (
        "try another mesh shape (sizes that divide the model's dims), or recipe 'auto'"
        if recipe != "auto"
        else "try another mesh shape (sizes that divide the model's dims)"
    )
    return NoLayoutError(
        f"recipe {recipe!r} has no plan on mesh {mesh}: {what}; {hint}", recipe=recipe, nodes=names
    )
