"""The model outputs' required layouts, priced as a conversion on their producers.

``PlanOptions.output_placements`` gives one compact placement per model output (default
Replicate on every axis); :data:`ANY_PLACEMENT` leaves an output where the ILP lays it out
(no conversion priced): a pipeline stage's boundary, which the runtime sends in the layout the
next stage reads.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autopar.capture.export import Captured
from autopar.mesh import Mesh
from autopar.options import PlanOptions
from autopar.placement import REPLICATE, Placements

__all__ = ["ANY_PLACEMENT", "output_requirements", "tensor_value"]


def tensor_value(node: fx.Node) -> bool:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return True
    return isinstance(val, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in val)


ANY_PLACEMENT = "*"
"""An ``output_placements`` entry that leaves the output where the ILP lays it out (no
conversion priced): a pipeline stage's boundary, sent in the layout the next stage reads."""


def output_requirements(
    captured: Captured, mesh: Mesh, options: PlanOptions
) -> dict[str, list[tuple[int, Placements]]]:
    """Producer name -> [(output index, required placement)] for the model's outputs."""
    from autopar.placement import parse_placements

    out_node = next(n for n in captured.gm.graph.nodes if n.op == "output")
    leaves = [leaf for leaf in torch.utils._pytree.tree_flatten(out_node.args)[0]]
    tensor_leaves = [leaf for leaf in leaves if isinstance(leaf, fx.Node) and tensor_value(leaf)]
    user_outputs = tensor_leaves[len(tensor_leaves) - len(captured.output_names) :]
    requirements: dict[str, list[tuple[int, Placements]]] = {}
    for i, leaf in enumerate(user_outputs):
        spec = None if options.output_placements is None else options.output_placements[i:][:1]
        if spec == (ANY_PLACEMENT,):
            continue  # laid out as the ILP chooses (a pipeline stage's boundary)
        if spec:
            required = parse_placements(options.output_placements[i])
            if len(required) != mesh.ndim:
                raise ValueError(
                    f"output_placements[{i}] = {options.output_placements[i]!r} has "
                    f"{len(required)} entries but the mesh has {mesh.ndim} axes"
                )
        else:
            required = (REPLICATE,) * mesh.ndim
        requirements.setdefault(leaf.name, []).append((0, required))
    return requirements
