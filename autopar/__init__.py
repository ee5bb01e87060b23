"""autopar: automatic parallelization for PyTorch.

Capture a model as an ATen graph, price every node, let an ILP choose each tensor's layout on
a device mesh, and run the result with explicit collectives on torch.distributed.
"""

from __future__ import annotations

from autopar.api import plan, plan_captured
from autopar.capture.export import Captured, capture
from autopar.errors import AutoparError, PlanMismatchError, PlanningError, UnsupportedModelError
from autopar.mesh import Mesh
from autopar.options import PlanOptions
from autopar.parallelize import autoparallelize
from autopar.plan.document import Plan
from autopar.runtime.module import ParallelModule
from autopar.version import __version__

__all__ = [
    "AutoparError",
    "Captured",
    "Mesh",
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
