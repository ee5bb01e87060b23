"""autopar: automatic parallelization for PyTorch.

Capture a model as an ATen graph, price every node, let an ILP choose each tensor's layout on
a device mesh, and run the result with explicit collectives on torch.distributed.

``import autopar`` is cheap: the public names load their modules (and torch) on first use, so
``autopar --help`` and the CLI's first progress line do not wait for torch and the planner.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# The subpackages named like the public functions ``plan`` and ``capture`` are imported first
# (their __init__ files are docstrings) so that binding the functions below wins: importing a
# submodule later (autopar.plan.document) does not rebind its parent package's attribute.
import autopar.capture as _capture_package  # noqa: F401
import autopar.plan as _plan_package  # noqa: F401
from autopar.errors import (
    AutoparError,
    BudgetError,
    NoLayoutError,
    PlanMismatchError,
    PlanningError,
    UnsupportedModelError,
)
from autopar.version import __version__

if TYPE_CHECKING:
    from autopar.capture.export import Captured
    from autopar.mesh import Mesh
    from autopar.options import PlanOptions
    from autopar.plan.document import Plan
    from autopar.runtime.module import ParallelModule

_LAZY = {
    "Captured": "autopar.capture.export",
    "Mesh": "autopar.mesh",
    "PlanOptions": "autopar.options",
    "Plan": "autopar.plan.document",
    "ParallelModule": "autopar.runtime.module",
    "autoparallelize": "autopar.parallelize",
    "plan_captured": "autopar.api",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'autopar' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def plan(*args: Any, **kwargs: Any) -> Plan:
    """:func:`autopar.api.plan`: plan a model on a mesh in one process (no GPU needed)."""
    from autopar.api import plan as plan_model

    return plan_model(*args, **kwargs)


def capture(*args: Any, **kwargs: Any) -> Captured:
    """:func:`autopar.capture.export.capture`: a model and example inputs -> a static ATen graph."""
    from autopar.capture.export import capture as capture_model

    return capture_model(*args, **kwargs)


__all__ = [
    "AutoparError",
    "BudgetError",
    "Captured",
    "Mesh",
    "NoLayoutError",
    "Plan",
    "ParallelModule",
    "PlanMismatchError",
    "PlanOptions",
    "PlanningError",
    "UnsupportedModelError",
    "__version__",
    "autoparallelize",
    "capture",
    "plan",
    "plan_captured",
]
