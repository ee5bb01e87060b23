"""pricing._bucket_pool shares the tables of alike parameter inputs (consumers of repeated
layers share their strategy lists): the pool equals the one walked input by input, on a
4-layer tiny GPT whose parameters differ in shape and layer."""

from __future__ import annotations

from autopar.capture.export import capture
from autopar.mesh import Mesh
from autopar.options import PlanOptions
from tests.models import tiny_gpt


def test_the_pool_equals_the_one_walked_input_by_input() -> None:
    from autopar.planner.pricing import _bucket_pool, _partial_tables
    from autopar.planner.space import build_space

    model, args, kwargs = tiny_gpt(layers=4)
    space = build_space(capture(model, args, kwargs), Mesh.parse("2x2"), PlanOptions())
    nodes, mesh = space.nodes, space.mesh
    inputs, total = _bucket_pool(nodes, space.edges, mesh)
    walked, sums = [], [0.0] * mesh.ndim
    for edge in space.edges:
        src, dst, j = nodes[edge.src], nodes[edge.dst], edge.input_index
        if src.kind != "param" or dst.kind != "op" or j < 0:
            continue
        full_bytes = float(max(src.local_numel)) * src.itemsize
        partial, blocks, largest = _partial_tables(dst.strategies, j, full_bytes, mesh)
        sums = [t + b for t, b in zip(sums, largest)]
        walked.append((edge.dst, partial, blocks, largest))
    assert inputs == walked and total == sums
    # Shared: fewer distinct tables than inputs (the layers' consumers alike).
    assert len({id(x[1]) for x in inputs}) < len(inputs)
    assert len({tuple(map(tuple, (x[1], x[2]))) for x in inputs}) > 2
